//! Tanh, GELU (tanh form) and softmax (over the last axis) as single f32 ops with their
//! own backward. On the CPU's Flex backend one pass over the host buffer each way, in
//! parallel chunks or rows, with [`super::fast_math`]'s vectorizable `exp` and `tanh`,
//! every chunk's loop through [`super::simd::vectorized`] (AVX-512 or AVX2 where the CPU
//! has them). On CubeCL devices one launch each way (`cube_rows.rs`; the softmax is
//! `masked_softmax.rs`'s kernel without its mask), where Burn's
//! composition launched a dozen. The backward passes use the saved output
//! (`g (1 - y^2)`, `y (g - sum(g y))`) or, for GELU, the saved input. Other dtypes and
//! other axes use Burn's own ops, which are also the reference the tests hold these to.

#[cfg(any(feature = "wgpu", feature = "cuda"))]
use burn::backend::Cube;
use burn::backend::autodiff::Autodiff;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::flex::{Flex, FlexTensor};
use burn::backend::tensor::FloatTensor;
use burn::backend::{AutodiffBackend, Backend, TensorMetadata, backend_extension};
use burn::tensor::activation;
use burn::tensor::{DType, FloatDType, TensorData};
use rayon::prelude::*;

#[cfg(any(feature = "wgpu", feature = "cuda"))]
use super::cube_rows::{self, Pointwise};
use super::fast_math;
#[cfg(any(feature = "wgpu", feature = "cuda"))]
use super::masked_softmax;
use super::simd::{self, Kernel};
use crate::value::unary_op::unary;
use crate::value::{MAX_RANK, PhysTensor};

/// Elements per parallel chunk of an element-wise pass.
const CHUNK: usize = 1 << 14;

fn fused_here(x: &PhysTensor) -> bool {
    x.dtype() == DType::F32
}

/// `tanh(x)`.
pub fn tanh(x: PhysTensor) -> PhysTensor {
    if !fused_here(&x) {
        return x.tanh();
    }
    PhysTensor::from_dispatch(<burn::backend::Dispatch as ActivationOps>::tanh_fused(
        x.into_dispatch(),
    ))
}

/// `0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`.
pub fn gelu_tanh(x: PhysTensor) -> PhysTensor {
    if !fused_here(&x) {
        return activation::gelu_approximate(x);
    }
    PhysTensor::from_dispatch(<burn::backend::Dispatch as ActivationOps>::gelu_tanh_fused(
        x.into_dispatch(),
    ))
}

/// `gelu_tanh(x + bias)`, `bias` broadcast to `x`; one op each way on CubeCL devices when
/// `bias` is as long as `x`'s rows (`gelu_bias.rs`; `x` in f32 or a low precision, the
/// result in `x`'s, `bias` f32), the composition elsewhere.
pub fn gelu_tanh_biased(x: PhysTensor, bias: PhysTensor) -> PhysTensor {
    let (xd, bd) = (x.dims(), bias.dims());
    let row_bias =
        bd[..MAX_RANK - 1].iter().all(|&d| d == 1) && bd[MAX_RANK - 1] == xd[MAX_RANK - 1];
    let any_float = matches!(x.dtype(), DType::F32 | DType::F16 | DType::BF16);
    let fused = row_bias && any_float && fused_here(&bias) && super::runs_cubecl(&x.device());
    if !fused {
        // The composition adds in the bias's precision (an `x` written in a low one by a
        // marked product is cast up; its readers, products, take either).
        let x = if x.dtype() != DType::F32 && bias.dtype() == DType::F32 {
            x.cast(FloatDType::F32)
        } else {
            x
        };
        return gelu_tanh(x + bias);
    }
    #[cfg(any(feature = "wgpu", feature = "cuda"))]
    return PhysTensor::from_dispatch(
        <burn::backend::Dispatch as super::gelu_bias::GeluBiasOps>::gelu_tanh_biased(
            x.into_dispatch(),
            bias.into_dispatch(),
        ),
    );
    #[cfg(not(any(feature = "wgpu", feature = "cuda")))]
    unreachable!("no CubeCL device in this build")
}

