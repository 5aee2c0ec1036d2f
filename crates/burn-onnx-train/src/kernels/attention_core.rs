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
//! backward runs, and past a budget a slice of the batch at a time (`Slicing` below).

use burn::tensor::FloatDType;

use crate::value::PhysTensor;

/// `softmax(where(keep != 0, (q kt) * scale, fill) + bias) v` over the last axis, the
/// products in `compute`, the result written in `out` (f32, or `compute` itself where
/// only products read it: `crate::model::activation_precision`; its gradient comes back
/// so): `q [.., t, d]`, `kt [.., d, s]`, `v [.., s, e]` (f32, equal batch dimensions),
/// `keep` and `bias` broadcastable to the scores `[.., t, s]`, `bias` not tracked. Scores
/// of more than `slice_bytes` in f32 are made a slice of the batch at a time
/// ([`super::TRANSIENT_BYTES`] in training). CubeCL devices only
/// ([`super::masked_softmax_fused_here`] of `q`).
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
    slice_bytes: usize,
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
                (scale, fill, slice_bytes),
                (compute, out),
            ),
        )
    }
    #[cfg(not(any(feature = "wgpu", feature = "cuda")))]
    unreachable!(
        "no CubeCL device in this build ({:?} {:?} {:?} {:?} {:?} {scale} {fill} {compute:?} {out:?} {slice_bytes})",
        q.dims(),
        kt.dims(),
        v.dims(),
        keep.dims(),
        bias.dims()
    )
}

#[cfg(any(feature = "wgpu", feature = "cuda"))]
mod cube {
    use std::ops::Range;

    use burn::backend::Cube;
    use burn::backend::autodiff::Autodiff;
    use burn::backend::autodiff::checkpoint::base::Checkpointer;
    use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
    use burn::backend::autodiff::grads::Gradients;
    use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
    use burn::backend::tensor::FloatTensor;
    use burn::backend::{Backend, Slice, TensorMetadata, backend_extension};
    use burn::tensor::FloatDType;
    use burn::tensor::FloatDType::F32;

    use crate::kernels::attention_rows::AttentionRowsOps;
    use crate::kernels::cube_matmul::CubeMatmulOps;

    /// The op as a backend extension (CubeCL, and Autodiff over it).
    #[backend_extension(Cube, Autodiff)]
    pub trait AttentionCoreOps: Backend {
        /// See [`super::attention_core`]; `keep` and `bias` have the scores' shape
        /// (broadcast strides), `masking` is `(scale, fill, slice_bytes)`, `precision`
        /// `(compute, out)`.
        fn attention_core(
            q: FloatTensor<Self>,
            kt: FloatTensor<Self>,
            v: FloatTensor<Self>,
            keep: FloatTensor<Self>,
            bias: FloatTensor<Self>,
            masking: (f32, f32, usize),
            precision: (FloatDType, FloatDType),
        ) -> FloatTensor<Self>;
    }

    /// The operands `[q, kt, v]` prepared for the products (`cube_matmul.rs`), the
    /// log-sum-exps of the scores' rows and the output (in `out`), a slice of the batch
    /// at a time when the scores pass its budget ([`Slicing`]).
    fn forward<B: CubeMatmulOps + AttentionRowsOps>(
        [q, kt, v]: [FloatTensor<B>; 3],
        m: &Masking<B>,
        (compute, out): (FloatDType, FloatDType),
    ) -> ([FloatTensor<B>; 3], FloatTensor<B>, FloatTensor<B>) {
        let q = B::matmul_operand(q, compute);
        let kt = B::matmul_operand(kt, compute);
        let v = B::matmul_operand(v, compute);
        let slice = |[q, kt, v]: [FloatTensor<B>; 3], m: &Masking<B>| {
            let scores = B::matmul_prepared(q, kt, F32);
            let (p, lse) = B::attention_probabilities(scores, m.keep(), m.bias(), m.at(), compute);
            (lse, B::matmul_prepared(p, v, out))
        };
        let prepared = [q, kt, v];
        let Some(slicing) = Slicing::of(&m.keep.shape(), m.slice_bytes) else {
            let (lse, y) = slice(prepared.clone(), m);
            return (prepared, lse, y);
        };
        let (lses, ys): (Vec<_>, Vec<_>) = slicing
            .ranges()
            .map(|range| {
                slice(
                    slicing.cut::<B>(&prepared, &range),
                    &slicing.masking::<B>(m, &range),
                )
            })
            .unzip();
        let y = B::float_cat(ys, slicing.axis);
        (prepared, B::float_cat(lses, 0), y)
    }

    /// One layer's scores cut along their outermost batch axis, so that each slice's
    /// scores in f32 fit the budget (`crate::kernels::TRANSIENT_BYTES` in training): GPT-2 at 16 x 1024 tokens makes `[16, 12,
    /// 1024, 1024]` scores (768 MiB in f32) and, in the backward, the probabilities' f32
    /// gradient beside them: the largest allocations of the update, which CubeCL's pool
    /// sizes every page after. Each slice runs the same kernels on its part of the
    /// batch; the log-sum-exps (one per row, rows in order) and the results are joined.
    struct Slicing {
        /// The axis cut (the first of the batch axes longer than 1).
        axis: usize,
        /// Its length.
        len: usize,
        /// Its positions per slice.
        step: usize,
        /// Score rows per position along the axis.
        rows: usize,
    }

    impl Slicing {
        /// The slicing of scores shaped `scores` within `budget` bytes, `None` when they
        /// fit whole.
        fn of(scores: &[usize], budget: usize) -> Option<Slicing> {
            let r = scores.len();
            let bytes = scores.iter().product::<usize>() * 4;
            let axis = (0..r - 2).find(|&a| scores[a] > 1)?;
            let len = scores[axis];
            let count = bytes.div_ceil(budget.max(1)).min(len);
            (count > 1).then(|| Slicing {
                axis,
                len,
                step: len.div_ceil(count),
                rows: scores[axis + 1..r - 1].iter().product(),
            })
        }

