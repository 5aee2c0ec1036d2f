//! [`ParallelPlan`]: where this rank sits in the run's topology and what it holds; the one
//! place where the parallelisms compose ([`ParallelPlan::parallelize`], torchtitan's
//! `parallelize_*`: tensor parallelism, then the pipeline cut, then the passes and the
//! update strategy over the right groups; ZeRO-3's sharding after the resume).
//!
//! The world splits into data-parallel replicas and, within a replica, tensor-parallel
//! ranks and pipeline stages (`burn_ort_dist::Topology`, Megatron's layout). A rank holds
//! its tp rank's part of its stage's part of the model, trains it with the passes of a
//! stage, averages gradients with the ranks holding the same part, writes that part into
//! checkpoints, and hands it on for export one parameter at a time (the stage owning it
//! gathers its ZeRO-3 chunks and tensor-parallel parts, and sends it to world rank 0,
//! which writes the file: [`super::streamed_export`]).
//!
//! The plan is the one source of the run's parallel facts (is tensor, pipeline or
//! sequence parallelism on, which ZeRO stage, prefetch, recomputation, overlap): it holds
//! the `[parallel]` section and answers from it and from the topology; the layers below
//! (model, onnx) get each fact as a value it passes down.

use std::borrow::Cow;
use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use burn::module::ParamId;
use burn::tensor::Device;
use burn_ort_dist::comm::fp16_wire::Fp16ReduceScatter;
use burn_ort_dist::{
    Communicator, DataParallel, Groups, ModelParallel, StateFile, Topology, UpdateStrategy,
};

use crate::collective::{CollectiveGroup, Collectives};
use crate::error::{OnnxError, Result};
use crate::kernels;
use crate::model::loss::LossKind;
use crate::model::{ChunkStore, OnnxModel};
use crate::onnx::export::{ExportOptions, export_onnx_gathered, export_onnx_with};
use crate::parallel::pipeline::Partition;
use crate::parallel::tensor_parallel::TensorParallel;
use crate::train::checkpoint::zero3_shards::{shard_file, shard_writer};
use crate::train::checkpoint::{model_file, model_file_writer, state_dir};
use crate::train::config::{ModelConfig, Overlap, ParallelConfig, ParamOffload, TrainingConfig};
use crate::train::data::Dataset;
use crate::train::evaluate::EvalPlace;
use crate::train::optimizer::{build_strategy, data_parallel};
use crate::train::passes::pipelined::Pipelined;
use crate::train::passes::segmented::Segmented;
use crate::train::passes::step::PassSettings;
use crate::train::passes::{Passes, Sequential};
use crate::train::report::summaries::SummaryRole;
use crate::value::Value;

use super::streamed_export::{ExportLayout, export_streamed};

/// `model` with the head its cross-entropy reads prepared for the device: padded to
/// `model.pad_vocab_to_multiple_of` columns (unset: 64 on CubeCL devices, none on the CPU;
/// see [`OnnxModel::with_padded_head`]) and, on CubeCL devices, writing its logits in the
/// autocast precision when there is one ([`OnnxModel::with_low_precision_logits`]) and,
/// when the loss is the LM cross-entropy, the forward is one pass (`whole_forward`) and
/// `model.fused_head_loss`, leaving its product to the loss ([`OnnxModel::with_fused_head_loss`]:
/// a classifier's logits are small, and its evaluation counts their top classes).
fn prepare_head(settings: &ModelConfig, model: OnnxModel, whole_forward: bool) -> OnnxModel {
    let cross_entropy = matches!(
        settings.loss,
        LossKind::CrossEntropy | LossKind::LmCrossEntropy
    );
    let cubecl = kernels::runs_cubecl(&model.device());
    let model = match settings.vocab_multiple(cubecl) {
        multiple if cross_entropy && multiple > 1 => {
            let model = model.with_padded_head(&settings.output_name, multiple);
            if let Some(head) = model.padded_head() {
                tracing::info!(
                    output = head.output,
                    classes = head.classes,
                    columns = head.padded,
                    "head padded to aligned columns"
                );
            }
            model
        }
        _ => model,
    };
    if !(cross_entropy && cubecl) {
        return model;
    }
    let (model, marked) = model.with_low_precision_logits(&settings.output_name);
    if marked {
        tracing::debug!(
            output = settings.output_name,
            "the head writes its logits in the autocast precision"
        );
    }
    let lm = settings.loss == LossKind::LmCrossEntropy;
    if !(lm && whole_forward && settings.fused_head_loss) {
        return model;
    }
    let (model, fused) = model.with_fused_head_loss(&settings.output_name);
    if fused {
        tracing::debug!(
            output = settings.output_name,
            "the head's product is left to the loss, a block of rows at a time"
        );
    }
    model
}

