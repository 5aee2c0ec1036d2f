//! The command-line flags every front end shares (`onnx-train train`, `plan` and the
//! examples): each overrides its config field only when given, over the config file, over
//! the front end's own defaults. [`ConfigFlags`] set the run's config; [`TrainFlags`] add
//! what only a training run reads (resume, restarts); [`DataFlags`] name the model's feeds
//! and the data, for front ends that read the user's own files (`onnx-train`; the examples
//! make their own data).

use std::path::PathBuf;

use crate::error::{OnnxError, Result};
use crate::model::loss::LossKind;
use crate::train::config::{OffloadTarget, Overlap, ParamOffload, Resume, TrainingConfig};

/// Flags that override a [`TrainingConfig`], grouped under headings in `--help`.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct ConfigFlags {
    /// TOML/JSON TrainingConfig file; fields it leaves out keep this front end's defaults,
    /// and the flags below override it.
    #[arg(long, help_heading = "Config")]
    pub config: Option<PathBuf>,
    /// A DeepSpeed config (`ds.json`), applied after `--config`: micro-batch, accumulation,
    /// train_batch_size, clipping, fp16/bf16 and loss scaling, communication_data_type, ZeRO
    /// stage and offload, optimizer, WarmupLR / WarmupDecayLR / WarmupCosineLR,
    /// steps_per_print, tensorboard. Hugging Face's "auto" keeps this run's value; keys that
    /// only tune DeepSpeed itself (bucket sizes, overlap_comm, pin_memory, its reports) are
    /// accepted with a warning; every other key is named in one error (`train::config::deepspeed`).
    #[arg(long, value_name = "ds.json", help_heading = "Config")]
    pub deepspeed: Option<PathBuf>,
    /// Override any config field: `--set KEY=VALUE`, repeatable; dotted keys for sections
    /// (`--set optimizer.kind=sgd`), TOML values (applied after the file, before the flags
    /// below).
    #[arg(long = "set", value_name = "KEY=VALUE", help_heading = "Config")]
    pub set: Vec<String>,
    /// Print the effective config (defaults, then the file, then the flags) as TOML and
    /// exit without training (`onnx-train` then checks it: exit 78 naming a field a run
    /// would refuse). A run writes the same to `<output_dir>/config.toml`.
    #[arg(long, help_heading = "Config")]
    pub print_config: bool,
    /// The ONNX model to train (`model_path`).
    #[arg(long, value_name = "FILE.onnx", help_heading = "Model and data")]
    pub model: Option<PathBuf>,
    /// Optimizer updates; sets `num_train_steps` (micro-steps) = N x accumulation.
    #[arg(long, value_name = "N", help_heading = "Schedule")]
    pub steps: Option<usize>,
    /// Train for N passes over the training data instead of a step count (`num_train_epochs`).
    #[arg(long, value_name = "N", help_heading = "Schedule")]
    pub epochs: Option<usize>,
    /// Samples per micro-batch and rank (`batch_size`; also `eval_batch_size`).
    #[arg(long, value_name = "N", help_heading = "Schedule")]
    pub batch_size: Option<usize>,
    /// Micro-batches accumulated per update (`gradient_accumulation_steps`).
    #[arg(long, value_name = "N", help_heading = "Schedule")]
    pub accumulation: Option<usize>,
    /// Peak learning rate (`lr.initial_lr`).
    #[arg(long, help_heading = "Schedule")]
    pub lr: Option<f64>,
    /// Seed of data order and dropout (`seed`).
    #[arg(long, help_heading = "Schedule")]
    pub seed: Option<u64>,
    /// Log the loss every N updates (`display_loss_steps`).
    #[arg(long, value_name = "N", help_heading = "Output")]
    pub display_loss_steps: Option<usize>,
    /// Evaluate every N updates (`evaluation_period`; 0 = only at the end).
    #[arg(long, value_name = "N", help_heading = "Output")]
    pub eval_period: Option<usize>,
    /// Checkpoint every N updates (`checkpoint_period`; 0 = never).
    #[arg(long, value_name = "N", help_heading = "Output")]
    pub checkpoint_period: Option<usize>,
    /// Output directory (`output_dir`): checkpoints, TensorBoard, perf.json, export.
    #[arg(long, value_name = "DIR", help_heading = "Output")]
    pub output_dir: Option<PathBuf>,
    /// Time each node's forward and write `<output_dir>/profile.json` (`profile`).
    #[arg(long, help_heading = "Output")]
    pub profile: bool,
    /// Data-parallel ranks (`data_parallel_size`): worker threads of this process, or the
    /// ranks of `mpirun -np N` (build with `--features mpi`).
    #[arg(long, value_name = "N", help_heading = "Parallelism")]
    pub dp: Option<usize>,
    /// ZeRO stage (`zero_stage`): 0 replicated, 1 optimizer state sharded across the
    /// data-parallel ranks, 2 gradients sharded too, 3 parameters sharded too (gathered
    /// where a node reads them; add `--recompute N` to hold one segment's at a time).
    #[arg(long, value_name = "STAGE", help_heading = "Parallelism")]
    pub zero: Option<usize>,
    /// Pipeline stages (`pipeline_parallel_size`): the graph is cut into N consecutive
    /// stages, one rank each; the world holds dp x pp ranks.
    #[arg(long, value_name = "N", help_heading = "Parallelism")]
    pub pp: Option<usize>,
    /// With --pp: model chunks per pipeline rank (`pipeline_virtual_stages`, Megatron's
    /// interleaved 1F1B): the graph is cut into pp x V stages, rank r runs r, r + pp, ...
    #[arg(long, value_name = "V", help_heading = "Parallelism")]
    pub virtual_stages: Option<usize>,
    /// Micro-batches each batch is cut into for the pipeline
    /// (`num_pipeline_micro_batches`; default: the largest divisor of the batch up to twice the stage count).
    #[arg(long, value_name = "M", help_heading = "Parallelism")]
    pub micro_batches: Option<usize>,
    /// Pipeline schedule (`pipeline_schedule`): 1f1b or gpipe.
    #[arg(long, value_name = "KIND", help_heading = "Parallelism")]
    pub pipeline_schedule: Option<crate::parallel::pipeline::PipelineSchedule>,
    /// Tensor-parallel ranks (`horizontal_parallel_size`): Megatron's split of the MLP and
    /// attention blocks found in the graph; the world holds dp x tp x pp ranks.
    #[arg(long, value_name = "N", help_heading = "Parallelism")]
    pub tp: Option<usize>,
    /// With --tp: Megatron's sequence parallelism (`tensor_parallel_sequence`): between
    /// the blocks each tensor-parallel rank holds its slice of the sequence.
    #[arg(long, help_heading = "Parallelism")]
    pub sequence_parallel: bool,
    /// Average data-parallel gradients during backward: `hooks` from per-parameter hooks in
    /// one backward pass, N >= 2 segment by segment, `off` (`parallel.overlap`; ORT's
    /// counts 0 and 1 mean off and hooks).
    #[arg(long, value_name = "off|hooks|N", help_heading = "Parallelism")]
    pub overlap: Option<Overlap>,
    /// Send data-parallel gradients as f16 (`allreduce_in_fp16`): half the bytes on the
    /// wire, f16's precision.
    #[arg(long, help_heading = "Parallelism")]
    pub allreduce_in_fp16: bool,
    /// Device (`device`): cpu, wgpu, wgpu:N (build with --features wgpu), cuda or cuda:N
    /// (--features cuda; without N each rank takes its node-local GPU).
    #[arg(long, value_name = "D", help_heading = "Device and precision")]
    pub device: Option<crate::train::process::device::DeviceSpec>,
    /// Precision of MatMul/Gemm/Conv (`precision`): f32, f16 or bf16, with f32 master
    /// weights. On the CPU, f16/bf16 are stored in half the bytes and computed through f32
    /// (emulated: they save memory, not time).
    #[arg(long, value_name = "P", help_heading = "Device and precision")]
    pub precision: Option<crate::train::precision::Precision>,
    /// Loss scale (`loss_scale`): 0 dynamic (the default under f16), or a static scale.
    #[arg(long, value_name = "S", help_heading = "Device and precision")]
    pub loss_scale: Option<f64>,
    /// Record the third update as a device graph (a CUDA graph on CUDA) and replay it for
    /// the rest (`train.cuda_graph`): one GPU, the LM loss; other runs train as usual.
    #[arg(long, help_heading = "Device and precision")]
    pub cuda_graph: bool,
    /// Activation recomputation over N segments (`recompute_segments`; 0 off).
    #[arg(long, value_name = "N", help_heading = "Memory")]
    pub recompute: Option<usize>,
    /// Keep Adam's moments in a memory-mapped file (`disk`, under `--output-dir`/offload or
    /// the config's `offload.offload_dir`) instead of memory (`offload.offload_optimizer`).
    #[arg(long, value_name = "none|cpu|disk", help_heading = "Memory")]
    pub offload_optimizer: Option<OffloadTarget>,
    /// With --zero 3: keep the parameter chunks in host memory while a GPU computes (`cpu`)
    /// or in a memory-mapped file under the offload directory (`disk`), gathered where a
    /// node reads them (`offload.offload_params`).
    #[arg(long, value_name = "none|cpu|disk", help_heading = "Memory")]
    pub offload_params: Option<ParamOffload>,
}

