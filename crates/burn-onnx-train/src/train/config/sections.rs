//! The sections of [`TrainingConfig`](super::TrainingConfig) other than parallelism and the
//! optimizer: `[model]`, `[data]`, `[train]`, `[eval]`, `[precision]`, `[checkpoint]`,
//! `[logging]`. Field names are ONNX Runtime Training's (`TrainingRunner::Parameters`), so
//! a flat ORT-style file maps onto them key for key (`file.rs`); each section checks its
//! own fields.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::invalid;
use crate::error::Result;
use crate::model::loss::LossKind;
use crate::train::precision::{Precision, check_loss_scale};

/// Where a run starts (config `checkpoint.resume`, `--resume latest|never|PATH`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Resume {
    /// From the newest checkpoint in the checkpoint directory, if any (or from
    /// `checkpoint_to_load_path` when set).
    #[default]
    Latest,
    /// From the model file, whatever the checkpoint directory holds (with checkpoints
    /// there: an error unless `overwrite_output_dir`, which deletes them first).
    Never,
}

/// `[model]`: the graph, what it is fed, the loss, and which initializers train.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ModelConfig {
    /// The ONNX model to train.
    pub model_path: PathBuf,
    /// Graph input fed with the batch (ids or images).
    pub input_name: String,
    /// Graph output the loss reads.
    pub output_name: String,
    /// Loss attached to `output_name`.
    pub loss: LossKind,
    /// With `loss = "graph"`: the graph input fed with the batch's targets (default
    /// `labels`); an error with any other loss.
    pub label_name: Option<String>,
    /// The graph input fed with the attention mask (Hugging Face's `attention_mask`): 1
    /// for a real token, 0 for padding (documents padded to the longest of a batch), all
    /// ones for windows. Unset: the graph has no such input.
    pub attention_mask_name: Option<String>,
    /// Train only these initializers (empty: all float initializers).
    pub weights_to_train: Vec<String>,
    /// Never train these initializers.
    pub weights_not_to_train: Vec<String>,
    /// Train an initializer that equals another exactly, directly or transposed, as that
    /// parameter (an exporter's folded copy of a tied weight, e.g. GPT-2's `lm_head`); on by
    /// default (off: `inspect` only reports such duplicates); see `initializer_ties`.
    pub tie_duplicate_initializers: bool,
    /// Give each node that reads a shared constant-filled initializer (exporter-merged norm
    /// weights, biases, batch-norm statistics) its own copy; see `initializer_ties`.
    pub untie_shared_constants: bool,
    /// Widen the head producing `output_name` (a MatMul or Gemm whose weight is a
    /// parameter, read by a cross-entropy loss) to a multiple of this many columns inside
    /// the model, with zero columns the loss never reads: GPT-2's 50257 become 50304, so
    /// the logits' rows are aligned for vectorized GPU kernels (nanoGPT's padding,
    /// Megatron's `make_vocab_size_divisible_by`). The parameter, checkpoints, exports and
    /// the loss are the unpadded model's. Unset: 64 on GPU devices, off on the CPU (whose
    /// kernels gain nothing from it); 1: off. Not with tensor parallelism, whose vocabulary
    /// split pads the head its own way.
    pub pad_vocab_to_multiple_of: Option<usize>,
    /// Leave the head producing `output_name` (a MatMul read only by the LM cross-entropy)
    /// to the loss, which computes the product and the cross-entropy (with their gradients
    /// in training) a block of rows at a time (at most 256 MiB of logits each), so the
    /// `[tokens, vocabulary]` logits never exist whole: Liger-Kernel's fused linear
    /// cross-entropy (1.65 GB less for GPT-2 124M at 16 x 1024 tokens in bf16). The same
    /// products run. Applies on GPU devices when the forward is one pass (no tensor or
    /// pipeline parallelism, no `recompute_segments` or overlap segments); false: off.
    pub fused_head_loss: bool,
}

impl Default for ModelConfig {
    fn default() -> Self {
        ModelConfig {
            model_path: PathBuf::new(),
            input_name: "input_ids".into(),
            output_name: "logits".into(),
            loss: LossKind::LmCrossEntropy,
            label_name: None,
            attention_mask_name: None,
            weights_to_train: Vec::new(),
            weights_not_to_train: Vec::new(),
            tie_duplicate_initializers: true,
            untie_shared_constants: true,
            pad_vocab_to_multiple_of: None,
            fused_head_loss: true,
        }
    }
}

