//! The `#[cube]` kernels behind [`super::layer_norm`], [`super::tanh`] and
//! [`super::gelu_tanh`] on CubeCL devices, f32 (the element-wise ones also f16 and bf16,
//! computing in f32): each op one launch forward and one
//! back (layer norm's backward two, plus one sum of the parameter gradients' partial rows),
//! where Burn's composition launched ~10 kernels forward and ~20 back per layer norm and
//! ~12 each way per GELU (the softmax's are `masked_softmax.rs`'s). A row op runs one cube per row (rows past 65535 spill into the
//! grid's second dimension); an element-wise op one unit per element.

use burn::backend::cubecl::dtype_to_storage_type;
use burn::backend::{DType, Shape, TensorMetadata};
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

use super::cube::{elementwise_grid, reduce_shared};

/// Threads per cube of the row kernels (a power of two: the tree reductions halve it).
const ROW_THREADS: u32 = 256;
/// Threads per cube of the element-wise kernels.
const ELEMWISE_THREADS: u32 = 256;
/// Rows each cube of the layer norm's parameter-gradient kernel sums.
const PARTIAL_ROWS: usize = 64;
/// The most cubes a grid dimension takes on every backend (wgpu's limit).
const MAX_GRID: usize = 65_535;

/// `sqrt(2 / pi)` and the cubic coefficient of GELU's tanh form.
const SQRT_2_OVER_PI: f32 = 0.797_884_6;
const CUBIC: f32 = 0.044_715;

/// The row a cube of a [`row_cubes`] grid works on.
#[cube]
pub(super) fn cube_row() -> usize {
    (CUBE_POS_Y * CUBE_COUNT_X + CUBE_POS_X) as usize
}

/// `tanh(u)` to a few f32 ulp, with no NaN for any argument: an odd Taylor polynomial
/// below |u| = 0.25 (where `1 - 2 / (exp(2u) + 1)` would lose the digits of a small
/// result, as some backends' own `tanh` does), that formula above it, on |u| clamped to
/// 15 (where tanh is 1 in f32).
#[cube]
fn tanh_of(u: f32) -> f32 {
    let a = f32::min(f32::abs(u), 15.0);
    let mut t = 1.0 - 2.0 / (f32::exp(2.0 * a) + 1.0);
    if a < 0.25 {
        let s = a * a;
        // 2/15, -17/315, 62/2835, -1/3.
        let odd = 0.133_333_33f32 + s * (-0.053_968_254f32 + s * 0.021_869_488f32);
        t = a * (1.0f32 + s * (-0.333_333_34f32 + s * odd));
    }
    if u < 0.0 {
        t = -t;
    }
    t
}

/// Sum of `shared[0..threads]` (each unit's share already stored), seen by every unit.
#[cube]
pub(super) fn cube_sum(shared: &mut Shared<[f32]>, value: f32) -> f32 {
    shared[UNIT_POS_X as usize] = value;
    sync_cube();
    reduce_shared::<f32>(shared, false);
    let total = shared[0];
    sync_cube();
    total
}

/// One cube per row: `y = (x - mean) * rstd * scale + bias` (computed in f32, written in
/// `y`'s precision `O`), `stats[row] = [mean, rstd]`.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn layer_norm_forward_kernel<O: Float>(
    x: &Tensor<f32>,
    scale: &Tensor<f32>,
    bias: &Tensor<f32>,
    y: &mut Tensor<O>,
    stats: &mut Tensor<f32>,
    eps: f32,
    #[comptime] threads: u32,
    #[define(O)] _dtype: ElemType,
) {
    let rows = x.shape(0);
    let cols = x.shape(1);
    let row = cube_row();
    if row < rows {
        let base = row * cols;
        let unit = UNIT_POS_X as usize;
        let step = CUBE_DIM_X as usize;
        let n = f32::cast_from(cols);
        let mut shared = Shared::new_slice(threads as usize);
        let mut sum = f32::new(0.0);
        let mut j = unit;
        while j < cols {
            sum += x[base + j];
            j += step;
        }
        let mean = cube_sum(&mut shared, sum) / n;
        let mut squares = f32::new(0.0);
        j = unit;
        while j < cols {
            let d = x[base + j] - mean;
            squares += d * d;
            j += step;
        }
        let rstd = 1.0 / f32::sqrt(cube_sum(&mut shared, squares) / n + eps);
        j = unit;
        while j < cols {
            y[base + j] = O::cast_from((x[base + j] - mean) * rstd * scale[j] + bias[j]);
            j += step;
        }
        if unit == 0 {
            stats[2 * row] = mean;
            stats[2 * row + 1] = rstd;
        }
    }
}

