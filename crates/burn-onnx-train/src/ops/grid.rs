//! Sampling grids: `GridSample` (nearest, linear and cubic interpolation over any number of
//! spatial dims; zeros, border and reflection padding) and `AffineGrid` (2-D and 3-D).
//!
//! `GridSample` decides on the host which pixels each output point reads (the grid is
//! downloaded to find the integer corners and the padding rule that applies), then works
//! on the device: the fractional offset of each point from its base corner is recomputed
//! from the grid tensor as `grid * a + b`, with `a` and `b` the host's per-point affine map
//! (denormalisation, then the border clamp or reflection that applied, then minus the
//! corner), so the interpolation weights, and through them the output, are differentiable
//! with respect to the grid as well as `X` (gathered with a row `select`). Nearest mode has
//! no gradient with respect to the grid. Linear and nearest modes move an out-of-range
//! coordinate into range by the padding rule before interpolating; cubic mode applies the
//! padding to each of its taps only, as PyTorch and onnxruntime do. `AffineGrid` is a batched matrix product of `theta`
//! with the base grid, differentiable with respect to `theta`.

use burn::tensor::{Tensor, TensorData};

use super::{Inputs, OpContext, OpOutput};
use crate::error::OpResult;
use crate::op_bail;
use crate::value::{FloatValue, PhysTensor, Value, int_tensor_1d, padded};

/// Zeros of a logical shape as a float value (zero-size shapes included).
fn zeros(ctx: &OpContext, shape: &[usize]) -> OpResult<FloatValue> {
    Ok(FloatValue::new(
        PhysTensor::zeros(padded(shape)?, ctx.device),
        shape.len(),
    ))
}

/// Keys' cubic convolution parameter (PyTorch's and onnxruntime's `bicubic`).
const CUBIC_A: f32 = -0.75;

#[derive(Clone, Copy, PartialEq)]
enum Interp {
    Nearest,
    Linear,
    Cubic,
}

#[derive(Clone, Copy, PartialEq)]
enum Padding {
    Zeros,
    Border,
    Reflection,
}

/// One spatial axis of `X`: its length, the valid coordinate range, and the map from a
/// normalised grid coordinate `g` to a pixel coordinate, `g * scale + shift`.
struct SpatialAxis {
    len: usize,
    lo: f64,
    hi: f64,
    scale: f64,
    shift: f64,
}

impl SpatialAxis {
    fn new(len: usize, align_corners: bool) -> Self {
        let l = len as f64;
        let (lo, hi, scale) = if align_corners {
            (0.0, l - 1.0, (l - 1.0) / 2.0)
        } else {
            (-0.5, l - 0.5, l / 2.0)
        };
        SpatialAxis {
            len,
            lo,
            hi,
            scale,
            shift: (l - 1.0) / 2.0,
        }
    }

    /// The pixel index that integer position `i` reads, or `None` for a zero.
    fn pixel(&self, i: i64, padding: Padding) -> Option<usize> {
        let last = self.len as i64 - 1;
        match padding {
            Padding::Zeros => (0..=last).contains(&i).then_some(i as usize),
            Padding::Border => Some(i.clamp(0, last) as usize),
            Padding::Reflection => {
                let (s, o) = reflect(i as f64, self.lo, self.hi);
                Some(((s * i as f64 + o) as i64).clamp(0, last) as usize)
            }
        }
    }
}

/// Reflection of `x` into `[lo, hi]` by the nearer border, repeated until inside, as the
/// affine map `(sign, offset)` with `reflected = sign * x + offset`.
fn reflect(x: f64, lo: f64, hi: f64) -> (f64, f64) {
    let range = hi - lo;
    if range <= 0.0 {
        return (0.0, lo);
    }
    if x < lo {
        let n = ((lo - x) / range).floor();
        if n as i64 % 2 == 0 {
            (-1.0, 2.0 * lo - n * range)
        } else {
            (1.0, range + n * range)
        }
    } else if x > hi {
        let n = ((x - hi) / range).floor();
        if n as i64 % 2 == 0 {
            (-1.0, 2.0 * hi + n * range)
        } else {
            (1.0, -range - n * range)
        }
    } else {
        (1.0, 0.0)
    }
}

