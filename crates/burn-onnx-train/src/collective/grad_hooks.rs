//! Per-parameter gradient hooks (PyTorch's post-accumulate-grad hooks, what DDP starts its
//! bucket all-reduces from): while a [`GradSink`] is installed on this thread ([`install`]),
//! the model reads each trainable parameter once per forward pass through [`hook`], an
//! identity whose backward runs when every reader of the parameter has added its part (Burn
//! runs backward steps from the newest node to the oldest, and the hook is older than all
//! its readers). There the parameter's gradient is final for the pass, and the sink gets a
//! host copy of it while the rest of backward goes on.

use std::cell::RefCell;
use std::sync::Arc;

#[cfg(any(feature = "wgpu", feature = "cuda"))]
use burn::backend::Cube;
use burn::backend::autodiff::Autodiff;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::flex::Flex;
use burn::backend::tensor::FloatTensor;
use burn::backend::{Backend, backend_extension};

use super::HostCopy;
use crate::value::PhysTensor;
use crate::value::unary_op::unary;

/// Where hooked gradients go.
pub trait GradSink: Send + Sync {
    /// Parameter `param`'s gradient for this pass is final: `values` of `shape` (the
    /// interpreter's physical shape), row-major.
    fn ready(&self, param: usize, values: Vec<f32>, shape: Vec<usize>);
}

thread_local! {
    static SINK: RefCell<Option<Arc<dyn GradSink>>> = const { RefCell::new(None) };
}

/// While alive, forward passes on this thread hook their parameters into the sink given
/// to [`install`].
pub struct SinkGuard(Option<Arc<dyn GradSink>>);

impl Drop for SinkGuard {
    fn drop(&mut self) {
        SINK.with(|s| *s.borrow_mut() = self.0.take());
    }
}

/// Hook this thread's forward passes into `sink` until the guard drops.
pub fn install(sink: Arc<dyn GradSink>) -> SinkGuard {
    SinkGuard(SINK.with(|s| s.borrow_mut().replace(sink)))
}

/// Whether a sink is installed on this thread.
pub fn active() -> bool {
    SINK.with(|s| s.borrow().is_some())
}

fn current() -> Option<Arc<dyn GradSink>> {
    SINK.with(|s| s.borrow().clone())
}

/// Parameter `param`'s value, its gradient handed to this thread's sink once final.
pub fn hook(x: PhysTensor, param: usize) -> PhysTensor {
    PhysTensor::from_dispatch(<burn::backend::Dispatch as GradHookOps>::grad_hook(
        x.into_dispatch(),
        param,
    ))
}

/// The hook as a backend extension: an identity on every backend, with the backward that
/// reports the gradient under autodiff.
#[backend_extension(Cube: cfg(any(feature = "wgpu", feature = "cuda")), Flex, Autodiff)]
pub trait GradHookOps: Backend {
    /// `x`; under autodiff, its gradient goes to the sink installed when this ran.
    fn grad_hook(x: FloatTensor<Self>, param: usize) -> FloatTensor<Self>;
}

impl GradHookOps for Flex {
    fn grad_hook(x: FloatTensor<Self>, _param: usize) -> FloatTensor<Self> {
        x
    }
}

#[cfg(any(feature = "wgpu", feature = "cuda"))]
impl GradHookOps for Cube {
    fn grad_hook(x: FloatTensor<Self>, _param: usize) -> FloatTensor<Self> {
        x
    }
}

impl<B: Backend + GradHookOps, C: CheckpointStrategy> GradHookOps for Autodiff<B, C> {
    fn grad_hook(x: FloatTensor<Self>, param: usize) -> FloatTensor<Self> {
        let Some(sink) = current() else {
            return x;
        };
        unary::<B, C, ()>(
            x,
            |x| x,
            |_, _| (),
            move |(), g| {
                let host = HostCopy::<B>::of(g.clone(), "gradient hook");
                sink.ready(param, host.values, host.shape);
                g
            },
        )
    }
}