/// `softmax(x)` along physical axis `dim`.
pub fn softmax(x: PhysTensor, dim: usize) -> PhysTensor {
    if !fused_here(&x) || dim != MAX_RANK - 1 {
        return activation::softmax(x, dim);
    }
    PhysTensor::from_dispatch(<burn::backend::Dispatch as ActivationOps>::softmax_rows(
        x.into_dispatch(),
    ))
}

/// The fused ops as a backend extension (CubeCL, Flex, and Autodiff over them).
#[backend_extension(Cube: cfg(any(feature = "wgpu", feature = "cuda")), Flex, Autodiff)]
pub trait ActivationOps: Backend {
    /// `tanh(x)`.
    fn tanh_fused(x: FloatTensor<Self>) -> FloatTensor<Self>;
    /// `g (1 - y^2)` for `y = tanh(x)`.
    fn tanh_fused_backward(y: FloatTensor<Self>, g: FloatTensor<Self>) -> FloatTensor<Self>;
    /// GELU, tanh form.
    fn gelu_tanh_fused(x: FloatTensor<Self>) -> FloatTensor<Self>;
    /// `g * gelu'(x)`.
    fn gelu_tanh_fused_backward(x: FloatTensor<Self>, g: FloatTensor<Self>) -> FloatTensor<Self>;
    /// Softmax of every row (last axis).
    fn softmax_rows(x: FloatTensor<Self>) -> FloatTensor<Self>;
    /// `y (g - sum(g y))` per row for `y = softmax(x)`.
    fn softmax_rows_backward(y: FloatTensor<Self>, g: FloatTensor<Self>) -> FloatTensor<Self>;
}

/// A contiguous f32 copy (or view) of `t`, its values and shape.
fn host(t: &FlexTensor) -> (FlexTensor, Vec<usize>) {
    (t.to_contiguous(), t.shape().to_vec())
}

fn output(values: Vec<f32>, shape: Vec<usize>) -> FlexTensor {
    FlexTensor::from_data(TensorData::new(values, shape))
}

/// `y[i] = f(x[i])` over one chunk.
struct MapChunk<'a, F>(&'a mut [f32], &'a [f32], &'a F);

impl<F: Fn(f32) -> f32> Kernel for MapChunk<'_, F> {
    type Output = ();
    #[inline(always)]
    fn run(self) {
        let MapChunk(y, x, f) = self;
        for (y, &x) in y.iter_mut().zip(x) {
            *y = f(x);
        }
    }
}

/// `out[i] = f(a[i], g[i])` over one chunk.
struct Map2Chunk<'a, F>(&'a mut [f32], &'a [f32], &'a [f32], &'a F);

impl<F: Fn(f32, f32) -> f32> Kernel for Map2Chunk<'_, F> {
    type Output = ();
    #[inline(always)]
    fn run(self) {
        let Map2Chunk(out, a, g, f) = self;
        for ((o, &a), &g) in out.iter_mut().zip(a).zip(g) {
            *o = f(a, g);
        }
    }
}

/// `f` (an `#[inline(always)]` fn) over every element of `x` in parallel chunks.
fn map<F: Fn(f32) -> f32 + Sync>(x: &FlexTensor, f: F) -> FlexTensor {
    let (x, shape) = host(x);
    let x: &[f32] = x.as_slice().expect("contiguous f32");
    let mut y = vec![0f32; x.len()];
    y.par_chunks_mut(CHUNK)
        .zip(x.par_chunks(CHUNK))
        .for_each(|(y, x)| simd::vectorized(MapChunk(y, x, &f)));
    output(y, shape)
}

/// `f(a, g)` (an `#[inline(always)]` fn) over every element pair in parallel chunks.
fn map2<F: Fn(f32, f32) -> f32 + Sync>(a: &FlexTensor, g: &FlexTensor, f: F) -> FlexTensor {
    let ((a, shape), (g, _)) = (host(a), host(g));
    let (a, g): (&[f32], &[f32]) = (
        a.as_slice().expect("contiguous f32"),
        g.as_slice().expect("contiguous f32"),
    );
    let mut out = vec![0f32; a.len()];
    out.par_chunks_mut(CHUNK)
        .zip(a.par_chunks(CHUNK).zip(g.par_chunks(CHUNK)))
        .for_each(|(out, (a, g))| simd::vectorized(Map2Chunk(out, a, g, &f)));
    output(out, shape)
}

