//! Data-parallel gradient averaging for any Burn module.
//!
//! [`all_reduce_gradients`] walks the module's float parameters, takes each gradient out of
//! the `GradientsParams`, packs them into flat buckets of at most `bucket_bytes` (PyTorch
//! DDP's default is 25 MB), averages every bucket across the group, and puts the averaged
//! gradients back. Every rank walks the same module in the same order, so buckets line up.
//! When the group reduces device buffers (NCCL on CUDA), the buckets stay on the GPU
//! ([`crate::grads::device_buckets`]). Gradients already averaged during backward
//! ([`crate::grads::overlap`]) are left out.

use std::collections::{HashMap, HashSet};

use burn::module::{Module, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::{Tensor, TensorData};

use crate::comm::communicator::{Communicator, ReduceOp};
use crate::error::{DistError, DistResult};
use crate::grads::buckets::bucket_ranges;

/// PyTorch DDP's default bucket size.
pub const DEFAULT_BUCKET_BYTES: usize = 25 * 1024 * 1024;

/// One gradient taken out of a `GradientsParams` as flat host values.
pub struct FlatGrad {
    /// Its parameter.
    pub id: ParamId,
    shape: Vec<usize>,
    rank: usize,
    /// The values, row-major.
    pub values: Vec<f32>,
}

impl FlatGrad {
    /// Parameter `id`'s gradient: `values` of `shape` (the parameter tensor's rank and
    /// dimensions), row-major.
    pub fn new(id: ParamId, shape: Vec<usize>, values: Vec<f32>) -> Self {
        FlatGrad {
            id,
            rank: shape.len(),
            shape,
            values,
        }
    }
}

struct Collect<'a, F> {
    grads: &'a mut GradientsParams,
    keep: F,
    slots: Vec<FlatGrad>,
    error: Option<String>,
}

impl<F: Fn(ParamId) -> bool> ModuleVisitor for Collect<'_, F> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        if !(self.keep)(param.id) {
            return;
        }
        let Some(g) = self.grads.remove::<D>(param.id) else {
            return;
        };
        let shape = g.dims().to_vec();
        // A gradient taken out owns its buffer: its values move out without a copy.
        match crate::collective_host_values(g) {
            Ok(values) => self.slots.push(FlatGrad {
                id: param.id,
                shape,
                rank: D,
                values,
            }),
            Err(e) => self.error = Some(e),
        }
    }
}

/// Take out of `grads` the gradients of `module`'s parameters that `keep` selects, in the
/// module's parameter order, as flat host values.
pub fn take_flat<M: Module>(
    module: &M,
    grads: &mut GradientsParams,
    keep: impl Fn(ParamId) -> bool,
    rank: usize,
) -> DistResult<Vec<FlatGrad>> {
    let mut collect = Collect {
        grads,
        keep,
        slots: Vec::new(),
        error: None,
    };
    module.visit(&mut collect);
    match collect.error {
        Some(e) => Err(DistError::Invalid {
            rank,
            message: format!("cannot read a gradient: {e}"),
        }),
        None => Ok(collect.slots),
    }
}

struct Restore<'a> {
    grads: &'a mut GradientsParams,
    slots: HashMap<ParamId, FlatGrad>,
    device: burn::tensor::Device,
}

impl ModuleVisitor for Restore<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        if self.slots.get(&param.id).is_none_or(|s| s.rank != D) {
            return;
        }
        let slot = self.slots.remove(&param.id).expect("looked up above");
        let t: Tensor<D> =
            Tensor::from_data(TensorData::new(slot.values, slot.shape), &self.device);
        self.grads.register(param.id, t);
    }
}

/// Put gradients taken by [`take_flat`] back into `grads`, on `module`'s device.
pub fn put_flat<M: Module>(
    module: &M,
    grads: &mut GradientsParams,
    flat: impl IntoIterator<Item = FlatGrad>,
) {
    let mut restore = Restore {
        grads,
        slots: flat.into_iter().map(|f| (f.id, f)).collect(),
        // Gradients live on the module's inner device, as backward's do: a tensor made on
        // the autodiff device would reach the optimizer as an autodiff tensor, which the
        // GPU's fused update does not take.
        device: module
            .devices()
            .into_iter()
            .next()
            .unwrap_or_default()
            .inner(),
    };
    module.visit(&mut restore);
}

/// How gradients from the ranks are combined.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Reduction {
    /// The mean (PyTorch DDP, ORT's AllReduce).
    #[default]
    Mean,
    /// The mean with the gradients sent as f16 (ORT's `allreduce_in_fp16`; see
    /// [`crate::comm::fp16_wire`]): half the bytes, f16's precision.
    MeanFp16,
    /// Adasum (Maleki et al. 2021; ORT's `enable_adasum`), per tensor, over a binary tree of
    /// the ranks: `adasum(a, b) = (1 - a.b / 2|a|^2) a + (1 - a.b / 2|b|^2) b`.
    Adasum,
}

/// Combine two gradients with the Adasum rule.
pub fn adasum_pair(a: &[f32], b: &[f32]) -> Vec<f32> {
    let dot: f64 = a.iter().zip(b).map(|(x, y)| *x as f64 * *y as f64).sum();
    let aa: f64 = a.iter().map(|x| (*x as f64).powi(2)).sum();
    let bb: f64 = b.iter().map(|x| (*x as f64).powi(2)).sum();
    let ca = if aa > 0.0 {
        1.0 - dot / (2.0 * aa)
    } else {
        1.0
    };
    let cb = if bb > 0.0 {
        1.0 - dot / (2.0 * bb)
    } else {
        1.0
    };
    a.iter()
        .zip(b)
        .map(|(x, y)| (ca * *x as f64 + cb * *y as f64) as f32)
        .collect()
}

