//! The rows of the attention core's softmax on CubeCL devices, as `attention_core.rs`
//! needs them, each `[.., t, s]` tensor written once, in the precision of the product that
//! reads it (the products' operands are f16/bf16 under autocast; the softmax computes in
//! f32 either way):
//!
//! - forward: the probabilities and each row's log-sum-exp (`masked_softmax.rs`'s kernel);
//! - backward, for `dv = p^T g`: the probabilities again from the scores and the
//!   log-sum-exp, one element-wise pass (`exp(z - lse)`: no row reductions);
//! - backward, for `dq` and `dkt`: the scores' gradient `keep ? scale p (dp - sum(p dp)) :
//!   0` from the scores, the log-sum-exp and `dp`, the probabilities made in registers.
//!
//! Where the softmax wrote f32 probabilities that a cast then copied to the products'
//! precision (forward, and again for `dv`), kept f32 probabilities for its backward and
//! wrote an f32 gradient that a cast copied again, this moves 42 bytes a score under
//! autocast instead of 66, in three launches fewer a layer.

use burn::backend::AutodiffBackend;
use burn::backend::Cube;
use burn::backend::autodiff::Autodiff;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::cubecl::dtype_to_storage_type;
use burn::backend::tensor::FloatTensor;
use burn::backend::{Backend, DType, TensorMetadata, backend_extension};
use burn::tensor::FloatDType;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

use super::cube::elementwise_grid;
use super::cube_rows::{cube_row, cube_sum, row_cubes};
use super::masked_softmax::cube::{Masking, masked_score, row_offset, rows, softmax_forward_in};

/// Threads per cube of the row kernel (a power of two: the tree reductions halve it).
const ROW_THREADS: u32 = 256;

/// The rows as a backend extension (CubeCL, and Autodiff over it, untracked: the attention
/// core's own forward and backward are their only callers). `keep` and `bias` have the
/// scores' shape (broadcast strides); `lse` is `[rows]`, f32; `out` the precision written.
#[backend_extension(Cube, Autodiff)]
pub trait AttentionRowsOps: Backend {
    /// `(softmax(masked_score(x)) in out, lse)`.
    fn attention_probabilities(
        x: FloatTensor<Self>,
        keep: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        masking: (f32, f32),
        out: FloatDType,
    ) -> (FloatTensor<Self>, FloatTensor<Self>);
    /// `exp(masked_score(x) - lse)` in `out`.
    fn attention_probabilities_again(
        x: FloatTensor<Self>,
        keep: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        masking: (f32, f32),
        out: FloatDType,
    ) -> FloatTensor<Self>;
    /// `keep ? scale p (dp - sum(p dp)) : 0` per row, `p = exp(masked_score(x) - lse)`,
    /// in `out`.
    fn attention_scores_backward(
        x: FloatTensor<Self>,
        keep: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        dp: FloatTensor<Self>,
        masking: (f32, f32),
        out: FloatDType,
    ) -> FloatTensor<Self>;
}

/// A score's probability from its row's log-sum-exp.
#[cube]
fn probability(x: f32, keep: f32, bias: f32, lse: f32, scale: f32, fill: f32) -> f32 {
    f32::exp(masked_score(x, keep, bias, scale, fill) - lse)
}

/// One unit per score of the contiguous `x`: `p = exp(masked_score(x) - lse[row])`.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn probabilities_again_kernel<O: Float>(
    x: &Tensor<f32>,
    keep: &Tensor<f32>,
    bias: &Tensor<f32>,
    lse: &Tensor<f32>,
    p: &mut Tensor<O>,
    scale: f32,
    fill: f32,
    #[define(O)] _dtype: ElemType,
) {
    let i = ABSOLUTE_POS;
    if i < x.len() {
        let last = x.rank() - 1;
        let cols = x.shape(last);
        let (row, col) = (i / cols, i % cols);
        let k = row_offset(keep, x, row) + col * keep.stride(last);
        let b = row_offset(bias, x, row) + col * bias.stride(last);
        let z = probability(x[i], keep[k], bias[b], lse[row], scale, fill);
        p[i] = O::cast_from(z);
    }
}

