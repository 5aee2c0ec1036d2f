//! The core of attention, `softmax(masked(q kt)) v`, as one differentiable op on CubeCL
//! devices that keeps no `[batch, heads, seq, seq]` tensor for its backward: Megatron's
//! selective activation recomputation (Korthikanti et al. 2022), which PyTorch's
//! `scaled_dot_product_attention` gives its users too. The graph's two products and the
//! Softmax between them are one node (`onnx::fusion::fuse_attention_core`).
//!
//! Forward: the scores `q kt` (f32), the masked softmax writing the probabilities in the
//! products' precision and each row's log-sum-exp (`attention_rows.rs`), the product with
//! `v` (`cube_matmul.rs`: operands in the compute precision, results in f32). Kept for the
//! backward: the prepared `q`, `kt` and `v` (the inputs' size), the mask and bias (their
//! own, broadcast, size) and the log-sum-exps (one f32 a row); the scores and the
//! probabilities are dropped, where the composition kept the probabilities (f32) and their
//! low-precision copy for `dv`. Backward: the scores again, the probabilities again from
//! them and the log-sum-exps (one element-wise pass) for `dv = p^T g`, `dp = g v^T`, the
//! scores' gradient from the scores, the log-sum-exps and `dp` in the products'
//! precision, `dq = ds k`, `dkt = q^T ds`. The scores of one layer exist only while its
//! backward runs.

use burn::tensor::FloatDType;

use crate::value::PhysTensor;

/// `softmax(where(keep != 0, (q kt) * scale, fill) + bias) v` over the last axis, the
/// products in `compute`, the result written in `out` (f32, or `compute` itself where
/// only products read it: `crate::model::activation_precision`; its gradient comes back
/// so): `q [.., t, d]`, `kt [.., d, s]`, `v [.., s, e]` (f32, equal batch dimensions),
/// `keep` and `bias` broadcastable to the scores `[.., t, s]`, `bias` not tracked. CubeCL
/// devices only ([`super::masked_softmax_fused_here`] of `q`).
#[allow(clippy::too_many_arguments)]
pub fn attention_core(
    q: PhysTensor,
    kt: PhysTensor,
    v: PhysTensor,
    keep: PhysTensor,
    bias: PhysTensor,
    scale: f32,
    fill: f32,
    (compute, out): (FloatDType, FloatDType),
) -> PhysTensor {
    let mut scores = q.dims();
    let r = scores.len();
    scores[r - 1] = kt.dims()[r - 1];
    let (keep, bias) = (keep.expand(scores), bias.expand(scores));
    #[cfg(any(feature = "wgpu", feature = "cuda"))]
    {
        use cube::AttentionCoreOps;
        PhysTensor::from_dispatch(
            <burn::backend::Dispatch as AttentionCoreOps>::attention_core(
                q.into_dispatch(),
                kt.into_dispatch(),
                v.into_dispatch(),
                keep.into_dispatch(),
                bias.into_dispatch(),
                (scale, fill),
                (compute, out),
            ),
        )
    }
    #[cfg(not(any(feature = "wgpu", feature = "cuda")))]
    unreachable!(
        "no CubeCL device in this build ({:?} {:?} {:?} {:?} {:?} {scale} {fill} {compute:?} {out:?})",
        q.dims(),
        kt.dims(),
        v.dims(),
        keep.dims(),
        bias.dims()
    )
}

#[cfg(any(feature = "wgpu", feature = "cuda"))]
mod cube {
    use burn::backend::Cube;
    use burn::backend::autodiff::Autodiff;
    use burn::backend::autodiff::checkpoint::base::Checkpointer;
    use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
    use burn::backend::autodiff::grads::Gradients;
    use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
    use burn::backend::tensor::FloatTensor;
    use burn::backend::{Backend, TensorMetadata, backend_extension};
    use burn::tensor::FloatDType;
    use burn::tensor::FloatDType::F32;

    use crate::kernels::attention_rows::AttentionRowsOps;
    use crate::kernels::cube_matmul::CubeMatmulOps;

    /// The op as a backend extension (CubeCL, and Autodiff over it).
    #[backend_extension(Cube, Autodiff)]
    pub trait AttentionCoreOps: Backend {
        /// See [`super::attention_core`]; `keep` and `bias` have the scores' shape
        /// (broadcast strides), `masking` is `(scale, fill)`, `precision` `(compute, out)`.
        fn attention_core(
            q: FloatTensor<Self>,
            kt: FloatTensor<Self>,
            v: FloatTensor<Self>,
            keep: FloatTensor<Self>,
            bias: FloatTensor<Self>,
            masking: (f32, f32),
            precision: (FloatDType, FloatDType),
        ) -> FloatTensor<Self>;
    }

    /// The operands `[q, kt, v]` prepared for the products (`cube_matmul.rs`), the
    /// log-sum-exps of the scores' rows and the output (in `out`).
    fn forward<B: CubeMatmulOps + AttentionRowsOps>(
        [q, kt, v]: [FloatTensor<B>; 3],
        m: &Masking<B>,
        (compute, out): (FloatDType, FloatDType),
    ) -> ([FloatTensor<B>; 3], FloatTensor<B>, FloatTensor<B>) {
        let q = B::matmul_operand(q, compute);
        let kt = B::matmul_operand(kt, compute);
        let v = B::matmul_operand(v, compute);
        let scores = B::matmul_prepared(q.clone(), kt.clone(), F32);
        let (p, lse) = B::attention_probabilities(scores, m.keep(), m.bias(), m.at(), compute);
        let y = B::matmul_prepared(p, v.clone(), out);
        ([q, kt, v], lse, y)
    }

