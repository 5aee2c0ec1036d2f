//! An [`OnnxModel`] under ZeRO-3: every float parameter holds only this rank's chunk of
//! it (the parameter flattened and cut into `world` equal chunks, the last zero-padded:
//! `burn_ort_dist`'s per-tensor partitioning, so the update strategy's shard is the
//! model's parameters in order). A node reading a parameter gets the whole tensor through
//! [`gather_param`], whose backward reduce-scatters the gradient; checkpoints and export
//! take [`OnnxModel::unsharded`]. With the chunks in host memory
//! ([`ChunkStore::Host`], ZeRO-Infinity's parameter offload) the gather
//! runs on the host and the whole parameter moves to the model's device where it is read;
//! Burn's autodiff moves its gradient back for the reduce-scatter. With the chunks on disk
//! ([`ChunkStore::Disk`], `param_file.rs`) they are host tensors over a
//! memory-mapped file, paged in where they are read or updated and released after;
//! [`OnnxModel::settle_offloaded`] puts replaced chunks back into the file after an update.

use std::path::Path;
use std::sync::Arc;

use burn::module::Param;
use burn::tensor::{Device, TensorData};
use burn_ort_dist::update::zero::layout::{chunk_len, chunk_of};
use burn_ort_dist::{Communicator, SyncTimes};
use ndarray::{ArrayD, IxDyn};

use super::param_file::{Kept, ParamFile};
use super::{OnnxModel, Source, Spec};
use crate::collective::param_gather::gather_param;
use crate::collective::{CollectiveGroup, Collectives};
use crate::error::{OnnxError, OpError, Result};
use crate::value::{FloatValue, MAX_RANK, PhysTensor, padded};

/// Which chunk of every parameter a ZeRO-3 model holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sharding {
    /// This rank's chunk.
    pub rank: usize,
    /// Chunks per parameter (the sharding group's size).
    pub world: usize,
    /// Where the chunks live.
    pub place: ChunkPlace,
}

/// How [`OnnxModel::settle_offloaded`] kept the chunks on disk: counts of chunks.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Settled {
    /// Updated in place in the file.
    pub in_place: usize,
    /// Replaced by the update and copied back into the file.
    pub copied_back: usize,
    /// Left in memory for now (a tensor over its range is still alive).
    pub in_memory: usize,
}

/// Where [`OnnxModel::into_sharded`] puts the chunks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChunkStore<'a> {
    /// On the model's device.
    Device,
    /// In host memory (ZeRO-Infinity's parameter offload): a node's read gathers its
    /// parameter there and moves it to the model's device (see the module doc).
    Host,
    /// In a memory-mapped file under this directory (unlinked once mapped), paged in where
    /// the chunks are read or updated.
    Disk(&'a Path),
}

/// Where a ZeRO-3 model keeps its chunks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChunkPlace {
    /// On the model's device.
    Device,
    /// On the CPU device while the model computes on any device: in host memory, or in
    /// the model's parameter file when it has one ([`ChunkStore::Disk`]).
    Host,
}

impl Sharding {
    /// This rank's chunk of `whole`.
    fn cut(&self, whole: &[f32]) -> Vec<f32> {
        chunk_of(whole, self.rank, self.world)
    }

    /// Where the chunk of `whole` (on the model's device) lives.
    fn device_of(&self, whole: &PhysTensor) -> Device {
        let device = whole.device();
        if self.place == ChunkPlace::Device {
            device
        } else {
            host_device(&device)
        }
    }

    /// Whether the chunks live off the model's device (a read moves the gathered whole).
    pub fn off_device(&self) -> bool {
        self.place != ChunkPlace::Device
    }
}

fn host(t: PhysTensor, what: &str) -> Result<Vec<f32>> {
    burn_ort_dist::host_values(t).map_err(|e| OnnxError::field(what, e))
}

fn vector(values: Vec<f32>, device: &Device) -> PhysTensor {
    let mut shape = [1; MAX_RANK];
    shape[MAX_RANK - 1] = values.len();
    PhysTensor::from_data(TensorData::new(values, shape.to_vec()), device)
}

