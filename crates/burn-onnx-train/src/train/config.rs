//! [`TrainingConfig`]: the fields of ONNX Runtime Training's `TrainingRunner::Parameters`,
//! loaded from a TOML or JSON file, overridable from the command line, and validated with
//! errors that name the offending field.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::device::DeviceSpec;
use super::precision::{Precision, check_loss_scale};
use crate::error::{OnnxError, Result};
use crate::loss::LossKind;
use crate::pipeline::PipelineSchedule;

/// Where a run starts (config `resume`, `--resume latest|never|PATH`).
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

/// Optimizer choice (ORT: `training_optimizer_name`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "cli", derive(clap::ValueEnum))]
#[serde(rename_all = "lowercase")]
pub enum OptimizerKind {
    /// SGD with optional momentum.
    Sgd,
    /// Adam (L2 weight decay added to the gradient).
    Adam,
    /// AdamW (decoupled weight decay).
    Adamw,
    /// LAMB (layer-wise adaptive moments).
    Lamb,
}

/// Optimizer attributes (ORT: `optimizer_attributes`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct OptimizerConfig {
    /// Which optimizer.
    pub kind: OptimizerKind,
    /// Momentum for SGD (0 disables it).
    pub momentum: f64,
    /// Adam/AdamW/LAMB beta1.
    pub beta1: f32,
    /// Adam/AdamW/LAMB beta2.
    pub beta2: f32,
    /// Adam/AdamW/LAMB epsilon.
    pub epsilon: f32,
    /// Weight decay.
    pub weight_decay: f32,
    /// Initializer-name substrings excluded from weight decay (ORT's GPT-2 runner: biases
    /// and LayerNorm weights).
    pub no_weight_decay: Vec<String>,
}

impl Default for OptimizerConfig {
    fn default() -> Self {
        OptimizerConfig {
            kind: OptimizerKind::Adamw,
            momentum: 0.0,
            beta1: 0.9,
            beta2: 0.999,
            epsilon: 1e-8,
            weight_decay: 0.01,
            no_weight_decay: vec![
                "bias".into(),
                "ln_".into(),
                "LayerNorm".into(),
                "layer_norm".into(),
                "norm".into(),
            ],
        }
    }
}

/// Learning-rate schedule after warm-up (ORT: `lr_params.warmup_mode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "cli", derive(clap::ValueEnum))]
#[serde(rename_all = "lowercase")]
pub enum ScheduleKind {
    /// No warm-up, constant rate.
    None,
    /// Linear warm-up, then constant.
    Constant,
    /// Linear warm-up, then linear decay to 0 at the last step.
    Linear,
    /// Linear warm-up, then half-cosine decay to 0.
    Cosine,
    /// Linear warm-up, then polynomial decay (power `poly_power`) to `end_lr`.
    Poly,
}

/// Learning-rate parameters.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LrConfig {
    /// Peak learning rate.
    pub initial_lr: f64,
    /// Fraction of the update steps spent warming up, in [0, 1).
    pub warmup_ratio: f64,
    /// Schedule.
    pub mode: ScheduleKind,
    /// Poly: exponent.
    pub poly_power: f64,
    /// Poly: final rate.
    pub end_lr: f64,
}

impl Default for LrConfig {
    fn default() -> Self {
        LrConfig {
            initial_lr: 1e-3,
            warmup_ratio: 0.0,
            mode: ScheduleKind::None,
            poly_power: 1.0,
            end_lr: 0.0,
        }
    }
}

/// `collective_timeout`'s default under MPI, in seconds (torch.distributed's for Gloo/MPI).
pub const DEFAULT_MPI_COLLECTIVE_TIMEOUT_S: u64 = 1800;