    /// The mask, bias, scale and fill of the scores.
    #[derive(Debug, Clone)]
    struct Masking<B: Backend> {
        keep: FloatTensor<B>,
        bias: FloatTensor<B>,
        scale: f32,
        fill: f32,
    }

    impl<B: Backend> Masking<B> {
        fn keep(&self) -> FloatTensor<B> {
            self.keep.clone()
        }

        fn bias(&self) -> FloatTensor<B> {
            self.bias.clone()
        }

        /// `(scale, fill)`.
        fn at(&self) -> (f32, f32) {
            (self.scale, self.fill)
        }
    }

    impl AttentionCoreOps for Cube {
        fn attention_core(
            q: FloatTensor<Self>,
            kt: FloatTensor<Self>,
            v: FloatTensor<Self>,
            keep: FloatTensor<Self>,
            bias: FloatTensor<Self>,
            (scale, fill): (f32, f32),
            precision: (FloatDType, FloatDType),
        ) -> FloatTensor<Self> {
            let m = Masking {
                keep,
                bias,
                scale,
                fill,
            };
            forward::<Self>([q, kt, v], &m, precision).2
        }
    }

    fn transpose_last<B: Backend>(x: FloatTensor<B>) -> FloatTensor<B> {
        let r = x.shape().num_dims();
        B::float_swap_dims(x, r - 2, r - 1)
    }

    /// The backward from the prepared operands and the log-sum-exps, the scores and the
    /// probabilities made again; the output's gradient read in whichever precision it
    /// arrives (the output's).
    #[derive(Debug)]
    struct AttentionCoreBackward {
        compute: FloatDType,
    }

    impl<B: Backend + CubeMatmulOps + AttentionRowsOps> Backward<B, 3> for AttentionCoreBackward {
        /// The prepared `q`, `kt`, `v`, the masking and the log-sum-exps.
        type State = ([FloatTensor<B>; 3], Masking<B>, FloatTensor<B>);

        fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _: &mut Checkpointer) {
            let [q_node, kt_node, v_node] = ops.parents;
            let ([q, kt, v], m, lse) = ops.state;
            let compute = self.compute;
            let g = B::matmul_operand(grads.consume::<B>(&ops.node), compute);
            let scores = B::matmul_prepared(q.clone(), kt.clone(), F32);
            if let Some(node) = v_node {
                let p = B::attention_probabilities_again(
                    scores.clone(),
                    m.keep(),
                    m.bias(),
                    lse.clone(),
                    m.at(),
                    compute,
                );
                let p_t = B::matmul_operand(transpose_last::<B>(p), compute);
                grads.register::<B>(node.id, B::matmul_prepared(p_t, g.clone(), F32));
            }
            if q_node.is_none() && kt_node.is_none() {
                return;
            }
            let dp = B::matmul_prepared(g, transpose_last::<B>(v), F32);
            let ds =
                B::attention_scores_backward(scores, m.keep(), m.bias(), lse, dp, m.at(), compute);
            if let Some(node) = q_node {
                let dq = B::matmul_prepared(ds.clone(), transpose_last::<B>(kt), F32);
                grads.register::<B>(node.id, dq);
            }
            if let Some(node) = kt_node {
                let dkt = B::matmul_prepared(transpose_last::<B>(q), ds, F32);
                grads.register::<B>(node.id, dkt);
            }
        }
    }

    impl<B: Backend + CubeMatmulOps + AttentionRowsOps + AttentionCoreOps, C: CheckpointStrategy>
        AttentionCoreOps for Autodiff<B, C>
    {
        fn attention_core(
            q: FloatTensor<Self>,
            kt: FloatTensor<Self>,
            v: FloatTensor<Self>,
            keep: FloatTensor<Self>,
            bias: FloatTensor<Self>,
            (scale, fill): (f32, f32),
            precision: (FloatDType, FloatDType),
        ) -> FloatTensor<Self> {
            let (keep, bias) = (keep.into_primitive(), bias.into_primitive());
            match (AttentionCoreBackward {
                compute: precision.0,
            })
            .prepare::<C>([q.node(), kt.node(), v.node()])
            .compute_bound()
            .stateful()
            {
                OpsKind::Tracked(prep) => {
                    let m = Masking {
                        keep,
                        bias,
                        scale,
                        fill,
                    };
                    let operands = [q, kt, v].map(|x| x.into_primitive());
                    let (prepared, lse, out) = forward::<B>(operands, &m, precision);
                    prep.finish((prepared, m, lse), out)
                }
                OpsKind::UnTracked(prep) => prep.finish(B::attention_core(
                    q.into_primitive(),
                    kt.into_primitive(),
                    v.into_primitive(),
                    keep,
                    bias,
                    (scale, fill),
                    precision,
                )),
            }
        }
    }
}