/// The CPU device, tracked by autodiff when `like` is.
fn host_device(like: &Device) -> Device {
    if like.is_autodiff() {
        Device::flex().autodiff()
    } else {
        Device::flex()
    }
}

impl OnnxModel {
    /// Keep chunk `rank` of `world` of every float parameter (ZeRO-3), where `store` says;
    /// the parameters keep their ids and roles.
    pub fn into_sharded(self, rank: usize, world: usize, store: ChunkStore) -> Result<OnnxModel> {
        self.shard(rank, world, store, None)
    }

    /// [`Self::into_sharded`] for the ranks of `group` (a collective): each parameter's
    /// whole value is first broadcast from the group's rank 0, then cut (DeepSpeed's
    /// `zero.Init`), so a rank never holds more than one whole parameter, even while its
    /// values arrive.
    pub fn into_sharded_from_root(
        self,
        group: &dyn Communicator,
        store: ChunkStore,
    ) -> Result<OnnxModel> {
        self.shard(group.rank(), group.world_size(), store, Some(group))
    }

    fn shard(
        mut self,
        rank: usize,
        world: usize,
        store: ChunkStore,
        root: Option<&dyn Communicator>,
    ) -> Result<OnnxModel> {
        if self.spec.sharding.is_some() {
            return Err(OnnxError::field(
                "zero_stage",
                "the model is sharded already",
            ));
        }
        let world = world.max(1);
        let (place, file) = match store {
            ChunkStore::Device => (ChunkPlace::Device, None),
            ChunkStore::Host => (ChunkPlace::Host, None),
            ChunkStore::Disk(dir) => (
                ChunkPlace::Host,
                Some(Arc::new(self.param_file(world, dir)?)),
            ),
        };
        let sharding = Sharding { rank, world, place };
        for (i, (p, info)) in self.params.iter_mut().zip(&self.spec.params).enumerate() {
            let old = std::mem::replace(
                p,
                Param::from_tensor(PhysTensor::empty([1; MAX_RANK], &self.spec.device)),
            );
            let (id, t, _) = old.consume();
            let require = t.is_require_grad();
            let device = sharding.device_of(&t);
            let mut whole = host(t, &info.name)?;
            if let Some(group) = root.filter(|g| g.world_size() > 1) {
                group.broadcast(&mut whole, 0)?;
            }
            let values = sharding.cut(&whole);
            drop(whole);
            let chunk = match &file {
                Some(f) => f.store(i, &values, device.is_autodiff()),
                None => vector(values, &device),
            };
            *p = Param::initialized(id, chunk.set_require_grad(require));
        }
        self.spec = Arc::new(Spec {
            sharding: Some(sharding),
            param_file: file,
            ..(*self.spec).clone()
        });
        Ok(self)
    }

    /// A parameter file under `dir` with a range for each parameter's chunk of `world`.
    fn param_file(&self, world: usize, dir: &Path) -> Result<ParamFile> {
        let lens = self
            .spec
            .params
            .iter()
            .map(|info| Ok(chunk_len(padded(&info.shape)?.iter().product(), world)))
            .collect::<std::result::Result<Vec<usize>, OpError>>()
            .map_err(|e| OnnxError::field("offload.offload_params", e.0))?;
        ParamFile::create(dir, &lens).map_err(|e| {
            OnnxError::field(
                "offload.offload_dir",
                format!("cannot create the parameter file in {}: {e}", dir.display()),
            )
        })
    }

    /// After an update of a model with its chunks on disk: every chunk kept in its range
    /// of the file, its pages released (a chunk the update replaced is copied back; see
    /// `param_file.rs`), with how many chunks were kept each way. Other models come back
    /// as they are.
    pub fn settle_offloaded(mut self) -> Result<(OnnxModel, Settled)> {
        let mut settled = Settled::default();
        let Some(file) = self.spec.param_file.clone() else {
            return Ok((self, settled));
        };
        for i in 0..self.params.len() {
            match self.settle_param(&file, i)? {
                Kept::InPlace => settled.in_place += 1,
                Kept::CopiedBack => settled.copied_back += 1,
                Kept::InMemory => settled.in_memory += 1,
            }
        }
        Ok((self, settled))
    }