/// [`ConfigFlags`] and what only a training run reads: where it starts and how often it
/// restarts.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct TrainFlags {
    /// The flags that set the config.
    #[command(flatten)]
    pub settings: ConfigFlags,
    /// Restart a failed thread run up to K times from its newest checkpoint (under mpirun:
    /// `onnx-train launch --max-restarts K`). A run that fails before its first update
    /// (bad config, data or model) is never restarted.
    #[arg(
        long,
        value_name = "K",
        default_value_t = 0,
        help_heading = "Resume and restarts"
    )]
    pub max_restarts: usize,
    /// Where to start: `latest` (the newest checkpoint in the output directory, the
    /// default), `never` (the model file), or a checkpoint directory
    /// (`checkpoint_to_load_path`).
    #[arg(
        long,
        value_name = "latest|never|PATH",
        help_heading = "Resume and restarts"
    )]
    pub resume: Option<String>,
    /// With `--resume never`, delete the checkpoints an earlier run left instead of
    /// refusing to start (`overwrite_output_dir`).
    #[arg(long, help_heading = "Resume and restarts")]
    pub overwrite: bool,
}

/// The model's feeds and the user's data, for front ends that train the user's own files
/// without a config file (`onnx-train train --model M.onnx --train-data DIR`).
#[derive(clap::Args, Debug, Clone, Default)]
pub struct DataFlags {
    /// Directory of training shards (`data.train_data_dir`): `tokens_NNNNN.npy` for
    /// `lm_cross_entropy` (`onnx-train tokenize` writes them), `images_K.npy` with
    /// `labels_K.npy` / `targets_K.npy` for `cross_entropy` / `mse`.
    #[arg(long, value_name = "DIR", help_heading = "Model and data")]
    pub train_data: Option<PathBuf>,
    /// Directory of evaluation shards, in the training shards' format (`data.test_data_dir`).
    #[arg(long, value_name = "DIR", help_heading = "Model and data")]
    pub test_data: Option<PathBuf>,
    /// Tokens per training window (`data.seq_len`): at most the model's position table.
    #[arg(long, value_name = "N", help_heading = "Model and data")]
    pub seq_len: Option<usize>,
    /// The loss attached to the output (`model.loss`): lm_cross_entropy (next token, the
    /// default), cross_entropy (class ids), mse, or graph (the graph computes its own).
    #[arg(long, value_name = "KIND", help_heading = "Model and data")]
    pub loss: Option<LossKind>,
    /// The graph input fed with the batch (`model.input_name`; default `input_ids`).
    #[arg(long, value_name = "NAME", help_heading = "Model and data")]
    pub input_name: Option<String>,
    /// The graph output the loss reads (`model.output_name`; default `logits`).
    #[arg(long, value_name = "NAME", help_heading = "Model and data")]
    pub output_name: Option<String>,
}

