//! ZeRO-3's parameter gather as a differentiable op, on a sharding group
//! ([`super::Collectives::sharding`]): [`gather_param`] all-gathers the ranks' chunks of a
//! parameter into the whole tensor where a node reads it; its backward reduce-scatters the
//! whole gradient (mean over the ranks, as data parallelism averages), so each rank's chunk
//! receives the reduced gradient of its part and no rank keeps a whole gradient.
//!
//! On a GPU whose group moves device tensors (NCCL) both stay on the device
//! ([`super::on_device`]); elsewhere they go through host memory.
//!
//! Nothing holds a gathered parameter but the ops reading it: without an autodiff tape it
//! is freed after its last reader; with one, until the backward of its readers (activation
//! recomputation re-gathers a segment's parameters for its re-forward instead).

#[cfg(any(feature = "wgpu", feature = "cuda"))]
use burn::backend::Cube;
use burn::backend::autodiff::Autodiff;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::flex::Flex;
use burn::backend::tensor::FloatTensor;
use burn::backend::{AutodiffBackend, Backend, TensorMetadata, backend_extension};
#[cfg(any(feature = "wgpu", feature = "cuda"))]
use burn::tensor::Tensor;
#[cfg(any(feature = "wgpu", feature = "cuda"))]
use burn_ort_dist::DeviceCollectives;
use burn_ort_dist::ReduceOp;

#[cfg(any(feature = "wgpu", feature = "cuda"))]
use super::on_device::on_device;
use super::{CollectiveGroup, HostCopy};
use crate::value::unary_op::unary;
use crate::value::{MAX_RANK, PhysTensor};

/// The whole parameter of physical `shape` from every rank's chunk of it.
fn host_gather<B: Backend>(
    chunk: FloatTensor<B>,
    shape: Vec<usize>,
    group: &CollectiveGroup,
) -> FloatTensor<B> {
    let host = HostCopy::<B>::of(chunk, "ZeRO-3 parameter gather");
    let g = &group.0;
    let mut all = vec![0.0; host.values.len() * g.world_size()];
    g.all_gather(&host.values, &mut all)
        .unwrap_or_else(|e| panic!("ZeRO-3 parameter gather failed: {e}"));
    all.truncate(shape.iter().product());
    host.make(all, shape)
}

/// This rank's chunk (of `chunk_shape`) of the whole gradient averaged over the ranks.
fn host_reduce_scatter<B: Backend>(
    grad: FloatTensor<B>,
    chunk_shape: Vec<usize>,
    group: &CollectiveGroup,
) -> FloatTensor<B> {
    let mut host = HostCopy::<B>::of(grad, "ZeRO-3 gradient reduce-scatter");
    let g = &group.0;
    let chunk: usize = chunk_shape.iter().product();
    host.values.resize(chunk * g.world_size(), 0.0);
    let mut mine = vec![0.0; chunk];
    g.reduce_scatter(&host.values, &mut mine, ReduceOp::Mean)
        .unwrap_or_else(|e| panic!("ZeRO-3 gradient reduce-scatter failed: {e}"));
    host.make(mine, chunk_shape)
}

/// The gather as a backend extension.
#[backend_extension(Cube: cfg(any(feature = "wgpu", feature = "cuda")), Flex, Autodiff)]
pub trait ParamGatherOps: Backend {
    /// The whole parameter of physical `shape` from this rank's `chunk` and the others' in
    /// `group`.
    fn gather_param(
        chunk: FloatTensor<Self>,
        shape: Vec<usize>,
        group: CollectiveGroup,
    ) -> FloatTensor<Self>;
    /// This rank's chunk (of `chunk_shape`) of the whole gradient `grad` averaged over
    /// `group`: the gather's backward.
    fn scatter_param_grad(
        grad: FloatTensor<Self>,
        chunk_shape: Vec<usize>,
        group: CollectiveGroup,
    ) -> FloatTensor<Self>;
}

impl ParamGatherOps for Flex {
    fn gather_param(
        chunk: FloatTensor<Self>,
        shape: Vec<usize>,
        group: CollectiveGroup,
    ) -> FloatTensor<Self> {
        host_gather::<Self>(chunk, shape, &group)
    }

    fn scatter_param_grad(
        grad: FloatTensor<Self>,
        chunk_shape: Vec<usize>,
        group: CollectiveGroup,
    ) -> FloatTensor<Self> {
        host_reduce_scatter::<Self>(grad, chunk_shape, &group)
    }
}

#[cfg(any(feature = "wgpu", feature = "cuda"))]
impl ParamGatherOps for Cube {
    fn gather_param(
        chunk: FloatTensor<Self>,
        shape: Vec<usize>,
        group: CollectiveGroup,
    ) -> FloatTensor<Self> {
        let numel = shape.iter().product::<usize>();
        let what = "ZeRO-3 parameter gather";
        // The chunks are padded to equal lengths: the whole is the first `numel` values.
        let gather = |d: &dyn DeviceCollectives, t| Ok(d.all_gather(t)?.slice(0..numel));
        on_device(chunk, &group, what, gather, shape.clone())
            .unwrap_or_else(|chunk| host_gather::<Self>(chunk, shape, &group))
    }

    fn scatter_param_grad(
        grad: FloatTensor<Self>,
        chunk_shape: Vec<usize>,
        group: CollectiveGroup,
    ) -> FloatTensor<Self> {
        let chunk = chunk_shape.iter().product::<usize>();
        let world = group.0.world_size();
        let what = "ZeRO-3 gradient reduce-scatter";
        let scatter = |d: &dyn DeviceCollectives, t: Tensor<1>| {
            // The whole gradient padded with zeros to `world` equal chunks.
            let pad = chunk * world - t.dims()[0];
            let t = match pad {
                0 => t,
                _ => Tensor::cat(vec![t.clone(), Tensor::zeros([pad], &t.device())], 0),
            };
            d.reduce_scatter(t, ReduceOp::Mean)
        };
        on_device(grad, &group, what, scatter, chunk_shape.clone())
            .unwrap_or_else(|g| host_reduce_scatter::<Self>(g, chunk_shape.clone(), &group))
    }
}

impl<B: Backend + ParamGatherOps, C: CheckpointStrategy> ParamGatherOps for Autodiff<B, C> {
    fn gather_param(
        chunk: FloatTensor<Self>,
        shape: Vec<usize>,
        group: CollectiveGroup,
    ) -> FloatTensor<Self> {
        let chunk_shape = chunk.shape().to_vec();
        let kept = group.clone();
        unary::<B, C, CollectiveGroup>(
            chunk,
            move |x| B::gather_param(x, shape, group),
            |_, _| kept,
            move |group, g| B::scatter_param_grad(g, chunk_shape, group),
        )
    }

    fn scatter_param_grad(
        grad: FloatTensor<Self>,
        chunk_shape: Vec<usize>,
        group: CollectiveGroup,
    ) -> FloatTensor<Self> {
        // Only reached through the backward above (first-order autodiff).
        Self::from_inner(B::scatter_param_grad(
            grad.into_primitive(),
            chunk_shape,
            group,
        ))
    }
}

/// The whole parameter of physical `shape` from this rank's `chunk` (a collective of the
/// sharding `group`).
pub fn gather_param(
    chunk: PhysTensor,
    shape: [usize; MAX_RANK],
    group: &CollectiveGroup,
) -> PhysTensor {
    PhysTensor::from_dispatch(<burn::backend::Dispatch as ParamGatherOps>::gather_param(
        chunk.into_dispatch(),
        shape.to_vec(),
        group.clone(),
    ))
}