impl ModelConfig {
    /// The multiple the head's columns are padded to ([`Self::pad_vocab_to_multiple_of`];
    /// unset: 64 on CubeCL devices, 1 on the CPU).
    pub fn vocab_multiple(&self, cubecl: bool) -> usize {
        let default = if cubecl { 64 } else { 1 };
        self.pad_vocab_to_multiple_of.unwrap_or(default)
    }

    /// A model named; `label_name` only with the graph's own loss.
    pub fn validate(&self) -> Result<()> {
        if self.model_path.as_os_str().is_empty() {
            return Err(invalid(
                "model.model_path",
                "is required: the ONNX model to train (--model FILE.onnx, or model_path in --config)",
            ));
        }
        if self.pad_vocab_to_multiple_of == Some(0) {
            return Err(invalid(
                "model.pad_vocab_to_multiple_of",
                "must be at least 1 (1: no padding)",
            ));
        }
        if self.loss != LossKind::Graph && self.label_name.is_some() {
            return Err(invalid(
                "model.label_name",
                "names the graph input fed with targets, which only loss = \"graph\" uses",
            ));
        }
        Ok(())
    }

    /// The initializer-tie rewrites this run applies at load.
    pub fn tie_options(&self) -> crate::graph::initializer_ties::TieOptions {
        crate::graph::initializer_ties::TieOptions {
            tie_duplicates: self.tie_duplicate_initializers,
            untie_constant_fills: self.untie_shared_constants,
        }
    }

    /// The model file, loaded onto `device` with this run's initializer-tie choices.
    pub fn load(&self, device: &burn::tensor::Device) -> Result<crate::OnnxModel> {
        crate::OnnxModel::from_graph(
            crate::Graph::load_with(&self.model_path, self.tie_options())?,
            device,
        )
    }

    /// [`Self::load`], with the parameters this run trains chosen
    /// (`weights_to_train` / `weights_not_to_train`): the model the trainer starts from.
    pub fn load_for_training(&self, device: &burn::tensor::Device) -> Result<crate::OnnxModel> {
        self.load(device)?.select_trainable(
            &self.weights_to_train,
            &self.weights_not_to_train,
            (
                "config.model.weights_to_train",
                "config.model.weights_not_to_train",
            ),
        )
    }
}

/// `[data]`: where the samples come from and how big a batch is.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DataConfig {
    /// Directory of training shards; for token shards also one file (nanoGPT's `train.bin`).
    pub train_data_dir: PathBuf,
    /// Directory of evaluation shards; for token shards also one file (`val.bin`).
    pub test_data_dir: PathBuf,
    /// Micro-batch size per rank.
    pub batch_size: usize,
    /// Sequence length for token data: the window, or with documents the longest sample
    /// (a longer document is cut into pieces of this length).
    pub seq_len: usize,
    /// How token shards become samples: `"windows"` of `seq_len` cut from the stream
    /// (nanoGPT's way); `"documents"`, each document of `documents.idx.npy` its own sample,
    /// padded to the longest of its batch; `"packed"`, windows whose positions never
    /// predict across a document boundary. See `train::data::documents`.
    pub sequences: Sequences,
    /// With documents: consecutive global batches sorted by length together (length
    /// bucketing, so that a batch pads little); 1 takes them as shuffled.
    pub length_bucket_batches: usize,
    /// With documents: the id padding positions hold (never a label, masked from
    /// attention).
    pub pad_id: i64,
}

/// How token shards become samples (`data.sequences`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Sequences {
    /// Windows of `seq_len` cut from the stream.
    #[default]
    Windows,
    /// Each document its own sample, batches padded to their longest.
    Documents,
    /// Windows that never predict across a document boundary.
    Packed,
}

impl Default for DataConfig {
    fn default() -> Self {
        DataConfig {
            train_data_dir: PathBuf::new(),
            test_data_dir: PathBuf::new(),
            batch_size: 8,
            seq_len: 64,
            sequences: Sequences::Windows,
            length_bucket_batches: 50,
            pad_id: 0,
        }
    }
}

impl DataConfig {
    /// A batch of at least one sample, buckets of at least one batch.
    pub fn validate(&self) -> Result<()> {
        if self.batch_size == 0 {
            return Err(invalid("data.batch_size", "must be at least 1"));
        }
        if self.length_bucket_batches == 0 {
            return Err(invalid(
                "data.length_bucket_batches",
                "must be at least 1 (1: no length bucketing)",
            ));
        }
        if self.pad_id < 0 {
            return Err(invalid("data.pad_id", "must be a token id (>= 0)"));
        }
        Ok(())
    }
}