const SQRT_2_OVER_PI: f32 = 0.797_884_6;
const CUBIC: f32 = 0.044_715;

#[inline(always)]
fn tanh_grad(y: f32, g: f32) -> f32 {
    g * (1.0 - y * y)
}

#[inline(always)]
fn gelu_tanh_at(x: f32) -> f32 {
    0.5 * x * (1.0 + fast_math::tanh(SQRT_2_OVER_PI * (x + CUBIC * x * x * x)))
}

#[inline(always)]
fn gelu_tanh_grad(x: f32, g: f32) -> f32 {
    let t = fast_math::tanh(SQRT_2_OVER_PI * (x + CUBIC * x * x * x));
    g * (0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * SQRT_2_OVER_PI * (1.0 + 3.0 * CUBIC * x * x))
}

/// `y = softmax(x)` of one row.
struct SoftmaxRow<'a>(&'a mut [f32], &'a [f32]);

impl Kernel for SoftmaxRow<'_> {
    type Output = ();
    #[inline(always)]
    fn run(self) {
        let SoftmaxRow(y, x) = self;
        let max = simd::max(x);
        for (y, &x) in y.iter_mut().zip(x) {
            *y = fast_math::exp(x - max);
        }
        let scale = (1.0 / simd::sum_f64(y)) as f32;
        y.iter_mut().for_each(|y| *y *= scale);
    }
}

/// `dx = y (g - sum(g y))` of one row.
struct SoftmaxRowBackward<'a>(&'a mut [f32], &'a [f32], &'a [f32]);

impl Kernel for SoftmaxRowBackward<'_> {
    type Output = ();
    #[inline(always)]
    fn run(self) {
        let SoftmaxRowBackward(dx, y, g) = self;
        let dot = simd::dot_f64(y, g) as f32;
        for ((dx, &y), &g) in dx.iter_mut().zip(y).zip(g) {
            *dx = y * (g - dot);
        }
    }
}

impl ActivationOps for Flex {
    fn tanh_fused(x: FloatTensor<Self>) -> FloatTensor<Self> {
        map(&x, fast_math::tanh)
    }

    fn tanh_fused_backward(y: FloatTensor<Self>, g: FloatTensor<Self>) -> FloatTensor<Self> {
        map2(&y, &g, tanh_grad)
    }

    fn gelu_tanh_fused(x: FloatTensor<Self>) -> FloatTensor<Self> {
        map(&x, gelu_tanh_at)
    }

    fn gelu_tanh_fused_backward(x: FloatTensor<Self>, g: FloatTensor<Self>) -> FloatTensor<Self> {
        map2(&x, &g, gelu_tanh_grad)
    }

    fn softmax_rows(x: FloatTensor<Self>) -> FloatTensor<Self> {
        let (x, shape) = host(&x);
        let x: &[f32] = x.as_slice().expect("contiguous f32");
        let cols = shape.last().copied().unwrap_or(1).max(1);
        let mut y = vec![0f32; x.len()];
        y.par_chunks_mut(cols)
            .zip(x.par_chunks(cols))
            .for_each(|(y, x)| simd::vectorized(SoftmaxRow(y, x)));
        output(y, shape)
    }

    fn softmax_rows_backward(y: FloatTensor<Self>, g: FloatTensor<Self>) -> FloatTensor<Self> {
        let ((y, shape), (g, _)) = (host(&y), host(&g));
        let (y, g): (&[f32], &[f32]) = (
            y.as_slice().expect("contiguous f32"),
            g.as_slice().expect("contiguous f32"),
        );
        let cols = shape.last().copied().unwrap_or(1).max(1);
        let mut dx = vec![0f32; y.len()];
        dx.par_chunks_mut(cols)
            .zip(y.par_chunks(cols).zip(g.par_chunks(cols)))
            .for_each(|(dx, (y, g))| simd::vectorized(SoftmaxRowBackward(dx, y, g)));
        output(dx, shape)
    }
}

