//! `--deepspeed ds.json`: a DeepSpeed config read into a [`TrainingConfig`], so a DeepSpeed
//! user's file runs as it is. Each key DeepSpeed documents that has an equivalent here sets
//! it; a key that only tunes DeepSpeed's own memory, communication or reports is accepted with
//! one warning naming it and why it changes nothing here; a key or value this trainer cannot
//! honour (such as DeepSpeed's default logarithmic warm-up) is an error naming its full path.
//! Every problem of a file is reported in one error; what the file set is logged, one line a
//! key.
//!
//! | DeepSpeed | here |
//! |---|---|
//! | `train_micro_batch_size_per_gpu` | `batch_size` (and `eval_batch_size`) |
//! | `gradient_accumulation_steps` | `gradient_accumulation_steps` |
//! | `train_batch_size` | micro-batch x accumulation x `data_parallel_size`: checked when all three are given; otherwise the missing one follows (the accumulation if only it is missing, else the micro-batch), as in DeepSpeed |
//! | `gradient_clipping` | `max_grad_norm` |
//! | `fp16.enabled`, `loss_scale` (0: dynamic), `loss_scale_window`, `initial_scale_power` (16 only) | `precision = "f16"`, `loss_scale`, `loss_scale_growth_interval` |
//! | `bf16.enabled` (or `bfloat16.enabled`) | `precision = "bf16"`; with `fp16.enabled` too: refused, as DeepSpeed does |
//! | `communication_data_type` "fp16" / "fp32" | `parallel.allreduce_in_fp16` true / false |
//! | `zero_optimization.stage` | `zero_stage` |
//! | `zero_optimization.offload_optimizer.device` "nvme" / "cpu" / "none", `nvme_path` (or the deprecated `cpu_offload: true`) | `offload.offload_optimizer` "disk" / "cpu" / "none", `offload.offload_dir` |
//! | `zero_optimization.offload_param.device` "nvme" / "cpu" / "none", `nvme_path` (or `cpu_offload_param: true`) | `offload.offload_params` "disk" / "cpu" / "none", `offload.offload_dir` (one directory for both) |
//! | `optimizer.type` Adam (AdamW unless `adam_w_mode` is false), AdamW, Lamb, SGD; `params` lr, betas, eps, weight_decay, momentum | `optimizer`, `lr.initial_lr` |
//! | `scheduler.type` WarmupLR, WarmupDecayLR, WarmupCosineLR with `warmup_type: "linear"` from 0 (DeepSpeed warms up logarithmically unless told), decaying to 0 (`cos_min_ratio: 0`); DeepSpeed's defaults where `warmup_num_steps` (1000) or `warmup_max_lr` (0.001) is left out | `lr.mode` constant, linear, cosine; `lr.warmup_ratio`, `lr.initial_lr`; `total_num_steps` sets the updates |
//! | `steps_per_print` | `display_loss_steps` |
//! | `tensorboard.enabled`, `output_path`, `job_name` | `log_dir` |
//!
//! No effect here, accepted with a warning (the table `NO_OPS`): DeepSpeed's reports
//! (`wall_clock_breakdown`, `memory_breakdown`, `flops_profiler`, `comms_logger`,
//! `dump_state`); how its ZeRO buckets and schedules communication
//! (`zero_optimization.overlap_comm`, `contiguous_gradients`, the bucket sizes, the `stage3_*`
//! thresholds, ...); how it buffers offload transfers (`offload_*.pin_memory`, `buffer_*`,
//! `aio`, ...); which implementation of the same optimizer it takes (`torch_adam`,
//! `zero_allow_untested_optimizer`); when its dynamic loss scale drops (`fp16.hysteresis`,
//! `consecutive_hysteresis`, `min_loss_scale`); `activation_checkpointing`; and, at
//! DeepSpeed's default value only, `prescale_gradients` (false), `gradient_predivide_factor`
//! (1), `fp16.auto_cast` (false), `communication_data_type` (null).
//!
//! `"auto"`, Hugging Face Trainer's placeholder, keeps the run's own value (from `--config`
//! or the defaults) where the Trainer would fill it from its arguments: the batch sizes,
//! `gradient_accumulation_steps`, `gradient_clipping`, `optimizer.params` lr, betas, eps and
//! weight_decay, `scheduler.params` warmup_min_lr (0), warmup_max_lr, warmup_num_steps and
//! total_num_steps, and `fp16.enabled` / `bf16.enabled` (on when the run already computes in
//! that precision); keys without effect take it too. Anywhere else it is refused by path.

use std::path::{Path, PathBuf};

use serde::Serialize;
use serde_json::{Map, Value};

use super::{OffloadTarget, OptimizerKind, ParamOffload, ScheduleKind, TrainingConfig};
use crate::error::{OnnxError, Result};
use crate::train::precision::Precision;

/// `c` with the DeepSpeed config at `path` applied (see the module docs): every key it cannot
/// honour in one error naming the file, the keys without effect in one warning, what it set
/// in one log entry.
pub fn apply_deepspeed(c: TrainingConfig, path: &Path) -> Result<TrainingConfig> {
    let text = std::fs::read(path).map_err(|e| OnnxError::io(path, e))?;
    let bad = |message: String| OnnxError::Decode {
        path: path.to_path_buf(),
        what: "DeepSpeed config",
        message,
    };
    let root: Map<String, Value> = serde_json::from_slice(&text).map_err(|e| bad(e.to_string()))?;
    let applied = read(c, &root).map_err(bad)?;
    applied.log(path);
    Ok(applied.config)
}

type Step<T = ()> = std::result::Result<T, String>;

/// What a file did: the config it gave, one line per key it set or kept, and the keys it
/// holds that change nothing here, each with why.
struct Applied {
    config: TrainingConfig,
    mapped: Vec<String>,
    no_ops: Vec<(String, &'static str)>,
}

impl Applied {
    /// The mapping at info level, the keys without effect at warn level (one line).
    fn log(&self, path: &Path) {
        if !self.mapped.is_empty() {
            tracing::info!(
                "DeepSpeed config {}:\n  {}",
                path.display(),
                self.mapped.join("\n  ")
            );
        }
        if !self.no_ops.is_empty() {
            tracing::warn!(
                "DeepSpeed config {}: no effect here: {}",
                path.display(),
                self.no_ops_line()
            );
        }
    }

    /// The keys without effect grouped by reason: `a, b (why); c (why)`.
    fn no_ops_line(&self) -> String {
        let mut reasons: Vec<(&str, Vec<&str>)> = Vec::new();
        for (path, why) in &self.no_ops {
            match reasons.iter_mut().find(|(w, _)| w == why) {
                Some((_, paths)) => paths.push(path),
                None => reasons.push((why, vec![path])),
            }
        }
        let groups: Vec<String> = reasons
            .iter()
            .map(|(why, paths)| format!("{} ({why})", paths.join(", ")))
            .collect();
        groups.join("; ")
    }
}

/// The file's `root` applied to `c`, or every problem it has in one message.
fn read(c: TrainingConfig, root: &Map<String, Value>) -> Step<Applied> {
    let mut ds = Ds {
        c,
        errors: Vec::new(),
        mapped: Vec::new(),
        no_ops: Vec::new(),
        nvme_path: None,
    };
    ds.root(root);
    match ds.errors.as_slice() {
        [] => Ok(Applied {
            config: ds.c,
            mapped: ds.mapped,
            no_ops: ds.no_ops,
        }),
        [one] => Err(one.clone()),
        all => Err(format!("{} problems:\n  {}", all.len(), all.join("\n  "))),
    }
}

/// One key of the file: its full dotted path, its own name and its value.
struct Key<'v> {
    path: String,
    name: &'v str,
    value: &'v Value,
}

/// What `"auto"` on a key the Trainer does not fill is told.
const AUTO_ONLY: &str = "\"auto\" is resolved only where Hugging Face's Trainer fills it (the batch sizes, gradient_accumulation_steps, gradient_clipping, optimizer.params lr/betas/eps/weight_decay, scheduler.params warm-up and total steps, fp16/bf16 enabled); give a value";