    /// Parameter `i`'s chunk kept in its range of `file` (see `settle_offloaded`).
    fn settle_param(&mut self, file: &ParamFile, i: usize) -> Result<Kept> {
        let p = &mut self.params[i];
        let old = std::mem::replace(
            p,
            Param::from_tensor(PhysTensor::empty([1; MAX_RANK], &self.spec.device)),
        );
        let (id, t, _) = old.consume();
        let (t, kept) = file
            .settle(i, t)
            .map_err(|e| OnnxError::field(&self.spec.params[i].name, e))?;
        *p = Param::initialized(id, t);
        Ok(kept)
    }

    /// After parameter `i` was replaced: on a model with its chunks on disk, the new chunk
    /// goes into its range of the file (so values set one by one never pile up in memory).
    pub(super) fn settle_replaced(&mut self, i: usize) -> Result<()> {
        if let Some(file) = self.spec.param_file.clone() {
            self.settle_param(&file, i)?;
        }
        Ok(())
    }

    /// This model with its collective ops running on `groups` (the parallel plan's
    /// tensor-parallel group, and with ZeRO-3 the sharding group).
    pub fn with_collectives(mut self, groups: Collectives) -> OnnxModel {
        self.spec = Arc::new(Spec {
            collectives: groups,
            ..(*self.spec).clone()
        });
        self
    }

    /// The same model with its ZeRO-3 gathers run up to `depth` parameters ahead of the
    /// pass on a communication thread ([`crate::collective::prefetch`]; 0: inline). The
    /// run's plan decides the depth (`ParallelPlan::prefetch_depth`, 0 with a
    /// tensor-parallel group); the model still gathers inline when it holds such a group,
    /// as a guard for library callers, since its collectives would run beside the gathers.
    pub fn with_prefetch(mut self, depth: usize) -> OnnxModel {
        self.spec = Arc::new(Spec {
            prefetch: depth,
            ..(*self.spec).clone()
        });
        self
    }

    /// The time this model's passes (and its clones') spent prefetching since the last
    /// call: the communication thread's gathers, and the passes' waits for them.
    pub fn take_prefetch_times(&self) -> SyncTimes {
        self.spec.prefetch_times.take()
    }

    /// What a pass prefetches: the sharding group and this rank's chunks in the order the
    /// pass gathers them (first readers, graph order); `None` when it gathers inline (not
    /// sharded, prefetch off, a tensor-parallel group (see [`OnnxModel::with_prefetch`]), or
    /// control flow whose bodies read parameters in their own order).
    pub(super) fn prefetch_plan(&self) -> Option<(CollectiveGroup, Vec<PhysTensor>)> {
        const BODIES: [&str; 4] = ["If", "Loop", "Scan", "SequenceMap"];
        let spec = &self.spec;
        let group = spec.collectives.sharding.clone()?;
        let graph = &spec.graph;
        if spec.sharding.is_none()
            || spec.prefetch == 0
            || spec.collectives.tensor_parallel.is_some()
            || graph
                .nodes
                .iter()
                .any(|n| BODIES.contains(&n.op_type.as_str()))
        {
            return None;
        }
        let mut seen = std::collections::HashSet::new();
        let chunks = graph
            .nodes
            .iter()
            .flat_map(|n| &n.inputs)
            .filter_map(|name| match spec.sources.get(name) {
                Some(Source::Param(p)) if seen.insert(*p) => Some(self.params[*p].val()),
                _ => None,
            })
            .collect();
        Some((group, chunks))
    }

    /// The sharding of a ZeRO-3 model.
    pub fn sharding(&self) -> Option<Sharding> {
        self.spec.sharding
    }

    /// The model with whole parameters: each gathered from the chunks of every rank of
    /// `group` (a collective of the group; every rank gets the whole model). A model that
    /// is not sharded comes back as it is.
    pub fn unsharded(&self, group: &dyn Communicator) -> Result<OnnxModel> {
        if self.spec.sharding.is_none() {
            return Ok(self.clone());
        }
        let mut params = Vec::with_capacity(self.params.len());
        for (i, (p, info)) in self.params.iter().zip(&self.spec.params).enumerate() {
            let t = p.val();
            let whole = self.gather_whole(i, group)?;
            let phys = padded(&info.shape).map_err(|e| OnnxError::field(&info.name, e.0))?;
            let t2 = PhysTensor::from_data(TensorData::new(whole, phys.to_vec()), &t.device())
                .set_require_grad(t.is_require_grad());
            params.push(Param::initialized(p.id, t2));
        }
        Ok(OnnxModel {
            params,
            spec: Arc::new(Spec {
                sharding: None,
                ..(*self.spec).clone()
            }),
        })
    }

