//! [`TrainingConfig`]: the fields of ONNX Runtime Training's `TrainingRunner::Parameters`
//! in sections (`[model]`, `[data]`, `[train]`, `[eval]`, `[optimizer]`, `[lr]`,
//! `[precision]`, `[parallel]`, `[checkpoint]`, `[logging]`), loaded from a TOML or JSON
//! file in sections or flat (`file.rs`), overridable from the command line, and validated
//! section by section with errors that name the offending field (`config.data.batch_size`).
//! This file holds the whole and the checks that span sections.

pub mod deepspeed;
mod file;
mod keys;
mod optimizer;
mod parallel;
mod sections;

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

pub use optimizer::{LrConfig, OptimizerConfig, OptimizerKind, ScheduleKind};
pub use parallel::{DEFAULT_COLLECTIVE_TIMEOUT_S, Overlap, ParallelConfig};
pub use sections::{
    CheckpointConfig, DataConfig, EvalConfig, LoggingConfig, ModelConfig, OffloadConfig,
    OffloadTarget, ParamOffload, PrecisionConfig, Resume, Sequences, TrainLoopConfig,
};

use super::process::device::DeviceSpec;

/// Where the fused Adam-family optimizer keeps its moments ([`TrainingConfig::moment_place`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MomentPlace {
    /// On the training device, updated there.
    Device,
    /// In host memory; with a GPU device the update runs on the CPU.
    Host,
    /// In a memory-mapped file under this directory; the update runs on the CPU.
    Disk(PathBuf),
}
use super::precision::Precision;
use crate::error::{OnnxError, Result};
use crate::model::loss::LossKind;
use crate::parallel::tensor_parallel::SplitOptions;

/// Everything a training run needs, section by section.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TrainingConfig {
    /// The graph, its feeds, the loss, what trains.
    pub model: ModelConfig,
    /// Training and evaluation data, batch and sequence sizes.
    pub data: DataConfig,
    /// Steps, accumulation, clipping, seed.
    pub train: TrainLoopConfig,
    /// Evaluation.
    pub eval: EvalConfig,
    /// Optimizer (ORT: `optimizer_attributes`).
    pub optimizer: OptimizerConfig,
    /// Learning rate and its schedule.
    pub lr: LrConfig,
    /// Compute precision and loss scaling.
    pub precision: PrecisionConfig,
    /// Device, parallel layout, gradient reduction.
    pub parallel: ParallelConfig,
    /// Optimizer state out of memory.
    pub offload: OffloadConfig,
    /// Outputs, checkpoints, resume.
    pub checkpoint: CheckpointConfig,
    /// Console, TensorBoard, profile.
    pub logging: LoggingConfig,
}

/// A config error naming `config.<field>` (`field` with its section: `data.batch_size`).
fn invalid(field: &str, message: impl Into<String>) -> OnnxError {
    OnnxError::field(format!("config.{field}"), message)
}

/// `path` (config field `field`) exists, as a directory when `dir`; the error names the
/// absolute path a relative one resolved to.
fn check_exists(field: &str, path: &Path, dir: bool) -> Result<()> {
    let ok = if dir { path.is_dir() } else { path.is_file() };
    if ok {
        return Ok(());
    }
    let absolute = std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf());
    let what = match (path.exists(), dir) {
        (false, true) => "no such directory",
        (false, false) => "no such file",
        (true, true) => "is not a directory",
        (true, false) => "is not a file",
    };
    let resolved = if path.is_relative() {
        " (relative paths resolve against the working directory)"
    } else {
        ""
    };
    Err(invalid(
        field,
        format!("{}: {what}{resolved}", absolute.display()),
    ))
}

impl TrainingConfig {
    /// Pipeline micro-batches per batch (`num_pipeline_micro_batches`; by default the
    /// largest divisor of `batch_size` up to twice the pipeline ranks, with virtual stages
    /// the largest such multiple of the ranks; 1 without a pipeline).
    pub fn micro_batches(&self) -> usize {
        let p = &self.parallel;
        let step = if p.pipeline_virtual_stages > 1 {
            p.pipeline_parallel_size
        } else {
            1
        };
        match (p.pipeline_parallel_size, p.num_pipeline_micro_batches) {
            (1, _) => 1,
            (ranks, 0) => (1..=2 * ranks)
                .rev()
                .find(|m| self.data.batch_size.is_multiple_of(*m) && m.is_multiple_of(step))
                .unwrap_or(1),
            (_, m) => m,
        }
    }