impl<'v> Key<'v> {
    /// The key `name` inside this one.
    fn child(&self, name: &'v str, value: &'v Value) -> Key<'v> {
        Key {
            path: format!("{}.{name}", self.path),
            name,
            value,
        }
    }

    /// `path = value`, as the log shows what the file said.
    fn shown(&self) -> String {
        format!("{} = {}", self.path, self.value)
    }

    /// Hugging Face's placeholder.
    fn is_auto(&self) -> bool {
        self.value.as_str() == Some("auto")
    }

    /// The value as `kind`; `"auto"` refused.
    fn read<T>(&self, kind: &Kind<T>) -> Step<T> {
        if self.is_auto() {
            return Err(format!("{}: {AUTO_ONLY}", self.path));
        }
        (kind.parse)(self.value).ok_or_else(|| self.expected(kind.expected))
    }

    /// The value as `kind`, or `None` for `"auto"`.
    fn read_or_auto<T>(&self, kind: &Kind<T>) -> Step<Option<T>> {
        if self.is_auto() {
            return Ok(None);
        }
        match (kind.parse)(self.value) {
            Some(v) => Ok(Some(v)),
            None => Err(self.expected(&[kind.expected, &["\"auto\""]].concat())),
        }
    }

    /// `path: expected a, b or c, got value`.
    fn expected(&self, what: &[&str]) -> String {
        let what = match what {
            [rest @ .., last] if !rest.is_empty() => format!("{} or {last}", rest.join(", ")),
            _ => what.concat(),
        };
        format!("{}: expected {what}, got {}", self.path, self.value)
    }
}

/// The key called `name` among `keys`.
fn find<'k, 'v>(keys: &'k [Key<'v>], name: &str) -> Option<&'k Key<'v>> {
    keys.iter().find(|k| k.name == name)
}

/// How one kind of value is read from JSON, and what an error says was expected.
struct Kind<T> {
    parse: fn(&Value) -> Option<T>,
    expected: &'static [&'static str],
}

const COUNT: Kind<usize> = Kind {
    parse: as_count,
    expected: &["a non-negative integer"],
};
const NUMBER: Kind<f64> = Kind {
    parse: Value::as_f64,
    expected: &["a number"],
};
const FLOAT: Kind<f32> = Kind {
    parse: |v| v.as_f64().map(|x| x as f32),
    expected: &["a number"],
};
const FLAG: Kind<bool> = Kind {
    parse: Value::as_bool,
    expected: &["true", "false"],
};
const TEXT: Kind<String> = Kind {
    parse: |v| v.as_str().map(str::to_string),
    expected: &["a string"],
};
const BETAS: Kind<[f32; 2]> = Kind {
    parse: as_betas,
    expected: &["[beta1, beta2]"],
};

/// A non-negative integer, also written as a float (`2e8`).
fn as_count(v: &Value) -> Option<usize> {
    let n = v.as_u64().or_else(|| {
        v.as_f64()
            .filter(|f| f.fract() == 0.0 && (0.0..=9.0e15).contains(f))
            .map(|f| f as u64)
    })?;
    usize::try_from(n).ok()
}

/// Two numbers.
fn as_betas(v: &Value) -> Option<[f32; 2]> {
    match v.as_array()?.as_slice() {
        [b1, b2] => Some([b1.as_f64()? as f32, b2.as_f64()? as f32]),
        _ => None,
    }
}

/// A key the file may leave out, give, or leave to `"auto"`.
#[derive(Clone, Copy)]
enum Given<T> {
    /// Left out.
    Absent,
    /// `"auto"`: the run's own value.
    Auto,
    /// Given.
    Value(T),
}

/// Which of the three batch keys the file has (`"auto"` counts: it stands for the run's
/// value), and `train_batch_size` itself.
struct BatchKeys {
    /// `train_micro_batch_size_per_gpu` is there.
    micro: bool,
    /// `gradient_accumulation_steps` is there.
    accum: bool,
    /// `train_batch_size`.
    total: Given<usize>,
}

/// A precision section whose `enabled` is on: its path, whether by `"auto"`, what it sets.
struct Enabled {
    path: String,
    auto: bool,
    dtype: Precision,
}

/// One of DeepSpeed's schedulers this trainer runs: its name, its mode here, the params it
/// takes.
struct Scheduler {
    name: &'static str,
    mode: ScheduleKind,
    params: &'static [&'static str],
}

const SCHEDULERS: [Scheduler; 3] = [
    Scheduler {
        name: "WarmupLR",
        mode: ScheduleKind::Constant,
        params: &[
            "warmup_min_lr",
            "warmup_max_lr",
            "warmup_num_steps",
            "warmup_type",
        ],
    },
    Scheduler {
        name: "WarmupDecayLR",
        mode: ScheduleKind::Linear,
        params: &[
            "warmup_min_lr",
            "warmup_max_lr",
            "warmup_num_steps",
            "warmup_type",
            "total_num_steps",
        ],
    },
    Scheduler {
        name: "WarmupCosineLR",
        mode: ScheduleKind::Cosine,
        params: &[
            "warmup_min_ratio",
            "warmup_num_steps",
            "warmup_type",
            "total_num_steps",
            "cos_min_ratio",
        ],
    },
];

/// DeepSpeed's `warmup_num_steps` and `warmup_max_lr` where a scheduler leaves them out.
const DEEPSPEED_WARMUP_STEPS: usize = 1000;
const DEEPSPEED_WARMUP_MAX_LR: f64 = 0.001;

/// Keys DeepSpeed documents that change nothing here: `keys` of `section` (`""`: the top
/// level; a segment ending in `*` matches any name it starts), at any value or at `only`
/// (JSON, DeepSpeed's default), with why.
struct NoOps {
    section: &'static str,
    keys: &'static [&'static str],
    only: Option<&'static str>,
    why: &'static str,
}

/// Why DeepSpeed's offload buffering changes nothing here.
const OFFLOAD_BUFFERS: &str =
    "how DeepSpeed buffers its offload transfers; the same values are offloaded";
/// Why DeepSpeed's choice among optimizer implementations changes nothing here.
const OPTIMIZER_IMPLEMENTATION: &str =
    "which optimizer implementation DeepSpeed accepts or picks; the update is the same";

/// Every key accepted without effect (module docs).
const NO_OPS: &[NoOps] = &[
    NoOps {
        section: "",
        keys: &[
            "wall_clock_breakdown",
            "memory_breakdown",
            "flops_profiler",
            "comms_logger",
            "dump_state",
        ],
        only: None,
        why: "DeepSpeed's own reports",
    },
    NoOps {
        section: "zero_optimization",
        keys: &[
            "contiguous_gradients",
            "overlap_comm",
            "reduce_scatter",
            "reduce_bucket_size",
            "allgather_partitions",
            "allgather_bucket_size",
            "round_robin_gradients",
            "use_multi_rank_bucket_allreduce",
            "sub_group_size",
            "memory_efficient_linear",
            "stage3_prefetch_bucket_size",
            "stage3_param_persistence_threshold",
            "stage3_model_persistence_threshold",
            "stage3_max_live_parameters",
            "stage3_max_reuse_distance",
        ],
        only: None,
        why: "how DeepSpeed's ZeRO buckets, overlaps and schedules its communication and memory; the averaged gradients and the update are the same",
    },
    NoOps {
        section: "zero_optimization",
        keys: &[
            "stage3_gather_16bit_weights_on_model_save",
            "stage3_gather_fp16_weights_on_model_save",
        ],
        only: None,
        why: "how DeepSpeed saves a ZeRO-3 model; the export here writes the whole f32 weights",
    },
    NoOps {
        section: "zero_optimization.offload_*",
        keys: &[
            "pin_memory",
            "buffer_count",
            "buffer_size",
            "fast_init",
            "pipeline_read",
            "pipeline_write",
            "max_in_cpu",
        ],
        only: None,
        why: OFFLOAD_BUFFERS,
    },
    NoOps {
        section: "zero_optimization",
        keys: &["cpu_offload_use_pin_memory"],
        only: None,
        why: OFFLOAD_BUFFERS,
    },
    NoOps {
        section: "",
        keys: &["aio"],
        only: None,
        why: "libaio settings of DeepSpeed's NVMe transfers; the offload files here are memory-mapped",
    },
    NoOps {
        section: "",
        keys: &[
            "zero_allow_untested_optimizer",
            "zero_force_ds_cpu_optimizer",
        ],
        only: None,
        why: OPTIMIZER_IMPLEMENTATION,
    },
    NoOps {
        section: "optimizer.params",
        keys: &["torch_adam"],
        only: None,
        why: OPTIMIZER_IMPLEMENTATION,
    },
    NoOps {
        section: "fp16",
        keys: &["hysteresis", "consecutive_hysteresis", "min_loss_scale"],
        only: None,
        why: "when DeepSpeed lowers a dynamic loss scale after overflows; overflowing steps are skipped either way, and the scale here halves at each overflow, with no floor",
    },
    NoOps {
        section: "",
        keys: &["activation_checkpointing"],
        only: None,
        why: "settings of DeepSpeed's checkpointing API, which model code calls; recomputation here is --recompute, with the same gradients",
    },
    NoOps {
        section: "",
        keys: &["prescale_gradients"],
        only: Some("false"),
        why: "DeepSpeed's default: gradients averaged without pre-scaling, as here",
    },
    NoOps {
        section: "",
        keys: &["gradient_predivide_factor"],
        only: Some("1.0"),
        why: "DeepSpeed's default: no division before averaging, as here",
    },
    NoOps {
        section: "fp16",
        keys: &["auto_cast"],
        only: Some("false"),
        why: "DeepSpeed's default: the model's inputs are not cast to fp16, as here",
    },
    NoOps {
        section: "",
        keys: &["communication_data_type"],
        only: Some("null"),
        why: "DeepSpeed's default: gradients reduced as the run says (parallel.allreduce_in_fp16)",
    },
];

