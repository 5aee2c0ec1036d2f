//! `--deepspeed ds.json`: a DeepSpeed config read into a [`TrainingConfig`], so a DeepSpeed
//! user's file runs as it is. Each key DeepSpeed documents that has an equivalent here sets
//! it; a key this trainer does not honour (or a value it cannot honour, such as DeepSpeed's
//! default logarithmic warm-up) is an error naming it, never silently dropped.
//!
//! | DeepSpeed | here |
//! |---|---|
//! | `train_micro_batch_size_per_gpu` | `batch_size` (and `eval_batch_size`) |
//! | `gradient_accumulation_steps` | `gradient_accumulation_steps` |
//! | `train_batch_size` | checked: micro-batch x accumulation x `data_parallel_size` |
//! | `gradient_clipping` | `max_grad_norm` |
//! | `fp16.enabled`, `loss_scale` (0: dynamic), `loss_scale_window`, `initial_scale_power` (16) | `precision = "f16"`, `loss_scale`, `loss_scale_growth_interval` |
//! | `bf16.enabled` | `precision = "bf16"` |
//! | `zero_optimization.stage` | `zero_stage` |
//! | `zero_optimization.offload_optimizer.device` "nvme" / "cpu" / "none", `nvme_path` | `offload.offload_optimizer` "disk" / "cpu" / "none", `offload.offload_dir` |
//! | `zero_optimization.offload_param.device` "nvme" / "cpu" / "none", `nvme_path` | `offload.offload_params` "disk" / "cpu" / "none", `offload.offload_dir` |
//! | `optimizer.type` Adam (AdamW unless `adam_w_mode` is false), AdamW, Lamb, SGD; `params` lr, betas, eps, weight_decay, momentum | `optimizer`, `lr.initial_lr` |
//! | `scheduler.type` WarmupLR, WarmupDecayLR, WarmupCosineLR with linear warm-up from 0 | `lr.mode` constant, linear, cosine; `lr.warmup_ratio`; `total_num_steps` sets the updates |
//! | `steps_per_print` | `display_loss_steps` |
//! | `tensorboard.enabled`, `output_path`, `job_name` | `log_dir` |

use std::path::Path;

use serde_json::{Map, Value};

use super::config::{OffloadTarget, OptimizerKind, ParamOffload, ScheduleKind, TrainingConfig};
use super::precision::Precision;
use crate::error::{OnnxError, Result};

/// `c` with the DeepSpeed config at `path` applied (see the module docs).
pub fn apply_deepspeed(mut c: TrainingConfig, path: &Path) -> Result<TrainingConfig> {
    let text = std::fs::read(path).map_err(|e| OnnxError::io(path, e))?;
    let bad = |message: String| OnnxError::Decode {
        path: path.to_path_buf(),
        what: "DeepSpeed config",
        message,
    };
    let root: Map<String, Value> = serde_json::from_slice(&text).map_err(|e| bad(e.to_string()))?;
    let mut ds = Ds { c: &mut c };
    ds.root(&root).map_err(bad)?;
    Ok(c)
}

type Step<T = ()> = std::result::Result<T, String>;

struct Ds<'a> {
    c: &'a mut TrainingConfig,
}