/// One cube per row: `dx = rstd (h - mean(h) - xhat mean(h xhat))` with `h = g * scale`
/// (`g` in any precision `G`, read as f32).
#[cube(launch)]
fn layer_norm_backward_kernel<G: Float>(
    x: &Tensor<f32>,
    scale: &Tensor<f32>,
    stats: &Tensor<f32>,
    g: &Tensor<G>,
    dx: &mut Tensor<f32>,
    #[comptime] threads: u32,
    #[define(G)] _dtype: ElemType,
) {
    let rows = x.shape(0);
    let cols = x.shape(1);
    let row = cube_row();
    if row < rows {
        let base = row * cols;
        let unit = UNIT_POS_X as usize;
        let step = CUBE_DIM_X as usize;
        let n = f32::cast_from(cols);
        let mean = stats[2 * row];
        let rstd = stats[2 * row + 1];
        let mut shared = Shared::new_slice(threads as usize);
        let mut sum_h = f32::new(0.0);
        let mut sum_hx = f32::new(0.0);
        let mut j = unit;
        while j < cols {
            let h = f32::cast_from(g[base + j]) * scale[j];
            sum_h += h;
            sum_hx += h * (x[base + j] - mean) * rstd;
            j += step;
        }
        let a = cube_sum(&mut shared, sum_h) / n;
        let b = cube_sum(&mut shared, sum_hx) / n;
        j = unit;
        while j < cols {
            let xhat = (x[base + j] - mean) * rstd;
            dx[base + j] = rstd * (f32::cast_from(g[base + j]) * scale[j] - a - xhat * b);
            j += step;
        }
    }
}

/// Cube `(c, b)`: for the columns of cube `c`, the sums over rows block `b` of `g * xhat`
/// and of `g`, into row `b` of `partials` (`[blocks, 2 * cols]`: `dscale`'s, then
/// `dbias`'s).
#[cube(launch)]
fn layer_norm_param_grads_kernel<G: Float>(
    x: &Tensor<f32>,
    stats: &Tensor<f32>,
    g: &Tensor<G>,
    partials: &mut Tensor<f32>,
    #[comptime] block_rows: usize,
    #[define(G)] _dtype: ElemType,
) {
    let rows = x.shape(0);
    let cols = x.shape(1);
    let col = (CUBE_POS_X * CUBE_DIM_X + UNIT_POS_X) as usize;
    let block = CUBE_POS_Y as usize;
    if col < cols {
        let mut ds = f32::new(0.0);
        let mut db = f32::new(0.0);
        let mut row = block * block_rows;
        let mut end = row + block_rows;
        if end > rows {
            end = rows;
        }
        while row < end {
            let i = row * cols + col;
            let xhat = (x[i] - stats[2 * row]) * stats[2 * row + 1];
            let gi = f32::cast_from(g[i]);
            ds += gi * xhat;
            db += gi;
            row += 1;
        }
        partials[2 * block * cols + col] = ds;
        partials[(2 * block + 1) * cols + col] = db;
    }
}

