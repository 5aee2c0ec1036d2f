//! 2-D max pooling (f32) on the CPU with its own backward: planes in parallel, each
//! window's valid rows and columns worked out once per call instead of per element, the
//! whole windows of an output row scanned together (independent compares instead of one
//! dependent chain per window), and no index tensor: the backward finds each window's
//! maximum again (the first one in scan order, NaN winning, as PyTorch and Burn pick it)
//! and adds the gradient there (the forward keeps only the values, no indices). Other
//! dtypes and CubeCL devices use Burn's `max_pool2d`, the reference the tests hold this to.

use burn::backend::autodiff::Autodiff;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::flex::{Flex, FlexTensor};
use burn::backend::tensor::FloatTensor;
use burn::backend::{AutodiffBackend, Backend, TensorMetadata, backend_extension};
use burn::tensor::module::max_pool2d as burn_max_pool2d;
use burn::tensor::ops::MaxPoolOptions;
use burn::tensor::{DType, Tensor, TensorData};
use rayon::prelude::*;

use super::runs_cubecl;
use super::simd::{self, Kernel};
use crate::value::unary_op::unary;

/// Max pooling of `x` `[N, C, H, W]`.
pub fn max_pool2d(x: Tensor<4>, options: MaxPoolOptions<2>) -> Tensor<4> {
    if x.dtype() != DType::F32 || runs_cubecl(&x.device()) {
        return burn_max_pool2d(x, options);
    }
    Tensor::from_dispatch(<burn::backend::Dispatch as PoolOps>::max_pool2d_fused(
        x.into_dispatch(),
        options,
    ))
}

/// The pooling as a backend extension (Flex, and Autodiff over it).
#[backend_extension(Flex, Autodiff)]
pub trait PoolOps: Backend {
    /// Max pooling.
    fn max_pool2d_fused(x: FloatTensor<Self>, options: MaxPoolOptions<2>) -> FloatTensor<Self>;
    /// The gradient of `x` from the output's gradient `grad`.
    fn max_pool2d_fused_backward(
        x: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        options: MaxPoolOptions<2>,
    ) -> FloatTensor<Self>;
}

/// The input rows (or columns) each output row (column) reads along one axis.
struct Axis {
    /// Per output position: the first input index and how many valid taps it reads.
    windows: Vec<(usize, usize)>,
    kernel: usize,
    stride: usize,
    dilation: usize,
}

impl Axis {
    /// Output size as ONNX and PyTorch define it: with `ceil_mode` a last partial window
    /// is kept unless it would start in the end padding.
    fn new(
        input: usize,
        kernel: usize,
        pad: (usize, usize),
        stride: usize,
        dilation: usize,
        ceil: bool,
    ) -> Self {
        let span = dilation * (kernel - 1) + 1;
        let padded = input + pad.0 + pad.1;
        let out = if padded < span {
            0
        } else if ceil {
            let out = (padded - span).div_ceil(stride) + 1;
            if (out - 1) * stride >= input + pad.0 {
                out - 1
            } else {
                out
            }
        } else {
            (padded - span) / stride + 1
        };
        let windows = (0..out)
            .map(|o| {
                // Taps t with 0 <= o * stride + t * dilation - pad.0 < input.
                let origin = o * stride;
                let first = pad.0.saturating_sub(origin).div_ceil(dilation).min(kernel);
                let end = (input + pad.0)
                    .saturating_sub(origin)
                    .div_ceil(dilation)
                    .clamp(first, kernel);
                let start = (origin + first * dilation).saturating_sub(pad.0);
                (start, end - first)
            })
            .collect();
        Axis {
            windows,
            kernel,
            stride,
            dilation,
        }
    }

    fn len(&self) -> usize {
        self.windows.len()
    }
}

/// The output geometry of one pooling call.
struct Pooling {
    rows: Axis,
    cols: Axis,
    /// Input plane height and width.
    plane: [usize; 2],
}

impl Pooling {
    fn new(shape: &[usize], o: &MaxPoolOptions<2>) -> Self {
        let axis = |i: usize| {
            Axis::new(
                shape[2 + i],
                o.kernel_size[i],
                o.padding[i],
                o.stride[i],
                o.dilation[i],
                o.ceil_mode,
            )
        };
        Pooling {
            rows: axis(0),
            cols: axis(1),
            plane: [shape[2], shape[3]],
        }
    }

    /// The input index of every window's maximum over one plane, in output order (`None`
    /// for a window with no valid tap, whose output is -inf). Per output row, the columns
    /// whose windows are whole run tap by tap across the row, so consecutive outputs are
    /// independent work (a window at a time is one long chain of dependent compares); the
    /// clipped windows at the edges go one by one. Both visit a window's taps in scan
    /// order, so they pick the same maximum.
    #[inline(always)]
    fn argmax(&self, x: &[f32], at: &mut Vec<Option<usize>>) {
        at.clear();
        self.scan::<true>(x, at, &mut []);
    }