impl NoOps {
    /// Whether `key` is one of these keys (at any value).
    fn names(&self, key: &Key) -> bool {
        let parent = key.path.strip_suffix(key.name);
        let parent = parent.and_then(|p| p.strip_suffix('.')).unwrap_or("");
        self.keys.contains(&key.name) && segments_match(self.section, parent)
    }

    /// Whether `value` changes nothing here.
    fn harmless(&self, value: &Value) -> bool {
        self.only.is_none_or(|only| same(value, only))
    }
}

/// `path` against `pattern`, dotted segment by segment; a pattern segment ending in `*`
/// matches any segment it starts.
fn segments_match(pattern: &str, path: &str) -> bool {
    let (pattern, path): (Vec<&str>, Vec<&str>) =
        (pattern.split('.').collect(), path.split('.').collect());
    pattern.len() == path.len()
        && pattern
            .iter()
            .zip(&path)
            .all(|(p, s)| match p.strip_suffix('*') {
                Some(prefix) => s.starts_with(prefix),
                None => p == s,
            })
}

/// `value` equals the JSON `expected` (numbers by value: 1 is 1.0).
fn same(value: &Value, expected: &str) -> bool {
    let Ok(expected) = serde_json::from_str::<Value>(expected) else {
        return false;
    };
    match (value.as_f64(), expected.as_f64()) {
        (Some(a), Some(b)) => a == b,
        _ => *value == expected,
    }
}

/// A value as the log shows it (JSON).
fn shown(value: impl Serialize) -> String {
    serde_json::to_string(&value).unwrap_or_else(|e| e.to_string())
}

/// The reader: the config being set, and what it found on the way.
struct Ds {
    c: TrainingConfig,
    errors: Vec<String>,
    mapped: Vec<String>,
    no_ops: Vec<(String, &'static str)>,
    /// The first `nvme_path` read (its key and directory): the one offload directory.
    nvme_path: Option<(String, PathBuf)>,
}

impl Ds {
    /// Note a problem; reading goes on.
    fn fail(&mut self, message: String) {
        self.errors.push(message);
    }

    /// The value of `step`, its error noted.
    fn ok<T>(&mut self, step: Step<T>) -> Option<T> {
        step.map_err(|e| self.fail(e)).ok()
    }

    /// Log that `source` (a key and its value, or a rule) set our `field` to `value`.
    fn mapped(&mut self, source: &str, field: &str, value: impl Serialize) {
        self.mapped
            .push(format!("{source} → {field} = {}", shown(value)));
    }

    /// Log that `path`'s `"auto"` kept our `field` at `value`.
    fn kept(&mut self, path: &str, field: &str, value: impl Serialize) {
        self.mapped.push(format!(
            "{path} = \"auto\" → {field} kept = {}",
            shown(value)
        ));
    }

    /// `key` read as `kind` (`"auto"` refused), logged as setting `field`; `None` with the
    /// error noted.
    fn given<T: Serialize + Copy>(&mut self, key: &Key, kind: &Kind<T>, field: &str) -> Option<T> {
        let v = self.ok(key.read(kind))?;
        self.mapped(&key.shown(), field, v);
        Some(v)
    }

    /// `key` read as `kind` for our `field`: `Some` to set (logged), `None` for `"auto"`
    /// (the run's `current` value kept, logged) or a wrong value (noted).
    fn given_or_auto<T: Serialize + Copy>(
        &mut self,
        key: &Key,
        kind: &Kind<T>,
        field: &str,
        current: impl Serialize,
    ) -> Option<T> {
        match self.ok(key.read_or_auto(kind))? {
            Some(v) => {
                self.mapped(&key.shown(), field, v);
                Some(v)
            }
            None => {
                self.kept(&key.path, field, current);
                None
            }
        }
    }

    /// `key` read as `kind`, `"auto"` allowed; `None` where its value is wrong (noted).
    fn optional<T>(&mut self, key: &Key, kind: &Kind<T>) -> Option<Given<T>> {
        Some(match self.ok(key.read_or_auto(kind))? {
            Some(v) => Given::Value(v),
            None => Given::Auto,
        })
    }

