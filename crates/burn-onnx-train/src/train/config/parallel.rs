//! `[parallel]`: where the run computes and how its ranks share the work (data, tensor and
//! pipeline parallelism, ZeRO, gradient reduction, overlap and recomputation), with the
//! combinations these fields allow among themselves checked here.

use burn_ort_dist::Topology;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::invalid;
use crate::error::Result;
use crate::model::OnnxModel;
use crate::parallel::pipeline::{Partition, PipelineSchedule};
use crate::train::process::device::DeviceSpec;

/// `collective_timeout`'s default, in seconds (torch.distributed's for Gloo/MPI), for MPI
/// and thread ranks alike.
pub const DEFAULT_COLLECTIVE_TIMEOUT_S: u64 = 1800;

/// Gradient averaging during backward (PyTorch DDP's overlap), on a communication thread.
///
/// In a file: `overlap = "off"`, `"hooks"` or `{ segments = N }`; ORT-style files may say
/// `overlap_segments = 0 | 1 | N` (off, hooks, N segments), as the flag `--overlap` does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Overlap {
    /// Average after backward.
    #[default]
    Off,
    /// In one backward pass, each parameter's gradient joins a bucket the moment it is
    /// final (gradient hooks, DDP's way).
    Hooks,
    /// Cut the graph into this many (>= 2) balanced segments, run backward segment by
    /// segment from the last, and average the gradients each segment completes while the
    /// earlier segments' backward runs (composes with `recompute_segments`, which must then
    /// be the same count).
    Segments(usize),
}

impl Overlap {
    /// The mode `overlap_segments` (ORT-style count) and `--overlap N` mean: 0 off, 1 hooks,
    /// N >= 2 segments.
    pub fn from_count(n: usize) -> Overlap {
        match n {
            0 => Overlap::Off,
            1 => Overlap::Hooks,
            n => Overlap::Segments(n),
        }
    }

    /// Backward segments, when overlap cuts the graph into them.
    pub fn segments(self) -> Option<usize> {
        match self {
            Overlap::Segments(n) => Some(n),
            _ => None,
        }
    }
}

impl std::str::FromStr for Overlap {
    type Err = String;

    /// `off`, `hooks`, or a segment count N >= 2 (ORT's 0 and 1 mean off and hooks).
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "off" => Ok(Overlap::Off),
            "hooks" => Ok(Overlap::Hooks),
            n => n.parse().map(Overlap::from_count).map_err(|_| {
                format!("{n:?} is not an overlap mode: use off, hooks or a segment count")
            }),
        }
    }
}

/// How a file writes an [`Overlap`]: a name, a segment table, or ORT's count.
#[derive(Serialize, Deserialize)]
#[serde(untagged)]
enum OverlapRepr {
    Count(usize),
    Name(String),
    Segments { segments: usize },
}

impl Serialize for Overlap {
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        match *self {
            Overlap::Off => OverlapRepr::Name("off".into()),
            Overlap::Hooks => OverlapRepr::Name("hooks".into()),
            Overlap::Segments(segments) => OverlapRepr::Segments { segments },
        }
        .serialize(s)
    }
}

impl<'de> Deserialize<'de> for Overlap {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        match OverlapRepr::deserialize(d)? {
            OverlapRepr::Count(n) => Ok(Overlap::from_count(n)),
            OverlapRepr::Name(n) if n == "off" => Ok(Overlap::Off),
            OverlapRepr::Name(n) if n == "hooks" => Ok(Overlap::Hooks),
            OverlapRepr::Segments { segments } if segments >= 2 => Ok(Overlap::Segments(segments)),
            OverlapRepr::Segments { segments } => Err(serde::de::Error::custom(format!(
                "{{ segments = {segments} }}: overlap by segments needs at least 2 (or \"hooks\")"
            ))),
            OverlapRepr::Name(n) => Err(serde::de::Error::custom(format!(
                "{n:?} is not an overlap mode: use \"off\", \"hooks\" or {{ segments = N }}"
            ))),
        }
    }
}