/// What [`ParallelPlan::parallelize`] gives the trainer: this rank's part of the model
/// (holding the collective groups its ops run on), the passes that train it, and its update
/// strategy.
pub struct Parallelized {
    /// This rank's part of the model (whole parameters; ZeRO-3 shards it later).
    pub model: OnnxModel,
    /// The forward and backward passes of an update.
    pub passes: Box<dyn Passes>,
    /// The update after backward.
    pub strategy: Box<dyn UpdateStrategy<OnnxModel>>,
}

/// This rank's coordinates, groups and pipeline partition.
pub struct ParallelPlan {
    /// The sizes.
    pub topology: Topology,
    /// Coordinates and sub-communicators.
    pub groups: Groups,
    /// The partition of the model, cut by [`Self::parallelize`] with pipeline parallelism
    /// (read through [`Self::partition`]).
    partition: Option<Arc<Partition>>,
    /// The tensor-parallel split of the model, made by [`Self::parallelize`] with tensor
    /// parallelism (read through [`Self::tensor_parallel`]).
    tensor_parallel: Option<TensorParallel>,
    /// The tp x pp ranks of this replica (the global norm's group when both split).
    model_group: Option<Arc<dyn Communicator>>,
    /// The run's `[parallel]` section: every setting the plan applies is read here.
    settings: ParallelConfig,
    /// Where ZeRO-3's chunks live (`offload.offload_params`), with the offload directory.
    chunk_place: (ParamOffload, PathBuf),
}

impl ParallelPlan {
    /// Carve the groups out of `world` (collective) for `c`'s sizes.
    pub fn new(c: &TrainingConfig, world: &dyn Communicator) -> Result<Self> {
        let topology = Topology::new(
            c.parallel.data_parallel_size,
            c.parallel.horizontal_parallel_size,
            c.parallel.pipeline_parallel_size,
            world.world_size(),
        )?;
        let groups = topology.groups(world)?;
        let mut plan = ParallelPlan {
            topology,
            groups,
            partition: None,
            tensor_parallel: None,
            model_group: None,
            settings: c.parallel.clone(),
            chunk_place: (c.offload.offload_params, c.offload_dir()),
        };
        if plan.tp_enabled() && plan.pp_enabled() {
            plan.model_group = Some(Arc::from(world.split(plan.groups.dp_rank, world.rank())?));
        }
        Ok(plan)
    }

    /// Tensor parallelism: more than one tensor-parallel rank (the blocks split among them).
    pub fn tp_enabled(&self) -> bool {
        self.topology.tp > 1
    }

    /// Pipeline parallelism: more than one stage.
    pub fn pp_enabled(&self) -> bool {
        self.topology.pp > 1
    }

    /// The ZeRO stage: 0 replicated, 1 optimizer state sharded, 2 gradients too, 3 the
    /// parameters too.
    pub fn zero_stage(&self) -> usize {
        self.settings.zero_stage
    }

    /// ZeRO-3: the parameters sharded across the data-parallel group.
    pub fn zero3_enabled(&self) -> bool {
        self.zero_stage() == 3
    }

    /// How many parameters ZeRO-3's gathers run ahead of the pass (`zero3_prefetch`); 0,
    /// gathering inline, without ZeRO-3 and with tensor parallelism (whose collectives
    /// would run beside the gathers).
    pub fn prefetch_depth(&self) -> usize {
        match self.zero3_enabled() && !self.tp_enabled() {
            true => self.settings.zero3_prefetch,
            false => 0,
        }
    }

