//! Megatron's two conjugate operators as differentiable ops, on a tensor-parallel group
//! ([`super::Collectives::tensor_parallel`]):
//! - [`tp_copy`] (`f`): identity forward, all-reduce of the gradient backward (before a
//!   column-parallel block: every rank's partial gradient of the block input is summed);
//! - [`tp_reduce`] (`g`): all-reduce forward, identity backward (after a row-parallel
//!   projection: the ranks' partial products are summed).

use burn::backend::autodiff::Autodiff;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::flex::Flex;
use burn::backend::tensor::FloatTensor;
use burn::backend::{Backend, backend_extension};
#[cfg(any(feature = "wgpu", feature = "cuda"))]
use burn::backend::{Cube, TensorMetadata};
#[cfg(any(feature = "wgpu", feature = "cuda"))]
use burn_ort_dist::DeviceCollectives;
use burn_ort_dist::ReduceOp;

#[cfg(any(feature = "wgpu", feature = "cuda"))]
use super::on_device::on_device;
use super::{CollectiveGroup, HostCopy};
use crate::value::PhysTensor;
use crate::value::unary_op::unary;

/// Sum `x` over the tensor-parallel `group`, through host memory (where the group has no
/// device transport for it).
fn host_all_reduce<B: Backend>(x: FloatTensor<B>, group: &CollectiveGroup) -> FloatTensor<B> {
    let mut host = HostCopy::<B>::of(x, "tensor-parallel all-reduce");
    group
        .0
        .all_reduce(&mut host.values, ReduceOp::Sum)
        .unwrap_or_else(|e| panic!("tensor-parallel all-reduce failed: {e}"));
    let (values, shape) = (std::mem::take(&mut host.values), host.shape.clone());
    host.make(values, shape)
}

/// The two operators as a backend extension.
#[backend_extension(Cube: cfg(any(feature = "wgpu", feature = "cuda")), Flex, Autodiff)]
pub trait TensorParallelOps: Backend {
    /// `f`: identity (its gradient is all-reduced over `group`).
    fn tp_copy(x: FloatTensor<Self>, group: CollectiveGroup) -> FloatTensor<Self>;
    /// `g`: all-reduce over `group` (its gradient passes through).
    fn tp_reduce(x: FloatTensor<Self>, group: CollectiveGroup) -> FloatTensor<Self>;
}

impl TensorParallelOps for Flex {
    fn tp_copy(x: FloatTensor<Self>, _group: CollectiveGroup) -> FloatTensor<Self> {
        x
    }

    fn tp_reduce(x: FloatTensor<Self>, group: CollectiveGroup) -> FloatTensor<Self> {
        host_all_reduce::<Self>(x, &group)
    }
}

#[cfg(any(feature = "wgpu", feature = "cuda"))]
impl TensorParallelOps for Cube {
    fn tp_copy(x: FloatTensor<Self>, _group: CollectiveGroup) -> FloatTensor<Self> {
        x
    }

    fn tp_reduce(x: FloatTensor<Self>, group: CollectiveGroup) -> FloatTensor<Self> {
        let shape = x.shape().to_vec();
        let what = "tensor-parallel all-reduce";
        let sum = |d: &dyn DeviceCollectives, t| d.all_reduce(t, ReduceOp::Sum);
        on_device(x, &group, what, sum, shape)
            .unwrap_or_else(|x| host_all_reduce::<Self>(x, &group))
    }
}

impl<B: Backend + TensorParallelOps, C: CheckpointStrategy> TensorParallelOps for Autodiff<B, C> {
    fn tp_copy(x: FloatTensor<Self>, group: CollectiveGroup) -> FloatTensor<Self> {
        let kept = group.clone();
        unary::<B, C, CollectiveGroup>(
            x,
            |x| B::tp_copy(x, group),
            |_, _| kept,
            |group, g| B::tp_reduce(g, group),
        )
    }

    fn tp_reduce(x: FloatTensor<Self>, group: CollectiveGroup) -> FloatTensor<Self> {
        unary::<B, C, ()>(x, |x| B::tp_reduce(x, group), |_, _| (), |(), g| g)
    }
}

/// Megatron's `f` on a tensor, over `group`.
pub fn tp_copy(x: PhysTensor, group: &CollectiveGroup) -> PhysTensor {
    PhysTensor::from_dispatch(<burn::backend::Dispatch as TensorParallelOps>::tp_copy(
        x.into_dispatch(),
        group.clone(),
    ))
}

/// Megatron's `g` on a tensor, over `group`.
pub fn tp_reduce(x: PhysTensor, group: &CollectiveGroup) -> PhysTensor {
    PhysTensor::from_dispatch(<burn::backend::Dispatch as TensorParallelOps>::tp_reduce(
        x.into_dispatch(),
        group.clone(),
    ))
}
