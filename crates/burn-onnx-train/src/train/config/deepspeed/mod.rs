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

mod batch;
mod key;
mod kind;
mod no_ops;
mod optimizer;
mod precision;
mod reader;
mod scheduler;
mod tensorboard;
#[cfg(test)]
mod tests;
mod zero;

use std::path::Path;

use serde_json::{Map, Value};

use super::TrainingConfig;
use crate::error::{OnnxError, Result};
use reader::Ds;

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