    /// The keys of section `key`; an error noted when it is not an object.
    fn entries<'v>(&mut self, key: &Key<'v>) -> Vec<Key<'v>> {
        match key.value.as_object() {
            Some(map) => map.iter().map(|(name, v)| key.child(name, v)).collect(),
            None => {
                self.fail(key.expected(&["an object"]));
                Vec::new()
            }
        }
    }

    /// A key without a mapping: noted as without effect where [`NO_OPS`] says so for its
    /// value, refused by path otherwise.
    fn other(&mut self, key: &Key) {
        match NO_OPS.iter().find(|n| n.names(key)) {
            Some(n) if n.harmless(key.value) => self.no_ops.push((key.path.clone(), n.why)),
            Some(n) => self.fail(format!(
                "{} = {}: not available here; only {} is ({})",
                key.path,
                key.value,
                n.only.unwrap_or_default(),
                n.why
            )),
            None => self.fail(format!(
                "{}: not supported by this trainer (no equivalent here, or a misspelt key)",
                key.path
            )),
        }
    }

    /// The top level; the precision sections, the batch check and the scheduler go last,
    /// as they read what the other keys set.
    fn root(&mut self, root: &Map<String, Value>) {
        let keys: Vec<Key> = root
            .iter()
            .map(|(name, value)| Key {
                path: name.clone(),
                name,
                value,
            })
            .collect();
        let mut batch = BatchKeys {
            micro: false,
            accum: false,
            total: Given::Absent,
        };
        let (mut fp16, mut bf16, mut scheduler) = (None, None, None);
        for key in &keys {
            match key.name {
                "train_micro_batch_size_per_gpu" => {
                    batch.micro = true;
                    self.micro_batch(key);
                }
                "gradient_accumulation_steps" => {
                    batch.accum = true;
                    let current = self.c.train.gradient_accumulation_steps;
                    let field = "train.gradient_accumulation_steps";
                    if let Some(n) = self.given_or_auto(key, &COUNT, field, current) {
                        self.c.train.gradient_accumulation_steps = n;
                    }
                }
                "train_batch_size" => {
                    batch.total = self.optional(key, &COUNT).unwrap_or(Given::Absent);
                }
                "gradient_clipping" => {
                    let current = self.c.train.max_grad_norm;
                    if let Some(v) = self.given_or_auto(key, &FLOAT, "train.max_grad_norm", current)
                    {
                        self.c.train.max_grad_norm = v;
                    }
                }
                "steps_per_print" => {
                    if let Some(n) = self.given(key, &COUNT, "logging.display_loss_steps") {
                        self.c.logging.display_loss_steps = n;
                    }
                }
                "fp16" => fp16 = Some(key),
                "bf16" | "bfloat16" if bf16.is_some() => self.fail(format!(
                    "{}: bf16 and bfloat16 (its older name) are the same section; give one",
                    key.path
                )),
                "bf16" | "bfloat16" => bf16 = Some(key),
                "communication_data_type" => self.communication(key),
                "zero_optimization" => self.zero(key),
                "optimizer" => self.optimizer(key),
                "scheduler" => scheduler = Some(key),
                "tensorboard" => self.tensorboard(key),
                _ => self.other(key),
            }
        }
        self.precision(fp16, bf16);
        self.batch(batch);
        if let Some(s) = scheduler {
            self.scheduler(s);
        }
    }

    /// `train_micro_batch_size_per_gpu`: the batch size, for evaluation too.
    fn micro_batch(&mut self, key: &Key) {
        let field = "data.batch_size, eval.eval_batch_size";
        if let Some(b) = self.given_or_auto(key, &COUNT, field, self.c.data.batch_size) {
            (self.c.data.batch_size, self.c.eval.eval_batch_size) = (b, b);
        }
    }

    /// `train_batch_size` against micro-batch x accumulation x data-parallel ranks: checked
    /// when the file gives all three, else the one it leaves out follows (DeepSpeed's rule;
    /// the run's accumulation stands in when both others are left out).
    fn batch(&mut self, keys: BatchKeys) {
        let c = &self.c;
        let (micro, accum, dp) = (
            c.data.batch_size,
            c.train.gradient_accumulation_steps,
            c.parallel.data_parallel_size,
        );
        let product = micro.saturating_mul(accum).saturating_mul(dp);
        let total = match keys.total {
            Given::Absent => return,
            Given::Auto => {
                let line = format!(
                    "train_batch_size = \"auto\" → micro-batch {micro} x accumulation {accum} x data-parallel ranks {dp} = {product}"
                );
                return self.mapped.push(line);
            }
            Given::Value(total) => total,
        };
        match (keys.micro, keys.accum) {
            (true, true) if total != product => self.fail(format!(
                "train_batch_size {total} is not train_micro_batch_size_per_gpu {micro} x gradient_accumulation_steps {accum} x data-parallel ranks {dp} = {product}"
            )),
            (true, true) => {}
            (true, false) => {
                let field = "train.gradient_accumulation_steps";
                if let Some(n) = self.divide(total, micro, "train_micro_batch_size_per_gpu", field) {
                    self.c.train.gradient_accumulation_steps = n;
                }
            }
            (false, _) => {
                let field = "data.batch_size, eval.eval_batch_size";
                if let Some(b) = self.divide(total, accum, "gradient_accumulation_steps", field) {
                    (self.c.data.batch_size, self.c.eval.eval_batch_size) = (b, b);
                }
            }
        }
    }

    /// `train_batch_size` `total` / (`other`, the value of key `name`, x data-parallel
    /// ranks): the value of our `field` (logged), or `None` where it does not divide (noted).
    fn divide(&mut self, total: usize, other: usize, name: &str, field: &str) -> Option<usize> {
        let dp = self.c.parallel.data_parallel_size;
        let divisor = other.saturating_mul(dp);
        if divisor == 0 || !total.is_multiple_of(divisor) {
            self.fail(format!(
                "train_batch_size {total} is not a multiple of {name} {other} x data-parallel ranks {dp}"
            ));
            return None;
        }
        let n = total / divisor;
        self.mapped(
            &format!("train_batch_size / ({name} x data-parallel ranks)"),
            field,
            n,
        );
        Some(n)
    }

    /// `fp16` and `bf16` together: at most one on, which sets `precision.dtype` (`"auto"`:
    /// on when the run already computes in it); fp16's loss scaling applies when fp16 is on.
    fn precision(&mut self, fp16: Option<&Key>, bf16: Option<&Key>) {
        let fp16 = fp16.map(|k| self.entries(k)).unwrap_or_default();
        let bf16 = bf16.map(|k| self.entries(k)).unwrap_or_default();
        let half = self.enabled(&fp16, Precision::F16);
        let brain = self.enabled(&bf16, Precision::Bf16);
        match (&half, &brain) {
            (Some(f), Some(b)) => {
                let message = conflict(f, b);
                self.fail(message);
            }
            (Some(on), None) | (None, Some(on)) => self.dtype(on),
            (None, None) => {}
        }
        self.loss_scaling(&fp16, half.is_some() && brain.is_none());
        for k in bf16.iter().filter(|k| k.name != "enabled") {
            self.other(k);
        }
    }

    /// The `enabled` of a precision section (`keys`) when it is on; `"auto"` is on when the
    /// run already computes in `dtype`.
    fn enabled(&mut self, keys: &[Key], dtype: Precision) -> Option<Enabled> {
        let key = find(keys, "enabled")?;
        let given = self.ok(key.read_or_auto(&FLAG))?;
        let on = given.unwrap_or(self.c.precision.dtype == dtype);
        on.then(|| Enabled {
            path: key.path.clone(),
            auto: given.is_none(),
            dtype,
        })
    }

    /// `precision.dtype` from the section that is on.
    fn dtype(&mut self, on: &Enabled) {
        if on.auto {
            self.kept(&on.path, "precision.dtype", on.dtype);
        } else {
            self.mapped(&format!("{} = true", on.path), "precision.dtype", on.dtype);
            self.c.precision.dtype = on.dtype;
        }
    }

    /// The keys of `fp16` besides `enabled`: loss scaling applied when fp16 is `on`, every
    /// key checked either way.
    fn loss_scaling(&mut self, keys: &[Key], on: bool) {
        for k in keys {
            match k.name {
                "enabled" => {}
                "loss_scale" => {
                    if let Some(s) = self.read_if(on, k, &NUMBER, "precision.loss_scale") {
                        self.c.precision.loss_scale = Some(s);
                    }
                }
                "loss_scale_window" => {
                    let field = "precision.loss_scale_growth_interval";
                    if let Some(n) = self.read_if(on, k, &COUNT, field) {
                        self.c.precision.loss_scale_growth_interval = n;
                    }
                }
                "initial_scale_power" => {
                    if self.ok(k.read(&COUNT)).is_some_and(|p| on && p != 16) {
                        self.fail(format!(
                            "{}: the dynamic loss scale starts at 2^16 here; only 16 is honoured",
                            k.path
                        ));
                    }
                }
                _ => self.other(k),
            }
        }
    }

    /// `key` read as `kind`: logged as setting `field` and returned when `on`, only checked
    /// otherwise.
    fn read_if<T: Serialize + Copy>(
        &mut self,
        on: bool,
        key: &Key,
        kind: &Kind<T>,
        field: &str,
    ) -> Option<T> {
        if on {
            return self.given(key, kind, field);
        }
        self.ok(key.read(kind));
        None
    }

    /// `communication_data_type`: "fp16" or "fp32" reduction of the gradients.
    fn communication(&mut self, key: &Key) {
        let fp16 = match key.value.as_str() {
            Some("fp16") => true,
            Some("fp32") => false,
            _ if key.value.is_null() => return self.other(key),
            _ => {
                let message = key.expected(&["\"fp16\"", "\"fp32\"", "null"]);
                return self.fail(format!("{message} (no bf16 reduction here)"));
            }
        };
        self.mapped(&key.shown(), "parallel.allreduce_in_fp16", fp16);
        self.c.parallel.allreduce_in_fp16 = fp16;
    }

    /// `zero_optimization`: the stage and the offloads.
    fn zero(&mut self, key: &Key) {
        for k in &self.entries(key) {
            match k.name {
                "stage" => {
                    if let Some(s) = self.given(k, &COUNT, "parallel.zero_stage") {
                        self.c.parallel.zero_stage = s;
                    }
                }
                "offload_optimizer" => self.offload(
                    k,
                    "offload.offload_optimizer",
                    [OffloadTarget::None, OffloadTarget::Cpu, OffloadTarget::Disk],
                    |c, t| c.offload.offload_optimizer = t,
                ),
                "offload_param" => self.offload(
                    k,
                    "offload.offload_params",
                    [ParamOffload::None, ParamOffload::Cpu, ParamOffload::Disk],
                    |c, t| c.offload.offload_params = t,
                ),
                "cpu_offload" => self.cpu_offload(
                    k,
                    "offload.offload_optimizer",
                    OffloadTarget::Cpu,
                    |c, t| c.offload.offload_optimizer = t,
                ),
                "cpu_offload_param" => {
                    self.cpu_offload(k, "offload.offload_params", ParamOffload::Cpu, |c, t| {
                        c.offload.offload_params = t
                    })
                }
                _ => self.other(k),
            }
        }
    }

    /// An offload section: `device` "none", "cpu" or "nvme" picks among `targets`, set as
    /// our `field` with `set`; `nvme_path` is the offload directory (read with "nvme" only);
    /// the other keys tune DeepSpeed's transfers.
    fn offload<T: Serialize + Copy>(
        &mut self,
        key: &Key,
        field: &str,
        targets: [T; 3],
        set: impl FnOnce(&mut TrainingConfig, T),
    ) {
        const DEVICES: [&str; 3] = ["none", "cpu", "nvme"];
        let keys = self.entries(key);
        let Some(device) = find(&keys, "device") else {
            return self.fail(format!(
                "{}.device: missing (\"none\", \"cpu\" or \"nvme\")",
                key.path
            ));
        };
        let name = self.ok(device.read(&TEXT));
        let chosen = name
            .as_deref()
            .and_then(|n| DEVICES.iter().position(|d| *d == n));
        match chosen {
            Some(i) => {
                self.mapped(&device.shown(), field, targets[i]);
                set(&mut self.c, targets[i]);
            }
            None if name.is_some() => {
                self.fail(device.expected(&["\"none\"", "\"cpu\"", "\"nvme\""]));
            }
            None => {}
        }
        let nvme = chosen == Some(2);
        for k in &keys {
            match k.name {
                "device" => {}
                "nvme_path" if nvme => self.nvme_path(k),
                "nvme_path" => self.no_ops.push((
                    k.path.clone(),
                    "read by DeepSpeed only with device \"nvme\"",
                )),
                _ => self.other(k),
            }
        }
    }

    /// An `nvme_path`: the offload directory, the same for every offload of the file.
    fn nvme_path(&mut self, key: &Key) {
        let Some(dir) = self.ok(key.read(&TEXT)).map(PathBuf::from) else {
            return;
        };
        let clash = self.nvme_path.as_ref().filter(|(_, d)| *d != dir).map(|(other, d)| {
            format!(
                "{} {dir:?} differs from {other} {d:?}: this trainer keeps every offload file in one directory",
                key.path
            )
        });
        if let Some(message) = clash {
            return self.fail(message);
        }
        self.mapped(&key.shown(), "offload.offload_dir", &dir);
        self.nvme_path = Some((key.path.clone(), dir.clone()));
        self.c.offload.offload_dir = Some(dir);
    }

    /// The deprecated `cpu_offload` / `cpu_offload_param`: true offloads to `cpu`, set as our
    /// `field` with `set`.
    fn cpu_offload<T: Serialize + Copy>(
        &mut self,
        key: &Key,
        field: &str,
        cpu: T,
        set: impl FnOnce(&mut TrainingConfig, T),
    ) {
        if self.ok(key.read(&FLAG)) == Some(true) {
            self.mapped(&key.shown(), field, cpu);
            set(&mut self.c, cpu);
        }
    }

    /// `optimizer`: its type and params.
    fn optimizer(&mut self, key: &Key) {
        let keys = self.entries(key);
        let mut params = Vec::new();
        for k in &keys {
            match k.name {
                "type" => {}
                "params" => params = self.entries(k),
                _ => self.other(k),
            }
        }
        self.optimizer_kind(key, &keys, &params);
        for k in &params {
            let o = &self.c.optimizer;
            let current = (o.beta1, o.beta2, o.epsilon, o.weight_decay);
            match k.name {
                "lr" => {
                    if let Some(lr) =
                        self.given_or_auto(k, &NUMBER, "lr.initial_lr", self.c.lr.initial_lr)
                    {
                        self.c.lr.initial_lr = lr;
                    }
                }
                "betas" => {
                    let field = "optimizer.beta1, optimizer.beta2";
                    if let Some([b1, b2]) =
                        self.given_or_auto(k, &BETAS, field, [current.0, current.1])
                    {
                        (self.c.optimizer.beta1, self.c.optimizer.beta2) = (b1, b2);
                    }
                }
                "eps" => {
                    if let Some(e) = self.given_or_auto(k, &FLOAT, "optimizer.epsilon", current.2) {
                        self.c.optimizer.epsilon = e;
                    }
                }
                "weight_decay" => {
                    let field = "optimizer.weight_decay";
                    if let Some(w) = self.given_or_auto(k, &FLOAT, field, current.3) {
                        self.c.optimizer.weight_decay = w;
                    }
                }
                "momentum" => {
                    if let Some(m) = self.given(k, &NUMBER, "optimizer.momentum") {
                        self.c.optimizer.momentum = m;
                    }
                }
                "adam_w_mode" => {}
                _ => self.other(k),
            }
        }
    }

    /// `optimizer.type` (with `params.adam_w_mode` for Adam): our optimizer kind.
    fn optimizer_kind(&mut self, section: &Key, keys: &[Key], params: &[Key]) {
        let Some(ty) = find(keys, "type") else {
            return self.fail(format!(
                "{}.type: missing (Adam, AdamW, Lamb or SGD)",
                section.path
            ));
        };
        let adam_w_mode = match find(params, "adam_w_mode") {
            Some(m) => self.ok(m.read(&FLAG)),
            None => Some(true),
        };
        let (Some(name), Some(adam_w_mode)) = (self.ok(ty.read(&TEXT)), adam_w_mode) else {
            return;
        };
        let kind = match name.to_ascii_lowercase().as_str() {
            "adam" if adam_w_mode => OptimizerKind::Adamw,
            "adam" => OptimizerKind::Adam,
            "adamw" => OptimizerKind::Adamw,
            "lamb" => OptimizerKind::Lamb,
            "sgd" => OptimizerKind::Sgd,
            _ => {
                return self.fail(format!(
                    "{}: {name} is not available (Adam, AdamW, Lamb, SGD)",
                    ty.path
                ));
            }
        };
        self.mapped(&ty.shown(), "optimizer.kind", kind);
        self.c.optimizer.kind = kind;
    }

    /// `scheduler`: the mode, the peak rate, the warm-up as a fraction of the updates and the
    /// updates; DeepSpeed's defaults for what its params leave out, where this trainer can
    /// honour them.
    fn scheduler(&mut self, key: &Key) {
        let keys = self.entries(key);
        let mut params = Vec::new();
        for k in &keys {
            match k.name {
                "type" => {}
                "params" => params = self.entries(k),
                _ => self.other(k),
            }
        }
        let Some(s) = self.scheduler_type(key, &keys) else {
            return;
        };
        let mut warmup = Given::Absent;
        for k in &params {
            match k.name {
                name if !s.params.contains(&name) => self.other(k),
                "warmup_num_steps" => warmup = self.optional(k, &COUNT).unwrap_or(Given::Auto),
                "warmup_max_lr" => {
                    if let Some(lr) =
                        self.given_or_auto(k, &NUMBER, "lr.initial_lr", self.c.lr.initial_lr)
                    {
                        self.c.lr.initial_lr = lr;
                    }
                }
                "total_num_steps" => self.total_num_steps(k),
                "warmup_type" => self.warmup_type(k),
                "warmup_min_lr" => self.zero_only(k, true, "the warm-up here starts from 0"),
                "warmup_min_ratio" => self.zero_only(k, false, "the warm-up here starts from 0"),
                "cos_min_ratio" => self.zero_only(k, false, "the schedules here decay to 0"),
                _ => self.other(k),
            }
        }
        let params_path = format!("{}.params", key.path);
        if s.params.contains(&"warmup_max_lr") && find(&params, "warmup_max_lr").is_none() {
            let path = format!("{params_path}.warmup_max_lr (left out: DeepSpeed's default)");
            self.mapped(&path, "lr.initial_lr", DEEPSPEED_WARMUP_MAX_LR);
            self.c.lr.initial_lr = DEEPSPEED_WARMUP_MAX_LR;
        }
        self.warmup(&params_path, warmup);
        self.unhonoured_defaults(s, &params_path, &params);
        self.c.lr.mode = s.mode;
    }

    /// `scheduler.type`: which of [`SCHEDULERS`] (logged as our `lr.mode`).
    fn scheduler_type(&mut self, section: &Key, keys: &[Key]) -> Option<&'static Scheduler> {
        let names = "WarmupLR, WarmupDecayLR, WarmupCosineLR";
        let Some(ty) = find(keys, "type") else {
            self.fail(format!("{}.type: missing ({names})", section.path));
            return None;
        };
        let name = self.ok(ty.read(&TEXT))?;
        let Some(s) = SCHEDULERS.iter().find(|s| s.name == name) else {
            self.fail(format!("{}: {name} is not available ({names})", ty.path));
            return None;
        };
        self.mapped(&ty.shown(), "lr.mode", s.mode);
        Some(s)
    }

    /// `scheduler.params.total_num_steps`: the updates, so the micro-steps are that many
    /// times the accumulation (the run counts steps, not epochs).
    fn total_num_steps(&mut self, key: &Key) {
        let accum = self.c.train.gradient_accumulation_steps;
        let field = "train.num_train_steps";
        match self.optional(key, &COUNT) {
            Some(Given::Value(updates)) => match updates.checked_mul(accum) {
                Some(steps) => {
                    self.mapped(&key.shown(), field, steps);
                    (self.c.train.num_train_steps, self.c.train.num_train_epochs) = (steps, 0);
                }
                None => self.fail(format!("{}: {updates} updates is too many", key.path)),
            },
            Some(_) => self.kept(&key.path, field, self.c.train.num_train_steps),
            None => {}
        }
    }

    /// The warm-up, `warmup_num_steps` under `params` (its DeepSpeed default where left
    /// out), as our fraction of the run's updates; `"auto"` keeps the run's fraction.
    fn warmup(&mut self, params: &str, warmup: Given<usize>) {
        let (steps, path) = match warmup {
            Given::Auto => {
                let path = format!("{params}.warmup_num_steps");
                return self.kept(&path, "lr.warmup_ratio", self.c.lr.warmup_ratio);
            }
            Given::Value(n) => (n, format!("{params}.warmup_num_steps")),
            Given::Absent => (
                DEEPSPEED_WARMUP_STEPS,
                format!("{params}.warmup_num_steps (left out: DeepSpeed's default)"),
            ),
        };
        let updates =
            (self.c.train.num_train_steps / self.c.train.gradient_accumulation_steps.max(1)).max(1);
        if steps >= updates {
            return self.fail(format!(
                "{path}: {steps} warm-up updates are not fewer than the run's {updates} updates"
            ));
        }
        let ratio = steps as f64 / updates as f64;
        self.mapped(&format!("{path} = {steps}"), "lr.warmup_ratio", ratio);
        self.c.lr.warmup_ratio = ratio;
    }

    /// DeepSpeed's scheduler defaults this trainer cannot run, refused where `params` (the
    /// keys under `path`) leave them out: the logarithmic warm-up (when there is one), and
    /// WarmupCosineLR's floor of 0.0001 of the peak.
    fn unhonoured_defaults(&mut self, s: &Scheduler, path: &str, params: &[Key]) {
        let warms_up = self.c.lr.warmup_ratio > 0.0;
        if warms_up && find(params, "warmup_type").is_none() {
            self.fail(format!(
                "{path}.warmup_type: DeepSpeed's {} warms up logarithmically by default; the warm-up here is linear: set \"warmup_type\": \"linear\"",
                s.name
            ));
        }
        if s.params.contains(&"cos_min_ratio") && find(params, "cos_min_ratio").is_none() {
            self.fail(format!(
                "{path}.cos_min_ratio: DeepSpeed's {} decays to 0.0001 of the peak by default; the cosine here decays to 0: set \"cos_min_ratio\": 0",
                s.name
            ));
        }
    }

    /// `warmup_type`: only "linear" is honoured.
    fn warmup_type(&mut self, key: &Key) {
        match self.ok(key.read(&TEXT)).as_deref() {
            Some("linear") | None => {}
            Some("log") => self.fail(format!(
                "{}: \"log\" is not honoured: the warm-up here is linear",
                key.path
            )),
            Some(_) => self.fail(key.expected(&["\"linear\"", "\"log\""])),
        }
    }

    /// A scheduler param that must be 0 here (`why`); where the Trainer fills `"auto"`
    /// (`auto_is_zero`), it fills 0.
    fn zero_only(&mut self, key: &Key, auto_is_zero: bool, why: &str) {
        let value = if auto_is_zero {
            self.ok(key.read_or_auto(&NUMBER)).map(|v| v.unwrap_or(0.0))
        } else {
            self.ok(key.read(&NUMBER))
        };
        if value.is_some_and(|v| v != 0.0) {
            self.fail(format!(
                "{} = {}: not honoured ({why})",
                key.path, key.value
            ));
        }
    }

    /// `tensorboard`: enabled, the log directory is `output_path/job_name`; disabled, none.
    fn tensorboard(&mut self, key: &Key) {
        let (mut enabled, mut output, mut job) = (false, None, None);
        for k in &self.entries(key) {
            match k.name {
                "enabled" => enabled = self.ok(k.read(&FLAG)).unwrap_or(false),
                "output_path" => output = self.ok(k.read(&TEXT)).map(PathBuf::from),
                "job_name" => job = self.ok(k.read(&TEXT)),
                _ => self.other(k),
            }
        }
        let dir = if enabled {
            let dir = output.unwrap_or_else(|| self.c.checkpoint.output_dir.join("tensorboard"));
            match job {
                Some(j) => dir.join(j),
                None => dir,
            }
        } else {
            PathBuf::new()
        };
        self.mapped(&key.path, "logging.log_dir", &dir);
        self.c.logging.log_dir = Some(dir);
    }
}