impl Ds<'_> {
    fn root(&mut self, root: &Map<String, Value>) -> Step {
        let mut train_batch = None;
        for (key, v) in root {
            match key.as_str() {
                "train_micro_batch_size_per_gpu" => {
                    let b = count(key, v)?;
                    (self.c.data.batch_size, self.c.eval.eval_batch_size) = (b, b);
                }
                "gradient_accumulation_steps" => {
                    self.c.train.gradient_accumulation_steps = count(key, v)?
                }
                "train_batch_size" => train_batch = Some(count(key, v)?),
                "gradient_clipping" => self.c.train.max_grad_norm = number(key, v)? as f32,
                "steps_per_print" => self.c.logging.display_loss_steps = count(key, v)?,
                "fp16" => self.fp16(section(key, v)?)?,
                "bf16" => {
                    let s = section(key, v)?;
                    only(key, s, &["enabled"])?;
                    if flag(s, "enabled")? {
                        self.c.precision.dtype = Precision::Bf16;
                    }
                }
                "zero_optimization" => {
                    let s = section(key, v)?;
                    only(key, s, &["stage", "offload_optimizer", "offload_param"])?;
                    if let Some(stage) = s.get("stage") {
                        self.c.parallel.zero_stage = count("zero_optimization.stage", stage)?;
                    }
                    if let Some(o) = s.get("offload_optimizer") {
                        self.offload_optimizer(section("zero_optimization.offload_optimizer", o)?)?;
                    }
                    if let Some(o) = s.get("offload_param") {
                        self.offload_param(section("zero_optimization.offload_param", o)?)?;
                    }
                }
                "optimizer" => self.optimizer(section(key, v)?)?,
                "scheduler" => self.scheduler(section(key, v)?)?,
                "tensorboard" => self.tensorboard(section(key, v)?)?,
                other => return Err(unsupported(other)),
            }
        }
        if let Some(total) = train_batch {
            let c = &self.c;
            let product = c.data.batch_size
                * c.train.gradient_accumulation_steps
                * c.parallel.data_parallel_size;
            if total != product {
                return Err(format!(
                    "train_batch_size {total} is not train_micro_batch_size_per_gpu {} x gradient_accumulation_steps {} x data-parallel ranks {} = {product}",
                    c.data.batch_size,
                    c.train.gradient_accumulation_steps,
                    c.parallel.data_parallel_size
                ));
            }
        }
        Ok(())
    }

    fn fp16(&mut self, s: &Map<String, Value>) -> Step {
        only(
            "fp16",
            s,
            &[
                "enabled",
                "loss_scale",
                "loss_scale_window",
                "initial_scale_power",
            ],
        )?;
        if !flag(s, "enabled")? {
            return Ok(());
        }
        self.c.precision.dtype = Precision::F16;
        if let Some(v) = s.get("loss_scale") {
            self.c.precision.loss_scale = Some(number("fp16.loss_scale", v)?);
        }
        if let Some(v) = s.get("loss_scale_window") {
            self.c.precision.loss_scale_growth_interval = count("fp16.loss_scale_window", v)?;
        }
        if let Some(v) = s.get("initial_scale_power")
            && count("fp16.initial_scale_power", v)? != 16
        {
            return Err("fp16.initial_scale_power: the dynamic loss scale starts at 2^16 here; only 16 is honoured".into());
        }
        Ok(())
    }

    fn optimizer(&mut self, s: &Map<String, Value>) -> Step {
        only("optimizer", s, &["type", "params"])?;
        let kind = text("optimizer.type", s.get("type"))?;
        let params = match s.get("params") {
            Some(p) => section("optimizer.params", p)?.clone(),
            None => Map::new(),
        };
        let adam_w_mode = match params.get("adam_w_mode") {
            Some(v) => v
                .as_bool()
                .ok_or("optimizer.params.adam_w_mode: expected true or false")?,
            None => true,
        };
        let o = &mut self.c.optimizer;
        o.kind = match kind.to_ascii_lowercase().as_str() {
            "adam" if adam_w_mode => OptimizerKind::Adamw,
            "adam" => OptimizerKind::Adam,
            "adamw" => OptimizerKind::Adamw,
            "lamb" => OptimizerKind::Lamb,
            "sgd" => OptimizerKind::Sgd,
            other => {
                return Err(format!(
                    "optimizer.type: {other} is not available (Adam, AdamW, Lamb, SGD)"
                ));
            }
        };
        for (key, v) in &params {
            let name = format!("optimizer.params.{key}");
            match key.as_str() {
                "lr" => self.c.lr.initial_lr = number(&name, v)?,
                "betas" => {
                    let b = v
                        .as_array()
                        .filter(|b| b.len() == 2)
                        .ok_or(format!("{name}: expected [beta1, beta2]"))?;
                    o.beta1 = number(&name, &b[0])? as f32;
                    o.beta2 = number(&name, &b[1])? as f32;
                }
                "eps" => o.epsilon = number(&name, v)? as f32,
                "weight_decay" => o.weight_decay = number(&name, v)? as f32,
                "momentum" => o.momentum = number(&name, v)?,
                "adam_w_mode" => {}
                _ => return Err(unsupported(&name)),
            }
        }
        Ok(())
    }

    fn scheduler(&mut self, s: &Map<String, Value>) -> Step {
        only("scheduler", s, &["type", "params"])?;
        let kind = text("scheduler.type", s.get("type"))?;
        let mode = match kind.as_str() {
            "WarmupLR" => ScheduleKind::Constant,
            "WarmupDecayLR" => ScheduleKind::Linear,
            "WarmupCosineLR" => ScheduleKind::Cosine,
            other => {
                return Err(format!(
                    "scheduler.type: {other} is not available (WarmupLR, WarmupDecayLR, WarmupCosineLR)"
                ));
            }
        };
        let empty = Map::new();
        let params = match s.get("params") {
            Some(p) => section("scheduler.params", p)?,
            None => &empty,
        };
        let mut warmup = 0usize;
        for (key, v) in params {
            let name = format!("scheduler.params.{key}");
            match key.as_str() {
                "warmup_num_steps" => warmup = count(&name, v)?,
                "warmup_max_lr" => self.c.lr.initial_lr = number(&name, v)?,
                "total_num_steps" if mode != ScheduleKind::Constant => {
                    self.c.train.num_train_steps =
                        count(&name, v)? * self.c.train.gradient_accumulation_steps;
                    self.c.train.num_train_epochs = 0;
                }
                "warmup_type" if v.as_str() == Some("linear") => {}
                "warmup_min_lr" | "warmup_min_ratio" | "cos_min_ratio"
                    if v.as_f64() == Some(0.0) => {}
                _ => {
                    return Err(format!(
                        "{name} = {v}: not honoured (the schedules here warm up linearly from 0 and decay to 0)"
                    ));
                }
            }
        }
        if kind == "WarmupLR" && !params.contains_key("warmup_type") {
            return Err("scheduler.params.warmup_type: DeepSpeed's WarmupLR warms up logarithmically by default; the warm-up here is linear: set \"warmup_type\": \"linear\"".into());
        }
        let updates =
            (self.c.train.num_train_steps / self.c.train.gradient_accumulation_steps.max(1)).max(1);
        self.c.lr.mode = mode;
        self.c.lr.warmup_ratio = warmup as f64 / updates as f64;
        Ok(())
    }

    /// `zero_optimization.offload_optimizer`: `device` "nvme" (with `nvme_path`) is the
    /// state on disk, "cpu" in host memory while a GPU computes, "none" on the device.
    fn offload_optimizer(&mut self, s: &Map<String, Value>) -> Step {
        let name = "zero_optimization.offload_optimizer";
        only(name, s, &["device", "nvme_path"])?;
        match text(&format!("{name}.device"), s.get("device"))?.as_str() {
            "none" => self.c.offload.offload_optimizer = OffloadTarget::None,
            "cpu" => self.c.offload.offload_optimizer = OffloadTarget::Cpu,
            "nvme" => {
                self.c.offload.offload_optimizer = OffloadTarget::Disk;
                if let Some(p) = s.get("nvme_path") {
                    let path = text(&format!("{name}.nvme_path"), Some(p))?;
                    self.c.offload.offload_dir = Some(path.into());
                }
            }
            other => return Err(unsupported(&format!("{name}.device = {other:?}"))),
        }
        Ok(())
    }

    /// `zero_optimization.offload_param`: `device` "cpu" keeps ZeRO-3's parameter chunks
    /// in host memory, "nvme" in a file under `nvme_path` (the one directory of the
    /// offload files: it must agree with `offload_optimizer.nvme_path`).
    fn offload_param(&mut self, s: &Map<String, Value>) -> Step {
        let name = "zero_optimization.offload_param";
        only(name, s, &["device", "nvme_path"])?;
        self.c.offload.offload_params =
            match text(&format!("{name}.device"), s.get("device"))?.as_str() {
                "none" => ParamOffload::None,
                "cpu" => ParamOffload::Cpu,
                "nvme" => ParamOffload::Disk,
                other => return Err(unsupported(&format!("{name}.device = {other:?}"))),
            };
        if let Some(p) = s.get("nvme_path") {
            let path: std::path::PathBuf = text(&format!("{name}.nvme_path"), Some(p))?.into();
            match &self.c.offload.offload_dir {
                Some(dir) if dir != &path => {
                    return Err(format!(
                        "{name}.nvme_path {path:?} differs from zero_optimization.offload_optimizer.nvme_path {dir:?}: this trainer keeps every offload file in one directory"
                    ));
                }
                _ => self.c.offload.offload_dir = Some(path),
            }
        }
        Ok(())
    }

    fn tensorboard(&mut self, s: &Map<String, Value>) -> Step {
        only("tensorboard", s, &["enabled", "output_path", "job_name"])?;
        if !flag(s, "enabled")? {
            self.c.logging.log_dir = Some(Default::default());
            return Ok(());
        }
        let mut dir = match s.get("output_path") {
            Some(p) => std::path::PathBuf::from(text("tensorboard.output_path", Some(p))?),
            None => self.c.checkpoint.output_dir.join("tensorboard"),
        };
        if let Some(job) = s.get("job_name") {
            dir.push(text("tensorboard.job_name", Some(job))?);
        }
        self.c.logging.log_dir = Some(dir);
        Ok(())
    }
}

