//! GELU (tanh form) of `x + bias` as one op on CubeCL devices: the bias of the product
//! before it (GPT-2's `c_fc`) added inside the activation's kernel, forward and backward,
//! instead of by an `Add` writing and reading the `[rows, 4 x width]` sum in between
//! (`onnx::fusion::fuse_gelu_bias`). Backward: the input's gradient `g gelu'(x + bias)` in
//! one launch, the bias's its sum over the rows (what the `Add`'s backward reduced too).
//! `x` may arrive in the autocast precision (the product before it writes it so,
//! `crate::model::activation_precision`): the kernels compute in f32 and write the result and the
//! input's gradient in `x`'s precision, the bias's gradient in the bias's.

use burn::backend::Cube;
use burn::backend::autodiff::Autodiff;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::tensor::FloatTensor;
use burn::backend::{AutodiffBackend, Backend, TensorMetadata, backend_extension};
use burn::tensor::{DType, FloatDType};

use super::bias_residual::bias_gradient;
use super::cube_rows::{self, Pointwise};

/// The op as a backend extension (CubeCL, and Autodiff over it).
#[backend_extension(Cube, Autodiff)]
pub trait GeluBiasOps: Backend {
    /// GELU (tanh form) of `x + bias`, `bias` as long as `x`'s rows; `x` and the result in
    /// f32 or a low precision, `bias` in any.
    fn gelu_tanh_biased(x: FloatTensor<Self>, bias: FloatTensor<Self>) -> FloatTensor<Self>;
    /// `g gelu'(x + bias)`.
    fn gelu_tanh_biased_backward(
        x: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        g: FloatTensor<Self>,
    ) -> FloatTensor<Self>;
}

impl GeluBiasOps for Cube {
    fn gelu_tanh_biased(x: FloatTensor<Self>, bias: FloatTensor<Self>) -> FloatTensor<Self> {
        cube_rows::pointwise_biased(x, Some(bias), None, Pointwise::GeluTanh)
    }

    fn gelu_tanh_biased_backward(
        x: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        g: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        cube_rows::pointwise_biased(x, Some(bias), Some(g), Pointwise::GeluTanhBackward)
    }
}

/// The input's gradient in one launch, the bias's its sum over the rows.
#[derive(Debug)]
struct GeluBiasBackward;

impl<B: Backend + GeluBiasOps> Backward<B, 2> for GeluBiasBackward {
    type State = (FloatTensor<B>, FloatTensor<B>);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [x_node, bias_node] = ops.parents;
        let g = grads.consume::<B>(&ops.node);
        let (x, bias) = ops.state;
        let (bias_shape, bias_dtype) = (bias.shape(), bias.dtype());
        let dx = B::gelu_tanh_biased_backward(x, bias, g);
        if let Some(node) = bias_node {
            // Summed with f32 accumulators in `dx`'s precision (a low one rounds the sum
            // as PyTorch's autocast bias gradient is rounded), then in the bias's own.
            let db = bias_gradient::<B>(dx.clone(), bias_shape);
            let db = match bias_dtype {
                DType::F16 => B::float_cast(db, FloatDType::F16),
                DType::BF16 => B::float_cast(db, FloatDType::BF16),
                _ => B::float_cast(db, FloatDType::F32),
            };
            grads.register::<B>(node.id, db);
        }
        if let Some(node) = x_node {
            grads.register::<B>(node.id, dx);
        }
    }
}

impl<B: Backend + GeluBiasOps, C: CheckpointStrategy> GeluBiasOps for Autodiff<B, C> {
    fn gelu_tanh_biased(x: FloatTensor<Self>, bias: FloatTensor<Self>) -> FloatTensor<Self> {
        match GeluBiasBackward
            .prepare::<C>([x.node(), bias.node()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let (x, bias) = (x.into_primitive(), bias.into_primitive());
                let out = B::gelu_tanh_biased(x.clone(), bias.clone());
                prep.finish((x, bias), out)
            }
            OpsKind::UnTracked(prep) => prep.finish(B::gelu_tanh_biased(
                x.into_primitive(),
                bias.into_primitive(),
            )),
        }
    }

    fn gelu_tanh_biased_backward(
        x: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        g: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        // Only reached through the backward above (first-order autodiff).
        Self::from_inner(B::gelu_tanh_biased_backward(
            x.into_primitive(),
            bias.into_primitive(),
            g.into_primitive(),
        ))
    }
}
