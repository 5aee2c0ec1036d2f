//! The autocast matrix product on CubeCL devices: f32 operands cast to the low precision
//! (bf16 or f16), one product reading them and writing an **f32** result from its f32
//! accumulator, with a backward of its own that casts the incoming gradient once and
//! writes both operand gradients in f32 straight from the two products.
//!
//! Casting the result back to f32 as an op of its own (the plain composition, still the
//! CPU's) costs a launch forward, and back a launch for the gradient's cast per operand:
//! 6 casts around the 3 products of every autocast MatMul or Gemm, 3 here. The result is
//! also not rounded to the low precision on its way out (PyTorch's autocast does round
//! it; the f32 parameters, optimizer and other ops are unchanged). The forward keeps the
//! low-precision operands for the backward, as the composition's casts did.

use burn::backend::Cube;
use burn::backend::autodiff::Autodiff;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::ops::FloatTensorOps;
use burn::backend::tensor::FloatTensor;
use burn::backend::{AutodiffBackend, Backend, TensorMetadata, backend_extension};
use burn::tensor::{DType, FloatDType};
use burn_cubecl::kernel::matmul::{MatmulStrategy, matmul};

/// The product as a backend extension (CubeCL, and Autodiff over it).
#[backend_extension(Cube, Autodiff)]
pub trait AutocastMatmulOps: Backend {
    /// `a [.., m, k] x b [.., k, n]` (f32, equal batch dimensions) computed in `low`, the
    /// result in f32.
    fn matmul_autocast(
        a: FloatTensor<Self>,
        b: FloatTensor<Self>,
        low: FloatDType,
    ) -> FloatTensor<Self>;
    /// `a x b` of two operands already in a low precision, the result in f32.
    fn matmul_to_f32(a: FloatTensor<Self>, b: FloatTensor<Self>) -> FloatTensor<Self>;
}

impl AutocastMatmulOps for Cube {
    fn matmul_autocast(
        a: FloatTensor<Self>,
        b: FloatTensor<Self>,
        low: FloatDType,
    ) -> FloatTensor<Self> {
        Self::matmul_to_f32(Self::float_cast(a, low), Self::float_cast(b, low))
    }

    fn matmul_to_f32(a: FloatTensor<Self>, b: FloatTensor<Self>) -> FloatTensor<Self> {
        let (sa, sb) = (a.shape(), b.shape());
        matmul(a, b, None, MatmulStrategy::default(), DType::F32).unwrap_or_else(|e| {
            panic!("autocast matmul of {sa:?} x {sb:?} to f32 could not launch: {e:?}")
        })
    }
}

/// `dA = g B^T`, `dB = A^T g` from the low-precision operands the forward kept, with `g`
/// cast to that precision once; both gradients come out in f32.
#[derive(Debug)]
struct AutocastMatmulBackward {
    low: FloatDType,
}

fn transpose_last<B: Backend>(x: FloatTensor<B>) -> FloatTensor<B> {
    let r = x.shape().num_dims();
    B::float_swap_dims(x, r - 2, r - 1)
}

impl<B: Backend + AutocastMatmulOps> Backward<B, 2> for AutocastMatmulBackward {
    type State = (Option<FloatTensor<B>>, Option<FloatTensor<B>>);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [a_node, b_node] = ops.parents;
        let grad = B::float_cast(grads.consume::<B>(&ops.node), self.low);
        let (a_low, b_low) = ops.state;
        if let (Some(node), Some(b_low)) = (a_node, b_low) {
            let da = B::matmul_to_f32(grad.clone(), transpose_last::<B>(b_low));
            grads.register::<B>(node.id, da);
        }
        if let (Some(node), Some(a_low)) = (b_node, a_low) {
            grads.register::<B>(node.id, B::matmul_to_f32(transpose_last::<B>(a_low), grad));
        }
    }
}

impl<B: Backend + AutocastMatmulOps, C: CheckpointStrategy> AutocastMatmulOps for Autodiff<B, C> {
    fn matmul_autocast(
        a: FloatTensor<Self>,
        b: FloatTensor<Self>,
        low: FloatDType,
    ) -> FloatTensor<Self> {
        let (a_tracked, b_tracked) = (a.is_tracked(), b.is_tracked());
        match (AutocastMatmulBackward { low })
            .prepare::<C>([a.node(), b.node()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let a_low = B::float_cast(a.into_primitive(), low);
                let b_low = B::float_cast(b.into_primitive(), low);
                let out = B::matmul_to_f32(a_low.clone(), b_low.clone());
                // Each side's gradient needs the other side's operand.
                prep.finish(
                    (b_tracked.then_some(a_low), a_tracked.then_some(b_low)),
                    out,
                )
            }
            OpsKind::UnTracked(prep) => prep.finish(B::matmul_autocast(
                a.into_primitive(),
                b.into_primitive(),
                low,
            )),
        }
    }

    fn matmul_to_f32(a: FloatTensor<Self>, b: FloatTensor<Self>) -> FloatTensor<Self> {
        // Backward's products: not differentiated again (first-order autodiff).
        Self::from_inner(B::matmul_to_f32(a.into_primitive(), b.into_primitive()))
    }
}
