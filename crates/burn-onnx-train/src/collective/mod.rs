//! Collectives inside the model's forward and backward passes, as differentiable ops:
//! [`megatron`]'s `f`/`g` on the tensor-parallel group and [`param_gather`]'s ZeRO-3
//! parameter gather on the data-parallel (sharding) group, run ahead of the pass by
//! [`prefetch`]; [`sequence_parallel`]'s moves between sequence slices and whole sequences
//! (Megatron's sequence parallelism); [`vocab`]'s cross-entropy on logits split along the
//! vocabulary; and [`grad_hooks`], which hands
//! each parameter's final gradient to a data-parallel averaging thread during backward.
//!
//! [`axis_split`] says how an axis is divided among a group's ranks.
//!
//! The ops are Burn backend extensions (Flex, Cube, Autodiff) with their own backward. On a
//! GPU whose group moves device tensors itself (NCCL) the all-reduces, parameter gathers
//! and gradient scatters stay on the device ([`on_device`]); otherwise the values go
//! through the group's [`Communicator`] on host buffers, so the ops run on every device and
//! communicator (threads, MPI, NCCL). The groups are values: the parallel plan
//! gives a model its [`Collectives`] (`OnnxModel::with_collectives`), the interpreter hands
//! them to the ops, and an op's backward keeps the group it ran on. Every rank of a group
//! runs the same graph, so the collectives meet in the same order. A failed collective
//! panics: the interpreter turns a panic in forward into an error naming the node, and a
//! panic in backward ends the rank, which ends every rank.

pub mod axis_split;
pub mod grad_hooks;
pub mod megatron;
#[cfg(any(feature = "wgpu", feature = "cuda"))]
mod on_device;
pub mod param_gather;
pub mod prefetch;
pub mod sequence_parallel;
/// The old name of [`sequence_parallel`], kept for one release (docs/changelog.md).
#[doc(hidden)]
pub use sequence_parallel as sequence;
pub mod vocab;

use std::sync::Arc;

use burn::backend::tensor::FloatTensor;
use burn::backend::{Backend, TensorMetadata};
use burn::tensor::{DType, TensorData, read_sync};
use burn_ort_dist::Communicator;

/// A group of ranks an op runs its collective on: a communicator, cheap to clone into the
/// op's backward.
#[derive(Clone)]
pub struct CollectiveGroup(pub Arc<dyn Communicator>);

impl std::fmt::Debug for CollectiveGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "CollectiveGroup(rank {} of {})",
            self.0.rank(),
            self.0.world_size()
        )
    }
}

/// The groups a model's collective ops run on; a model outside a parallel run has none.
#[derive(Debug, Clone, Default)]
pub struct Collectives {
    /// The tensor-parallel ranks of one replica (Megatron's `f`/`g`).
    pub tensor_parallel: Option<CollectiveGroup>,
    /// The data-parallel ranks that share parameters by ZeRO-3 sharding (the gather, and
    /// the reduce-scatter of its backward).
    pub sharding: Option<CollectiveGroup>,
}

/// A tensor's values on the host as f32, with what it takes to make it again: a counted
/// host round trip (`burn_ort_dist::host_round_trips_so_far`) off the CPU.
struct HostCopy<B: Backend> {
    values: Vec<f32>,
    shape: Vec<usize>,
    device: B::Device,
    dtype: DType,
}

impl<B: Backend> HostCopy<B> {
    fn of(x: FloatTensor<B>, what: &str) -> Self {
        // Every backend but the CPU's keeps its values on a device.
        if std::any::TypeId::of::<B>() != std::any::TypeId::of::<burn::backend::flex::Flex>() {
            burn_ort_dist::count_host_round_trip();
        }
        let (device, dtype) = (x.device(), x.dtype());
        let data = read_sync(B::float_into_data(x))
            .unwrap_or_else(|e| panic!("{what}: reading the tensor: {e:?}"));
        let shape = data.shape().to_vec();
        let values = data
            .convert::<f32>()
            .try_into_vec::<f32>()
            .unwrap_or_else(|e| panic!("{what}: f32 values: {e:?}"));
        HostCopy {
            values,
            shape,
            device,
            dtype,
        }
    }

    /// `values` (any count) as a tensor of `shape` on the same device and dtype.
    fn make(&self, values: Vec<f32>, shape: Vec<usize>) -> FloatTensor<B> {
        B::float_from_data(
            TensorData::new(values, shape).convert_dtype(self.dtype),
            &self.device,
        )
    }
}
