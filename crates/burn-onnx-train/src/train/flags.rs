//! The command-line flags every front end shares (`onnx-train train` and the examples):
//! each overrides its config field only when given, over the config file, over the front
//! end's own defaults.

use std::path::PathBuf;

use super::config::{OffloadTarget, Overlap, ParamOffload, Resume, TrainingConfig};
use crate::error::{OnnxError, Result};

/// Flags that override a [`TrainingConfig`].
#[derive(clap::Args, Debug, Clone, Default)]
pub struct TrainFlags {
    /// TOML/JSON TrainingConfig file; fields it leaves out keep this front end's defaults,
    /// and the flags below override it.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// The ONNX model to train (`model_path`).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Output directory (`output_dir`): checkpoints, TensorBoard, perf.json, export.
    #[arg(long)]
    pub output_dir: Option<PathBuf>,
    /// Optimizer updates; sets `num_train_steps` (micro-steps) = N x accumulation.
    #[arg(long, value_name = "N")]
    pub steps: Option<usize>,
    /// Train for N passes over the training data instead of a step count (`num_train_epochs`).
    #[arg(long, value_name = "N")]
    pub epochs: Option<usize>,
    /// Samples per micro-batch and rank (`batch_size`; also `eval_batch_size`).
    #[arg(long)]
    pub batch_size: Option<usize>,
    /// Micro-batches accumulated per update (`gradient_accumulation_steps`).
    #[arg(long)]
    pub accumulation: Option<usize>,
    /// Peak learning rate (`lr.initial_lr`).
    #[arg(long)]
    pub lr: Option<f64>,
    /// Log the loss every N updates (`display_loss_steps`).
    #[arg(long, value_name = "N")]
    pub display_loss_steps: Option<usize>,
    /// Evaluate every N updates (`evaluation_period`; 0 = only at the end).
    #[arg(long, value_name = "N")]
    pub eval_period: Option<usize>,
    /// Checkpoint every N updates (`checkpoint_period`; 0 = never).
    #[arg(long, value_name = "N")]
    pub checkpoint_period: Option<usize>,
    /// Seed of data order and dropout (`seed`).
    #[arg(long)]
    pub seed: Option<u64>,
    /// Data-parallel ranks (`data_parallel_size`): worker threads of this process, or the
    /// ranks of `mpirun -np N` (build with `--features mpi`).
    #[arg(long)]
    pub dp: Option<usize>,
    /// ZeRO stage (`zero_stage`): 0 replicated, 1 optimizer state sharded across the
    /// data-parallel ranks, 2 gradients sharded too, 3 parameters sharded too (gathered
    /// where a node reads them; add `--recompute N` to hold one segment's at a time).
    #[arg(long, value_name = "STAGE")]
    pub zero: Option<usize>,
    /// Pipeline stages (`pipeline_parallel_size`): the graph is cut into N consecutive
    /// stages, one rank each; the world holds dp x pp ranks.
    #[arg(long, value_name = "N")]
    pub pp: Option<usize>,
    /// With --pp: model chunks per pipeline rank (`pipeline_virtual_stages`, Megatron's
    /// interleaved 1F1B): the graph is cut into pp x V stages, rank r runs r, r + pp, ...
    #[arg(long, value_name = "V")]
    pub virtual_stages: Option<usize>,
    /// Tensor-parallel ranks (`horizontal_parallel_size`): Megatron's split of the MLP and
    /// attention blocks found in the graph; the world holds dp x tp x pp ranks.
    #[arg(long, value_name = "N")]
    pub tp: Option<usize>,
    /// With --tp: Megatron's sequence parallelism (`tensor_parallel_sequence`): between
    /// the blocks each tensor-parallel rank holds its slice of the sequence.
    #[arg(long)]
    pub sequence_parallel: bool,
    /// Micro-batches each batch is cut into for the pipeline
    /// (`num_pipeline_micro_batches`; default: the largest divisor of the batch up to twice the stage count).
    #[arg(long, value_name = "M")]
    pub micro_batches: Option<usize>,
    /// Pipeline schedule (`pipeline_schedule`): 1f1b or gpipe.
    #[arg(long, value_name = "KIND")]
    pub pipeline_schedule: Option<crate::pipeline::PipelineSchedule>,
    /// Device (`device`): cpu, wgpu, wgpu:N (build with --features wgpu), cuda or cuda:N
    /// (--features cuda; without N each rank takes its node-local GPU).
    #[arg(long, value_name = "D")]
    pub device: Option<super::device::DeviceSpec>,
    /// Precision of MatMul/Gemm/Conv (`precision`): f32, f16 or bf16, with f32 master
    /// weights. On the CPU, f16/bf16 are stored in half the bytes and computed through f32
    /// (emulated: they save memory, not time).
    #[arg(long, value_name = "P")]
    pub precision: Option<super::precision::Precision>,
    /// Loss scale (`loss_scale`): 0 dynamic (the default under f16), or a static scale.
    #[arg(long, value_name = "S")]
    pub loss_scale: Option<f64>,
    /// Send data-parallel gradients as f16 (`allreduce_in_fp16`): half the bytes on the
    /// wire, f16's precision.
    #[arg(long)]
    pub allreduce_in_fp16: bool,
    /// Keep Adam's moments in a memory-mapped file (`disk`, under `--output-dir`/offload or
    /// the config's `offload.offload_dir`) instead of memory (`offload.offload_optimizer`).
    #[arg(long, value_name = "none|cpu|disk")]
    pub offload_optimizer: Option<OffloadTarget>,
    /// With --zero 3: keep the parameter chunks in host memory while a GPU computes (`cpu`)
    /// or in a memory-mapped file under the offload directory (`disk`), gathered where a
    /// node reads them (`offload.offload_params`).
    #[arg(long, value_name = "none|cpu|disk")]
    pub offload_params: Option<ParamOffload>,
    /// Activation recomputation over N segments (`recompute_segments`; 0 off).
    #[arg(long, value_name = "N")]
    pub recompute: Option<usize>,
    /// Average data-parallel gradients during backward: `hooks` from per-parameter hooks in
    /// one backward pass, N >= 2 segment by segment, `off` (`parallel.overlap`; ORT's
    /// counts 0 and 1 mean off and hooks).
    #[arg(long, value_name = "off|hooks|N")]
    pub overlap: Option<Overlap>,
    /// Time each node's forward and write `<output_dir>/profile.json` (`profile`).
    #[arg(long)]
    pub profile: bool,
    /// Restart a failed thread run up to K times from its newest checkpoint (under mpirun:
    /// `onnx-train launch --max-restarts K`).
    #[arg(long, value_name = "K", default_value_t = 0)]
    pub max_restarts: usize,
    /// Where to start: `latest` (the newest checkpoint in the output directory, the
    /// default), `never` (the model file), or a checkpoint directory
    /// (`checkpoint_to_load_path`).
    #[arg(long, value_name = "latest|never|PATH")]
    pub resume: Option<String>,
    /// With `--resume never`, delete the checkpoints an earlier run left instead of
    /// refusing to start (`overwrite_output_dir`).
    #[arg(long)]
    pub overwrite: bool,
    /// A DeepSpeed config (`ds.json`), applied after `--config`: micro-batch, accumulation,
    /// clipping, fp16/bf16 and loss scaling, ZeRO stage, optimizer, WarmupLR /
    /// WarmupDecayLR / WarmupCosineLR, steps_per_print, tensorboard; any other key is an
    /// error naming it (`train::deepspeed`).
    #[arg(long, value_name = "ds.json")]
    pub deepspeed: Option<PathBuf>,
    /// Override any config field: `--set KEY=VALUE`, repeatable; dotted keys for sections
    /// (`--set optimizer.kind=sgd`), TOML values (applied after the file, before the flags
    /// above).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub set: Vec<String>,
    /// Print the effective config (defaults, then the file, then the flags) as TOML and
    /// exit without training. A run writes the same to `<output_dir>/config.toml`.
    #[arg(long)]
    pub print_config: bool,
}