/// `[train]`: how long the loop runs, how micro-steps make an update, clipping, the seed.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TrainLoopConfig {
    /// Number of micro-steps (forward+backward); updates = num_train_steps / accumulation.
    pub num_train_steps: usize,
    /// Train for this many passes over the training data instead (0: use
    /// `num_train_steps`). An epoch is the full batches each rank's share of the data fills;
    /// the micro-steps are rounded down to a multiple of `gradient_accumulation_steps`.
    pub num_train_epochs: usize,
    /// Micro-steps accumulated per optimizer update.
    pub gradient_accumulation_steps: usize,
    /// Global gradient-norm clipping (ORT default 1.0; 0 disables).
    pub max_grad_norm: f32,
    /// Seed for initialisation-independent randomness: data order, dropout.
    pub seed: u64,
    /// Replay each update as one captured device graph from the third on (a CUDA graph on
    /// CUDA; cubecl's recorded dispatches on wgpu): the host queues no kernels, so an
    /// update costs the device's time alone. Where the run cannot be captured (not one
    /// rank on a GPU, not the LM loss on windows of tokens, random ops, a dynamic f16
    /// loss scale, an offloaded update) it trains as usual and says why.
    pub cuda_graph: bool,
}

impl Default for TrainLoopConfig {
    fn default() -> Self {
        TrainLoopConfig {
            num_train_steps: 100,
            num_train_epochs: 0,
            gradient_accumulation_steps: 1,
            max_grad_norm: 1.0,
            seed: 42,
            cuda_graph: false,
        }
    }
}

impl TrainLoopConfig {
    /// Steps and accumulation of at least one, whole updates, a usable clipping norm.
    pub fn validate(&self) -> Result<()> {
        for (field, v) in [
            ("train.num_train_steps", self.num_train_steps),
            (
                "train.gradient_accumulation_steps",
                self.gradient_accumulation_steps,
            ),
        ] {
            if v == 0 {
                return Err(invalid(field, "must be at least 1"));
            }
        }
        if self.num_train_epochs == 0
            && self.num_train_steps % self.gradient_accumulation_steps != 0
        {
            return Err(invalid(
                "train.num_train_steps",
                format!(
                    "{} is not a multiple of gradient_accumulation_steps ({})",
                    self.num_train_steps, self.gradient_accumulation_steps
                ),
            ));
        }
        if self.max_grad_norm < 0.0 || !self.max_grad_norm.is_finite() {
            return Err(invalid(
                "train.max_grad_norm",
                format!("{} must be >= 0 (0 disables clipping)", self.max_grad_norm),
            ));
        }
        Ok(())
    }

    /// Number of optimizer updates.
    pub fn num_updates(&self) -> usize {
        self.num_train_steps / self.gradient_accumulation_steps.max(1)
    }

    /// With `num_train_epochs` set, fix `num_train_steps` for a data set whose every rank
    /// fills `batches_per_epoch` batches per epoch.
    pub fn resolve_epochs(&mut self, batches_per_epoch: usize) -> Result<()> {
        if self.num_train_epochs == 0 {
            return Ok(());
        }
        let k = self.gradient_accumulation_steps.max(1);
        self.num_train_steps = self.num_train_epochs * batches_per_epoch / k * k;
        if self.num_train_steps == 0 {
            return Err(invalid(
                "train.num_train_epochs",
                format!(
                    "{} epoch(s) of {batches_per_epoch} batch(es) per rank make no update of {k} accumulated micro-step(s)",
                    self.num_train_epochs
                ),
            ));
        }
        Ok(())
    }
}

/// `[eval]`: when and on how much of the test set the run evaluates.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct EvalConfig {
    /// Evaluation batch size.
    pub eval_batch_size: usize,
    /// Evaluate every this many updates (0 = only at the end).
    pub evaluation_period: usize,
    /// Number of evaluation batches (0 = the whole test set).
    pub eval_batches: usize,
    /// Split the evaluation batches across the data-parallel ranks and all-reduce the
    /// metrics (`true`), or have every rank evaluate all of them (`false`, "replicated").
    pub eval_partitioned: bool,
}