/// The error for fp16 and bf16 both on, naming both keys and which came from `"auto"`.
fn conflict(fp16: &Enabled, bf16: &Enabled) -> String {
    let auto: Vec<String> = [fp16, bf16]
        .iter()
        .filter(|e| e.auto)
        .map(|e| {
            format!(
                " ({} is \"auto\" and the run computes in {})",
                e.path,
                shown(e.dtype)
            )
        })
        .collect();
    format!(
        "{} and {} are both on{}: DeepSpeed refuses fp16 and bf16 together; enable one",
        fp16.path,
        bf16.path,
        auto.concat()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `tests/data/deepspeed/<name>` (sources in its SOURCES.md).
    fn fixture_path(name: &str) -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/data/deepspeed")
            .join(name)
    }

    /// The fixture `name` as JSON.
    fn fixture(name: &str) -> Value {
        let text = std::fs::read_to_string(fixture_path(name)).unwrap();
        serde_json::from_str(&text).unwrap()
    }

    /// A run config as `--config` would give it, with values a DeepSpeed file's `"auto"`
    /// keeps: 4 x 2 micro-steps, 200 micro-steps (100 updates), clipping 0.5, AdamW with
    /// betas (0.85, 0.98), eps 1e-6, decay 0.05, lr 3e-5, in `dtype`.
    fn run(dtype: Precision) -> TrainingConfig {
        let mut c = TrainingConfig::default();
        (c.data.batch_size, c.eval.eval_batch_size) = (4, 4);
        c.train.gradient_accumulation_steps = 2;
        c.train.num_train_steps = 200;
        c.train.max_grad_norm = 0.5;
        c.lr.initial_lr = 3e-5;
        let o = &mut c.optimizer;
        (o.beta1, o.beta2, o.epsilon, o.weight_decay) = (0.85, 0.98, 1e-6, 0.05);
        c.precision.dtype = dtype;
        c
    }

    /// `json` read over `c`.
    fn apply(c: TrainingConfig, json: &Value) -> Step<Applied> {
        read(c, json.as_object().unwrap())
    }

    /// `json` read over `c`, expected to succeed.
    fn applied(c: TrainingConfig, json: &Value) -> Applied {
        apply(c, json).unwrap_or_else(|e| panic!("refused: {e}"))
    }

    /// `json` read over `c`, expected to fail: the message.
    fn refused(c: TrainingConfig, json: serde_json::Value) -> String {
        match apply(c, &json) {
            Ok(_) => panic!("accepted: {json}"),
            Err(e) => e,
        }
    }

    /// The keys `a` accepted without effect.
    fn no_ops(a: &Applied) -> Vec<&str> {
        a.no_ops.iter().map(|(path, _)| path.as_str()).collect()
    }

    /// `json` with the key at `path` (dotted) removed.
    fn without(mut json: Value, path: &str) -> Value {
        let (parent, name) = path.rsplit_once('.').unwrap_or(("", path));
        let mut at = &mut json;
        for segment in parent.split('.').filter(|s| !s.is_empty()) {
            at = &mut at[segment];
        }
        at.as_object_mut().unwrap().remove(name).unwrap();
        json
    }

    #[test]
    fn hugging_face_zero2_keeps_the_run_where_it_says_auto() {
        let json = fixture("transformers_ds_config_zero2.json");
        let a = applied(run(Precision::F16), &json);
        let c = &a.config;
        assert_eq!((c.data.batch_size, c.eval.eval_batch_size), (4, 4));
        assert_eq!(c.train.gradient_accumulation_steps, 2);
        assert_eq!(c.train.max_grad_norm, 0.5);
        assert_eq!(c.train.num_train_steps, 200);
        assert_eq!(c.parallel.zero_stage, 2);
        assert_eq!(c.offload.offload_optimizer, OffloadTarget::Cpu);
        assert_eq!(c.offload.offload_params, ParamOffload::None);
        assert_eq!(c.optimizer.kind, OptimizerKind::Adamw);
        assert_eq!((c.optimizer.beta1, c.optimizer.beta2), (0.85, 0.98));
        assert_eq!(
            (c.optimizer.epsilon, c.optimizer.weight_decay),
            (1e-6, 0.05)
        );
        assert_eq!(c.lr.initial_lr, 3e-5);
        assert_eq!(
            (c.lr.mode, c.lr.warmup_ratio),
            (ScheduleKind::Constant, 0.0)
        );
        // fp16 "auto" under an f16 run: its loss scaling applies.
        assert_eq!(c.precision.dtype, Precision::F16);
        assert_eq!(c.precision.loss_scale, Some(0.0));
        assert_eq!(c.precision.loss_scale_growth_interval, 1000);
        assert_eq!(c.logging.display_loss_steps, 2000);
        let quiet = no_ops(&a);
        for key in [
            "wall_clock_breakdown",
            "fp16.hysteresis",
            "fp16.min_loss_scale",
            "zero_optimization.overlap_comm",
            "zero_optimization.contiguous_gradients",
            "zero_optimization.allgather_bucket_size",
            "zero_optimization.reduce_bucket_size",
            "zero_optimization.offload_optimizer.pin_memory",
        ] {
            assert!(quiet.contains(&key), "{key} not in {quiet:?}");
        }
        assert!(a.mapped.contains(
            &"train_micro_batch_size_per_gpu = \"auto\" → data.batch_size, eval.eval_batch_size kept = 4".to_string()
        ), "{:#?}", a.mapped);
        assert!(
            a.mapped
                .contains(&"zero_optimization.stage = 2 → parallel.zero_stage = 2".to_string())
        );
        let line = a.no_ops_line();
        assert!(
            line.contains("zero_optimization.overlap_comm") && line.contains("ZeRO"),
            "{line}"
        );
    }

    #[test]
    fn hugging_face_fp16_auto_leaves_an_f32_run_and_its_loss_scale_alone() {
        let json = fixture("transformers_ds_config_zero2.json");
        let c = applied(run(Precision::F32), &json).config;
        assert_eq!(c.precision.dtype, Precision::F32);
        assert_eq!(c.precision.loss_scale, None);
        assert_eq!(c.precision.loss_scale_growth_interval, 2000);
    }

    #[test]
    fn hugging_face_zero3_offloads_parameters_and_optimizer_to_the_cpu() {
        let json = fixture("transformers_ds_config_zero3.json");
        let a = applied(run(Precision::F32), &json);
        let c = &a.config;
        assert_eq!(c.parallel.zero_stage, 3);
        assert_eq!(c.offload.offload_optimizer, OffloadTarget::Cpu);
        assert_eq!(c.offload.offload_params, ParamOffload::Cpu);
        assert_eq!(c.precision.dtype, Precision::F32);
        assert_eq!(c.data.batch_size, 4);
        assert_eq!(c.optimizer.kind, OptimizerKind::Adamw);
        let quiet = no_ops(&a);
        for key in [
            "zero_optimization.stage3_gather_fp16_weights_on_model_save",
            "zero_optimization.stage3_prefetch_bucket_size",
            "zero_optimization.sub_group_size",
            "zero_optimization.offload_param.pin_memory",
        ] {
            assert!(quiet.contains(&key), "{key} not in {quiet:?}");
        }
    }

    #[test]
    fn hugging_face_bfloat16_auto_keeps_a_bf16_run() {
        let json = fixture("transformers_ds_config_zero2_bf16.json");
        let a = applied(run(Precision::Bf16), &json);
        assert_eq!(a.config.precision.dtype, Precision::Bf16);
        assert_eq!(a.config.precision.loss_scale, None);
        assert!(
            a.mapped
                .iter()
                .any(|l| l.starts_with("bfloat16.enabled = \"auto\""))
        );
    }

    #[test]
    fn a_hugging_face_warm_up_left_to_auto_must_be_linear_when_the_run_has_one() {
        let json = fixture("transformers_ds_config_zero2.json");
        let mut c = run(Precision::F32);
        (c.lr.mode, c.lr.warmup_ratio) = (ScheduleKind::Linear, 0.1);
        let err = apply(c.clone(), &json).err().unwrap();
        assert!(
            err.contains("scheduler.params.warmup_type") && err.contains("logarithmically"),
            "{err}"
        );
        let mut json = json;
        json["scheduler"]["params"]["warmup_type"] = "linear".into();
        let c = applied(c, &json).config;
        assert_eq!(
            (c.lr.mode, c.lr.warmup_ratio),
            (ScheduleKind::Constant, 0.1)
        );
    }

    #[test]
    fn the_hugging_face_nvme_example_names_its_misplaced_aio_and_nothing_else() {
        let json = fixture("transformers_docs_deepspeed_zero3_nvme.json");
        let err = refused(run(Precision::F16), json.clone());
        assert!(
            err.starts_with("zero_optimization.aio: not supported"),
            "{err}"
        );
        assert!(!err.contains("problems"), "{err}");
        let a = applied(run(Precision::F16), &without(json, "zero_optimization.aio"));
        let c = &a.config;
        assert_eq!(c.parallel.zero_stage, 3);
        assert_eq!(c.offload.offload_optimizer, OffloadTarget::Disk);
        assert_eq!(c.offload.offload_params, ParamOffload::Disk);
        assert_eq!(c.offload.offload_dir, Some(PathBuf::from("/local_nvme")));
        for key in [
            "zero_optimization.offload_param.max_in_cpu",
            "zero_optimization.offload_param.buffer_size",
            "zero_optimization.offload_optimizer.fast_init",
        ] {
            assert!(no_ops(&a).contains(&key), "{key}");
        }
    }

    #[test]
    fn the_cifar_example_lists_everything_it_cannot_have_in_one_error() {
        let json = fixture("deepspeedexamples_cifar_ds_config.json");
        let mut long = run(Precision::F32);
        (
            long.train.gradient_accumulation_steps,
            long.train.num_train_steps,
        ) = (1, 20_000);
        let err = refused(long.clone(), json.clone());
        assert!(err.starts_with("3 problems:"), "{err}");
        for key in [
            "fp16.fp16_master_weights_and_grads: not supported",
            "fp16.initial_scale_power: the dynamic loss scale starts at 2^16",
            "scheduler.params.warmup_type: DeepSpeed's WarmupLR warms up logarithmically",
        ] {
            assert!(err.contains(key), "{key}: {err}");
        }
        // Without what it cannot have, the rest maps.
        let mut json = without(json, "fp16.fp16_master_weights_and_grads");
        json["fp16"]["initial_scale_power"] = 16.into();
        json["scheduler"]["params"]["warmup_type"] = "linear".into();
        let a = applied(long, &json);
        let c = &a.config;
        // train_batch_size 4 on one rank, the run's accumulation 1: micro-batches of 4.
        assert_eq!(
            (c.data.batch_size, c.train.gradient_accumulation_steps),
            (4, 1)
        );
        assert_eq!(c.parallel.zero_stage, 2);
        assert_eq!(c.offload.offload_optimizer, OffloadTarget::Cpu);
        assert_eq!(c.optimizer.kind, OptimizerKind::Adamw);
        assert_eq!((c.optimizer.beta1, c.optimizer.beta2), (0.8, 0.999));
        assert_eq!(c.optimizer.weight_decay, 3e-7);
        assert_eq!(c.lr.initial_lr, 0.001);
        assert_eq!(
            (c.lr.mode, c.lr.warmup_ratio),
            (ScheduleKind::Constant, 0.05)
        );
        assert_eq!(c.train.max_grad_norm, 1.0);
        assert_eq!(c.precision.dtype, Precision::F16);
        assert_eq!(c.precision.loss_scale_growth_interval, 500);
        assert!(no_ops(&a).contains(&"prescale_gradients"));
    }

    #[test]
    fn megatron_zero2_infers_the_micro_batch_and_runs_fp16_adamw() {
        let json = fixture("deepspeedexamples_megatron_lm_ds_zero2_config.json");
        let a = applied(run(Precision::F32), &json);
        let c = &a.config;
        assert_eq!((c.data.batch_size, c.eval.eval_batch_size), (16, 16));
        assert_eq!(c.train.gradient_accumulation_steps, 1);
        assert_eq!(c.parallel.zero_stage, 2);
        assert_eq!(c.precision.dtype, Precision::F16);
        assert_eq!(c.precision.loss_scale, Some(0.0));
        assert_eq!(c.optimizer.kind, OptimizerKind::Adamw);
        assert_eq!(c.lr.initial_lr, 0.00015);
        assert_eq!(c.train.max_grad_norm, 1.0);
        assert_eq!(c.logging.display_loss_steps, 1);
        assert!(no_ops(&a).contains(&"activation_checkpointing"));
    }

    #[test]
    fn megatron_zero_infinity_names_its_misspelt_key_and_maps_the_rest() {
        let json =
            fixture("deepspeedexamples_megatron_lm_zero3_ds_zero_stage_infinity_config.json");
        let misspelt = "zero_optimization.stage3_param_persitance_threshold";
        let err = refused(run(Precision::F32), json.clone());
        assert!(
            err.starts_with(&format!("{misspelt}: not supported")),
            "{err}"
        );
        let a = applied(run(Precision::F32), &without(json, misspelt));
        let c = &a.config;
        assert_eq!(
            (c.data.batch_size, c.train.gradient_accumulation_steps),
            (4, 1)
        );
        assert_eq!(c.parallel.zero_stage, 3);
        assert_eq!(c.offload.offload_optimizer, OffloadTarget::Disk);
        assert_eq!(c.offload.offload_params, ParamOffload::Disk);
        assert_eq!(c.offload.offload_dir, Some(PathBuf::from("/nvme_data")));
        assert_eq!(c.precision.dtype, Precision::F16);
        assert_eq!(c.precision.loss_scale, Some(1024.0));
        for key in [
            "aio",
            "zero_allow_untested_optimizer",
            "zero_optimization.offload_optimizer.pipeline_read",
        ] {
            assert!(no_ops(&a).contains(&key), "{key}");
        }
    }

    #[test]
    fn every_unsupported_key_and_bad_value_is_named_by_its_full_path_in_one_error() {
        let err = refused(
            run(Precision::F32),
            serde_json::json!({
                "sparse_gradients": true,
                "zero_optimization": {"stage": 2, "zero_quantized_weights": true},
                "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "amsgrad": true}},
                "fp16": {"enabled": "yes"}
            }),
        );
        assert!(err.starts_with("4 problems:"), "{err}");
        for key in [
            "sparse_gradients: not supported",
            "zero_optimization.zero_quantized_weights: not supported",
            "optimizer.params.amsgrad: not supported",
            "fp16.enabled: expected true, false or \"auto\", got \"yes\"",
        ] {
            assert!(err.contains(key), "{key}: {err}");
        }
    }

    #[test]
    fn fp16_and_bf16_both_on_are_refused_naming_both() {
        let both = serde_json::json!({"fp16": {"enabled": true}, "bf16": {"enabled": true}});
        let err = refused(run(Precision::F32), both);
        assert!(
            err.contains("fp16.enabled and bf16.enabled are both on"),
            "{err}"
        );
        // "auto" counts as on where the run already computes in that precision.
        let auto = serde_json::json!({"fp16": {"enabled": true}, "bf16": {"enabled": "auto"}});
        let err = refused(run(Precision::Bf16), auto.clone());
        assert!(
            err.contains("bf16.enabled is \"auto\" and the run computes in \"bf16\""),
            "{err}"
        );
        assert_eq!(
            applied(run(Precision::F32), &auto).config.precision.dtype,
            Precision::F16
        );
    }

    #[test]
    fn auto_where_the_trainer_fills_nothing_is_refused_by_path() {
        let err = refused(
            run(Precision::F32),
            serde_json::json!({
                "zero_optimization": {"stage": "auto"},
                "optimizer": {"type": "SGD", "params": {"momentum": "auto"}}
            }),
        );
        for key in [
            "zero_optimization.stage: \"auto\" is resolved only",
            "optimizer.params.momentum: \"auto\"",
        ] {
            assert!(err.contains(key), "{key}: {err}");
        }
    }

    #[test]
    fn a_no_op_only_at_deepspeeds_default_is_refused_at_another_value() {
        let err = refused(
            run(Precision::F32),
            serde_json::json!({"prescale_gradients": true}),
        );
        assert!(
            err.starts_with("prescale_gradients = true: not available here; only false"),
            "{err}"
        );
        let err = refused(
            run(Precision::F32),
            serde_json::json!({"gradient_predivide_factor": 8}),
        );
        assert!(err.starts_with("gradient_predivide_factor = 8"), "{err}");
        let a = applied(
            run(Precision::F32),
            &serde_json::json!({"gradient_predivide_factor": 1}),
        );
        assert_eq!(no_ops(&a), ["gradient_predivide_factor"]);
    }

    #[test]
    fn communication_data_type_sets_the_reduction_precision() {
        let fp16 = serde_json::json!({"communication_data_type": "fp16"});
        assert!(
            applied(run(Precision::F16), &fp16)
                .config
                .parallel
                .allreduce_in_fp16
        );
        let err = refused(
            run(Precision::F32),
            serde_json::json!({"communication_data_type": "bf16"}),
        );
        assert!(
            err.starts_with("communication_data_type: expected \"fp16\", \"fp32\" or null"),
            "{err}"
        );
    }

    #[test]
    fn train_batch_size_is_checked_when_all_three_are_given_and_completes_the_rest() {
        let all = serde_json::json!({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 2});
        let err = refused(run(Precision::F32), all);
        assert!(err.starts_with("train_batch_size 64 is not train_micro_batch_size_per_gpu 8 x gradient_accumulation_steps 2 x data-parallel ranks 1 = 16"), "{err}");
        let two = serde_json::json!({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 8});
        assert_eq!(
            applied(run(Precision::F32), &two)
                .config
                .train
                .gradient_accumulation_steps,
            8
        );
        let err = refused(
            run(Precision::F32),
            serde_json::json!({"train_batch_size": 7}),
        );
        assert!(
            err.contains("not a multiple of gradient_accumulation_steps 2"),
            "{err}"
        );
    }

    #[test]
    fn a_scheduler_gets_deepspeeds_defaults_for_what_it_leaves_out() {
        let decay = serde_json::json!({"scheduler": {"type": "WarmupDecayLR", "params": {"warmup_type": "linear", "total_num_steps": 2000}}});
        let c = applied(run(Precision::F32), &decay).config;
        // 2000 updates of 2 micro-steps; DeepSpeed's 1000 warm-up updates and peak 0.001.
        assert_eq!(c.train.num_train_steps, 4000);
        assert_eq!(
            (c.lr.mode, c.lr.warmup_ratio, c.lr.initial_lr),
            (ScheduleKind::Linear, 0.5, 0.001)
        );
        let cosine = serde_json::json!({"scheduler": {"type": "WarmupCosineLR", "params": {"warmup_num_steps": 0}}});
        let err = refused(run(Precision::F32), cosine);
        assert!(
            err.starts_with(
                "scheduler.params.cos_min_ratio: DeepSpeed's WarmupCosineLR decays to 0.0001"
            ),
            "{err}"
        );
    }

    #[test]
    fn the_file_and_the_path_are_in_the_error() {
        let path = fixture_path("deepspeedexamples_cifar_ds_config.json");
        match apply_deepspeed(run(Precision::F32), &path) {
            Err(OnnxError::Decode {
                path: p,
                what,
                message,
            }) => {
                assert_eq!((p, what), (path, "DeepSpeed config"));
                assert!(
                    message.contains("fp16.fp16_master_weights_and_grads"),
                    "{message}"
                );
            }
            other => panic!("{other:?}"),
        }
    }
}
