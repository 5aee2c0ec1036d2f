//! A product's bias and the residual it feeds added in one pass on CubeCL devices:
//! `x + bias + residual`, where a transformer block's output projection wrote `x`, an `Add`
//! added its bias and another `Add` the residual stream (`onnx::fusion::fuse_bias_residual`
//! makes the two one node). One launch instead of two, and the `[rows, width]` sum between
//! them is neither written nor read. Backward: `x`'s and the residual's gradients are the
//! output's (no launch), the bias's its sum over the rows (what the first `Add`'s backward
//! reduced too).

use burn::backend::Cube;
use burn::backend::autodiff::Autodiff;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::tensor::FloatTensor;
use burn::backend::{Backend, Shape, TensorMetadata, backend_extension};

use super::cube_rows::{self, Pointwise};

/// The op as a backend extension (CubeCL, and Autodiff over it).
#[backend_extension(Cube, Autodiff)]
pub trait BiasResidualOps: Backend {
    /// `x + bias + residual`, `bias` as long as `x`'s rows, `residual` shaped as `x`.
    fn add_bias_residual(
        x: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        residual: FloatTensor<Self>,
    ) -> FloatTensor<Self>;
}

impl BiasResidualOps for Cube {
    fn add_bias_residual(
        x: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        residual: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        cube_rows::pointwise_biased(x, Some(bias), Some(residual), Pointwise::AddResidual)
    }
}

/// The gradient of a bias added to every row of a tensor whose gradient is `g`: `g`'s sum
/// over the rows (f32 accumulators, in `g`'s precision), shaped `bias_shape`.
pub(super) fn bias_gradient<B: Backend>(g: FloatTensor<B>, bias_shape: Shape) -> FloatTensor<B> {
    let cols = bias_shape.num_elements();
    let rows = g.shape().num_elements() / cols;
    let flat = B::float_reshape(g, Shape::new([rows, cols]));
    B::float_reshape(B::float_sum_dim(flat, 0), bias_shape)
}

/// The output's gradient to `x` and the residual, its sum over the rows to the bias.
#[derive(Debug)]
struct BiasResidualBackward;

impl<B: Backend> Backward<B, 3> for BiasResidualBackward {
    /// The bias's shape.
    type State = Shape;

    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [x_node, bias_node, residual_node] = ops.parents;
        let g = grads.consume::<B>(&ops.node);
        let bias_shape = ops.state;
        if let Some(node) = bias_node {
            grads.register::<B>(node.id, bias_gradient::<B>(g.clone(), bias_shape));
        }
        if let Some(node) = residual_node {
            grads.register::<B>(node.id, g.clone());
        }
        if let Some(node) = x_node {
            grads.register::<B>(node.id, g);
        }
    }
}

impl<B: Backend + BiasResidualOps, C: CheckpointStrategy> BiasResidualOps for Autodiff<B, C> {
    fn add_bias_residual(
        x: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        residual: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        let bias_shape = bias.shape();
        match BiasResidualBackward
            .prepare::<C>([x.node(), bias.node(), residual.node()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish(
                bias_shape,
                B::add_bias_residual(
                    x.into_primitive(),
                    bias.into_primitive(),
                    residual.into_primitive(),
                ),
            ),
            OpsKind::UnTracked(prep) => prep.finish(B::add_bias_residual(
                x.into_primitive(),
                bias.into_primitive(),
                residual.into_primitive(),
            )),
        }
    }
}