impl Default for EvalConfig {
    fn default() -> Self {
        EvalConfig {
            eval_batch_size: 8,
            evaluation_period: 50,
            eval_batches: 8,
            eval_partitioned: true,
        }
    }
}

impl EvalConfig {
    /// A batch of at least one sample.
    pub fn validate(&self) -> Result<()> {
        if self.eval_batch_size == 0 {
            return Err(invalid("eval.eval_batch_size", "must be at least 1"));
        }
        Ok(())
    }
}

/// `[precision]`: the compute dtype of the big products and the loss scale.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PrecisionConfig {
    /// Precision of MatMul/Gemm/Conv: `"f32"`, `"f16"` or `"bf16"` (a flat file says
    /// `precision = "bf16"`, or ORT's way, `use_mixed_precision = true` (f16) plus
    /// `use_bfloat16 = true` (bf16)). Parameters, optimizer state and the other ops stay
    /// f32. On the CPU (Flex) f16/bf16 are stored in half the bytes but computed through
    /// f32: they save memory, not time.
    pub dtype: Precision,
    /// Loss scale: absent, dynamic under f16 and none (1) otherwise; 0, dynamic (starts at
    /// 2^16, halves and skips the update on inf/NaN gradients, doubles after
    /// `loss_scale_growth_interval` finite updates); positive, that static scale.
    pub loss_scale: Option<f64>,
    /// Finite updates in a row before a dynamic loss scale doubles.
    pub loss_scale_growth_interval: usize,
}

impl Default for PrecisionConfig {
    fn default() -> Self {
        PrecisionConfig {
            dtype: Precision::F32,
            loss_scale: None,
            loss_scale_growth_interval: 2000,
        }
    }
}

impl PrecisionConfig {
    /// A usable loss scale and growth interval.
    pub fn validate(&self) -> Result<()> {
        if self.loss_scale_growth_interval == 0 {
            return Err(invalid(
                "precision.loss_scale_growth_interval",
                "must be at least 1",
            ));
        }
        check_loss_scale(self.loss_scale)
    }
}

/// `[checkpoint]`: where the run writes, how often it checkpoints, where it resumes from.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CheckpointConfig {
    /// Where the run writes its outputs (exported model, perf report, and by default its
    /// checkpoints and TensorBoard events).
    pub output_dir: PathBuf,
    /// Checkpoint directory (default `<output_dir>/checkpoints`).
    pub checkpoints_dir: Option<PathBuf>,
    /// Checkpoint every this many updates (0 = never).
    pub checkpoint_period: usize,
    /// Keep at most this many checkpoints.
    pub max_num_checkpoints: usize,
    /// Resume from this checkpoint instead of the latest one.
    pub checkpoint_to_load_path: Option<PathBuf>,
    /// Resume from the newest checkpoint (`latest`) or start from the model (`never`).
    pub resume: Resume,
    /// With `resume = "never"`: delete the checkpoints an earlier run left in the
    /// checkpoint directory instead of refusing to start (Hugging Face's
    /// `overwrite_output_dir`).
    pub overwrite_output_dir: bool,
}

impl Default for CheckpointConfig {
    fn default() -> Self {
        CheckpointConfig {
            output_dir: PathBuf::from("runs/default"),
            checkpoints_dir: None,
            checkpoint_period: 0,
            max_num_checkpoints: 3,
            checkpoint_to_load_path: None,
            resume: Resume::Latest,
            overwrite_output_dir: false,
        }
    }
}

impl CheckpointConfig {
    /// Room for one checkpoint; one way to choose where to resume.
    pub fn validate(&self) -> Result<()> {
        if self.max_num_checkpoints == 0 {
            return Err(invalid(
                "checkpoint.max_num_checkpoints",
                "must be at least 1",
            ));
        }
        if self.resume == Resume::Never && self.checkpoint_to_load_path.is_some() {
            return Err(invalid(
                "checkpoint.resume",
                "\"never\" with checkpoint_to_load_path: drop one of them",
            ));
        }
        Ok(())
    }

    /// Resolved checkpoint directory.
    pub fn checkpoints_dir(&self) -> PathBuf {
        self.checkpoints_dir
            .clone()
            .unwrap_or_else(|| self.output_dir.join("checkpoints"))
    }
}