    /// The whole values of parameter `i` of a ZeRO-3 model, gathered from the chunks of
    /// every rank of `group` (a collective of the group), in its logical shape; a model that
    /// is not sharded gives its own.
    pub fn whole_param(&self, i: usize, group: &dyn Communicator) -> Result<ArrayD<f32>> {
        let info = &self.spec.params[i];
        let values = match self.spec.sharding {
            Some(_) => self.gather_whole(i, group)?,
            None => host(self.params[i].val(), &info.name)?,
        };
        ArrayD::from_shape_vec(IxDyn(&info.shape), values)
            .map_err(|e| OnnxError::field(&info.name, e.to_string()))
    }

    /// Parameter `i`'s chunks from every rank of `group`, joined (padding dropped).
    fn gather_whole(&self, i: usize, group: &dyn Communicator) -> Result<Vec<f32>> {
        let info = &self.spec.params[i];
        if let Some(s) = self.spec.sharding
            && group.world_size() != s.world
        {
            return Err(OnnxError::field(
                "zero_stage",
                format!(
                    "the model is sharded {} ways, the group has {} ranks",
                    s.world,
                    group.world_size()
                ),
            ));
        }
        let chunk = host(self.params[i].val(), &info.name)?;
        self.release_chunk(i);
        let mut whole = vec![0.0; chunk.len() * group.world_size()];
        group.all_gather(&chunk, &mut whole)?;
        whole.truncate(info.shape.iter().product());
        Ok(whole)
    }

    /// Parameter `i` as a node reads it: whole (gathered on a ZeRO-3 model).
    pub(super) fn read_param(&self, i: usize) -> std::result::Result<FloatValue, OpError> {
        self.read_param_on(i, &self.spec.collectives)
    }

    /// [`Self::read_param`], a ZeRO-3 chunk gathered over `collectives`' sharding group.
    pub(super) fn read_param_on(
        &self,
        i: usize,
        collectives: &Collectives,
    ) -> std::result::Result<FloatValue, OpError> {
        let (p, info) = (&self.params[i], &self.spec.params[i]);
        let Some(_) = self.spec.sharding else {
            return Ok(FloatValue::new(p.val(), info.shape.len()));
        };
        let Some(group) = &collectives.sharding else {
            return Err(OpError(format!(
                "'{}' is a ZeRO-3 chunk but the model has no sharding group to gather it over (OnnxModel::with_collectives)",
                info.name
            )));
        };
        let whole = gather_param(p.val(), padded(&info.shape)?, group);
        self.release_chunk(i);
        let whole = match self.spec.sharding {
            Some(s) if s.off_device() => whole.to_device(&self.device()),
            _ => whole,
        };
        Ok(FloatValue::new(whole, info.shape.len()))
    }

    /// Drop chunk `i`'s pages from memory once it is read, when the chunks are on disk.
    pub(crate) fn release_chunk(&self, i: usize) {
        if let Some(file) = &self.spec.param_file {
            file.release(i);
        }
    }

    /// The logical rank of what parameter `i` stores: its own, or 1 for a chunk.
    pub(super) fn stored_rank(&self, i: usize) -> usize {
        if self.spec.sharding.is_some() {
            1
        } else {
            self.spec.params[i].shape.len()
        }
    }

    /// A whole parameter value as this model stores it: this rank's chunk on a ZeRO-3
    /// model.
    pub(super) fn stored(&self, t: PhysTensor) -> PhysTensor {
        match self.spec.sharding {
            None => t,
            Some(s) => {
                let values = t
                    .clone()
                    .into_data()
                    .convert::<f32>()
                    .try_to_vec::<f32>()
                    .expect("a float tensor converted to f32 reads as f32");
                vector(s.cut(&values), &s.device_of(&t))
            }
        }
    }
}
