//! Per-parameter gradient hooks (PyTorch's post-accumulate-grad hooks, what DDP starts its
//! bucket all-reduces from): a model given a [`GradSink`] (`OnnxModel::with_grad_sink`)
//! reads each trainable parameter once per training-mode forward pass through [`hook`], an
//! identity whose backward runs when every reader of the parameter has added its part (Burn
//! runs backward steps from the newest node to the oldest, and the hook is older than all
//! its readers). There the parameter's gradient is final for the pass, and the sink gets a
//! host copy of it while the rest of backward goes on.

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

/// The sink a pass's hooks hand their gradients to, cheap to clone into the backward.
#[derive(Clone)]
pub struct SinkRef(pub Arc<dyn GradSink>);

impl std::fmt::Debug for SinkRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SinkRef")
    }
}

/// Parameter `param`'s value, its gradient handed to `sink` once final.
pub fn hook(x: PhysTensor, param: usize, sink: &SinkRef) -> PhysTensor {
    PhysTensor::from_dispatch(<burn::backend::Dispatch as GradHookOps>::grad_hook(
        x.into_dispatch(),
        param,
        sink.clone(),
    ))
}

/// The hook as a backend extension: an identity on every backend, with the backward that
/// reports the gradient under autodiff.
#[backend_extension(Cube: cfg(any(feature = "wgpu", feature = "cuda")), Flex, Autodiff)]
pub trait GradHookOps: Backend {
    /// `x`; under autodiff, its gradient goes to `sink`.
    fn grad_hook(x: FloatTensor<Self>, param: usize, sink: SinkRef) -> FloatTensor<Self>;
}

impl GradHookOps for Flex {
    fn grad_hook(x: FloatTensor<Self>, _param: usize, _sink: SinkRef) -> FloatTensor<Self> {
        x
    }
}

#[cfg(any(feature = "wgpu", feature = "cuda"))]
impl GradHookOps for Cube {
    fn grad_hook(x: FloatTensor<Self>, _param: usize, _sink: SinkRef) -> FloatTensor<Self> {
        x
    }
}

impl<B: Backend + GradHookOps, C: CheckpointStrategy> GradHookOps for Autodiff<B, C> {
    fn grad_hook(x: FloatTensor<Self>, param: usize, sink: SinkRef) -> FloatTensor<Self> {
        unary::<B, C, ()>(
            x,
            |x| x,
            |_, _| (),
            move |(), g| {
                let host = HostCopy::<B>::of(g.clone(), "gradient hook");
                sink.0.ready(param, host.values, host.shape);
                g
            },
        )
    }
}
