//! Collectives inside the model's forward and backward passes, as differentiable ops:
//! [`megatron`]'s `f`/`g` on the tensor-parallel group and [`param_gather`]'s ZeRO-3
//! parameter gather on the data-parallel (sharding) group; and [`grad_hooks`], which hands
//! each parameter's final gradient to a data-parallel averaging thread during backward.
//!
//! The ops are Burn backend extensions (Flex, Cube, Autodiff) with their own backward. They
//! move data through the group's [`Communicator`] on host buffers, so they run on every
//! device and communicator (threads, MPI, NCCL). The groups are thread-locals set by
//! [`enter`] for the duration of a run: a rank's forward and backward passes run on its
//! thread, and every rank of a group runs the same graph, so the collectives meet in the
//! same order. A failed collective panics: the interpreter turns a panic in forward into an
//! error naming the node, and a panic in backward ends the rank, which ends every rank.

pub mod grad_hooks;
pub mod megatron;
pub mod param_gather;

use std::cell::RefCell;
use std::sync::Arc;

use burn::backend::tensor::FloatTensor;
use burn::backend::{Backend, TensorMetadata};
use burn::tensor::{DType, TensorData, read_sync};
use burn_ort_dist::Communicator;

/// The groups an op can run its collective on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Group {
    /// The tensor-parallel ranks of one replica (Megatron's `f`/`g`).
    TensorParallel,
    /// The data-parallel ranks that share parameters by ZeRO-3 sharding.
    Sharding,
}

impl Group {
    fn index(self) -> usize {
        self as usize
    }
}

thread_local! {
    static GROUPS: RefCell<[Option<Arc<dyn Communicator>>; 2]> = const { RefCell::new([None, None]) };
}

/// While alive, this thread's group of one kind is the one given to [`enter`].
pub struct GroupGuard {
    kind: Group,
    previous: Option<Arc<dyn Communicator>>,
}

impl Drop for GroupGuard {
    fn drop(&mut self) {
        GROUPS.with(|g| g.borrow_mut()[self.kind.index()] = self.previous.take());
    }
}

/// Make `group` this thread's group of kind `kind` until the guard drops.
pub fn enter(kind: Group, group: Arc<dyn Communicator>) -> GroupGuard {
    GroupGuard {
        kind,
        previous: GROUPS.with(|g| g.borrow_mut()[kind.index()].replace(group)),
    }
}

/// Whether this thread has a group of kind `kind`.
pub fn active(kind: Group) -> bool {
    GROUPS.with(|g| g.borrow()[kind.index()].is_some())
}

/// This thread's group of kind `kind`; panics outside a run that set one.
fn group(kind: Group) -> Arc<dyn Communicator> {
    GROUPS
        .with(|g| g.borrow()[kind.index()].clone())
        .unwrap_or_else(|| {
            panic!("a collective op of the {kind:?} group ran on a thread without that group")
        })
}

/// A tensor's values on the host as f32, with what it takes to make it again.
struct HostCopy<B: Backend> {
    values: Vec<f32>,
    shape: Vec<usize>,
    device: B::Device,
    dtype: DType,
}

impl<B: Backend> HostCopy<B> {
    fn of(x: FloatTensor<B>, what: &str) -> Self {
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