/// Everything a training run needs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TrainingConfig {
    /// The ONNX model to train.
    pub model_path: PathBuf,
    /// Directory of training shards; for token shards also one file (nanoGPT's `train.bin`).
    pub train_data_dir: PathBuf,
    /// Directory of evaluation shards; for token shards also one file (`val.bin`).
    pub test_data_dir: PathBuf,
    /// Where the run writes its outputs (exported model, perf report).
    pub output_dir: PathBuf,
    /// Graph input fed with the batch (ids or images).
    pub input_name: String,
    /// Graph output the loss reads.
    pub output_name: String,
    /// Loss attached to `output_name`.
    pub loss: LossKind,
    /// With `loss = "graph"`: the graph input fed with the batch's targets (default
    /// `labels`); an error with any other loss.
    pub label_name: Option<String>,
    /// Micro-batch size per rank.
    pub batch_size: usize,
    /// Evaluation batch size.
    pub eval_batch_size: usize,
    /// Sequence length for token data.
    pub seq_len: usize,
    /// Number of micro-steps (forward+backward); updates = num_train_steps / accumulation.
    pub num_train_steps: usize,
    /// Train for this many passes over the training data instead (0: use
    /// `num_train_steps`). An epoch is the full batches each rank's share of the data fills;
    /// the micro-steps are rounded down to a multiple of `gradient_accumulation_steps`.
    pub num_train_epochs: usize,
    /// Micro-steps accumulated per optimizer update.
    pub gradient_accumulation_steps: usize,
    /// Print the loss every this many updates.
    pub display_loss_steps: usize,
    /// Evaluate every this many updates (0 = only at the end).
    pub evaluation_period: usize,
    /// Number of evaluation batches (0 = the whole test set).
    pub eval_batches: usize,
    /// Split the evaluation batches across the data-parallel ranks and all-reduce the
    /// metrics (`true`), or have every rank evaluate all of them (`false`, "replicated").
    pub eval_partitioned: bool,
    /// Optimizer.
    pub optimizer: OptimizerConfig,
    /// Learning rate.
    pub lr: LrConfig,
    /// Global gradient-norm clipping (ORT default 1.0; 0 disables).
    pub max_grad_norm: f32,
    /// Where the run computes: `"cpu"` (Flex), `"wgpu"` / `"wgpu:N"` (feature `wgpu`),
    /// `"cuda"` / `"cuda:N"` (feature `cuda`; without an index each rank takes its
    /// node-local GPU).
    pub device: DeviceSpec,
    /// Precision of MatMul/Gemm/Conv: `"f32"`, `"f16"` or `"bf16"`; config files may say it
    /// ORT's way, `use_mixed_precision = true` (f16) plus `use_bfloat16 = true` (bf16).
    /// Parameters, optimizer state and the other
    /// ops stay f32. On the CPU (Flex) f16/bf16 are stored in half the bytes but computed
    /// through f32: they save memory, not time.
    pub precision: Precision,
    /// Loss scale: absent, dynamic under f16 and none (1) otherwise; 0, dynamic (starts at
    /// 2^16, halves and skips the update on inf/NaN gradients, doubles after
    /// `loss_scale_growth_interval` finite updates); positive, that static scale.
    pub loss_scale: Option<f64>,
    /// Finite updates in a row before a dynamic loss scale doubles.
    pub loss_scale_growth_interval: usize,
    /// Send data-parallel gradients as f16 (ORT's `allreduce_in_fp16`): half the bytes of
    /// the all-reduce (ZeRO-2/3: reduce-scatter), f16's precision (about 3 decimal digits
    /// relative to the largest gradient of a bucket). Not with Adasum.
    pub allreduce_in_fp16: bool,
    /// Seconds one collective may wait for its peers; past it the job ends with an error
    /// naming the operation, its bytes, the group and the ranks that never arrived, instead
    /// of hanging (PyTorch's process-group `timeout`). Unset: 1800 under MPI, no limit for
    /// thread ranks (a failed or finished thread rank fails its peers at once); 0: no limit.
    pub collective_timeout: Option<f64>,
    /// Data-parallel size.
    pub data_parallel_size: usize,
    /// Horizontal (tensor) parallel size: the Megatron blocks found in the graph (MLP and
    /// self-attention: a column-parallel projection through to the row-parallel one) are
    /// split over this many ranks of each replica.
    pub horizontal_parallel_size: usize,
    /// With `horizontal_parallel_size` > 1, run a graph in which no block splits
    /// replicated on every tensor-parallel rank instead of stopping with an error.
    pub tensor_parallel_allow_replicated: bool,
    /// Pipeline-parallel size: the graph is cut into this many stages, one per rank of a
    /// replica.
    pub pipeline_parallel_size: usize,
    /// Micro-batches each batch is cut into for the pipeline; must divide `batch_size`.
    /// 0: the largest divisor of `batch_size` up to twice the stage count (the bubble is
    /// `(stages - 1) / (micro-batches + stages - 1)` of the time).
    pub num_pipeline_micro_batches: usize,
    /// Pipeline schedule: `"1f1b"` (activation memory bounded by the stage count) or
    /// `"gpipe"`; both give the same gradients.
    pub pipeline_schedule: PipelineSchedule,
    /// Cut the pipeline after the nodes producing these values (ORT's cut edges), one name
    /// per cut, in execution order; empty: cut automatically, balancing parameters and work.
    pub pipeline_cut_after: Vec<String>,
    /// Activation recomputation (ORT's gradient checkpointing): cut the graph into this
    /// many balanced segments, keep only the values crossing the cuts through the forward
    /// pass and re-run each segment's forward in backward. 0: off; at least 2 otherwise.
    /// With a pipeline the segments are its stages (Megatron's full recomputation): set it
    /// to `pipeline_parallel_size`, and each stage keeps only its inputs per micro-batch.
    pub recompute_segments: usize,
    /// Average data-parallel gradients during backward (PyTorch DDP's overlap) on a
    /// communication thread. 1: in one backward pass, each parameter's gradient joins a
    /// bucket the moment it is final (gradient hooks, DDP's way). 2 or more: cut the graph
    /// into this many balanced segments, run backward segment by segment from the last,
    /// and average the gradients each segment completes while the earlier segments'
    /// backward runs (composes with `recompute_segments`, which must then be the same
    /// count). 0: off (average after backward). Needs data_parallel_size > 1 and ZeRO
    /// stage 0 with mean reduction; not with pipeline or tensor parallelism.
    pub overlap_segments: usize,
    /// Combine data-parallel gradients with Adasum instead of averaging them.
    pub enable_adasum: bool,
    /// ZeRO stage (ORT: `deepspeed_zero_stage`): 0 replicates the optimizer state on every
    /// rank; 1 shards it across the data-parallel ranks; 2 also shards the gradients; 3
    /// also shards the parameters (gathered where a node reads them). With
    /// `recompute_segments`, stage 3 holds one segment's gathered parameters at a time.
    #[serde(alias = "deepspeed_zero_stage")]
    pub zero_stage: usize,
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
    /// TensorBoard directory (default `<output_dir>/tensorboard`; empty string disables).
    pub log_dir: Option<PathBuf>,
    /// Weights whose histograms are logged at each evaluation.
    pub histogram_weights: Vec<String>,
    /// Weights whose L2 norm and gradient norm are logged to TensorBoard every
    /// `display_loss_steps` updates (`norms/weight/<name>`, `norms/gradient/<name>`; ORT's
    /// norm summaries). `"*"` selects every trainable weight.
    pub norm_weights: Vec<String>,
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
    /// Seed for initialisation-independent randomness: data order, dropout.
    pub seed: u64,
    /// Show a progress bar.
    pub progress: bool,
    /// Time every node of the training forward passes and write
    /// `<output_dir>/profile.json` (rank 0's nodes: by op type and by node, per update).
    pub profile: bool,
}