/// The coordinate after the padding rule (`sign * x + offset`): unchanged inside the valid
/// range, clamped (a constant) or reflected outside it.
fn pad_coordinate(x: f64, axis: &SpatialAxis, padding: Padding) -> (f64, f64) {
    if x >= axis.lo && x <= axis.hi {
        return (1.0, 0.0);
    }
    match padding {
        Padding::Zeros => (1.0, 0.0),
        Padding::Border => (0.0, x.clamp(0.0, axis.len as f64 - 1.0)),
        Padding::Reflection => reflect(x, axis.lo, axis.hi),
    }
}

fn far_cubic(u: Tensor<3>) -> Tensor<3> {
    let a = CUBIC_A;
    u.clone()
        .mul_scalar(a)
        .sub_scalar(5.0 * a)
        .mul(u.clone())
        .add_scalar(8.0 * a)
        .mul(u)
        .sub_scalar(4.0 * a)
}

fn near_cubic(t: Tensor<3>) -> Tensor<3> {
    let a = CUBIC_A;
    t.clone()
        .mul_scalar(a + 2.0)
        .sub_scalar(a + 3.0)
        .mul(t.clone())
        .mul(t)
        .add_scalar(1.0)
}

/// `[N, P, taps]` interpolation weights of one grid component from its fractional offsets
/// `t` (`[N, P, 1]`).
fn tap_weights(t: Tensor<3>, interp: Interp) -> Tensor<3> {
    match interp {
        Interp::Nearest => t.ones_like(),
        Interp::Linear => Tensor::cat(vec![t.clone().neg().add_scalar(1.0), t], 2),
        Interp::Cubic => {
            let w0 = far_cubic(t.clone().add_scalar(1.0));
            let w1 = near_cubic(t.clone());
            let w2 = near_cubic(t.clone().neg().add_scalar(1.0));
            let w3 = far_cubic(t.neg().add_scalar(2.0));
            Tensor::cat(vec![w0, w1, w2, w3], 2)
        }
    }
}

