//! The fused kernels on the CPU's Flex backend: plain Rust over the host buffers, rows in
//! parallel (rayon). Same arithmetic as the `#[cube]` kernels: per row a max, a sum of
//! exponentials and a pick in forward; in backward the exponentials written once straight
//! into the gradient row and scaled in place to `softmax - onehot`, no intermediate
//! `[rows, classes]` tensor.

use burn::backend::flex::FlexTensor;
use burn::backend::{DType, TensorMetadata};
use burn::tensor::TensorData;
use rayon::prelude::*;

/// The f32 values of a contiguous `[rows, classes]` tensor and its two dimensions.
fn rows(logits: &FlexTensor) -> (FlexTensor, usize, usize) {
    let dims = logits.shape().dims::<2>();
    (logits.to_contiguous(), dims[0], dims[1])
}

/// The targets as indices (any integer dtype).
fn targets(targets: FlexTensor) -> Vec<usize> {
    targets
        .into_data()
        .convert::<i64>()
        .try_into_vec::<i64>()
        .unwrap_or_default()
        .into_iter()
        .map(|t| t as usize)
        .collect()
}

/// Values per block of a row's exponentials (written to a buffer, then summed).
const BLOCK: usize = 256;

/// `out[i] = exp(x[i] - max)` over one block; returns the block's sum in f64 (a row of
/// 50257 f32 terms summed in order would lose ~1e-5 relative). libm's `expf`, not
/// `fast_math::exp`: the polynomial's 2-ulp error in every probability moved AdamW's
/// updates of rarely seen tokens' embeddings by 1.3e-5 between a tensor-parallel and a
/// one-process run (0.5e-5 with `expf`), past `tests/tensor_parallel.rs`' 1e-5.
fn exp_block(x: &[f32], max: f32, out: &mut [f32]) -> f64 {
    out.iter_mut()
        .zip(x)
        .map(|(e, &v)| {
            *e = (v - max).exp();
            f64::from(*e)
        })
        .sum()
}

fn row_max(row: &[f32]) -> f32 {
    row.iter().copied().fold(f32::NEG_INFINITY, f32::max)
}

/// Max and sum of `exp(x - max)` of one row.
fn softmax_stats(row: &[f32]) -> (f32, f32) {
    let max = row_max(row);
    let mut block = [0f32; BLOCK];
    let sum: f64 = row
        .chunks(BLOCK)
        .map(|x| exp_block(x, max, &mut block[..x.len()]))
        .sum();
    (max, sum as f32)
}

/// Per-row `max + ln(sum exp(x - max)) - x[target]`.
pub fn cross_entropy_forward(logits: FlexTensor, target: FlexTensor) -> FlexTensor {
    assert_eq!(
        logits.dtype(),
        DType::F32,
        "fused cross-entropy takes f32 logits"
    );
    let (logits, n, c) = rows(&logits);
    let x: &[f32] = logits.as_slice().expect("contiguous f32");
    let t = targets(target);
    let loss: Vec<f32> = x
        .par_chunks(c)
        .zip(t.par_iter())
        .map(|(row, &t)| {
            let (max, sum) = softmax_stats(row);
            max + sum.ln() - row[t]
        })
        .collect();
    FlexTensor::from_data(TensorData::new(loss, vec![n]))
}

/// `(softmax(x) - onehot(target)) * grad` per row.
pub fn cross_entropy_backward(
    logits: FlexTensor,
    target: FlexTensor,
    grad: FlexTensor,
) -> FlexTensor {
    assert_eq!(
        logits.dtype(),
        DType::F32,
        "fused cross-entropy takes f32 logits"
    );
    let (logits, n, c) = rows(&logits);
    let x: &[f32] = logits.as_slice().expect("contiguous f32");
    let t = targets(target);
    let g = grad
        .into_data()
        .convert::<f32>()
        .try_into_vec::<f32>()
        .unwrap_or_default();
    let mut dx = vec![0f32; n * c];
    dx.par_chunks_mut(c)
        .zip(x.par_chunks(c))
        .enumerate()
        .for_each(|(r, (out, row))| {
            // One pass of exponentials, kept in the gradient row, then scaled in place.
            let max = row_max(row);
            let sum: f64 = row
                .chunks(BLOCK)
                .zip(out.chunks_mut(BLOCK))
                .map(|(x, e)| exp_block(x, max, e))
                .sum();
            let scale = g[r] / sum as f32;
            out.iter_mut().for_each(|o| *o *= scale);
            out[t[r]] -= g[r];
        });
    FlexTensor::from_data(TensorData::new(dx, vec![n, c]))
}