impl Default for TrainingConfig {
    fn default() -> Self {
        TrainingConfig {
            model_path: PathBuf::new(),
            train_data_dir: PathBuf::new(),
            test_data_dir: PathBuf::new(),
            output_dir: PathBuf::from("runs/default"),
            input_name: "input_ids".into(),
            output_name: "logits".into(),
            loss: LossKind::LmCrossEntropy,
            label_name: None,
            batch_size: 8,
            eval_batch_size: 8,
            seq_len: 64,
            num_train_steps: 100,
            num_train_epochs: 0,
            gradient_accumulation_steps: 1,
            display_loss_steps: 10,
            evaluation_period: 50,
            eval_batches: 8,
            eval_partitioned: true,
            optimizer: OptimizerConfig::default(),
            lr: LrConfig::default(),
            max_grad_norm: 1.0,
            device: DeviceSpec::Cpu,
            precision: Precision::F32,
            loss_scale: None,
            loss_scale_growth_interval: 2000,
            allreduce_in_fp16: false,
            collective_timeout: None,
            data_parallel_size: 1,
            horizontal_parallel_size: 1,
            tensor_parallel_allow_replicated: false,
            pipeline_parallel_size: 1,
            num_pipeline_micro_batches: 0,
            pipeline_schedule: PipelineSchedule::OneFOneB,
            pipeline_cut_after: Vec::new(),
            recompute_segments: 0,
            overlap_segments: 0,
            enable_adasum: false,
            zero_stage: 0,
            checkpoints_dir: None,
            checkpoint_period: 0,
            max_num_checkpoints: 3,
            checkpoint_to_load_path: None,
            resume: Resume::Latest,
            overwrite_output_dir: false,
            log_dir: None,
            histogram_weights: Vec::new(),
            norm_weights: Vec::new(),
            weights_to_train: Vec::new(),
            weights_not_to_train: Vec::new(),
            tie_duplicate_initializers: true,
            untie_shared_constants: true,
            seed: 42,
            progress: true,
            profile: false,
        }
    }
}

