//! ZeRO's flat buffers as device tensors, for the update on the device
//! ([`super::device_step`]): this rank's shard of the parameters and of the reduced gradient
//! made from the module's tensors (slices laid end to end, zeros where a parameter has no
//! gradient and in the padding), and the updated shard put back: all-gathered into every
//! parameter (stages 1, 2) or cut into the module's own chunks (stage 3). The collectives
//! are the group's [`DeviceCollectives`] (NCCL on CUDA devices), a window of
//! [`super::buckets::BUCKET`] values of each shard at a time, as on the host path; no value
//! passes through host memory.

use std::collections::HashMap;
use std::ops::Range;

use burn::module::{Module, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::tensor::{Device, FloatDType, Tensor};

use super::buckets::{BUCKET, windows};
use super::layout::FlatLayout;
use crate::comm::communicator::{DeviceCollectives, ReduceOp};
use crate::error::DistResult;
use crate::storage::param_swap::{Place, Release};

/// Values `range` of the flat buffer `layout` lays `tensors` (one flat tensor per slot,
/// `None`: zeros) into, on `device`.
pub fn flat_range(
    layout: &FlatLayout,
    tensors: &[Option<Tensor<1>>],
    range: Range<usize>,
    device: &Device,
) -> Tensor<1> {
    let zeros = |n: usize| Tensor::<1>::zeros([n], device);
    let mut parts = Vec::new();
    let mut at = range.start;
    let end = range.end.min(layout.len);
    let first = layout
        .slots
        .partition_point(|s| s.offset + s.len <= range.start);
    for (s, t) in layout.slots.iter().zip(tensors).skip(first) {
        if s.offset >= end {
            break;
        }
        let (lo, hi) = (s.offset.max(range.start), (s.offset + s.len).min(end));
        let Some(t) = t.as_ref().filter(|_| lo < hi) else {
            continue;
        };
        if lo > at {
            parts.push(zeros(lo - at));
        }
        parts.push(t.clone().slice(lo - s.offset..hi - s.offset));
        at = hi;
    }
    if range.end > at {
        parts.push(zeros(range.end - at));
    }
    joined(parts, device)
}

/// The module's parameters, flat, f32 and without autodiff, in layout order.
pub fn param_tensors<M: Module>(module: &M) -> Vec<Option<Tensor<1>>> {
    struct Params(Vec<Option<Tensor<1>>>);
    impl ModuleVisitor for Params {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let t = param.val().inner().cast(FloatDType::F32);
            let n: usize = t.dims().iter().product();
            self.0.push(Some(t.reshape([n])));
        }
    }
    let mut p = Params(Vec::new());
    module.visit(&mut p);
    p.0
}

/// The gradients of `layout`'s trainable slots taken out of `grads`, flat and f32 (`None`:
/// a frozen slot, or no gradient).
pub fn grad_tensors<M: Module>(
    layout: &FlatLayout,
    module: &M,
    grads: &mut GradientsParams,
) -> Vec<Option<Tensor<1>>> {
    let taken = layout.take_grad_tensors(module, grads);
    layout
        .slots
        .iter()
        .zip(taken)
        .map(|(s, g)| g.filter(|_| s.trainable).map(|g| g.cast(FloatDType::F32)))
        .collect()
}

/// This rank's shard of the mean of every rank's flat gradient (`grads`, one per slot of
/// the contiguous `layout`): ZeRO-2's reduce-scatter, window by window.
pub fn reduce_scatter(
    group: &dyn DeviceCollectives,
    layout: &FlatLayout,
    grads: &[Option<Tensor<1>>],
    device: &Device,
) -> DistResult<Tensor<1>> {
    let shard = layout.shard_len();
    let mut mine = Vec::new();
    for (a, b) in windows(shard, BUCKET) {
        // Window [a, b) of every rank's shard, end to end: rank r receives its own.
        let send: Vec<Tensor<1>> = (0..layout.world)
            .map(|r| flat_range(layout, grads, r * shard + a..r * shard + b, device))
            .collect();
        mine.push(group.reduce_scatter(Tensor::cat(send, 0), ReduceOp::Mean)?);
    }
    Ok(joined(mine, device))
}

/// `parts` end to end (an empty tensor for none).
fn joined(mut parts: Vec<Tensor<1>>, device: &Device) -> Tensor<1> {
    match parts.len() {
        0 => Tensor::zeros([0], device),
        1 => parts.pop().expect("one part"),
        _ => Tensor::cat(parts, 0),
    }
}

/// `module` with its parameters replaced by every rank's `mine` (its updated shard of the
/// contiguous `layout`), all-gathered window by window; the old values are released first.
pub fn gather_params<M: Module>(
    group: &dyn DeviceCollectives,
    layout: &FlatLayout,
    module: M,
    mine: Tensor<1>,
) -> DistResult<M> {
    let mut release = Release::all();
    let module = module.map(&mut release);
    let device = mine.device();
    let shard = layout.shard_len();
    let mut by_rank: Vec<Vec<Tensor<1>>> = vec![Vec::new(); layout.world];
    for (a, b) in windows(shard, BUCKET) {
        let got = group.all_gather(mine.clone().slice(a..b))?;
        for (r, parts) in by_rank.iter_mut().enumerate() {
            parts.push(got.clone().slice(r * (b - a)..(r + 1) * (b - a)));
        }
    }
    let flat = joined(by_rank.into_iter().flatten().collect(), &device);
    Ok(place(module, layout, &flat, &release.devices))
}

/// `module` (its parameters released) with each slot of `layout` taken from `flat`.
pub fn place<M: Module>(
    module: M,
    layout: &FlatLayout,
    flat: &Tensor<1>,
    devices: &HashMap<burn::module::ParamId, Device>,
) -> M {
    let values = layout
        .slots
        .iter()
        .filter_map(|s| {
            let device = devices.get(&s.id)?;
            let t = flat.clone().slice(s.offset..s.offset + s.len);
            let t = if device.is_autodiff() {
                t.autodiff()
            } else {
                t
            };
            Some((s.id, (t, s.shape.clone())))
        })
        .collect();
    module.map(&mut Place(values))
}

/// `module` (ZeRO-3: its parameters are this rank's chunks, laid out by `local`) with its
/// chunks replaced by the updated shard `mine`.
pub fn put_chunks<M: Module>(module: M, local: &FlatLayout, mine: &Tensor<1>) -> M {
    let mut release = Release::all();
    let module = module.map(&mut release);
    place(module, local, mine, &release.devices)
}