    /// Activation recomputation: the forward of each segment (or pipeline stage) re-run in
    /// backward (`recompute_segments` of 2 or more).
    pub fn recompute_enabled(&self) -> bool {
        self.settings.recompute_segments > 1
    }

    /// The whole model's forward runs as one pass: no pipeline stages, and no segments
    /// for recomputation or for averaging during backward.
    pub fn whole_forward_enabled(&self) -> bool {
        !self.pp_enabled() && !self.recompute_enabled() && self.overlap().segments().is_none()
    }

    /// Gradient averaging during backward (`overlap`): off, from hooks, or by segments.
    pub fn overlap(&self) -> Overlap {
        self.settings.overlap
    }

    /// The pipeline partition, with pipeline parallelism.
    ///
    /// # Panics
    /// With pipeline parallelism, before [`Self::parallelize`] cut the model.
    pub fn partition(&self) -> Option<&Arc<Partition>> {
        self.pp_enabled().then(|| {
            self.partition
                .as_ref()
                .expect("parallelize cuts the pipeline")
        })
    }

    /// The tensor-parallel split of the model, with tensor parallelism (which says whether
    /// sequence parallelism is on too: [`TensorParallel::sequence`]).
    ///
    /// # Panics
    /// With tensor parallelism, before [`Self::parallelize`] split the model.
    pub fn tensor_parallel(&self) -> Option<&TensorParallel> {
        self.tp_enabled().then(|| {
            self.tensor_parallel
                .as_ref()
                .expect("parallelize splits the model")
        })
    }

    /// Apply the plan to `model` (the whole model): its tensor-parallel split and pipeline
    /// stage (`Self::model_part`), the groups its ops run on, the passes (plain,
    /// segmented or a pipeline stage's) and the update strategy (replicated or ZeRO over
    /// the data-parallel group; the global norm over the model-parallel group).
    pub fn parallelize(
        &mut self,
        c: &TrainingConfig,
        model: OnnxModel,
        train: &dyn Dataset,
        device: &Device,
    ) -> Result<Parallelized> {
        let model = self
            .model_part(c, model, train)?
            .with_collectives(self.collectives())
            .with_prefetch(self.prefetch_depth());
        let ddp = data_parallel(&self.settings, self.groups.dp.clone());
        let passes = self.passes(c, &model, device, &ddp)?;
        let mut strategy = build_strategy(
            &c.optimizer,
            self.zero_stage(),
            c.moment_place(),
            &model,
            &ddp,
        )?;
        if let Some(group) = self.model_parallel(&model) {
            strategy.set_model_parallel(group);
        }
        Ok(Parallelized {
            model,
            passes,
            strategy,
        })
    }

    /// `model` with the activations only products read marked to be written in the
    /// autocast precision (`crate::model::activation_precision`) on CubeCL devices, where
    /// the marks are read: the MLP's hidden activation, the attention cores' outputs, and
    /// the layer norms' outputs unless tensor parallelism puts a collective between a norm
    /// and its products. Not under pipeline parallelism, whose cut may fall between marked
    /// nodes and whose wire carries f32.
    fn prepare_activations(&self, model: OnnxModel) -> OnnxModel {
        if !kernels::runs_cubecl(&model.device()) || self.pp_enabled() {
            return model;
        }
        let (model, mlp) = model.with_low_precision_mlp();
        let (model, attention) = model.with_low_precision_attention();
        let (model, norms) = if self.tp_enabled() {
            (model, 0)
        } else {
            model.with_low_precision_norms()
        };
        if mlp + attention + norms > 0 {
            tracing::debug!(
                mlp,
                attention,
                norms,
                "activations only products read are written in the autocast precision"
            );
        }
        model
    }