/// Overlay `top` on `base`, merging tables recursively.
fn merge(base: &mut toml::Table, top: toml::Table) {
    for (k, v) in top {
        match (base.get_mut(&k), v) {
            (Some(toml::Value::Table(b)), toml::Value::Table(t)) => merge(b, t),
            (_, v) => {
                base.insert(k, v);
            }
        }
    }
}

/// `error` (a type or value the config cannot take, which serde reports without the key)
/// with the key of `file` that causes it: each key (each key of a section) is tried alone
/// over `base`, and the first that fails is named (`batch_size: invalid type: string
/// "eight", expected usize`).
fn name_the_field(base: &toml::Table, file: &toml::Table, error: toml::de::Error) -> String {
    let fails = |alone: toml::Table| {
        let mut one = base.clone();
        merge(&mut one, alone);
        toml::Value::Table(one).try_into::<TrainingConfig>().err()
    };
    let single = |k: &str, v: &toml::Value| toml::Table::from_iter([(k.to_string(), v.clone())]);
    for (key, value) in file {
        if let toml::Value::Table(section) = value {
            for (k, v) in section {
                if let Some(e) = fails(single(key, &toml::Value::Table(single(k, v)))) {
                    return format!("{key}.{k}: {}", e.message());
                }
            }
        }
        if let Some(e) = fails(single(key, value)) {
            return format!("{key}: {}", e.message());
        }
    }
    error.to_string()
}

fn invalid(field: &str, message: impl Into<String>) -> OnnxError {
    OnnxError::field(format!("config.{field}"), message)
}

/// ORT's `use_mixed_precision` (f16) and `use_bfloat16` (with it: bf16) become `precision`;
/// an explicit `precision` that disagrees with them is an error.
fn ort_precision_aliases(file: &mut toml::Table) -> std::result::Result<(), String> {
    let mut flag = |key: &str| match file.remove(key) {
        None => Ok(false),
        Some(toml::Value::Boolean(b)) => Ok(b),
        Some(other) => Err(format!("{key}: expected true or false, got {other}")),
    };
    let (mixed, bf16) = (flag("use_mixed_precision")?, flag("use_bfloat16")?);
    if bf16 && !mixed {
        return Err(
            "use_bfloat16 = true needs use_mixed_precision = true (or write precision = \"bf16\")"
                .into(),
        );
    }
    if !mixed {
        return Ok(());
    }
    let implied = if bf16 { "bf16" } else { "f16" };
    match file.get("precision") {
        Some(p) if p.as_str() != Some(implied) => Err(format!(
            "precision = {p} contradicts use_mixed_precision/use_bfloat16, which mean \"{implied}\""
        )),
        _ => {
            file.insert("precision".into(), implied.into());
            Ok(())
        }
    }
}

