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
//! which writes the file).

use std::borrow::Cow;
use std::collections::{BTreeSet, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use burn::module::ParamId;
use burn::tensor::Device;
use burn_ort_dist::comm::fp16_wire::Fp16ReduceScatter;
use burn_ort_dist::{
    Communicator, DataParallel, Groups, ModelParallel, StateFile, Topology, UpdateStrategy,
};
use ndarray::{ArrayD, IxDyn};

use crate::collective::{CollectiveGroup, Collectives};
use crate::error::{OnnxError, Result};
use crate::graph::Graph;
use crate::model::{ChunkStore, OnnxModel};
use crate::onnx::export::{
    ExportOptions, ParamSource, export_onnx_from, export_onnx_gathered, param_reads,
};
use crate::parallel::pipeline::Partition;
use crate::parallel::tensor_parallel::TensorParallel;
use crate::train::checkpoint::zero3_shards::{shard_file, shard_writer};
use crate::train::checkpoint::{model_file, model_file_writer, state_dir};
use crate::train::config::{Overlap, ParamOffload, TrainingConfig};
use crate::train::data::Dataset;
use crate::train::optimizer::{build_strategy, data_parallel};
use crate::train::passes::pipelined::Pipelined;
use crate::train::passes::segmented::Segmented;
use crate::train::passes::step::PassSettings;
use crate::train::passes::{Passes, Sequential};
use crate::train::report::summaries::SummaryRole;
use crate::value::Value;
use crate::value::host_tensor::into_row_major_vec;

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
    /// The partition of the model, with more than one stage.
    pub partition: Option<Arc<Partition>>,
    /// The tensor-parallel split of the model, with more than one tp rank.
    pub tensor_parallel: Option<TensorParallel>,
    /// The tp x pp ranks of this replica (the global norm's group when both split).
    model_group: Option<Arc<dyn Communicator>>,
    /// The ZeRO stage (`parallel.zero_stage`; 3 shards the parameters).
    zero_stage: usize,
    /// Where ZeRO-3's chunks live (`offload.offload_params`), with the offload directory.
    chunk_place: (ParamOffload, PathBuf),
    /// Gradients cross the data-parallel group as f16 (`allreduce_in_fp16`).
    fp16_gradients: bool,
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
            zero_stage: c.parallel.zero_stage,
            chunk_place: (c.offload.offload_params, c.offload_dir()),
            fp16_gradients: c.parallel.allreduce_in_fp16,
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
        self.zero_stage
    }

    /// ZeRO-3: the parameters sharded across the data-parallel group.
    pub fn zero3_enabled(&self) -> bool {
        self.zero_stage == 3
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
            .with_prefetch(c.parallel.zero3_prefetch);
        let ddp = data_parallel(&c.parallel, self.groups.dp.clone());
        let passes = self.passes(c, &model, device, &ddp)?;
        let mut strategy = build_strategy(
            &c.optimizer,
            c.parallel.zero_stage,
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

    /// This rank's part of `model` (the whole model): its tensor-parallel split (planned
    /// from a probe pass on two samples of `train`), then its pipeline stage.
    fn model_part(
        &mut self,
        c: &TrainingConfig,
        model: OnnxModel,
        train: &dyn Dataset,
    ) -> Result<OnnxModel> {
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
            model
        };
        if !self.pp_enabled() {
            return Ok(model);
        }
        let partition = c.parallel.partition(&model)?;
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
        let (recompute, overlap) = (
            c.parallel.recompute_segments > 1,
            c.parallel.overlap.segments().is_some(),
        );
        Ok(match &self.partition {
            None if recompute || overlap => {
                let (segments, field) = if recompute {
                    (
                        c.parallel.recompute_segments,
                        "config.parallel.recompute_segments",
                    )
                } else {
                    let segments = c.parallel.overlap.segments().unwrap_or_default();
                    (segments, "config.parallel.overlap")
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
                    overlap: overlap.then(|| ddp.clone()),
                    settings: PassSettings::of(c),
                })
            }
            None => Box::new(Sequential {
                replica: self.groups.dp_rank,
                device: device.clone(),
                overlap: (c.parallel.overlap == Overlap::Hooks).then(|| ddp.clone()),
                settings: PassSettings::of(c),
            }),
            Some(p) => Box::new(Pipelined {
                partition: p.clone(),
                comm: self.groups.pp.clone(),
                replica: self.groups.dp_rank,
                schedule: c.parallel.pipeline_schedule,
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
            let group: Arc<dyn Communicator> = if self.fp16_gradients {
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
        if let Some(p) = &self.partition {
            let me = self.groups.pp_rank;
            elsewhere.extend(
                p.shared
                    .iter()
                    .filter(|s| p.rank_of(s.stages[0]) != me)
                    .filter_map(|s| id(&s.name)),
            );
        }
        if let Some(t) = self
            .tensor_parallel
            .as_ref()
            .filter(|_| self.groups.tp_rank != 0)
        {
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
        match &self.partition {
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

    /// Export the trained model to `path` on world rank 0 (a collective over `world`;
    /// whether this rank wrote it). No rank holds the trained model whole: the writer
    /// reads each parameter where it reaches it. Without tensor or pipeline parallelism
    /// the model is the whole graph, and ZeRO-3 gathers each parameter from its chunks
    /// ([`export_onnx_gathered`]); with them, rank 0 writes the model file and every rank
    /// walks the parameters it reads with it (`Self::stream_param`).
    pub fn export(&self, model: &OnnxModel, world: &dyn Communicator, path: &Path) -> Result<bool> {
        let root = world.rank() == 0;
        if !self.pp_enabled() && !self.tp_enabled() {
            let path = root.then_some(path);
            export_onnx_gathered(
                model,
                self.groups.dp.as_ref(),
                path,
                ExportOptions::default(),
            )?;
            world.barrier()?;
            return Ok(root);
        }
        let names = self.whole_param_names(model);
        if root {
            // Every rank's graph keeps the whole model's protobuf and ties for export.
            let graph = model.graph();
            let params = Streamed {
                plan: self,
                model,
                names: &names,
                shapes: initializer_shapes(graph),
            };
            let reads: Vec<usize> = param_reads(graph, &params)
                .iter()
                .filter_map(|n| names.binary_search(n).ok())
                .collect();
            broadcast_indices(world, reads)?;
            export_onnx_from(graph, &params, path, ExportOptions::default())?;
        } else {
            for i in broadcast_indices(world, Vec::new())? {
                self.stream_param(model, &names[i])?;
            }
        }
        world.barrier()?;
        Ok(root)
    }

    /// The names of the whole model's parameters, sorted: the same list on every rank
    /// (each pipeline rank knows every stage's parameters from the partition).
    fn whole_param_names(&self, model: &OnnxModel) -> Vec<String> {
        let names: BTreeSet<String> = match &self.partition {
            Some(p) => (0..p.ranks).flat_map(|k| p.params_of(k)).collect(),
            None => model.param_infos().iter().map(|i| i.name.clone()).collect(),
        };
        names.into_iter().collect()
    }

    /// One step of the streamed export, on every rank for the same parameter `name` in
    /// the same order: the ranks of the stage owning it gather it whole (ZeRO-3 over the
    /// data-parallel group, then the tensor-parallel parts on tp rank 0), and the first
    /// replica's tp rank 0 of that stage sends it to stage 0. World rank 0 gets `Some`
    /// when it owns the parameter itself; every other rank gets `None`.
    fn stream_param(&self, model: &OnnxModel, name: &str) -> Result<Option<ArrayD<f32>>> {
        let g = &self.groups;
        let owner = self.owner_stage(name);
        if g.pp_rank != owner || (!self.zero3_enabled() && g.dp_rank != 0) {
            return Ok(None);
        }
        let local = model.whole_param(model.require_param(name)?, g.dp.as_ref())?;
        if g.dp_rank != 0 {
            return Ok(None);
        }
        let full = match &self.tensor_parallel {
            Some(t) => t.gather_param(name, local, g.tp.as_ref())?,
            None => Some(local),
        };
        match full {
            Some(full) if owner != 0 => {
                g.pp.recv(&mut [0.0], 0)?;
                g.pp.send(&into_row_major_vec(full), 0)?;
                Ok(None)
            }
            full => Ok(full),
        }
    }

    /// World rank 0's side of [`Self::stream_param`]: parameter `name` (of `shape`), its
    /// own or received from the stage owning it. The owner sends once asked, so one
    /// parameter at a time is in flight.
    fn received_param(
        &self,
        model: &OnnxModel,
        name: &str,
        shape: &[usize],
    ) -> Result<ArrayD<f32>> {
        if let Some(values) = self.stream_param(model, name)? {
            return Ok(values);
        }
        let owner = self.owner_stage(name);
        let pp = self.groups.pp.as_ref();
        pp.send(&[0.0], owner)?;
        let mut values = vec![0f32; shape.iter().product()];
        pp.recv(&mut values, owner)?;
        ArrayD::from_shape_vec(IxDyn(shape), values)
            .map_err(|e| OnnxError::field(format!("parameter '{name}'"), e.to_string()))
    }

    /// The pipeline rank whose stages write parameter `name` (0 without a pipeline).
    fn owner_stage(&self, name: &str) -> usize {
        self.partition
            .as_ref()
            .and_then(|p| p.owner(name))
            .unwrap_or(0)
    }
}

/// World rank 0's parameters in a streamed export ([`ParallelPlan::export`]).
struct Streamed<'a> {
    plan: &'a ParallelPlan,
    /// Rank 0's part of the trained model.
    model: &'a OnnxModel,
    /// The whole model's parameters, sorted.
    names: &'a [String],
    /// Each initializer's shape, from the whole model's protobuf.
    shapes: HashMap<String, Vec<usize>>,
}

impl ParamSource for Streamed<'_> {
    fn holds(&self, name: &str) -> bool {
        self.names
            .binary_search_by(|n| n.as_str().cmp(name))
            .is_ok()
    }

    fn values(&self, name: &str) -> Result<ArrayD<f32>> {
        let shape = self.shapes.get(name).ok_or_else(|| {
            OnnxError::field(
                format!("parameter '{name}'"),
                "not an initializer of the model",
            )
        })?;
        self.plan.received_param(self.model, name, shape)
    }
}

/// The shape of each initializer of `graph`'s protobuf, by name.
fn initializer_shapes(graph: &Graph) -> HashMap<String, Vec<usize>> {
    graph
        .model
        .graph
        .iter()
        .flat_map(|g| &g.initializer)
        .map(|t| {
            (
                t.name.clone(),
                t.dims.iter().map(|&d| d.max(0) as usize).collect(),
            )
        })
        .collect()
}

/// `indices` from world rank 0 to every rank (the others pass an empty list): a length,
/// then the indices, as f32 (exact below 2^24).
fn broadcast_indices(world: &dyn Communicator, indices: Vec<usize>) -> Result<Vec<usize>> {
    let mut len = [indices.len() as f32];
    world.broadcast(&mut len, 0)?;
    let mut buf: Vec<f32> = indices.iter().map(|&i| i as f32).collect();
    buf.resize(len[0] as usize, 0.0);
    world.broadcast(&mut buf, 0)?;
    Ok(buf.into_iter().map(|x| x as usize).collect())
}