    /// Every window's maximum over one plane into `y` (output order; -inf for a window
    /// with no valid tap): the values at [`Self::argmax`]'s picks, without tracking where
    /// they are (the forward needs only the values).
    #[inline(always)]
    fn max(&self, x: &[f32], y: &mut [f32]) {
        self.scan::<false>(x, &mut Vec::new(), y);
    }

    /// The scan behind [`Self::argmax`] (`TRACK`: indices pushed onto `at`) and
    /// [`Self::max`] (values written to `y`).
    #[inline(always)]
    fn scan<const TRACK: bool>(&self, x: &[f32], at: &mut Vec<Option<usize>>, y: &mut [f32]) {
        let w = self.plane[1];
        let (dy, dx, stride) = (self.rows.dilation * w, self.cols.dilation, self.cols.stride);
        let kernel = self.cols.kernel;
        let cols = self.cols.len();
        // The whole windows: a contiguous run of columns, each `stride` after the one before.
        let whole = |ox: &usize| self.cols.windows[*ox].1 == kernel;
        let lo = (0..cols).find(whole).unwrap_or(0);
        let hi = (lo..cols).rfind(whole).map_or(lo, |l| l + 1);
        let n = hi - lo;
        let (mut best, mut tap, mut vals) = (vec![0f32; n], vec![0u32; n], vec![0f32; n]);
        // Per tap of a window (scan order), its offset from the window's first tap.
        let mut offsets = Vec::with_capacity(self.rows.kernel * kernel);
        for (oy, &(y0, ny)) in self.rows.windows.iter().enumerate() {
            let row = oy * cols;
            for (ox, &(x0, nx)) in self.cols.windows.iter().enumerate() {
                let clipped = ox < lo || ox >= hi || ny == 0;
                let window = clipped.then(|| window_argmax(x, y0 * w + x0, ny, nx, dy, dx));
                if TRACK {
                    at.push(window.flatten());
                } else if let Some(window) = window {
                    y[row + ox] = window.map_or(f32::NEG_INFINITY, |i| x[i]);
                }
            }
            if ny == 0 || n == 0 {
                continue;
            }
            // Tap by tap (scan order) across the row: the tap's values gathered, then
            // compared with every window's best so far at once.
            let first = y0 * w + self.cols.windows[lo].0;
            offsets.clear();
            offsets.extend((0..ny).flat_map(|ty| (0..kernel).map(move |tx| ty * dy + tx * dx)));
            for (t, &offset) in offsets.iter().enumerate() {
                gather_tap(&mut vals, &x[first + offset..], stride);
                if t == 0 {
                    best.copy_from_slice(&vals);
                    tap.fill(0);
                } else if TRACK {
                    tap_max(&mut best, &mut tap, &vals, t as u32);
                } else {
                    value_max(&mut best, &vals);
                }
            }
            if TRACK {
                for (k, (slot, &t)) in at[row + lo..row + hi].iter_mut().zip(&tap).enumerate() {
                    *slot = Some(first + k * stride + offsets[t as usize]);
                }
            } else {
                y[row + lo..row + hi].copy_from_slice(&best);
            }
        }
    }
}

/// `vals[k] = x[k * stride]`. Strides 1 and 2 (SqueezeNet's, ResNet's pools) as plain
/// copies and pair picks, which vectorize; `step_by` compiled to one bounds-checked scalar
/// load per value (~5% of a SqueezeNet step).
#[inline(always)]
fn gather_tap(vals: &mut [f32], x: &[f32], stride: usize) {
    let n = vals.len();
    match stride {
        1 => vals.copy_from_slice(&x[..n]),
        2 if n > 0 => {
            let (body, last) = vals.split_at_mut(n - 1);
            for (v, pair) in body.iter_mut().zip(x[..2 * (n - 1)].chunks_exact(2)) {
                *v = pair[0];
            }
            last[0] = x[2 * (n - 1)];
        }
        _ => {
            for (v, &xv) in vals.iter_mut().zip(x.iter().step_by(stride.max(1))) {
                *v = xv;
            }
        }
    }
}

/// One tap of every whole window in a row: where the tap's value `vals[k]` beats window
/// `k`'s best so far (or is NaN), it becomes the best and `t` its tap. Selects, not
/// branches (`|`, not `||`), so the loop vectorizes.
#[inline(always)]
fn tap_max(best: &mut [f32], tap: &mut [u32], vals: &[f32], t: u32) {
    for ((b, tap), &v) in best.iter_mut().zip(tap.iter_mut()).zip(vals) {
        let take = (v > *b) | v.is_nan();
        *tap = if take { t } else { *tap };
        *b = if take { v } else { *b };
    }
}

/// [`tap_max`] without the taps: `best[k]` becomes `vals[k]` where that is larger or NaN.
#[inline(always)]
fn value_max(best: &mut [f32], vals: &[f32]) {
    for (b, &v) in best.iter_mut().zip(vals) {
        let take = (v > *b) | v.is_nan();
        *b = if take { v } else { *b };
    }
}