/// `[parallel]`: the device, the parallel layout and how gradients are reduced.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ParallelConfig {
    /// Where the run computes: `"cpu"` (Flex), `"wgpu"` / `"wgpu:N"` (feature `wgpu`),
    /// `"cuda"` / `"cuda:N"` (feature `cuda`; without an index each rank takes its
    /// node-local GPU).
    pub device: DeviceSpec,
    /// Data-parallel size.
    pub data_parallel_size: usize,
    /// Horizontal (tensor) parallel size: the Megatron blocks found in the graph (MLP and
    /// self-attention: a column-parallel projection through to the row-parallel one) are
    /// split over this many ranks of each replica.
    pub horizontal_parallel_size: usize,
    /// With `horizontal_parallel_size` > 1, run a graph in which no block splits
    /// replicated on every tensor-parallel rank instead of stopping with an error.
    pub tensor_parallel_allow_replicated: bool,
    /// With `horizontal_parallel_size` > 1, also split the token embeddings and the LM
    /// head along the vocabulary (Megatron's vocabulary parallelism): each rank holds its
    /// slice of the table and of the logits, and with a cross-entropy loss the loss is
    /// computed from the slices (the logits are never whole on one rank). Default on.
    pub tensor_parallel_vocab: bool,
    /// With `horizontal_parallel_size` > 1, Megatron's sequence parallelism (its
    /// `sequence_parallel`): between the blocks (LayerNorms, residual adds, dropout) each
    /// rank holds only its slice of the sequence, and the blocks' all-reduces become
    /// all-gathers and reduce-scatters. The sequence length must divide by the tp size.
    #[serde(alias = "sequence_parallel")]
    pub tensor_parallel_sequence: bool,
    /// Pipeline-parallel size: the graph is cut into this many stages, one per rank of a
    /// replica.
    pub pipeline_parallel_size: usize,
    /// Model chunks per pipeline rank (Megatron's `virtual_pipeline_model_parallel_size`):
    /// the graph is cut into `pipeline_parallel_size x` this many stages, rank `r` runs
    /// stages `r`, `r + pp`, `r + 2 pp`, ..., and the interleaved 1F1B schedule shrinks the
    /// bubble to `(pp - 1) / (chunks x micro-batches + pp - 1)` for as many times the
    /// messages. 1 (the default): one stage per rank. The micro-batch count must be a
    /// multiple of `pipeline_parallel_size`.
    #[serde(alias = "virtual_pipeline_model_parallel_size")]
    pub pipeline_virtual_stages: usize,
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
    /// ZeRO stage (ORT: `deepspeed_zero_stage`): 0 replicates the optimizer state on every
    /// rank; 1 shards it across the data-parallel ranks; 2 also shards the gradients; 3
    /// also shards the parameters (gathered where a node reads them). With
    /// `recompute_segments`, stage 3 holds one segment's gathered parameters at a time.
    #[serde(alias = "deepspeed_zero_stage")]
    pub zero_stage: usize,
    /// ZeRO-3: gather up to this many parameters ahead of the nodes that read them, on a
    /// communication thread (DeepSpeed's stage-3 prefetch); 0 (the default) gathers each
    /// where it is read. Taken where nothing else communicates during the pass: not with
    /// tensor parallelism, nor in graphs with control flow, which gather inline. On the
    /// CPU device the thread competes with the computation for the same cores (measured
    /// 8-21% slower on 2 cores, BENCHMARKS.md); it is meant for computation on a GPU.
    pub zero3_prefetch: usize,
    /// Combine data-parallel gradients with Adasum instead of averaging them.
    pub enable_adasum: bool,
    /// Send data-parallel gradients as f16 (ORT's `allreduce_in_fp16`): half the bytes of
    /// the all-reduce (ZeRO-2/3: reduce-scatter), f16's precision (about 3 decimal digits
    /// relative to the largest gradient of a bucket). Not with Adasum.
    pub allreduce_in_fp16: bool,
    /// Average data-parallel gradients during backward ([`Overlap`]). Needs
    /// data_parallel_size > 1 and ZeRO stage 0 with mean reduction; not with pipeline or
    /// tensor parallelism.
    pub overlap: Overlap,
    /// Activation recomputation (ORT's gradient checkpointing): cut the graph into this
    /// many balanced segments, keep only the values crossing the cuts through the forward
    /// pass and re-run each segment's forward in backward. 0: off; at least 2 otherwise.
    /// With a pipeline the segments are its stages (Megatron's full recomputation): set it
    /// to `pipeline_parallel_size`, and each stage keeps only its inputs per micro-batch.
    pub recompute_segments: usize,
    /// Seconds one collective may wait for its peers; past it the job ends with an error
    /// naming the operation, its bytes, the group and the ranks that never arrived, instead
    /// of hanging (PyTorch's process-group `timeout`). Unset: 1800, for MPI and thread ranks
    /// alike (a failed or finished thread rank fails its peers at once; the limit catches
    /// one stuck for good: a deadlock, a hung device); 0: no limit.
    pub collective_timeout: Option<f64>,
}