/// Where the optimizer state lives (config `offload.offload_optimizer`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "cli", derive(clap::ValueEnum))]
#[serde(rename_all = "lowercase")]
pub enum OffloadTarget {
    /// In memory, beside the parameters.
    #[default]
    None,
    /// In host memory while the model computes on a GPU (ZeRO-Offload): each update
    /// moves the parameters and gradients to the CPU, updates them there with the fused
    /// CPU update, and moves the parameters back. Adam, AdamW and LAMB on a GPU device;
    /// with ZeRO each rank's shard, which otherwise stays on the GPU where the group moves
    /// device tensors (NCCL).
    Cpu,
    /// In a memory-mapped file under `offload_dir` (ZeRO-Infinity's NVMe offload): each
    /// parameter's moments are paged in for its update and released after it, so memory
    /// holds one parameter's state at a time (on a GPU device, the update runs on the CPU
    /// as with `cpu`). Adam, AdamW and LAMB; with ZeRO each rank's shard of the state.
    Disk,
}

/// Where a ZeRO-3 rank keeps its chunks of the parameters (config `offload.offload_params`,
/// DeepSpeed's `offload_param`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "cli", derive(clap::ValueEnum))]
#[serde(rename_all = "lowercase")]
pub enum ParamOffload {
    /// On the training device.
    #[default]
    None,
    /// In host memory while the model computes on a GPU (ZeRO-Infinity's CPU offload of
    /// parameters): a node's read gathers the whole parameter on the host and moves it to
    /// the GPU, its gradient comes back to the host for the reduce-scatter, and the update
    /// runs there, so the GPU holds no parameter between its readers. ZeRO-3 on a GPU.
    Cpu,
    /// In a memory-mapped file under `offload_dir` (ZeRO-Infinity's NVMe offload of
    /// parameters; DeepSpeed's `"nvme"`): each chunk is paged in where a node reads it or
    /// the update writes it and released after, so memory holds the chunks in use, not the
    /// rank's share of the model. ZeRO-3, on any device.
    #[serde(alias = "nvme")]
    #[cfg_attr(feature = "cli", value(alias = "nvme"))]
    Disk,
}

/// `[offload]`: optimizer state and parameters out of the device's memory.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct OffloadConfig {
    /// Where the optimizer state lives.
    pub offload_optimizer: OffloadTarget,
    /// Where ZeRO-3's parameter chunks live.
    pub offload_params: ParamOffload,
    /// The directory of the files of `disk` (default `<output_dir>/offload`; a fast local
    /// disk: every update reads and writes the whole state once, and with the parameters
    /// there every pass reads them).
    pub offload_dir: Option<PathBuf>,
}

/// `[logging]`: the console, TensorBoard summaries and the node profile.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LoggingConfig {
    /// Print the loss every this many updates. On a GPU the losses and gradient norms of
    /// the updates in between stay on the device until then (every update is still
    /// reported, and a loss that is not finite still names its update).
    pub display_loss_steps: usize,
    /// TensorBoard directory (default `<output_dir>/tensorboard`; empty string disables).
    pub log_dir: Option<PathBuf>,
    /// Weights whose histograms are logged at each evaluation.
    pub histogram_weights: Vec<String>,
    /// Weights whose L2 norm and gradient norm are logged to TensorBoard every
    /// `display_loss_steps` updates (`norms/weight/<name>`, `norms/gradient/<name>`; ORT's
    /// norm summaries). `"*"` selects every trainable weight.
    pub norm_weights: Vec<String>,
    /// Show a progress bar (feature `progress`, part of `cli`; a library built without it
    /// reports through the log lines alone).
    pub progress: bool,
    /// Time every node of the training forward passes and write
    /// `<output_dir>/profile.json` (rank 0's nodes: by op type and by node, per update).
    pub profile: bool,
}

impl Default for LoggingConfig {
    fn default() -> Self {
        LoggingConfig {
            display_loss_steps: 10,
            log_dir: None,
            histogram_weights: Vec::new(),
            norm_weights: Vec::new(),
            progress: true,
            profile: false,
        }
    }
}

impl LoggingConfig {
    /// Resolved TensorBoard directory for a run writing into `output_dir`, `None` when
    /// disabled.
    pub fn resolved_log_dir(&self, output_dir: &Path) -> Option<PathBuf> {
        match &self.log_dir {
            Some(p) if p.as_os_str().is_empty() => None,
            Some(p) => Some(p.clone()),
            None => Some(output_dir.join("tensorboard")),
        }
    }
}