/// [`Pooling::argmax`] of one plane, compiled for the widest vector unit.
struct PlaneArgmax<'a> {
    pooling: &'a Pooling,
    x: &'a [f32],
    at: &'a mut Vec<Option<usize>>,
}

impl Kernel for PlaneArgmax<'_> {
    type Output = ();
    #[inline(always)]
    fn run(self) {
        self.pooling.argmax(self.x, self.at);
    }
}

/// [`Pooling::max`] of one plane, compiled for the widest vector unit.
struct PlaneMax<'a> {
    pooling: &'a Pooling,
    x: &'a [f32],
    y: &'a mut [f32],
}

impl Kernel for PlaneMax<'_> {
    type Output = ();
    #[inline(always)]
    fn run(self) {
        self.pooling.max(self.x, self.y);
    }
}

/// The input index of the maximum of one window of `ny` x `nx` taps from `origin` (steps
/// `dy`, `dx`) in scan order: the first maximum, or the last NaN; `None` when empty.
fn window_argmax(
    x: &[f32],
    origin: usize,
    ny: usize,
    nx: usize,
    dy: usize,
    dx: usize,
) -> Option<usize> {
    (ny > 0 && nx > 0).then(|| {
        let (mut at, mut max) = (origin, x[origin]);
        for ty in 0..ny {
            let row = origin + ty * dy;
            // A counted loop: `step_by` divides once per row, which cost more than the
            // comparisons.
            for tap in 0..nx {
                let i = row + tap * dx;
                let v = x[i];
                // Selects, not a branch: which tap wins is data-dependent and a
                // mispredicted branch per tap cost more than the compare.
                let take = v > max || v.is_nan();
                at = if take { i } else { at };
                max = if take { v } else { max };
            }
        }
        at
    })
}

fn plane_sizes(shape: &[usize], p: &Pooling) -> (usize, usize) {
    (shape[2] * shape[3], p.rows.len() * p.cols.len())
}

impl PoolOps for Flex {
    fn max_pool2d_fused(x: FlexTensor, options: MaxPoolOptions<2>) -> FlexTensor {
        let (x, shape) = (x.to_contiguous(), x.shape().to_vec());
        let p = Pooling::new(&shape, &options);
        let (input_plane, output_plane) = plane_sizes(&shape, &p);
        let x: &[f32] = x.as_slice().expect("contiguous f32");
        let mut y = vec![0f32; shape[0] * shape[1] * output_plane];
        if output_plane > 0 {
            y.par_chunks_mut(output_plane)
                .zip(x.par_chunks(input_plane))
                .for_each(|(y, x)| simd::vectorized(PlaneMax { pooling: &p, x, y }));
        }
        let out = vec![shape[0], shape[1], p.rows.len(), p.cols.len()];
        FlexTensor::from_data(TensorData::new(y, out))
    }

    fn max_pool2d_fused_backward(
        x: FlexTensor,
        grad: FlexTensor,
        options: MaxPoolOptions<2>,
    ) -> FlexTensor {
        let (x, shape) = (x.to_contiguous(), x.shape().to_vec());
        let grad = grad.to_contiguous();
        let p = Pooling::new(&shape, &options);
        let (input_plane, output_plane) = plane_sizes(&shape, &p);
        let (x, g): (&[f32], &[f32]) = (
            x.as_slice().expect("contiguous f32"),
            grad.as_slice().expect("contiguous f32"),
        );
        let mut dx = vec![0f32; x.len()];
        if output_plane > 0 {
            dx.par_chunks_mut(input_plane)
                .zip(x.par_chunks(input_plane).zip(g.par_chunks(output_plane)))
                .for_each_init(Vec::new, |at, (dx, (x, g))| {
                    simd::vectorized(PlaneArgmax { pooling: &p, x, at });
                    for (&g, i) in g.iter().zip(at.iter()) {
                        if let Some(i) = *i {
                            dx[i] += g;
                        }
                    }
                });
        }
        FlexTensor::from_data(TensorData::new(dx, shape))
    }
}

impl<B: Backend + PoolOps, C: CheckpointStrategy> PoolOps for Autodiff<B, C> {
    fn max_pool2d_fused(x: FloatTensor<Self>, options: MaxPoolOptions<2>) -> FloatTensor<Self> {
        let forward_options = options.clone();
        unary::<B, C, FloatTensor<B>>(
            x,
            |x| B::max_pool2d_fused(x, forward_options),
            |x, _| x.clone(),
            move |x, g| B::max_pool2d_fused_backward(x, g, options),
        )
    }

    fn max_pool2d_fused_backward(
        x: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        options: MaxPoolOptions<2>,
    ) -> FloatTensor<Self> {
        // Reached through the backward above on the inner backend; as a forward op of its
        // own it is not differentiated again (first-order autodiff).
        Autodiff::<B, C>::from_inner(B::max_pool2d_fused_backward(
            x.into_primitive(),
            grad.into_primitive(),
            options,
        ))
    }
}