impl Default for ParallelConfig {
    fn default() -> Self {
        ParallelConfig {
            device: DeviceSpec::Cpu,
            data_parallel_size: 1,
            horizontal_parallel_size: 1,
            tensor_parallel_allow_replicated: false,
            tensor_parallel_vocab: true,
            tensor_parallel_sequence: false,
            pipeline_parallel_size: 1,
            pipeline_virtual_stages: 1,
            num_pipeline_micro_batches: 0,
            pipeline_schedule: PipelineSchedule::OneFOneB,
            pipeline_cut_after: Vec::new(),
            zero_stage: 0,
            zero3_prefetch: 0,
            enable_adasum: false,
            allreduce_in_fp16: false,
            overlap: Overlap::Off,
            recompute_segments: 0,
            collective_timeout: None,
        }
    }
}

fn refuse(field: &str, why: impl Into<String>) -> Result<()> {
    Err(invalid(&format!("parallel.{field}"), why))
}

impl ParallelConfig {
    /// The layout fills a world of `world_size` processes, and the reduction, overlap and
    /// recomputation settings go together.
    pub fn validate(&self, world_size: usize) -> Result<()> {
        if let Some(t) = self.collective_timeout
            && !(t.is_finite() && t >= 0.0)
        {
            return refuse(
                "collective_timeout",
                format!("{t} is not a number of seconds (0 for no limit)"),
            );
        }
        for (field, v) in [
            ("data_parallel_size", self.data_parallel_size),
            ("horizontal_parallel_size", self.horizontal_parallel_size),
            ("pipeline_parallel_size", self.pipeline_parallel_size),
            ("pipeline_virtual_stages", self.pipeline_virtual_stages),
        ] {
            if v == 0 {
                return refuse(field, "must be at least 1");
            }
        }
        let product = self.world_size();
        if product != world_size {
            return refuse(
                "data_parallel_size",
                format!(
                    "data_parallel_size ({}) * horizontal_parallel_size ({}) * pipeline_parallel_size ({}) = {product}, but the world has {world_size} process(es)",
                    self.data_parallel_size,
                    self.horizontal_parallel_size,
                    self.pipeline_parallel_size
                ),
            );
        }
        if self.tensor_parallel_sequence && self.horizontal_parallel_size < 2 {
            return refuse(
                "tensor_parallel_sequence",
                "sequence parallelism splits the sequence among the tensor-parallel ranks: set horizontal_parallel_size > 1 (--tp N) or drop it",
            );
        }
        if self.pipeline_virtual_stages > 1 && self.pipeline_parallel_size < 2 {
            return refuse(
                "pipeline_virtual_stages",
                "virtual stages interleave the chunks of several pipeline ranks: set pipeline_parallel_size > 1 (--pp N) or drop it",
            );
        }
        self.check_reduction()?;
        self.check_recompute()?;
        self.check_overlap()
    }

    /// Pipeline stages the graph is cut into: ranks x virtual stages.
    pub fn pipeline_stages(&self) -> usize {
        self.pipeline_parallel_size * self.pipeline_virtual_stages
    }

    /// `model` (a tensor-parallel rank's part, or the whole) cut into
    /// [`Self::pipeline_stages`] stages, at `pipeline_cut_after` or else balanced
    /// ([`Partition::auto`]), laid out on the `pipeline_parallel_size` ranks.
    pub fn partition(&self, model: &OnnxModel) -> Result<Partition> {
        let (stages, cuts) = (self.pipeline_stages(), &self.pipeline_cut_after);
        let partition = if cuts.is_empty() {
            Partition::auto(model, stages)?
        } else if cuts.len() + 1 == stages {
            Partition::after(model, cuts)?
        } else {
            return Err(invalid(
                "parallel.pipeline_cut_after",
                format!(
                    "{} cut(s) make {} stages, but pipeline_parallel_size ({}) x pipeline_virtual_stages ({}) is {stages}",
                    cuts.len(),
                    cuts.len() + 1,
                    self.pipeline_parallel_size,
                    self.pipeline_virtual_stages
                ),
            ));
        };
        partition.on_ranks(self.pipeline_parallel_size)
    }