    /// What a tensor-parallel split cuts besides Megatron's blocks: with
    /// `tensor_parallel_vocab`, the token embeddings, and the head of `model.output_name`
    /// when a cross-entropy reads it (another loss needs whole outputs); with
    /// `tensor_parallel_sequence`, the sequence between the blocks.
    pub fn tensor_parallel_split(&self) -> SplitOptions {
        let p = &self.parallel;
        let vocab_loss = matches!(
            self.model.loss,
            LossKind::CrossEntropy | LossKind::LmCrossEntropy
        );
        SplitOptions {
            allow_replicated: p.tensor_parallel_allow_replicated,
            vocab_parallel: p.tensor_parallel_vocab,
            vocab_head: (p.tensor_parallel_vocab && vocab_loss)
                .then(|| self.model.output_name.clone()),
            sequence_parallel: p.tensor_parallel_sequence,
        }
    }

    /// Where the fused optimizer keeps its moments (`[offload]`).
    pub fn moment_place(&self) -> MomentPlace {
        match self.offload.offload_optimizer {
            OffloadTarget::None => MomentPlace::Device,
            OffloadTarget::Cpu => MomentPlace::Host,
            OffloadTarget::Disk => MomentPlace::Disk(self.offload_dir()),
        }
    }

    /// Resolved TensorBoard directory, `None` when disabled.
    pub fn log_dir(&self) -> Option<PathBuf> {
        self.logging.resolved_log_dir(&self.checkpoint.output_dir)
    }

    /// Can this run continue a checkpoint written by a run with `saved` on `saved_world`
    /// data-parallel replicas at ZeRO stage `saved_zero`? The data stream and the optimizer
    /// state depend on the global batch, the seed and the optimizer: those must match
    /// (`checkpoint` names the checkpoint in the error). The global batch (`batch_size` x
    /// replicas x `gradient_accumulation_steps`) may be split another way: a replicated
    /// (stage 0) checkpoint resumes on any data-parallel size at stage 0, a ZeRO checkpoint
    /// reshards onto any data-parallel size and stage 1 to 3 (as torchrun's elastic
    /// restarts keep the global batch by raising accumulation). Either resumes on any
    /// pipeline stage count (each stage takes its parameters' state from the stages that
    /// wrote it). Step counts, schedules, periods and paths may change.
    pub fn check_resume(
        &self,
        saved: &TrainingConfig,
        saved_world: usize,
        saved_zero: usize,
        world: usize,
        checkpoint: &Path,
    ) -> Result<()> {
        let here = checkpoint.display();
        if (saved_zero == 0) != (self.parallel.zero_stage == 0) {
            return Err(invalid(
                "parallel.zero_stage",
                format!(
                    "{} cannot continue {here}, written at zero_stage {saved_zero}: a replicated optimizer record and ZeRO shards do not convert",
                    self.parallel.zero_stage
                ),
            ));
        }
        let was = saved.data.batch_size * saved_world * saved.train.gradient_accumulation_steps;
        let is = self.data.batch_size * world * self.train.gradient_accumulation_steps;
        if was != is {
            return Err(invalid(
                "data.batch_size",
                format!(
                    "{} per rank x {world} replica(s) x {} accumulation step(s) = a global batch of {is} samples, but {here} was trained with {was} ({} x {saved_world} x {}): keep the global batch to resume",
                    self.data.batch_size,
                    self.train.gradient_accumulation_steps,
                    saved.data.batch_size,
                    saved.train.gradient_accumulation_steps
                ),
            ));
        }
        let pairs = [
            (
                "data.seq_len",
                format!("{}", saved.data.seq_len),
                format!("{}", self.data.seq_len),
            ),
            (
                "train.seed",
                format!("{}", saved.train.seed),
                format!("{}", self.train.seed),
            ),
            (
                "model.loss",
                format!("{:?}", saved.model.loss),
                format!("{:?}", self.model.loss),
            ),
            (
                "optimizer.kind",
                format!("{:?}", saved.optimizer.kind),
                format!("{:?}", self.optimizer.kind),
            ),
        ];
        for (field, was, is) in pairs {
            if was != is {
                return Err(invalid(
                    field,
                    format!(
                        "{is} differs from {was} in the run that wrote {here}: the run cannot resume from it (use a fresh output_dir or checkpoints_dir)"
                    ),
                ));
            }
        }
        Ok(())
    }

    /// What a front end that reads data from files needs before it reads any: the model
    /// file and the training (and, if named, test) shard directories named and present.
    /// Errors name the field and the absolute path a relative one resolved to (against the
    /// working directory, as torchrun's and DeepSpeed's launchers resolve theirs).
    pub fn check_files_named(&self) -> Result<()> {
        if self.model.model_path.as_os_str().is_empty() {
            return Err(invalid(
                "model.model_path",
                "is required: the ONNX model to train (--model FILE.onnx, or model_path in --config)",
            ));
        }
        if self.data.train_data_dir.as_os_str().is_empty() {
            return Err(invalid(
                "data.train_data_dir",
                "is required: the directory of training shards (--train-data DIR, or train_data_dir in --config)",
            ));
        }
        check_exists("model.model_path", &self.model.model_path, false)?;
        check_exists("data.train_data_dir", &self.data.train_data_dir, true)?;
        if !self.data.test_data_dir.as_os_str().is_empty() {
            check_exists("data.test_data_dir", &self.data.test_data_dir, true)?;
        }
        Ok(())
    }