impl TrainingConfig {
    /// Read a `.toml` or `.json` file (by extension).
    pub fn from_file(path: &Path) -> Result<Self> {
        Self::from_file_over(TrainingConfig::default(), path)
    }

    /// `base` with the fields that the `.toml` / `.json` file at `path` sets replaced (nested
    /// tables merge field by field): how a front end's defaults meet a user's config file.
    pub fn from_file_over(base: TrainingConfig, path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| OnnxError::io(path, e))?;
        let bad = |m: String| OnnxError::Decode {
            path: path.to_path_buf(),
            what: "training config",
            message: m,
        };
        let mut file: toml::Table = match path.extension().and_then(|e| e.to_str()) {
            Some("json") => serde_json::from_str(&text).map_err(|e| bad(e.to_string()))?,
            _ => toml::from_str(&text).map_err(|e| bad(e.to_string()))?,
        };
        ort_precision_aliases(&mut file).map_err(bad)?;
        let base: toml::Table = toml::Table::try_from(&base).map_err(|e| bad(e.to_string()))?;
        let mut merged = base.clone();
        merge(&mut merged, file.clone());
        toml::Value::Table(merged)
            .try_into()
            .map_err(|e: toml::de::Error| bad(name_the_field(&base, &file, e)))
    }

    /// `self` with `KEY=VALUE` overrides (`--set`): dotted keys reach into sections
    /// (`optimizer.kind=sgd`, `lr.initial_lr=3e-4`); a value is TOML (`0.5`, `true`,
    /// `[1, 2]`, `"text"`) or else taken as a string. A key the config does not have is an
    /// error naming it.
    pub fn with_overrides(self, sets: &[String]) -> Result<Self> {
        if sets.is_empty() {
            return Ok(self);
        }
        let bad = |m: String| OnnxError::field("--set", m);
        let mut merged = toml::Table::try_from(&self).map_err(|e| bad(e.to_string()))?;
        for set in sets {
            let Some((key, text)) = set.split_once('=') else {
                return Err(bad(format!("{set:?} is not KEY=VALUE")));
            };
            let text = text.trim();
            let mut value = toml::from_str::<toml::Table>(&format!("v = {text}"))
                .ok()
                .and_then(|mut t| t.remove("v"))
                .unwrap_or_else(|| toml::Value::String(text.to_string()));
            let parts: Vec<&str> = key.trim().split('.').collect();
            for part in parts[1..].iter().rev() {
                value = toml::Value::Table(toml::Table::from_iter([(part.to_string(), value)]));
            }
            merge(
                &mut merged,
                toml::Table::from_iter([(parts[0].to_string(), value)]),
            );
        }
        toml::Value::Table(merged)
            .try_into()
            .map_err(|e: toml::de::Error| bad(e.to_string()))
    }

    /// Parse TOML held in memory (a checkpoint's copy of its run's config); `source` names
    /// where it came from in errors.
    pub fn from_toml(text: &str, source: &Path) -> Result<Self> {
        toml::from_str(text).map_err(|e| OnnxError::Decode {
            path: source.to_path_buf(),
            what: "training config",
            message: e.to_string(),
        })
    }

    /// Serialise as TOML (written next to checkpoints so a run documents itself).
    pub fn to_toml(&self) -> Result<String> {
        toml::to_string_pretty(self).map_err(|e| OnnxError::field("config", e.to_string()))
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
                "num_train_epochs",
                format!(
                    "{} epoch(s) of {batches_per_epoch} batch(es) per rank make no update of {k} accumulated micro-step(s)",
                    self.num_train_epochs
                ),
            ));
        }
        Ok(())
    }

    /// Pipeline micro-batches per batch (`num_pipeline_micro_batches`; by default the
    /// largest divisor of `batch_size` up to twice the stage count; 1 without a pipeline).
    pub fn micro_batches(&self) -> usize {
        match (self.pipeline_parallel_size, self.num_pipeline_micro_batches) {
            (1, _) => 1,
            (p, 0) => (1..=2 * p)
                .rev()
                .find(|m| self.batch_size % m == 0)
                .unwrap_or(1),
            (_, m) => m,
        }
    }

    /// Number of optimizer updates.
    pub fn num_updates(&self) -> usize {
        self.num_train_steps / self.gradient_accumulation_steps.max(1)
    }

    /// The initializer-tie rewrites this run applies at load.
    pub fn tie_options(&self) -> crate::initializer_ties::TieOptions {
        crate::initializer_ties::TieOptions {
            tie_duplicates: self.tie_duplicate_initializers,
            untie_constant_fills: self.untie_shared_constants,
        }
    }

    /// The model file, loaded onto `device` with this run's initializer-tie choices.
    pub fn load_model(&self, device: &burn::tensor::Device) -> Result<crate::OnnxModel> {
        crate::OnnxModel::from_graph(
            crate::Graph::load_with(&self.model_path, self.tie_options())?,
            device,
        )
    }

    /// How long one collective may wait: `collective_timeout`, or its default for thread
    /// ranks (`mpi` false: none) or MPI ranks (1800 s); `None`: no limit.
    pub fn collective_wait_limit(&self, mpi: bool) -> Option<std::time::Duration> {
        match self.collective_timeout {
            Some(s) if s > 0.0 => Some(std::time::Duration::from_secs_f64(s)),
            Some(_) => None,
            None => mpi.then(|| std::time::Duration::from_secs(DEFAULT_MPI_COLLECTIVE_TIMEOUT_S)),
        }
    }

    /// Resolved checkpoint directory.
    pub fn checkpoints_dir(&self) -> PathBuf {
        self.checkpoints_dir
            .clone()
            .unwrap_or_else(|| self.output_dir.join("checkpoints"))
    }

    /// Resolved TensorBoard directory, `None` when disabled.
    pub fn log_dir(&self) -> Option<PathBuf> {
        match &self.log_dir {
            Some(p) if p.as_os_str().is_empty() => None,
            Some(p) => Some(p.clone()),
            None => Some(self.output_dir.join("tensorboard")),
        }
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
        if (saved_zero == 0) != (self.zero_stage == 0) {
            return Err(invalid(
                "zero_stage",
                format!(
                    "{} cannot continue {here}, written at zero_stage {saved_zero}: a replicated optimizer record and ZeRO shards do not convert",
                    self.zero_stage
                ),
            ));
        }
        let was = saved.batch_size * saved_world * saved.gradient_accumulation_steps;
        let is = self.batch_size * world * self.gradient_accumulation_steps;
        if was != is {
            return Err(invalid(
                "batch_size",
                format!(
                    "{} per rank x {world} replica(s) x {} accumulation step(s) = a global batch of {is} samples, but {here} was trained with {was} ({} x {saved_world} x {}): keep the global batch to resume",
                    self.batch_size,
                    self.gradient_accumulation_steps,
                    saved.batch_size,
                    saved.gradient_accumulation_steps
                ),
            ));
        }
        let pairs = [
            (
                "seq_len",
                format!("{}", saved.seq_len),
                format!("{}", self.seq_len),
            ),
            ("seed", format!("{}", saved.seed), format!("{}", self.seed)),
            (
                "loss",
                format!("{:?}", saved.loss),
                format!("{:?}", self.loss),
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
    /// and the training shards named (an empty config fails here, naming them).
    pub fn check_files_named(&self) -> Result<()> {
        if self.model_path.as_os_str().is_empty() {
            return Err(invalid(
                "model_path",
                "is required: the ONNX model to train",
            ));
        }
        if self.train_data_dir.as_os_str().is_empty() {
            return Err(invalid(
                "train_data_dir",
                "is required: the directory of training shards",
            ));
        }
        Ok(())
    }

    /// Check every field; `world_size` is the number of processes the run has.
    pub fn validate(&self, world_size: usize) -> Result<()> {
        if self.model_path.as_os_str().is_empty() {
            return Err(invalid("model_path", "is required"));
        }

        if self.resume == Resume::Never && self.checkpoint_to_load_path.is_some() {
            return Err(invalid(
                "resume",
                "\"never\" with checkpoint_to_load_path: drop one of them",
            ));
        }
        if let Some(t) = self.collective_timeout
            && !(t.is_finite() && t >= 0.0)
        {
            return Err(invalid(
                "collective_timeout",
                format!("{t} is not a number of seconds (0 for no limit)"),
            ));
        }
        if matches!(self.device, DeviceSpec::Wgpu(_)) && self.precision == Precision::Bf16 {
            return Err(invalid(
                "precision",
                "bf16 on wgpu: Vulkan, Metal and DX12 store bf16 but do not compute in it; use f16 (or f32), or bf16 on cuda",
            ));
        }
        for (field, v) in [
            ("batch_size", self.batch_size),
            ("eval_batch_size", self.eval_batch_size),
            ("num_train_steps", self.num_train_steps),
            (
                "gradient_accumulation_steps",
                self.gradient_accumulation_steps,
            ),
            ("data_parallel_size", self.data_parallel_size),
            ("horizontal_parallel_size", self.horizontal_parallel_size),
            ("pipeline_parallel_size", self.pipeline_parallel_size),
            ("max_num_checkpoints", self.max_num_checkpoints),
            (
                "loss_scale_growth_interval",
                self.loss_scale_growth_interval,
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
                "num_train_steps",
                format!(
                    "{} is not a multiple of gradient_accumulation_steps ({})",
                    self.num_train_steps, self.gradient_accumulation_steps
                ),
            ));
        }
        let product =
            self.data_parallel_size * self.horizontal_parallel_size * self.pipeline_parallel_size;
        if product != world_size {
            return Err(invalid(
                "data_parallel_size",
                format!(
                    "data_parallel_size ({}) * horizontal_parallel_size ({}) * pipeline_parallel_size ({}) = {product}, but the world has {world_size} process(es)",
                    self.data_parallel_size,
                    self.horizontal_parallel_size,
                    self.pipeline_parallel_size
                ),
            ));
        }
        if self.zero_stage > 3 {
            return Err(invalid(
                "zero_stage",
                format!("{} is not a ZeRO stage: use 0, 1, 2 or 3", self.zero_stage),
            ));
        }
        if self.zero_stage >= 2 && self.enable_adasum {
            return Err(invalid(
                "enable_adasum",
                "Adasum needs each rank's whole per-tensor gradient, but ZeRO-2 and 3 reduce-scatter the gradient so no rank holds another's: use zero_stage 1 or mean reduction",
            ));
        }
        if self.allreduce_in_fp16 && self.enable_adasum {
            return Err(invalid(
                "allreduce_in_fp16",
                "Adasum combines whole per-tensor gradients in f32; f16 on the wire applies to the mean all-reduce: drop one of allreduce_in_fp16 and enable_adasum",
            ));
        }
        if self.pipeline_parallel_size > 1 && self.batch_size % self.micro_batches() != 0 {
            return Err(invalid(
                "num_pipeline_micro_batches",
                format!(
                    "{} micro-batches do not divide batch_size {}",
                    self.micro_batches(),
                    self.batch_size
                ),
            ));
        }
        if self.loss != LossKind::Graph && self.label_name.is_some() {
            return Err(invalid(
                "label_name",
                "names the graph input fed with targets, which only loss = \"graph\" uses",
            ));
        }
        if self.loss == LossKind::Graph
            && (self.pipeline_parallel_size > 1 || self.overlap_segments > 1)
        {
            return Err(invalid(
                "loss",
                "\"graph\" is not implemented with pipeline parallelism or segmented overlap (overlap_segments >= 2): attach the loss instead",
            ));
        }
        if matches!(self.loss, LossKind::LmCrossEntropy) && self.seq_len < 2 {
            return Err(invalid(
                "seq_len",
                "must be at least 2 for the language-model loss",
            ));
        }
        if !(0.0..1.0).contains(&self.lr.warmup_ratio) {
            return Err(invalid(
                "lr.warmup_ratio",
                format!("{} is outside [0, 1)", self.lr.warmup_ratio),
            ));
        }
        if self.lr.warmup_ratio > 0.0 && self.lr.mode == ScheduleKind::None {
            return Err(invalid(
                "lr.warmup_ratio",
                format!(
                    "{} has no effect with lr.mode = \"none\" (no warm-up); use mode \"constant\" for warm-up then a constant rate",
                    self.lr.warmup_ratio
                ),
            ));
        }
        if !(self.lr.initial_lr > 0.0 && self.lr.initial_lr.is_finite()) {
            return Err(invalid(
                "lr.initial_lr",
                format!("{} must be a positive number", self.lr.initial_lr),
            ));
        }
        if self.max_grad_norm < 0.0 || !self.max_grad_norm.is_finite() {
            return Err(invalid(
                "max_grad_norm",
                format!("{} must be >= 0 (0 disables clipping)", self.max_grad_norm),
            ));
        }
        let o = &self.optimizer;
        for (field, beta) in [("optimizer.beta1", o.beta1), ("optimizer.beta2", o.beta2)] {
            if !(0.0..1.0).contains(&beta) {
                return Err(invalid(field, format!("{beta} is outside [0, 1)")));
            }
        }
        if o.epsilon <= 0.0 {
            return Err(invalid("optimizer.epsilon", "must be positive"));
        }
        if o.weight_decay < 0.0 {
            return Err(invalid("optimizer.weight_decay", "must be >= 0"));
        }
        if !(0.0..1.0).contains(&o.momentum) {
            return Err(invalid(
                "optimizer.momentum",
                format!("{} is outside [0, 1)", o.momentum),
            ));
        }
        check_loss_scale(self.loss_scale)?;
        if self.recompute_segments == 1 {
            return Err(invalid(
                "recompute_segments",
                "1 segment recomputes nothing: use 0 (off) or at least 2",
            ));
        }
        let stages = self.pipeline_parallel_size;
        if self.recompute_segments > 1 && stages > 1 && self.recompute_segments != stages {
            return Err(invalid(
                "recompute_segments",
                format!(
                    "{} with {stages} pipeline stages: each stage is one recomputed segment, set it to {stages}",
                    self.recompute_segments
                ),
            ));
        }
        self.check_overlap()
    }

    /// The combinations `overlap_segments` supports.
    fn check_overlap(&self) -> Result<()> {
        let s = self.overlap_segments;
        let refuse = |why: &str| Err(invalid("overlap_segments", why.to_string()));
        if s == 0 {
            return Ok(());
        }
        if self.data_parallel_size < 2 {
            return refuse(
                "there is no gradient averaging to overlap with one data-parallel replica: set data_parallel_size > 1 or overlap_segments 0",
            );
        }
        if self.zero_stage > 0 {
            return refuse(
                "ZeRO stages 1-3 reduce-scatter gradients in the update strategy; overlap is implemented for stage 0",
            );
        }
        if self.enable_adasum {
            return refuse(
                "Adasum combines whole gradients after backward: drop one of enable_adasum and overlap_segments",
            );
        }
        if self.pipeline_parallel_size > 1 || self.horizontal_parallel_size > 1 {
            return refuse(
                "not implemented with pipeline or tensor parallelism: use overlap_segments 0",
            );
        }
        if self.recompute_segments > 1 && self.recompute_segments != s {
            return Err(invalid(
                "overlap_segments",
                format!(
                    "{s} differs from recompute_segments ({}): both cut the same segments",
                    self.recompute_segments
                ),
            ));
        }
        Ok(())
    }
}
