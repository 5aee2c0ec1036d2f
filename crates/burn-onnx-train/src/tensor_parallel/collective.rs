//! Megatron's two conjugate operators as differentiable ops, on the tensor-parallel group
//! of the calling thread:
//! - [`tp_copy`] (`f`): identity forward, all-reduce of the gradient backward (before a
//!   column-parallel block: every rank's partial gradient of the block input is summed);
//! - [`tp_reduce`] (`g`): all-reduce forward, identity backward (after a row-parallel
//!   projection: the ranks' partial products are summed).
//!
//! Both are a Burn backend extension with their own backward under autodiff. The
//! all-reduce goes through the group's [`Communicator`] on host buffers, so it runs on every
//! device and communicator (threads, MPI, NCCL). The group is a thread-local set by
//! [`enter`] for the duration of a run: a rank's forward and backward passes run on its
//! thread.

use std::cell::RefCell;
use std::sync::Arc;

#[cfg(any(feature = "wgpu", feature = "cuda"))]
use burn::backend::Cube;
use burn::backend::autodiff::Autodiff;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::flex::Flex;
use burn::backend::tensor::FloatTensor;
use burn::backend::{Backend, TensorMetadata, backend_extension};
use burn::tensor::{TensorData, read_sync};
use burn_ort_dist::{Communicator, ReduceOp};

use crate::value::PhysTensor;

thread_local! {
    static GROUP: RefCell<Option<Arc<dyn Communicator>>> = const { RefCell::new(None) };
}

/// While alive, the tensor-parallel group of this thread is the one given to [`enter`].
pub struct GroupGuard(Option<Arc<dyn Communicator>>);

impl Drop for GroupGuard {
    fn drop(&mut self) {
        GROUP.with(|g| *g.borrow_mut() = self.0.take());
    }
}

/// Make `group` this thread's tensor-parallel group until the guard drops.
pub fn enter(group: Arc<dyn Communicator>) -> GroupGuard {
    GroupGuard(GROUP.with(|g| g.borrow_mut().replace(group)))
}

/// Whether this thread has a tensor-parallel group.
pub fn active() -> bool {
    GROUP.with(|g| g.borrow().is_some())
}

/// Sum `x` over this thread's group, through host memory. A failed collective panics: the
/// interpreter turns a panic in forward into an error naming the node, and a panic in
/// backward ends the rank, which ends every rank of the run.
fn host_all_reduce<B: Backend>(x: FloatTensor<B>) -> FloatTensor<B> {
    let group = GROUP
        .with(|g| g.borrow().clone())
        .expect("a tensor-parallel op ran outside a tensor-parallel run");
    let (device, dtype) = (x.device(), x.dtype());
    let data =
        read_sync(B::float_into_data(x)).expect("tensor-parallel all-reduce: reading the tensor");
    let shape = data.shape().clone();
    let mut values: Vec<f32> = data
        .convert::<f32>()
        .try_into_vec::<f32>()
        .expect("f32 values");
    group
        .all_reduce(&mut values, ReduceOp::Sum)
        .unwrap_or_else(|e| panic!("tensor-parallel all-reduce failed: {e}"));
    B::float_from_data(TensorData::new(values, shape).convert_dtype(dtype), &device)
}

/// The two operators as a backend extension.
#[backend_extension(Cube: cfg(any(feature = "wgpu", feature = "cuda")), Flex, Autodiff)]
pub trait TensorParallelOps: Backend {
    /// `f`: identity (its gradient is all-reduced).
    fn tp_copy(x: FloatTensor<Self>) -> FloatTensor<Self>;
    /// `g`: all-reduce (its gradient passes through).
    fn tp_reduce(x: FloatTensor<Self>) -> FloatTensor<Self>;
}

impl TensorParallelOps for Flex {
    fn tp_copy(x: FloatTensor<Self>) -> FloatTensor<Self> {
        x
    }

    fn tp_reduce(x: FloatTensor<Self>) -> FloatTensor<Self> {
        host_all_reduce::<Self>(x)
    }
}

#[cfg(any(feature = "wgpu", feature = "cuda"))]
impl TensorParallelOps for Cube {
    fn tp_copy(x: FloatTensor<Self>) -> FloatTensor<Self> {
        x
    }

    fn tp_reduce(x: FloatTensor<Self>) -> FloatTensor<Self> {
        host_all_reduce::<Self>(x)
    }
}

/// The backward of `f` or `g`: the gradient mapped by a function (all-reduce or identity).
struct MapGrad<B: Backend>(fn(FloatTensor<B>) -> FloatTensor<B>);

impl<B: Backend> std::fmt::Debug for MapGrad<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("MapGrad")
    }
}

impl<B: Backend> Backward<B, 1> for MapGrad<B> {
    type State = ();

    fn backward(
        self,
        ops: Ops<Self::State, 1>,
        grads: &mut Gradients,
        _checkpointer: &mut Checkpointer,
    ) {
        let [parent] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        if let Some(node) = parent {
            grads.register::<B>(node.id, (self.0)(grad));
        }
    }
}

/// `forward(x)` under autodiff with gradient `backward(g)`.
fn tracked<B: Backend, C: CheckpointStrategy>(
    x: FloatTensor<Autodiff<B, C>>,
    forward: fn(FloatTensor<B>) -> FloatTensor<B>,
    backward: fn(FloatTensor<B>) -> FloatTensor<B>,
) -> FloatTensor<Autodiff<B, C>> {
    match MapGrad(backward)
        .prepare::<C>([x.node()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => {
            let out = forward(x.primitive().clone());
            prep.finish((), out)
        }
        OpsKind::UnTracked(prep) => prep.finish(forward(x.into_primitive())),
    }
}

fn identity<B: Backend>(g: FloatTensor<B>) -> FloatTensor<B> {
    g
}

impl<B: Backend + TensorParallelOps, C: CheckpointStrategy> TensorParallelOps for Autodiff<B, C> {
    fn tp_copy(x: FloatTensor<Self>) -> FloatTensor<Self> {
        tracked::<B, C>(x, B::tp_copy, host_all_reduce::<B>)
    }

    fn tp_reduce(x: FloatTensor<Self>) -> FloatTensor<Self> {
        tracked::<B, C>(x, B::tp_reduce, identity::<B>)
    }
}

/// Megatron's `f` on a tensor.
pub fn tp_copy(x: PhysTensor) -> PhysTensor {
    PhysTensor::from_dispatch(<burn::backend::Dispatch as TensorParallelOps>::tp_copy(
        x.into_dispatch(),
    ))
}

/// Megatron's `g` on a tensor.
pub fn tp_reduce(x: PhysTensor) -> PhysTensor {
    PhysTensor::from_dispatch(<burn::backend::Dispatch as TensorParallelOps>::tp_reduce(
        x.into_dispatch(),
    ))
}