    /// This rank's part of `model` (the whole model): the activations only products read
    /// marked for the autocast precision, its tensor-parallel split (planned from a probe
    /// pass on two samples of `train`) or its head padded to aligned columns, then its
    /// pipeline stage.
    fn model_part(
        &mut self,
        c: &TrainingConfig,
        model: OnnxModel,
        train: &dyn Dataset,
    ) -> Result<OnnxModel> {
        let model = self.prepare_activations(model);
        let model = if self.tp_enabled() {
            let sample = train.batch(&[0, 1.min(train.len().saturating_sub(1))])?;
            let input = Value::from_host(&sample.input, &model.device())
                .map_err(|e| OnnxError::field("batch", e.0))?;
            let (part, t) = TensorParallel::apply(
                model,
                vec![(c.model.input_name.clone(), input)],
                self.groups.tp_rank,
                self.topology.tp,
                &c.tensor_parallel_split(),
            )?;
            if self.groups.tp_rank == 0 && self.groups.dp_rank == 0 && self.groups.pp_rank == 0 {
                tracing::info!(
                    ranks = t.size,
                    blocks = t.blocks.len(),
                    split_weights = t.params.len(),
                    sequence_parallel = ?t.sequence,
                    "tensor parallelism"
                );
            }
            self.tensor_parallel = Some(t);
            part
        } else {
            prepare_head(&c.model, model, self.whole_forward_enabled())
        };
        if !self.pp_enabled() {
            return Ok(model);
        }
        let partition = self.settings.partition(&model)?;
        let mine = partition.stages_of(self.groups.pp_rank);
        let part = model.into_stages(&mine.iter().map(|s| s.part()).collect::<Vec<_>>())?;
        self.partition = Some(Arc::new(partition));
        Ok(part)
    }

    /// The passes this rank runs on `model` (its part of the model); `ddp` averages the
    /// gradients (during backward with `parallel.overlap`: from gradient hooks inside one
    /// backward pass, or segment by segment).
    fn passes(
        &self,
        c: &TrainingConfig,
        model: &OnnxModel,
        device: &Device,
        ddp: &DataParallel,
    ) -> Result<Box<dyn Passes>> {
        warn_if_overlap_leaves_the_device(self.overlap(), ddp, device);
        let (recompute, overlap) = (self.recompute_enabled(), self.overlap().segments());
        Ok(match self.partition() {
            None if recompute || overlap.is_some() => {
                let (segments, field) = if recompute {
                    (
                        self.settings.recompute_segments,
                        "config.parallel.recompute_segments",
                    )
                } else {
                    (overlap.unwrap_or_default(), "config.parallel.overlap")
                };
                let nodes = model.graph().nodes.len();
                if segments > nodes {
                    return Err(OnnxError::field(
                        field,
                        format!("{segments} segments for a graph of {nodes} nodes"),
                    ));
                }
                Box::new(Segmented {
                    partition: Arc::new(Partition::auto(model, segments)?),
                    replica: self.groups.dp_rank,
                    device: device.clone(),
                    recompute,
                    overlap: overlap.is_some().then(|| ddp.clone()),
                    settings: PassSettings::of(c),
                })
            }
            None => Box::new(Sequential {
                replica: self.groups.dp_rank,
                device: device.clone(),
                overlap: (self.overlap() == Overlap::Hooks).then(|| ddp.clone()),
                settings: PassSettings::of(c),
            }),
            Some(p) => Box::new(Pipelined {
                partition: p.clone(),
                comm: self.groups.pp.clone(),
                replica: self.groups.dp_rank,
                schedule: self.settings.pipeline_schedule,
                micro_batches: c.micro_batches(),
                device: device.clone(),
                recompute,
                settings: PassSettings::of(c),
            }),
        })
    }

    /// The groups the model's collective ops run on: the tensor-parallel group with tensor
    /// parallelism, the data-parallel group with ZeRO-3 (whose gradients it reduce-scatters
    /// in backward, as f16 on the wire with `allreduce_in_fp16`).
    fn collectives(&self) -> Collectives {
        let sharding = self.zero3_enabled().then(|| {
            let group: Arc<dyn Communicator> = if self.settings.allreduce_in_fp16 {
                Arc::new(Fp16ReduceScatter(self.groups.dp.clone()))
            } else {
                self.groups.dp.clone()
            };
            CollectiveGroup(group)
        });
        Collectives {
            tensor_parallel: self
                .tp_enabled()
                .then(|| CollectiveGroup(self.groups.tp.clone())),
            sharding,
        }
    }