    /// The data x tensor x pipeline parallel sizes as configured (unchecked: [`Self::validate`]
    /// checks them against the world).
    pub fn topology(&self) -> Topology {
        Topology {
            dp: self.data_parallel_size,
            tp: self.horizontal_parallel_size,
            pp: self.pipeline_parallel_size,
        }
    }

    /// Processes the layout needs: data x tensor x pipeline parallel sizes.
    pub fn world_size(&self) -> usize {
        self.topology().world_size()
    }

    /// How long one collective may wait: `collective_timeout`, or its default (1800 s);
    /// `None`: no limit.
    pub fn collective_wait_limit(&self) -> Option<std::time::Duration> {
        match self.collective_timeout {
            Some(s) if s > 0.0 => Some(std::time::Duration::from_secs_f64(s)),
            Some(_) => None,
            None => Some(std::time::Duration::from_secs(DEFAULT_COLLECTIVE_TIMEOUT_S)),
        }
    }

    /// ZeRO's stage and what can reduce with it.
    fn check_reduction(&self) -> Result<()> {
        if self.zero_stage > 3 {
            return refuse(
                "zero_stage",
                format!("{} is not a ZeRO stage: use 0, 1, 2 or 3", self.zero_stage),
            );
        }
        if self.zero_stage >= 2 && self.enable_adasum {
            return refuse(
                "enable_adasum",
                "Adasum needs each rank's whole per-tensor gradient, but ZeRO-2 and 3 reduce-scatter the gradient so no rank holds another's: use zero_stage 1 or mean reduction",
            );
        }
        if self.allreduce_in_fp16 && self.enable_adasum {
            return refuse(
                "allreduce_in_fp16",
                "Adasum combines whole per-tensor gradients in f32; f16 on the wire applies to the mean all-reduce: drop one of allreduce_in_fp16 and enable_adasum",
            );
        }
        Ok(())
    }

    /// Recomputation segments: none, or at least 2; with a pipeline, one per stage.
    fn check_recompute(&self) -> Result<()> {
        if self.recompute_segments == 1 {
            return refuse(
                "recompute_segments",
                "1 segment recomputes nothing: use 0 (off) or at least 2",
            );
        }
        let stages = self.pipeline_parallel_size;
        if self.recompute_segments > 1 && stages > 1 && self.recompute_segments != stages {
            return refuse(
                "recompute_segments",
                format!(
                    "{} with {stages} pipeline stages: each stage is one recomputed segment, set it to {stages}",
                    self.recompute_segments
                ),
            );
        }
        Ok(())
    }

    /// The combinations `overlap` supports.
    fn check_overlap(&self) -> Result<()> {
        if self.overlap == Overlap::Off {
            return Ok(());
        }
        if self.data_parallel_size < 2 {
            return refuse(
                "overlap",
                "there is no gradient averaging to overlap with one data-parallel replica: set data_parallel_size > 1 or overlap \"off\"",
            );
        }
        if self.zero_stage > 0 {
            return refuse(
                "overlap",
                "ZeRO stages 1-3 reduce-scatter gradients in the update strategy; overlap is implemented for stage 0",
            );
        }
        if self.enable_adasum {
            return refuse(
                "overlap",
                "Adasum combines whole gradients after backward: drop one of enable_adasum and overlap",
            );
        }
        if self.pipeline_parallel_size > 1 || self.horizontal_parallel_size > 1 {
            return refuse(
                "overlap",
                "not implemented with pipeline or tensor parallelism: use overlap \"off\"",
            );
        }
        if self.overlap == Overlap::Hooks && self.recompute_segments > 1 {
            return refuse(
                "overlap",
                format!(
                    "\"hooks\" averages inside one backward pass, but recompute_segments ({}) runs backward segment by segment: use overlap = {{ segments = {} }}",
                    self.recompute_segments, self.recompute_segments
                ),
            );
        }
        if let Some(s) = self.overlap.segments()
            && self.recompute_segments > 1
            && self.recompute_segments != s
        {
            return refuse(
                "overlap",
                format!(
                    "{s} segments differ from recompute_segments ({}): both cut the same segments",
                    self.recompute_segments
                ),
            );
        }
        Ok(())
    }
}