/// The element-wise functions: `tanh`, GELU (tanh form), and their backward from the saved
/// tensor (`tanh`'s output, GELU's input).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Pointwise {
    /// `tanh(x)`.
    Tanh,
    /// `g (1 - y^2)` from `y = tanh(x)`.
    TanhBackward,
    /// `0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`.
    GeluTanh,
    /// `g gelu'(x)`.
    GeluTanhBackward,
    /// `x + g`: with a bias, a product's biased output added to the residual `g` it feeds.
    AddResidual,
}

/// `out[i] = f(a[i] (+ bias[i % cols]), g[i])` for the comptime-chosen `f` (`g` unread by
/// the forward ones; `bias`, of the rows' length, read when `with_bias`), computed in f32
/// whatever the precision `F` of `a`, `g` and `out` (and `B` of `bias`).
#[cube(launch)]
fn pointwise_kernel<F: Float, B: Float>(
    a: &Tensor<F>,
    g: &Tensor<F>,
    bias: &Tensor<B>,
    out: &mut Tensor<F>,
    #[comptime] f: Pointwise,
    #[comptime] with_bias: bool,
    #[define(F, B)] _dtypes: [ElemType; 2],
) {
    let i = ABSOLUTE_POS;
    if i < a.len() {
        let mut v = f32::cast_from(a[i]);
        if comptime![with_bias] {
            v += f32::cast_from(bias[i % bias.len()]);
        }
        match comptime![f] {
            Pointwise::Tanh => out[i] = F::cast_from(tanh_of(v)),
            Pointwise::TanhBackward => {
                out[i] = F::cast_from(f32::cast_from(g[i]) * (1.0 - v * v));
            }
            Pointwise::GeluTanh => {
                let t = tanh_of(SQRT_2_OVER_PI * (v + CUBIC * v * v * v));
                out[i] = F::cast_from(0.5 * v * (1.0 + t));
            }
            Pointwise::GeluTanhBackward => {
                let t = tanh_of(SQRT_2_OVER_PI * (v + CUBIC * v * v * v));
                let slope = SQRT_2_OVER_PI * (1.0 + 3.0 * CUBIC * v * v);
                let d = 0.5 * (1.0 + t) + 0.5 * v * (1.0 - t * t) * slope;
                out[i] = F::cast_from(f32::cast_from(g[i]) * d);
            }
            Pointwise::AddResidual => out[i] = F::cast_from(v + f32::cast_from(g[i])),
        }
    }
}

/// A grid of one cube per row.
pub(super) fn row_cubes(rows: usize) -> CubeCount {
    let x = rows.clamp(1, MAX_GRID);
    CubeCount::Static(x as u32, rows.div_ceil(x).max(1) as u32, 1)
}

/// A fresh contiguous tensor shaped `shape` on `like`'s device, of its dtype.
fn empty_like(like: &CubeTensor, shape: Shape) -> CubeTensor {
    empty_device_contiguous_dtype(like.client.clone(), like.device.clone(), shape, like.dtype)
}

fn rows_cols(x: &CubeTensor) -> (usize, usize) {
    let dims = x.shape().dims::<2>();
    (dims[0], dims[1])
}

/// Layer norm of the rows of `[rows, cols]` `x` (f32): the output in `out` (f32 or a low
/// precision) and `[rows, 2]` f32 statistics.
pub fn layer_norm_forward(
    x: CubeTensor,
    scale: CubeTensor,
    bias: CubeTensor,
    eps: f32,
    out: DType,
) -> (CubeTensor, CubeTensor) {
    let (x, scale, bias) = (
        into_contiguous(x),
        into_contiguous(scale),
        into_contiguous(bias),
    );
    let (rows, _) = rows_cols(&x);
    let y = empty_device_contiguous_dtype(x.client.clone(), x.device.clone(), x.shape(), out);
    let stats = empty_like(&x, Shape::new([rows, 2]));
    layer_norm_forward_kernel::launch(
        &x.client.clone(),
        row_cubes(rows),
        CubeDim::new_1d(ROW_THREADS),
        x.into_tensor_arg(),
        scale.into_tensor_arg(),
        bias.into_tensor_arg(),
        y.clone().into_tensor_arg(),
        stats.clone().into_tensor_arg(),
        eps,
        ROW_THREADS,
        dtype_to_storage_type(out),
    );
    (y, stats)
}