    /// `model` with whole parameters to read them from (weight summaries) when `wanted`:
    /// with ZeRO-3 gathered over the data-parallel group (a collective: every rank calls it
    /// at the same points with the same `wanted`), otherwise `model` itself.
    pub fn readable<'a>(&self, model: &'a OnnxModel, wanted: bool) -> Result<Cow<'a, OnnxModel>> {
        if self.zero3_enabled() && wanted {
            return Ok(Cow::Owned(model.unsharded(self.groups.dp.as_ref())?));
        }
        Ok(Cow::Borrowed(model))
    }

    /// What this rank trains of `model` (its whole part), with the values of the
    /// data-parallel group's rank 0 (a collective of the group): with ZeRO-3 its chunk of
    /// every parameter (in host memory or on disk with `offload_params`), each parameter
    /// broadcast whole and cut in turn; otherwise all of it, broadcast.
    pub fn replicate_or_shard(&self, model: OnnxModel) -> Result<OnnxModel> {
        let group = self.groups.dp.as_ref();
        if !self.zero3_enabled() {
            return Ok(DataParallel::new(self.groups.dp.clone()).broadcast_parameters(model)?);
        }
        let store = match &self.chunk_place {
            (ParamOffload::None, _) => ChunkStore::Device,
            (ParamOffload::Cpu, _) => ChunkStore::Host,
            (ParamOffload::Disk, dir) => ChunkStore::Disk(dir),
        };
        model.into_sharded_from_root(group, store)
    }

    /// The model-parallel norm group of a stage or tp rank (`None` when the model is
    /// whole here): a parameter whose first holder is another stage, and on tp ranks other
    /// than 0 a weight every tp rank holds whole, count there.
    fn model_parallel(&self, model: &OnnxModel) -> Option<ModelParallel> {
        let id = |name: &str| model.param_index(name).map(|i| model.params()[i].id);
        let mut elsewhere: HashSet<ParamId> = HashSet::new();
        if let Some(p) = self.partition() {
            let me = self.groups.pp_rank;
            elsewhere.extend(
                p.shared
                    .iter()
                    .filter(|s| p.rank_of(s.stages[0]) != me)
                    .filter_map(|s| id(&s.name)),
            );
        }
        if let Some(t) = self.tensor_parallel().filter(|_| self.groups.tp_rank != 0) {
            elsewhere.extend(
                model
                    .param_infos()
                    .iter()
                    .filter(|i| !t.params.contains_key(&i.name))
                    .filter_map(|i| id(&i.name)),
            );
        }
        let group = match (self.pp_enabled(), self.tp_enabled(), &self.model_group) {
            (false, false, _) => return None,
            (true, false, _) => self.groups.pp.clone(),
            (false, true, _) => self.groups.tp.clone(),
            (true, true, group) => group.clone().expect("a tp x pp group when both split"),
        };
        Some(ModelParallel::new(group, elsewhere))
    }

    /// Does this rank write parameter `name` (the rank of the first stage holding it does)?
    fn owns(&self, name: &str) -> bool {
        match self.partition() {
            None => true,
            Some(p) => p
                .shared
                .iter()
                .find(|s| s.name == name)
                .is_none_or(|s| p.rank_of(s.stages[0]) == self.groups.pp_rank),
        }
    }

    /// This rank's tensor-parallel rank, when the model is split.
    pub fn tp_rank(&self) -> Option<usize> {
        self.tp_enabled().then_some(self.groups.tp_rank)
    }

    /// This rank's files in a checkpoint: its part of the model (first replica only; with
    /// ZeRO-3 every replica its chunks of it, with no gather) and the optimizer state
    /// `state` (under `stage-<k>/` in a pipeline, `tp-<r>/` for a tp rank).
    pub fn checkpoint_files<'a>(
        &'a self,
        model: &'a OnnxModel,
        state: Vec<StateFile<'a>>,
    ) -> Result<Vec<StateFile<'a>>> {
        let stage = self.pp_enabled().then_some(self.groups.pp_rank);
        let mut files: Vec<StateFile<'a>> = match state_dir(stage, self.tp_rank()) {
            None => state,
            Some(dir) => state
                .into_iter()
                .map(|f| StateFile {
                    name: format!("{dir}/{}", f.name),
                    ..f
                })
                .collect(),
        };
        let part = model_file(stage, self.tp_rank());
        if self.zero3_enabled() {
            files.push(shard_writer(
                shard_file(&part, self.groups.dp_rank),
                model,
                |n| self.owns(n),
            )?);
        } else if self.groups.dp_rank == 0 {
            files.push(model_file_writer(part, model, |n| self.owns(n)));
        }
        Ok(files)
    }

    /// What this rank writes to TensorBoard: world rank 0 the run, the first replica of
    /// every later pipeline stage the summaries of its own weights.
    pub fn summary_role(&self, world_rank: usize) -> SummaryRole {
        match (world_rank, self.pp_enabled()) {
            (0, _) => SummaryRole::Run,
            (_, true) if self.groups.dp_rank == 0 => SummaryRole::StageWeights,
            _ => SummaryRole::Silent,
        }
    }

    /// What the streamed export reads of the layout.
    fn export_layout(&self) -> ExportLayout<'_> {
        ExportLayout {
            groups: &self.groups,
            partition: self.partition().map(Arc::as_ref),
            tensor_parallel: self.tensor_parallel(),
            zero3: self.zero3_enabled(),
        }
    }

    /// Where this rank evaluates: its replica of the data-parallel group, whether it
    /// counts the losses (tp rank 0 of the replica), and whether the replicas run every
    /// round together (ZeRO-3 gathers the parameters in every forward pass).
    pub fn eval_place(&self) -> EvalPlace {
        EvalPlace {
            replica: self.groups.dp_rank,
            replicas: self.topology.dp,
            reports: self.groups.tp_rank == 0,
            lockstep: self.zero3_enabled(),
        }
    }

    /// Export the trained model to `path` on world rank 0 (a collective over `world`;
    /// whether this rank wrote it). No rank holds the trained model whole: the writer
    /// reads each parameter where it reaches it. Without tensor or pipeline parallelism
    /// the model is the whole graph, gathered parameter by parameter from its chunks with
    /// ZeRO-3 ([`export_onnx_gathered`]) and otherwise written as it is; with them, rank 0
    /// writes the model file and every rank streams it the parameters it reads
    /// ([`export_streamed`]).
    pub fn export(&self, model: &OnnxModel, world: &dyn Communicator, path: &Path) -> Result<bool> {
        let root = world.rank() == 0;
        let options = ExportOptions::default();
        if self.pp_enabled() || self.tp_enabled() {
            export_streamed(&self.export_layout(), model, world, path)?;
        } else if self.zero3_enabled() {
            let path = root.then_some(path);
            export_onnx_gathered(model, self.groups.dp.as_ref(), path, options)?;
        } else if root {
            export_onnx_with(model, path, options)?;
        }
        world.barrier()?;
        Ok(root)
    }
}

/// Averaging during backward (`parallel.overlap`) packs its buckets in host memory; where
/// the group averages device tensors itself (NCCL) the update's device buckets after
/// backward move no value through the host and are faster: say so once, on rank 0.
fn warn_if_overlap_leaves_the_device(overlap: Overlap, ddp: &DataParallel, device: &Device) {
    let comm = ddp.comm();
    let on_device = comm
        .device_collectives()
        .is_some_and(|d| d.works_on(device));
    if overlap != Overlap::Off && on_device && comm.rank() == 0 {
        tracing::warn!(
            "parallel.overlap averages gradients through host memory: this group averages them on the GPUs after backward (NCCL), which copies nothing to the host; set parallel.overlap = \"off\" for that"
        );
    }
}
