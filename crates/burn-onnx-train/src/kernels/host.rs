//! The fused kernels on the CPU's Flex backend: plain Rust over the host buffers, rows in
//! parallel (rayon). Same arithmetic as the `#[cube]` kernels: per row a max, a sum of
//! exponentials and a pick in forward; in backward the exponentials written once straight
//! into the gradient row and scaled in place to `softmax - onehot`, no intermediate
//! `[rows, classes]` tensor. The row loops run on [`fast_math::exp`] through
//! [`simd::vectorized`] (AVX-512 or AVX2): libm's `expf`, one element at a time, was ~9% of
//! a gpt2_tiny step (vocabulary 1024).

use burn::backend::flex::FlexTensor;
use burn::backend::{DType, TensorMetadata};
use burn::tensor::TensorData;
use rayon::prelude::*;

use super::fast_math;
use super::simd::{self, Kernel};

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

/// `(max, sum(exp(x - max)))` of one row, the sum in f64 lanes (a row of 50257 f32 terms
/// summed in order would lose ~1e-5 relative).
struct SoftmaxStats<'a>(&'a [f32]);

impl Kernel for SoftmaxStats<'_> {
    type Output = (f32, f64);
    #[inline(always)]
    fn run(self) -> (f32, f64) {
        let max = simd::max(self.0);
        (max, simd::sum_map_f64(self.0, |x| fast_math::exp(x - max)))
    }
}

/// One row of the gradient, `(softmax(x) - onehot(t)) * g`: the exponentials written into
/// the row once, then scaled in place.
struct GradientRow<'a> {
    out: &'a mut [f32],
    x: &'a [f32],
    target: usize,
    g: f32,
}

impl Kernel for GradientRow<'_> {
    type Output = ();
    #[inline(always)]
    fn run(self) {
        let max = simd::max(self.x);
        for (e, &x) in self.out.iter_mut().zip(self.x) {
            *e = fast_math::exp(x - max);
        }
        let scale = self.g / simd::sum_f64(self.out) as f32;
        self.out.iter_mut().for_each(|o| *o *= scale);
        self.out[self.target] -= self.g;
    }
}

/// Per-row `max + ln(sum exp(x - max)) - x[target]` over the first `classes` columns.
pub fn cross_entropy_forward(logits: FlexTensor, target: FlexTensor, classes: usize) -> FlexTensor {
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
            let (max, sum) = simd::vectorized(SoftmaxStats(&row[..classes]));
            max + (sum as f32).ln() - row[t]
        })
        .collect();
    FlexTensor::from_data(TensorData::new(loss, vec![n]))
}

/// `(softmax(x) - onehot(target)) * grad` per row over its first `classes` columns, 0 in
/// the rest.
pub fn cross_entropy_backward(
    logits: FlexTensor,
    target: FlexTensor,
    grad: FlexTensor,
    classes: usize,
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
        .for_each(|(r, (out, x))| {
            simd::vectorized(GradientRow {
                out: &mut out[..classes],
                x: &x[..classes],
                target: t[r],
                g: g[r],
            })
        });
    FlexTensor::from_data(TensorData::new(dx, vec![n, c]))
}