/// The backward of [`layer_norm_forward`]: `dx`, and `[blocks, 2 * cols]` partial sums
/// over blocks of rows of `dscale` (the first `cols` of a row) and `dbias` (the rest), for
/// the caller to sum over the blocks in one reduction; `g` in the output's precision, the
/// rest f32.
pub fn layer_norm_backward(
    x: CubeTensor,
    scale: CubeTensor,
    stats: CubeTensor,
    g: CubeTensor,
) -> (CubeTensor, CubeTensor) {
    let (x, scale, stats, g) = (
        into_contiguous(x),
        into_contiguous(scale),
        into_contiguous(stats),
        into_contiguous(g),
    );
    let (rows, cols) = rows_cols(&x);
    let client = x.client.clone();
    let dx = empty_like(&x, x.shape());
    let g_dtype = dtype_to_storage_type(g.dtype);
    layer_norm_backward_kernel::launch(
        &client,
        row_cubes(rows),
        CubeDim::new_1d(ROW_THREADS),
        x.clone().into_tensor_arg(),
        scale.into_tensor_arg(),
        stats.clone().into_tensor_arg(),
        g.clone().into_tensor_arg(),
        dx.clone().into_tensor_arg(),
        ROW_THREADS,
        g_dtype,
    );
    let blocks = rows.div_ceil(PARTIAL_ROWS).max(1);
    let partials = empty_like(&x, Shape::new([blocks, 2 * cols]));
    let threads = ELEMWISE_THREADS as usize;
    layer_norm_param_grads_kernel::launch(
        &client,
        CubeCount::Static(cols.div_ceil(threads).max(1) as u32, blocks as u32, 1),
        CubeDim::new_1d(ELEMWISE_THREADS),
        x.into_tensor_arg(),
        stats.into_tensor_arg(),
        g.into_tensor_arg(),
        partials.clone().into_tensor_arg(),
        PARTIAL_ROWS,
        g_dtype,
    );
    (dx, partials)
}

/// `f` over every element of `a` (and `g`, for a backward).
pub fn pointwise(a: CubeTensor, g: Option<CubeTensor>, f: Pointwise) -> CubeTensor {
    pointwise_biased(a, None, g, f)
}

/// [`pointwise`] of `a` plus `bias` (as long as `a`'s rows, added to each) when given; the
/// result (and `g`) in `a`'s precision, `bias` in any.
pub fn pointwise_biased(
    a: CubeTensor,
    bias: Option<CubeTensor>,
    g: Option<CubeTensor>,
    f: Pointwise,
) -> CubeTensor {
    let a = into_contiguous(a);
    let g = g.map(into_contiguous).unwrap_or_else(|| a.clone());
    assert_eq!(
        g.dtype, a.dtype,
        "a pointwise backward takes its gradient in its input's precision"
    );
    let with_bias = bias.is_some();
    let bias = bias.map(into_contiguous).unwrap_or_else(|| a.clone());
    let client = a.client.clone();
    let out = empty_like(&a, a.shape());
    let (count, dim) = elementwise_grid(&client, a.shape().num_elements());
    let dtypes = [
        dtype_to_storage_type(a.dtype),
        dtype_to_storage_type(bias.dtype),
    ];
    pointwise_kernel::launch(
        &client,
        count,
        dim,
        a.into_tensor_arg(),
        g.into_tensor_arg(),
        bias.into_tensor_arg(),
        out.clone().into_tensor_arg(),
        f,
        with_bias,
        dtypes,
    );
    out
}