    /// Everything a run checks of the config alone ([`Self::validate`] on the world the
    /// config lays out): front ends call it before reading data or starting ranks, so a bad
    /// field fails at once; the ranks check the world they find when they start.
    pub fn check(&self) -> Result<()> {
        self.validate(self.parallel.world_size())
    }

    /// Check every section, then the combinations across sections; `world_size` is the
    /// number of processes the run has.
    pub fn validate(&self, world_size: usize) -> Result<()> {
        self.model.validate()?;
        self.checkpoint.validate()?;
        self.data.validate()?;
        self.eval.validate()?;
        self.train.validate()?;
        self.parallel.validate(world_size)?;
        self.precision.validate()?;
        self.optimizer.validate()?;
        self.lr.validate()?;
        self.check_across_sections()
    }

    /// `offload.offload_params`: ZeRO-3's chunks, off a GPU (`cpu`) or on disk.
    fn check_param_offload(&self) -> Result<()> {
        let (name, target) = match self.offload.offload_params {
            ParamOffload::None => return Ok(()),
            ParamOffload::Cpu => ("cpu", "in host memory"),
            ParamOffload::Disk => ("disk", "on disk"),
        };
        let why = if self.parallel.zero_stage != 3 {
            format!(
                "keeps ZeRO-3's parameter chunks {target}: set parallel.zero_stage = 3 (other stages hold whole parameters on every rank)"
            )
        } else if name == "cpu" && self.parallel.device == DeviceSpec::Cpu {
            "moves the parameters off a GPU; on the CPU device they are in host memory already (use \"none\", or \"disk\")".into()
        } else {
            return Ok(());
        };
        Err(invalid(
            "offload.offload_params",
            format!("\"{name}\" {why}"),
        ))
    }

    /// The directory of the offload files (`offload.offload_dir`, default
    /// `<output_dir>/offload`).
    pub fn offload_dir(&self) -> PathBuf {
        self.offload
            .offload_dir
            .clone()
            .unwrap_or_else(|| self.checkpoint.output_dir.join("offload"))
    }

    /// The refusals that involve fields of two sections.
    fn check_across_sections(&self) -> Result<()> {
        let p = &self.parallel;
        if matches!(p.device, DeviceSpec::Wgpu(_)) && self.precision.dtype == Precision::Bf16 {
            return Err(invalid(
                "precision.dtype",
                "bf16 on wgpu: Vulkan, Metal and DX12 store bf16 but do not compute in it; use f16 (or f32), or bf16 on cuda",
            ));
        }
        if p.pipeline_parallel_size > 1 && self.data.batch_size % self.micro_batches() != 0 {
            return Err(invalid(
                "parallel.num_pipeline_micro_batches",
                format!(
                    "{} micro-batches do not divide batch_size {}",
                    self.micro_batches(),
                    self.data.batch_size
                ),
            ));
        }
        if p.pipeline_virtual_stages > 1
            && !self
                .micro_batches()
                .is_multiple_of(p.pipeline_parallel_size)
        {
            return Err(invalid(
                "parallel.num_pipeline_micro_batches",
                format!(
                    "{} micro-batches with pipeline_virtual_stages {}: the interleaved schedule takes micro-batches in groups of pipeline_parallel_size ({}), so the count must be a multiple of it (and divide batch_size {})",
                    self.micro_batches(),
                    p.pipeline_virtual_stages,
                    p.pipeline_parallel_size,
                    self.data.batch_size
                ),
            ));
        }
        if self.model.loss == LossKind::Graph
            && (p.pipeline_parallel_size > 1 || p.overlap.segments().is_some())
        {
            return Err(invalid(
                "model.loss",
                "\"graph\" is not implemented with pipeline parallelism or segmented overlap: attach the loss instead",
            ));
        }
        let offload = self.offload.offload_optimizer;
        if offload != OffloadTarget::None {
            let name = if offload == OffloadTarget::Cpu {
                "cpu"
            } else {
                "disk"
            };
            let why = if offload == OffloadTarget::Cpu && p.device == DeviceSpec::Cpu {
                Some(
                    "moves the state off a GPU; on the CPU device it is in host memory already (use \"none\")",
                )
            } else if self.optimizer.kind == OptimizerKind::Sgd {
                Some("offloads Adam, AdamW and LAMB moments; SGD's momentum stays in memory")
            } else {
                None
            };
            if let Some(why) = why {
                return Err(invalid(
                    "offload.offload_optimizer",
                    format!("\"{name}\" {why}"),
                ));
            }
        }
        self.check_param_offload()?;
        if matches!(self.model.loss, LossKind::LmCrossEntropy) && self.data.seq_len < 2 {
            return Err(invalid(
                "data.seq_len",
                "must be at least 2 for the language-model loss",
            ));
        }
        Ok(())
    }
}