/// `GridSample` (`mode`: bilinear/linear, nearest, bicubic/cubic; `padding_mode`: zeros,
/// border, reflection; `align_corners`), on `X` `[N, C, D1, .., Dk]` and `grid`
/// `[N, O1, .., Ok, k]` (grid components in reverse axis order: x, y, z).
pub fn grid_sample(ctx: &OpContext, mut inputs: Inputs) -> OpResult<OpOutput> {
    let x = inputs.float(0, "X", ctx.device)?;
    let grid = inputs.float(1, "grid", ctx.device)?;
    let default_mode = if ctx.opset >= 20 {
        "linear"
    } else {
        "bilinear"
    };
    let interp = match ctx.attrs.string("mode", default_mode)?.as_str() {
        "nearest" => Interp::Nearest,
        "bilinear" | "linear" => Interp::Linear,
        "bicubic" | "cubic" => Interp::Cubic,
        other => op_bail!("attribute `mode` must be linear, nearest or cubic, got {other:?}"),
    };
    let padding = match ctx.attrs.string("padding_mode", "zeros")?.as_str() {
        "zeros" => Padding::Zeros,
        "border" => Padding::Border,
        "reflection" => Padding::Reflection,
        other => {
            op_bail!("attribute `padding_mode` must be zeros, border or reflection, got {other:?}")
        }
    };
    let align = ctx.attrs.int("align_corners", 0)? != 0;
    let (xs, gs) = (x.shape(), grid.shape());
    if xs.len() < 3 {
        op_bail!("X must be [N, C, D1, ...], got {xs:?}");
    }
    let k = xs.len() - 2;
    if gs.len() != k + 2 || gs[0] != xs[0] || gs[k + 1] != k {
        op_bail!("grid {gs:?} does not match X {xs:?}: it must be [N, O1, .., O{k}, {k}]");
    }
    let (n, c) = (xs[0], xs[1]);
    let dims = &xs[2..];
    let s: usize = dims.iter().product();
    let p: usize = gs[1..=k].iter().product();
    let mut out_shape = vec![n, c];
    out_shape.extend_from_slice(&gs[1..=k]);
    if n * c * p == 0 || s == 0 {
        return Ok(Value::Float(zeros(ctx, &out_shape)?).into());
    }
    // Axis `j` of the grid's last dimension addresses spatial axis `k - 1 - j`.
    let axes: Vec<SpatialAxis> = (0..k)
        .map(|j| SpatialAxis::new(dims[k - 1 - j], align))
        .collect();
    let mut strides = vec![1usize; k];
    for i in (0..k.saturating_sub(1)).rev() {
        strides[i] = strides[i + 1] * dims[i + 1];
    }
    let taps: usize = match interp {
        Interp::Nearest => 1,
        Interp::Linear => 2,
        Interp::Cubic => 4,
    };
    let combos = taps.pow(k as u32);
    let g_host = grid.to_array()?;
    let g_host: Vec<f32> = g_host.iter().copied().collect();
    // Per point and component: `t = grid * a + b`; the first tap's integer position.
    let mut a = vec![0f32; n * p * k];
    let mut b = vec![0f32; n * p * k];
    let mut first = vec![0i64; n * p * k];
    let mut rows = Vec::with_capacity(n * p * combos);
    let mut mask = Vec::with_capacity(n * p * combos);
    let mut any_masked = false;
    for ni in 0..n {
        for pi in 0..p {
            let base = (ni * p + pi) * k;
            for (j, ax) in axes.iter().enumerate() {
                let g = f64::from(g_host[base + j]);
                let xc = g * ax.scale + ax.shift;
                if interp == Interp::Nearest {
                    let r = xc.round_ties_even();
                    let (sg, off) = pad_coordinate(r, ax, padding);
                    first[base + j] = (sg * r + off).trunc() as i64;
                } else {
                    // Cubic pads only its taps (as PyTorch and onnxruntime; the ONNX
                    // reference also moves the coordinate into range first).
                    let (sg, off) = if interp == Interp::Cubic {
                        (1.0, 0.0)
                    } else {
                        pad_coordinate(xc, ax, padding)
                    };
                    let x0 = (sg * xc + off).floor();
                    a[base + j] = (ax.scale * sg) as f32;
                    b[base + j] = (ax.shift * sg + off - x0) as f32;
                    first[base + j] =
                        (x0 as i64).saturating_sub(i64::from(interp == Interp::Cubic));
                }
            }
            for combo in 0..combos {
                let mut flat = 0;
                let mut valid = true;
                for (j, ax) in axes.iter().enumerate() {
                    let tap = (combo / taps.pow((k - 1 - j) as u32)) % taps;
                    match ax.pixel(first[base + j].saturating_add(tap as i64), padding) {
                        Some(i) => flat += i * strides[k - 1 - j],
                        None => valid = false,
                    }
                }
                any_masked |= !valid;
                rows.push((ni * s + if valid { flat } else { 0 }) as i64);
                mask.push(if valid { 1f32 } else { 0.0 });
            }
        }
    }
    let dev = ctx.device;
    let weights: Tensor<3> = if interp == Interp::Nearest {
        Tensor::from_data(TensorData::new(mask, vec![n, p, 1]), dev)
    } else {
        let g = grid.reshape(&[n, p, k])?.into_rank::<3>()?;
        let a: Tensor<3> = Tensor::from_data(TensorData::new(a, vec![n, p, k]), dev);
        let b: Tensor<3> = Tensor::from_data(TensorData::new(b, vec![n, p, k]), dev);
        let t = g.mul(a).add(b);
        let mut acc = tap_weights(t.clone().narrow(2, 0, 1), interp);
        for j in 1..k {
            let w = tap_weights(t.clone().narrow(2, j, 1), interp);
            let m = acc.dims()[2];
            acc = acc
                .unsqueeze_dim::<4>(3)
                .mul(w.unsqueeze_dim::<4>(2))
                .reshape([n, p, m * taps]);
        }
        if any_masked {
            acc.mul(Tensor::from_data(
                TensorData::new(mask, vec![n, p, combos]),
                dev,
            ))
        } else {
            acc
        }
    };
    let table = x
        .reshape(&[n, c, s])?
        .into_rank::<3>()?
        .swap_dims(1, 2)
        .reshape([n * s, c]);
    let picked = table
        .select(0, int_tensor_1d(rows, dev))
        .reshape([n, p, combos, c]);
    let y = picked
        .mul(weights.unsqueeze_dim::<4>(3))
        .sum_dim(2)
        .reshape([n, p, c])
        .swap_dims(1, 2);
    Ok(Value::Float(FloatValue::from_rank(y)?.reshape(&out_shape)?).into())
}

