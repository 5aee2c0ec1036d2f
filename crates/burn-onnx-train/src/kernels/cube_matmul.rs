//! The matrix product of f32 tensors on CubeCL devices, in f32 or autocast to a low
//! precision (bf16, f16), with operands prepared once and kept so for the backward.
//!
//! An operand is prepared by casting it to the compute precision and, when its batch and
//! matrix strides interleave (`[b, h, t, d]` heads cut out of a `[b, t, h * d]` projection,
//! or a gradient arriving through the transpose that merged them back), copying it
//! contiguous: CubeCL's matmul would copy such an operand itself, and Burn's autodiff
//! kept the unprepared view, so every backward product copied it again. Here the forward
//! prepares each operand in one launch (cast and copy in one pass when both are needed),
//! keeps the prepared operands, prepares the incoming gradient once for both backward
//! products, and writes the result in f32 and each gradient in its operand's precision
//! from the products' f32 accumulators: no cast of a result or gradient back to f32, as
//! the plain autocast composition (the CPU's) has. The result is not rounded to the low
//! precision on its way out (PyTorch's autocast rounds it), except where the caller asks
//! for it in the low precision (the loss's logits, `crate::model::head_precision`, and the
//! MLP's hidden activation, `crate::model::activation_precision`: their readers take them so, and
//! their gradients come back so); an operand that arrives in the low precision is read as
//! it is and gets its gradient in it. The f32 parameters, optimizer and other ops are
//! unchanged.

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
use burn_cubecl::kernel::{into_contiguous, untile};
use cubecl::std::tensor::{MatrixBatchLayout, matrix_batch_layout};

use super::cube::cast_contiguous;
use super::float_dtype;

/// The product as a backend extension (CubeCL, and Autodiff over it).
#[backend_extension(Cube, Autodiff)]
pub trait CubeMatmulOps: Backend {
    /// `a [.., m, k] x b [.., k, n]` (f32 or `compute`, equal batch dimensions) with both
    /// operands read in `compute` (f32 or a low precision); the result written in `out`
    /// from the f32 accumulators (the gradients of `a` and `b` in their own precisions).
    fn matmul_in(
        a: FloatTensor<Self>,
        b: FloatTensor<Self>,
        compute: FloatDType,
        out: FloatDType,
    ) -> FloatTensor<Self>;
    /// `x` as a product reads it: in `compute`, and contiguous when its batch and matrix
    /// strides interleave; `x` itself (no launch) when it already is both.
    fn matmul_operand(x: FloatTensor<Self>, compute: FloatDType) -> FloatTensor<Self>;
    /// `a x b` of two prepared operands, the result in `out`.
    fn matmul_prepared(
        a: FloatTensor<Self>,
        b: FloatTensor<Self>,
        out: FloatDType,
    ) -> FloatTensor<Self>;
}

/// Whether the product would copy `x` before reading it: batch strides below a matrix
/// stride, or a broadcast (stride 0) matrix dimension.
fn interleaved(x: &FloatTensor<Cube>) -> bool {
    matches!(
        matrix_batch_layout(x.meta.strides(), None),
        MatrixBatchLayout::HighlyPermuted
    )
}

impl CubeMatmulOps for Cube {
    fn matmul_in(
        a: FloatTensor<Self>,
        b: FloatTensor<Self>,
        compute: FloatDType,
        out: FloatDType,
    ) -> FloatTensor<Self> {
        Self::matmul_prepared(
            Self::matmul_operand(a, compute),
            Self::matmul_operand(b, compute),
            out,
        )
    }

    fn matmul_operand(x: FloatTensor<Self>, compute: FloatDType) -> FloatTensor<Self> {
        let x = untile(x);
        let cast = x.dtype != DType::from(compute);
        match (interleaved(&x), cast) {
            (false, false) => x,
            (false, true) => Self::float_cast(x, compute),
            (true, false) => into_contiguous(x),
            (true, true) => cast_contiguous(x, compute.into()),
        }
    }

    fn matmul_prepared(
        a: FloatTensor<Self>,
        b: FloatTensor<Self>,
        out: FloatDType,
    ) -> FloatTensor<Self> {
        let (sa, sb) = (a.shape(), b.shape());
        matmul(a, b, None, MatmulStrategy::default(), out.into()).unwrap_or_else(|e| {
            panic!("matmul of {sa:?} x {sb:?} to {out:?} could not launch: {e:?}")
        })
    }
}

/// `dA = g B^T`, `dB = A^T g` from the prepared operands the forward kept, with `g`
/// prepared once (no launch when it arrives in the compute precision); each gradient comes
/// out in its operand's own precision (f32, or the low one of an operand that arrived in
/// it).
#[derive(Debug)]
struct CubeMatmulBackward {
    compute: FloatDType,
    /// The precisions `a` and `b` arrived in.
    operands: [FloatDType; 2],
}

fn transpose_last<B: Backend>(x: FloatTensor<B>) -> FloatTensor<B> {
    let r = x.shape().num_dims();
    B::float_swap_dims(x, r - 2, r - 1)
}

impl<B: Backend + CubeMatmulOps> Backward<B, 2> for CubeMatmulBackward {
    type State = (Option<FloatTensor<B>>, Option<FloatTensor<B>>);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [a_node, b_node] = ops.parents;
        let grad = B::matmul_operand(grads.consume::<B>(&ops.node), self.compute);
        let (a_kept, b_kept) = ops.state;
        if let (Some(node), Some(b)) = (a_node, b_kept) {
            let da = B::matmul_prepared(grad.clone(), transpose_last::<B>(b), self.operands[0]);
            grads.register::<B>(node.id, da);
        }
        if let (Some(node), Some(a)) = (b_node, a_kept) {
            let db = B::matmul_prepared(transpose_last::<B>(a), grad, self.operands[1]);
            grads.register::<B>(node.id, db);
        }
    }
}

impl<B: Backend + CubeMatmulOps, C: CheckpointStrategy> CubeMatmulOps for Autodiff<B, C> {
    fn matmul_in(
        a: FloatTensor<Self>,
        b: FloatTensor<Self>,
        compute: FloatDType,
        out: FloatDType,
    ) -> FloatTensor<Self> {
        let (a_tracked, b_tracked) = (a.is_tracked(), b.is_tracked());
        let operands = [float_dtype(a.dtype()), float_dtype(b.dtype())];
        match (CubeMatmulBackward { compute, operands })
            .prepare::<C>([a.node(), b.node()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let a = B::matmul_operand(a.into_primitive(), compute);
                let b = B::matmul_operand(b.into_primitive(), compute);
                let product = B::matmul_prepared(a.clone(), b.clone(), out);
                // Each side's gradient needs the other side's operand.
                prep.finish((b_tracked.then_some(a), a_tracked.then_some(b)), product)
            }
            OpsKind::UnTracked(prep) => prep.finish(B::matmul_in(
                a.into_primitive(),
                b.into_primitive(),
                compute,
                out,
            )),
        }
    }

    fn matmul_operand(x: FloatTensor<Self>, compute: FloatDType) -> FloatTensor<Self> {
        // Used inside the backward only (first-order autodiff).
        Self::from_inner(B::matmul_operand(x.into_primitive(), compute))
    }

    fn matmul_prepared(
        a: FloatTensor<Self>,
        b: FloatTensor<Self>,
        out: FloatDType,
    ) -> FloatTensor<Self> {
        Self::from_inner(B::matmul_prepared(
            a.into_primitive(),
            b.into_primitive(),
            out,
        ))
    }
}