impl TrainFlags {
    /// `defaults`, overlaid with the config file's fields (if `--config`), overlaid with
    /// the flags that were given.
    pub fn apply(&self, defaults: TrainingConfig) -> Result<TrainingConfig> {
        let c = match &self.config {
            Some(path) => TrainingConfig::from_file_over(defaults, path)?,
            None => defaults,
        };
        let c = match &self.deepspeed {
            Some(path) => super::deepspeed::apply_deepspeed(c, path)?,
            None => c,
        };
        let mut c = c.with_overrides(&self.set)?;
        let set = |field: &mut usize, v: Option<usize>| {
            if let Some(v) = v {
                *field = v;
            }
        };
        c.model.model_path = self.model.clone().unwrap_or(c.model.model_path);
        c.checkpoint.output_dir = self.output_dir.clone().unwrap_or(c.checkpoint.output_dir);
        set(&mut c.train.gradient_accumulation_steps, self.accumulation);
        if let Some(n) = self.steps {
            c.train.num_train_steps = n
                .checked_mul(c.train.gradient_accumulation_steps)
                .ok_or_else(|| OnnxError::field("--steps", "too large"))?;
            c.train.num_train_epochs = 0;
        }
        set(&mut c.train.num_train_epochs, self.epochs);
        if let Some(b) = self.batch_size {
            (c.data.batch_size, c.eval.eval_batch_size) = (b, b);
        }
        c.lr.initial_lr = self.lr.unwrap_or(c.lr.initial_lr);
        set(&mut c.logging.display_loss_steps, self.display_loss_steps);
        set(&mut c.eval.evaluation_period, self.eval_period);
        set(&mut c.checkpoint.checkpoint_period, self.checkpoint_period);
        c.train.seed = self.seed.unwrap_or(c.train.seed);
        set(&mut c.parallel.data_parallel_size, self.dp);
        set(&mut c.parallel.zero_stage, self.zero);
        set(&mut c.parallel.pipeline_parallel_size, self.pp);
        set(&mut c.parallel.pipeline_virtual_stages, self.virtual_stages);
        set(&mut c.parallel.horizontal_parallel_size, self.tp);
        set(
            &mut c.parallel.num_pipeline_micro_batches,
            self.micro_batches,
        );
        c.parallel.pipeline_schedule = self
            .pipeline_schedule
            .unwrap_or(c.parallel.pipeline_schedule);
        c.parallel.device = self.device.unwrap_or(c.parallel.device);
        c.precision.dtype = self.precision.unwrap_or(c.precision.dtype);
        c.precision.loss_scale = self.loss_scale.or(c.precision.loss_scale);
        set(&mut c.parallel.recompute_segments, self.recompute);
        c.parallel.overlap = self.overlap.unwrap_or(c.parallel.overlap);
        c.logging.profile |= self.profile;
        c.parallel.allreduce_in_fp16 |= self.allreduce_in_fp16;
        c.parallel.tensor_parallel_sequence |= self.sequence_parallel;
        c.offload.offload_optimizer = self
            .offload_optimizer
            .unwrap_or(c.offload.offload_optimizer);
        c.offload.offload_params = self.offload_params.unwrap_or(c.offload.offload_params);
        match self.resume.as_deref() {
            None => {}
            Some("latest") => c.checkpoint.resume = Resume::Latest,
            Some("never") => c.checkpoint.resume = Resume::Never,
            Some(path) => {
                c.checkpoint.resume = Resume::Latest;
                c.checkpoint.checkpoint_to_load_path = Some(PathBuf::from(path));
            }
        }
        c.checkpoint.overwrite_output_dir |= self.overwrite;
        Ok(c)
    }

    /// With `--print-config`, print `c` as TOML and say so (the front end then exits).
    pub fn printed(&self, c: &TrainingConfig) -> Result<bool> {
        if self.print_config {
            print!("{}", c.to_toml()?);
        }
        Ok(self.print_config)
    }
}