/// Normalised coordinates of the `len` pixel centres of one axis (0 for a single pixel,
/// as PyTorch and onnxruntime).
fn base_coords(len: usize, align_corners: bool) -> Vec<f32> {
    (0..len)
        .map(|i| {
            if len == 1 {
                0.0
            } else if align_corners {
                -1.0 + 2.0 * i as f32 / (len - 1) as f32
            } else {
                (2 * i + 1) as f32 / len as f32 - 1.0
            }
        })
        .collect()
}

/// `AffineGrid(theta, size)` (`align_corners`): `theta` `[N, 2, 3]` with `size`
/// `[N, C, H, W]` gives `[N, H, W, 2]`; `[N, 3, 4]` with `[N, C, D, H, W]` gives
/// `[N, D, H, W, 3]`.
pub fn affine_grid(ctx: &OpContext, mut inputs: Inputs) -> OpResult<OpOutput> {
    let theta = inputs.float(0, "theta", ctx.device)?;
    let size = inputs.take(1, "size")?.dims_list("size")?;
    let align = ctx.attrs.int("align_corners", 0)? != 0;
    let k = match size.len() {
        4 => 2,
        5 => 3,
        _ => op_bail!("size must be [N, C, H, W] or [N, C, D, H, W], got {size:?}"),
    };
    let n = size[0];
    let ts = theta.shape();
    if ts != [n, k, k + 1] {
        op_bail!(
            "theta must be [{n}, {k}, {}] for size {size:?}, got {ts:?}",
            k + 1
        );
    }
    let spatial = &size[2..];
    let p: usize = spatial.iter().product();
    let mut out_shape = vec![n];
    out_shape.extend_from_slice(spatial);
    out_shape.push(k);
    if n * p == 0 {
        return Ok(Value::Float(zeros(ctx, &out_shape)?).into());
    }
    // Homogeneous base points (x, y[, z], 1), x along the last axis.
    let coords: Vec<Vec<f32>> = spatial.iter().map(|&l| base_coords(l, align)).collect();
    let mut base = Vec::with_capacity(n * p * (k + 1));
    for _ in 0..n {
        for pi in 0..p {
            let mut rem = pi;
            let mut idx = vec![0; k];
            for d in (0..k).rev() {
                idx[d] = rem % spatial[d];
                rem /= spatial[d];
            }
            for d in (0..k).rev() {
                base.push(coords[d][idx[d]]);
            }
            base.push(1.0);
        }
    }
    let base: Tensor<3> = Tensor::from_data(TensorData::new(base, vec![n, p, k + 1]), ctx.device);
    let theta = theta.into_rank::<3>()?.swap_dims(1, 2);
    let grid = base.matmul(theta);
    Ok(Value::Float(FloatValue::from_rank(grid)?.reshape(&out_shape)?).into())
}