#[cfg(any(feature = "wgpu", feature = "cuda"))]
impl ActivationOps for Cube {
    fn tanh_fused(x: FloatTensor<Self>) -> FloatTensor<Self> {
        cube_rows::pointwise(x, None, Pointwise::Tanh)
    }

    fn tanh_fused_backward(y: FloatTensor<Self>, g: FloatTensor<Self>) -> FloatTensor<Self> {
        cube_rows::pointwise(y, Some(g), Pointwise::TanhBackward)
    }

    fn gelu_tanh_fused(x: FloatTensor<Self>) -> FloatTensor<Self> {
        cube_rows::pointwise(x, None, Pointwise::GeluTanh)
    }

    fn gelu_tanh_fused_backward(x: FloatTensor<Self>, g: FloatTensor<Self>) -> FloatTensor<Self> {
        cube_rows::pointwise(x, Some(g), Pointwise::GeluTanhBackward)
    }

    fn softmax_rows(x: FloatTensor<Self>) -> FloatTensor<Self> {
        masked_softmax::cube::softmax_forward(x, None)
    }

    fn softmax_rows_backward(y: FloatTensor<Self>, g: FloatTensor<Self>) -> FloatTensor<Self> {
        masked_softmax::cube::softmax_backward(y, g, None)
    }
}

/// What an op's backward keeps from its forward.
#[derive(Debug, Clone, Copy)]
enum Saved {
    Input,
    Output,
}

/// `forward(x)` under autodiff, differentiated by `backward` from the `saved` tensor.
fn tracked<B: Backend, C: CheckpointStrategy>(
    x: FloatTensor<Autodiff<B, C>>,
    forward: fn(FloatTensor<B>) -> FloatTensor<B>,
    backward: fn(FloatTensor<B>, FloatTensor<B>) -> FloatTensor<B>,
    saved: Saved,
) -> FloatTensor<Autodiff<B, C>> {
    let keep = move |input: &FloatTensor<B>, output: &FloatTensor<B>| match saved {
        Saved::Input => input.clone(),
        Saved::Output => output.clone(),
    };
    unary::<B, C, FloatTensor<B>>(x, forward, keep, backward)
}

/// A backward function called as an op of its own: it runs on the inner backend and is not
/// differentiated again (first-order autodiff).
fn untracked<B: Backend, C: CheckpointStrategy>(
    a: FloatTensor<Autodiff<B, C>>,
    g: FloatTensor<Autodiff<B, C>>,
    f: fn(FloatTensor<B>, FloatTensor<B>) -> FloatTensor<B>,
) -> FloatTensor<Autodiff<B, C>> {
    Autodiff::<B, C>::from_inner(f(a.into_primitive(), g.into_primitive()))
}

impl<B: Backend + ActivationOps, C: CheckpointStrategy> ActivationOps for Autodiff<B, C> {
    fn tanh_fused(x: FloatTensor<Self>) -> FloatTensor<Self> {
        tracked::<B, C>(x, B::tanh_fused, B::tanh_fused_backward, Saved::Output)
    }

    fn tanh_fused_backward(y: FloatTensor<Self>, g: FloatTensor<Self>) -> FloatTensor<Self> {
        untracked::<B, C>(y, g, B::tanh_fused_backward)
    }

    fn gelu_tanh_fused(x: FloatTensor<Self>) -> FloatTensor<Self> {
        tracked::<B, C>(
            x,
            B::gelu_tanh_fused,
            B::gelu_tanh_fused_backward,
            Saved::Input,
        )
    }

    fn gelu_tanh_fused_backward(x: FloatTensor<Self>, g: FloatTensor<Self>) -> FloatTensor<Self> {
        untracked::<B, C>(x, g, B::gelu_tanh_fused_backward)
    }

    fn softmax_rows(x: FloatTensor<Self>) -> FloatTensor<Self> {
        tracked::<B, C>(x, B::softmax_rows, B::softmax_rows_backward, Saved::Output)
    }

    fn softmax_rows_backward(y: FloatTensor<Self>, g: FloatTensor<Self>) -> FloatTensor<Self> {
        untracked::<B, C>(y, g, B::softmax_rows_backward)
    }
}