fn unsupported(key: &str) -> String {
    format!(
        "{key}: not supported by this trainer (remove it; the keys read are listed in `onnx-train train --help` under --deepspeed)"
    )
}

/// An error naming the first key of `s` outside `known` (keys of section `name`).
fn only(name: &str, s: &Map<String, Value>, known: &[&str]) -> Step {
    match s.keys().find(|k| !known.contains(&k.as_str())) {
        Some(k) => Err(unsupported(&format!("{name}.{k}"))),
        None => Ok(()),
    }
}

fn section<'v>(name: &str, v: &'v Value) -> Step<&'v Map<String, Value>> {
    v.as_object().ok_or(format!("{name}: expected an object"))
}

fn flag(s: &Map<String, Value>, key: &str) -> Step<bool> {
    match s.get(key) {
        None => Ok(false),
        Some(v) => v.as_bool().ok_or(format!("{key}: expected true or false")),
    }
}

fn count(name: &str, v: &Value) -> Step<usize> {
    v.as_u64()
        .map(|n| n as usize)
        .ok_or(format!("{name}: expected a non-negative integer, got {v}"))
}

fn number(name: &str, v: &Value) -> Step<f64> {
    v.as_f64()
        .ok_or(format!("{name}: expected a number, got {v}"))
}

fn text(name: &str, v: Option<&Value>) -> Step<String> {
    v.and_then(Value::as_str)
        .map(str::to_string)
        .ok_or(format!("{name}: expected a string"))
}