/// Adasum over any number of vectors: adjacent pairs, level by level.
pub fn adasum_tree(mut parts: Vec<Vec<f32>>) -> Vec<f32> {
    while parts.len() > 1 {
        let mut next = Vec::with_capacity(parts.len().div_ceil(2));
        let mut it = parts.into_iter();
        while let Some(a) = it.next() {
            next.push(match it.next() {
                Some(b) => adasum_pair(&a, &b),
                None => a,
            });
        }
        parts = next;
    }
    parts.pop().unwrap_or_default()
}

/// Combine the gradients of `module` across the ranks of `comm`, bucket by bucket.
pub fn reduce_gradients<M: Module>(
    comm: &dyn Communicator,
    module: &M,
    grads: &mut GradientsParams,
    bucket_bytes: usize,
    reduction: Reduction,
) -> DistResult<()> {
    reduce_gradients_except(
        comm,
        module,
        grads,
        bucket_bytes,
        reduction,
        &HashSet::new(),
    )
}

/// [`reduce_gradients`] leaving out the gradients of the parameters in `skip` (averaged
/// already).
pub(crate) fn reduce_gradients_except<M: Module>(
    comm: &dyn Communicator,
    module: &M,
    grads: &mut GradientsParams,
    bucket_bytes: usize,
    reduction: Reduction,
    skip: &HashSet<ParamId>,
) -> DistResult<()> {
    if comm.world_size() == 1 {
        return Ok(());
    }
    let device = module.devices().into_iter().next().unwrap_or_default();
    if reduction == Reduction::Mean
        && let Some(on_device) = comm.device_collectives()
        && on_device.works_on(&device)
    {
        return crate::grads::device_buckets::reduce_on_device(
            on_device,
            module,
            grads,
            bucket_bytes,
            skip,
        );
    }
    let mut slots = take_flat(module, grads, |id| !skip.contains(&id), comm.rank())?;
    let lens: Vec<usize> = slots.iter().map(|s| s.values.len()).collect();
    // One buffer for every bucket of several gradients: a fresh 25 MB allocation per
    // bucket costs its page faults again each time.
    let mut bucket = Vec::new();
    for range in bucket_ranges(&lens, bucket_bytes) {
        let group = &mut slots[range];
        if reduction == Reduction::Adasum {
            let flat = flatten_into(&mut bucket, group);
            let reduced = adasum_bucket(comm, flat, group)?;
            scatter_back(&reduced, group);
        } else if let [single] = group {
            // A gradient that fills a bucket alone is reduced where it lies.
            reduce_bucket(comm, &mut single.values, reduction)?;
        } else {
            reduce_bucket(comm, flatten_into(&mut bucket, group), reduction)?;
            scatter_back(&bucket, group);
        }
    }
    put_flat(module, grads, slots);
    Ok(())
}

/// `group`'s gradients laid end to end in `buffer` (its earlier contents dropped).
fn flatten_into<'b>(buffer: &'b mut Vec<f32>, group: &[FlatGrad]) -> &'b mut [f32] {
    buffer.clear();
    buffer.reserve(group.iter().map(|g| g.values.len()).sum());
    for slot in group {
        buffer.extend_from_slice(&slot.values);
    }
    buffer
}

/// `group`'s gradients laid end to end in a new buffer.
pub(crate) fn flatten(group: &[FlatGrad]) -> Vec<f32> {
    let mut buffer = Vec::new();
    flatten_into(&mut buffer, group);
    buffer
}

/// Cut `flat` (the gradients of `group` end to end) back into `group`.
pub(crate) fn scatter_back(flat: &[f32], group: &mut [FlatGrad]) {
    let mut offset = 0;
    for slot in group {
        let n = slot.values.len();
        slot.values.copy_from_slice(&flat[offset..offset + n]);
        offset += n;
    }
}

/// Average one flat bucket across the ranks with a mean `reduction` (f32, or f16 on the
/// wire); Adasum works per tensor and is refused here.
pub(crate) fn reduce_bucket(
    comm: &dyn Communicator,
    bucket: &mut [f32],
    reduction: Reduction,
) -> DistResult<()> {
    match reduction {
        Reduction::Mean => comm.all_reduce(bucket, ReduceOp::Mean),
        Reduction::MeanFp16 => crate::comm::fp16_wire::all_reduce(comm, bucket, ReduceOp::Mean),
        Reduction::Adasum => Err(DistError::Invalid {
            rank: comm.rank(),
            message: "Adasum combines whole tensors, not a flat bucket".into(),
        }),
    }
}

/// Gather the bucket from every rank and apply Adasum tensor by tensor.
fn adasum_bucket(
    comm: &dyn Communicator,
    bucket: &[f32],
    slots: &[FlatGrad],
) -> DistResult<Vec<f32>> {
    let world = comm.world_size();
    let mut all = vec![0.0; bucket.len() * world];
    comm.all_gather(bucket, &mut all)?;
    let mut out = Vec::with_capacity(bucket.len());
    let mut offset = 0;
    for slot in slots {
        let n = slot.values.len();
        let parts = (0..world)
            .map(|r| all[r * bucket.len() + offset..r * bucket.len() + offset + n].to_vec())
            .collect();
        out.extend(adasum_tree(parts));
        offset += n;
    }
    Ok(out)
}

/// Average the gradients of `module` across the ranks of `comm` (PyTorch DDP semantics).
pub fn all_reduce_gradients<M: Module>(
    comm: &dyn Communicator,
    module: &M,
    grads: &mut GradientsParams,
    bucket_bytes: usize,
) -> DistResult<()> {
    reduce_gradients(comm, module, grads, bucket_bytes, Reduction::Mean)
}