/// `field` set to `value` when the flag was given.
fn set<T>(field: &mut T, value: Option<T>) {
    if let Some(v) = value {
        *field = v;
    }
}

impl ConfigFlags {
    /// `defaults`, overlaid with the config file's fields (if `--config`), the DeepSpeed
    /// file's (if `--deepspeed`), the `--set` overrides, then the flags that were given.
    pub fn apply(&self, defaults: TrainingConfig) -> Result<TrainingConfig> {
        let c = match &self.config {
            Some(path) => TrainingConfig::from_file_over(defaults, path)?,
            None => defaults,
        };
        let c = match &self.deepspeed {
            Some(path) => crate::train::config::deepspeed::apply_deepspeed(c, path)?,
            None => c,
        };
        let mut c = c.with_overrides(&self.set)?;
        set(&mut c.model.model_path, self.model.clone());
        set(&mut c.checkpoint.output_dir, self.output_dir.clone());
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
        set(&mut c.lr.initial_lr, self.lr);
        set(&mut c.logging.display_loss_steps, self.display_loss_steps);
        set(&mut c.eval.evaluation_period, self.eval_period);
        set(&mut c.checkpoint.checkpoint_period, self.checkpoint_period);
        set(&mut c.train.seed, self.seed);
        set(&mut c.parallel.data_parallel_size, self.dp);
        set(&mut c.parallel.zero_stage, self.zero);
        set(&mut c.parallel.pipeline_parallel_size, self.pp);
        set(&mut c.parallel.pipeline_virtual_stages, self.virtual_stages);
        set(&mut c.parallel.horizontal_parallel_size, self.tp);
        set(
            &mut c.parallel.num_pipeline_micro_batches,
            self.micro_batches,
        );
        set(&mut c.parallel.pipeline_schedule, self.pipeline_schedule);
        set(&mut c.parallel.device, self.device);
        set(&mut c.precision.dtype, self.precision);
        c.precision.loss_scale = self.loss_scale.or(c.precision.loss_scale);
        set(&mut c.parallel.recompute_segments, self.recompute);
        set(&mut c.parallel.overlap, self.overlap);
        c.logging.profile |= self.profile;
        c.parallel.allreduce_in_fp16 |= self.allreduce_in_fp16;
        c.parallel.tensor_parallel_sequence |= self.sequence_parallel;
        c.train.cuda_graph |= self.cuda_graph;
        set(&mut c.offload.offload_optimizer, self.offload_optimizer);
        set(&mut c.offload.offload_params, self.offload_params);
        Ok(c)
    }

    /// With `--print-config`, print `c` as TOML (the front end then exits).
    pub fn printed(&self, c: &TrainingConfig) -> Result<bool> {
        if self.print_config {
            print!("{}", c.to_toml()?);
        }
        Ok(self.print_config)
    }
}

impl TrainFlags {
    /// [`ConfigFlags::apply`], then where the run starts (`--resume`, `--overwrite`).
    pub fn apply(&self, defaults: TrainingConfig) -> Result<TrainingConfig> {
        let mut c = self.settings.apply(defaults)?;
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

    /// [`ConfigFlags::printed`].
    pub fn printed(&self, c: &TrainingConfig) -> Result<bool> {
        self.settings.printed(c)
    }
}

impl DataFlags {
    /// `c` with the model's feeds and the data directories that were given.
    pub fn apply(&self, mut c: TrainingConfig) -> TrainingConfig {
        set(&mut c.data.train_data_dir, self.train_data.clone());
        set(&mut c.data.test_data_dir, self.test_data.clone());
        set(&mut c.data.seq_len, self.seq_len);
        set(&mut c.model.loss, self.loss);
        set(&mut c.model.input_name, self.input_name.clone());
        set(&mut c.model.output_name, self.output_name.clone());
        c
    }
}