        fn ranges(&self) -> impl Iterator<Item = Range<usize>> + '_ {
            (0..self.len)
                .step_by(self.step)
                .map(|s| s..(s + self.step).min(self.len))
        }

        /// `x`'s part along the axis.
        fn narrow<B: Backend>(&self, x: FloatTensor<B>, range: &Range<usize>) -> FloatTensor<B> {
            let slices: Vec<Slice> = (0..x.shape().num_dims())
                .map(|d| match d == self.axis {
                    true => Slice::from(range.clone()),
                    false => Slice::full(),
                })
                .collect();
            B::float_slice(x, &slices)
        }

        fn cut<B: Backend>(
            &self,
            xs: &[FloatTensor<B>; 3],
            range: &Range<usize>,
        ) -> [FloatTensor<B>; 3] {
            xs.clone().map(|x| self.narrow::<B>(x, range))
        }

        fn masking<B: Backend>(&self, m: &Masking<B>, range: &Range<usize>) -> Masking<B> {
            Masking {
                keep: self.narrow::<B>(m.keep(), range),
                bias: self.narrow::<B>(m.bias(), range),
                ..m.clone()
            }
        }

        /// The log-sum-exps of the slice's rows.
        fn rows<B: Backend>(&self, lse: FloatTensor<B>, range: &Range<usize>) -> FloatTensor<B> {
            let rows = range.start * self.rows..range.end * self.rows;
            B::float_slice(lse, &[Slice::from(rows)])
        }
    }

    /// The mask, bias, scale and fill of the scores, and the bytes of f32 scores above
    /// which they are made a slice at a time ([`Slicing`]).
    #[derive(Debug, Clone)]
    struct Masking<B: Backend> {
        keep: FloatTensor<B>,
        bias: FloatTensor<B>,
        scale: f32,
        fill: f32,
        slice_bytes: usize,
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
            (scale, fill, slice_bytes): (f32, f32, usize),
            precision: (FloatDType, FloatDType),
        ) -> FloatTensor<Self> {
            let m = Masking {
                keep,
                bias,
                scale,
                fill,
                slice_bytes,
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

    /// The gradients `[dq, dkt, dv]` (those `want` asks for) of one slice, from the
    /// prepared operands, the masking, the log-sum-exps and the prepared output gradient
    /// `g`, the scores and the probabilities made again.
    fn gradients<B: CubeMatmulOps + AttentionRowsOps>(
        [q, kt, v]: [FloatTensor<B>; 3],
        m: &Masking<B>,
        lse: FloatTensor<B>,
        g: FloatTensor<B>,
        compute: FloatDType,
        want: [bool; 3],
    ) -> [Option<FloatTensor<B>>; 3] {
        let scores = B::matmul_prepared(q.clone(), kt.clone(), F32);
        let dv = want[2].then(|| {
            let p = B::attention_probabilities_again(
                scores.clone(),
                m.keep(),
                m.bias(),
                lse.clone(),
                m.at(),
                compute,
            );
            let p_t = B::matmul_operand(transpose_last::<B>(p), compute);
            B::matmul_prepared(p_t, g.clone(), F32)
        });
        if !want[0] && !want[1] {
            return [None, None, dv];
        }
        let dp = B::matmul_prepared(g, transpose_last::<B>(v), F32);
        let ds = B::attention_scores_backward(scores, m.keep(), m.bias(), lse, dp, m.at(), compute);
        let dq = want[0].then(|| B::matmul_prepared(ds.clone(), transpose_last::<B>(kt), F32));
        let dkt = want[1].then(|| B::matmul_prepared(transpose_last::<B>(q), ds, F32));
        [dq, dkt, dv]
    }

    impl<B: Backend + CubeMatmulOps + AttentionRowsOps> Backward<B, 3> for AttentionCoreBackward {
        /// The prepared `q`, `kt`, `v`, the masking and the log-sum-exps.
        type State = ([FloatTensor<B>; 3], Masking<B>, FloatTensor<B>);

        fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _: &mut Checkpointer) {
            let nodes = ops.parents;
            let (prepared, m, lse) = ops.state;
            let compute = self.compute;
            let g = B::matmul_operand(grads.consume::<B>(&ops.node), compute);
            let want = [0, 1, 2].map(|i| nodes[i].is_some());
            let found = match Slicing::of(&m.keep.shape(), m.slice_bytes) {
                None => gradients::<B>(prepared, &m, lse, g, compute, want),
                Some(slicing) => {
                    let mut parts: [Vec<FloatTensor<B>>; 3] = Default::default();
                    for range in slicing.ranges() {
                        let found = gradients::<B>(
                            slicing.cut::<B>(&prepared, &range),
                            &slicing.masking::<B>(&m, &range),
                            slicing.rows::<B>(lse.clone(), &range),
                            slicing.narrow::<B>(g.clone(), &range),
                            compute,
                            want,
                        );
                        for (part, d) in parts.iter_mut().zip(found) {
                            part.extend(d);
                        }
                    }
                    parts.map(|p| (!p.is_empty()).then(|| B::float_cat(p, slicing.axis)))
                }
            };
            for (node, d) in nodes.into_iter().zip(found) {
                if let (Some(node), Some(d)) = (node, d) {
                    grads.register::<B>(node.id, d);
                }
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
            (scale, fill, slice_bytes): (f32, f32, usize),
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
                        slice_bytes,
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
                    (scale, fill, slice_bytes),
                    precision,
                )),
            }
        }
    }
}