/// One cube per row of the contiguous `x` and `dp`: `ds = keep ? scale p (dp - sum(p dp))
/// : 0`, `p` made from `lse`.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn scores_backward_kernel<O: Float>(
    x: &Tensor<f32>,
    keep: &Tensor<f32>,
    bias: &Tensor<f32>,
    lse: &Tensor<f32>,
    dp: &Tensor<f32>,
    ds: &mut Tensor<O>,
    scale: f32,
    fill: f32,
    #[comptime] threads: u32,
    #[define(O)] _dtype: ElemType,
) {
    let last = x.rank() - 1;
    let cols = x.shape(last);
    let rows = x.len() / cols;
    let row = cube_row();
    if row < rows {
        let base = row * cols;
        let (kbase, bbase) = (row_offset(keep, x, row), row_offset(bias, x, row));
        let (kstep, bstep) = (keep.stride(last), bias.stride(last));
        let row_lse = lse[row];
        let mut shared = Shared::new_slice(threads as usize);
        let mut dot = f32::new(0.0);
        let mut j = UNIT_POS_X as usize;
        while j < cols {
            let (i, k, b) = (base + j, kbase + j * kstep, bbase + j * bstep);
            dot += probability(x[i], keep[k], bias[b], row_lse, scale, fill) * dp[i];
            j += CUBE_DIM_X as usize;
        }
        let dot = cube_sum(&mut shared, dot);
        j = UNIT_POS_X as usize;
        while j < cols {
            let (i, k, b) = (base + j, kbase + j * kstep, bbase + j * bstep);
            let p = probability(x[i], keep[k], bias[b], row_lse, scale, fill);
            let mut d = scale * p * (dp[i] - dot);
            if keep[k] == 0.0 {
                d = f32::new(0.0);
            }
            ds[i] = O::cast_from(d);
            j += CUBE_DIM_X as usize;
        }
    }
}

/// A fresh contiguous tensor of `like`'s shape in `dtype`.
fn empty_in(like: &CubeTensor, dtype: DType) -> CubeTensor {
    empty_device_contiguous_dtype(
        like.client.clone(),
        like.device.clone(),
        like.shape(),
        dtype,
    )
}

impl AttentionRowsOps for Cube {
    fn attention_probabilities(
        x: FloatTensor<Self>,
        keep: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        (scale, fill): (f32, f32),
        out: FloatDType,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let masking = Masking {
            keep,
            bias,
            scale,
            fill,
        };
        let (p, lse) = softmax_forward_in(x, Some(masking), out.into(), true);
        (p, lse.expect("asked for the log-sum-exps"))
    }

    fn attention_probabilities_again(
        x: FloatTensor<Self>,
        keep: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        (scale, fill): (f32, f32),
        out: FloatDType,
    ) -> FloatTensor<Self> {
        let x = into_contiguous(x);
        let p = empty_in(&x, out.into());
        let client = x.client.clone();
        let (count, dim) = elementwise_grid(&client, x.shape().num_elements());
        probabilities_again_kernel::launch(
            &client,
            count,
            dim,
            x.into_tensor_arg(),
            keep.into_tensor_arg(),
            bias.into_tensor_arg(),
            lse.into_tensor_arg(),
            p.clone().into_tensor_arg(),
            scale,
            fill,
            dtype_to_storage_type(out.into()),
        );
        p
    }

    fn attention_scores_backward(
        x: FloatTensor<Self>,
        keep: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        dp: FloatTensor<Self>,
        (scale, fill): (f32, f32),
        out: FloatDType,
    ) -> FloatTensor<Self> {
        let (x, dp) = (into_contiguous(x), into_contiguous(dp));
        let ds = empty_in(&x, out.into());
        scores_backward_kernel::launch(
            &x.client.clone(),
            row_cubes(rows(&x)),
            CubeDim::new_1d(ROW_THREADS),
            x.into_tensor_arg(),
            keep.into_tensor_arg(),
            bias.into_tensor_arg(),
            lse.into_tensor_arg(),
            dp.into_tensor_arg(),
            ds.clone().into_tensor_arg(),
            scale,
            fill,
            ROW_THREADS,
            dtype_to_storage_type(out.into()),
        );
        ds
    }
}

impl<B: Backend + AttentionRowsOps, C: CheckpointStrategy> AttentionRowsOps for Autodiff<B, C> {
    fn attention_probabilities(
        x: FloatTensor<Self>,
        keep: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        masking: (f32, f32),
        out: FloatDType,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let (p, lse) = B::attention_probabilities(
            x.into_primitive(),
            keep.into_primitive(),
            bias.into_primitive(),
            masking,
            out,
        );
        (Self::from_inner(p), Self::from_inner(lse))
    }

    fn attention_probabilities_again(
        x: FloatTensor<Self>,
        keep: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        masking: (f32, f32),
        out: FloatDType,
    ) -> FloatTensor<Self> {
        Self::from_inner(B::attention_probabilities_again(
            x.into_primitive(),
            keep.into_primitive(),
            bias.into_primitive(),
            lse.into_primitive(),
            masking,
            out,
        ))
    }

    fn attention_scores_backward(
        x: FloatTensor<Self>,
        keep: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        dp: FloatTensor<Self>,
        masking: (f32, f32),
        out: FloatDType,
    ) -> FloatTensor<Self> {
        Self::from_inner(B::attention_scores_backward(
            x.into_primitive(),
            keep.into_primitive(),
            bias.into_primitive(),
            lse.into_primitive(),
            dp.into_primitive(),
            masking,
            out,
        ))
    }
}
