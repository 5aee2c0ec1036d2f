//! Spectral ops: `DFT` (opsets 17 and 20), `STFT` and `MelWeightMatrix`.
//!
//! `DFT` and `STFT` are linear in the signal: each is a matrix product of the (framed)
//! signal, flattened to `[rows, n * c]` (`c` = 1 for a real, 2 for a complex signal), with
//! a host-built `[n * c, k * 2]` matrix of cosines and sines (zero padding or truncation to
//! `dft_length`, the one-sided bins, the inverse's `1/n` and an `STFT` window are folded
//! into it). The product runs on the device, so both are differentiable in the signal.
//! `MelWeightMatrix` is built on the host from its scalar inputs (no gradient).

use std::f64::consts::PI;

use burn::tensor::{Tensor, TensorData};
use ndarray::{ArrayD, IxDyn};

use super::{Inputs, OpContext, OpOutput};
use crate::error::OpResult;
use crate::op_bail;
use crate::value::host_tensor::dtype;
use crate::value::{FloatValue, PhysTensor, Value, int_tensor_1d, norm_axis, padded};

/// One scalar integer input, if present.
fn scalar_int(inputs: &mut Inputs, i: usize, what: &str) -> OpResult<Option<i64>> {
    match inputs.int_list(i, what)? {
        None => Ok(None),
        Some(v) => match v[..] {
            [x] => Ok(Some(x)),
            _ => op_bail!("{what} must hold one element, got {}", v.len()),
        },
    }
}

/// The DFT as a real `[n_in * c_in, n_out * c_out]` matrix, row-major.
///
/// Input element `j < min(n_in, len)` (the signal zero-padded or truncated to `len`) with
/// `c_in` parts (real, or real and imaginary) maps to output `k < n_out` with `c_out`
/// parts. Forward: `y_k = sum_j x_j e^{-2 pi i jk / len}`. Inverse: `y_k = 1/len sum_j x_j
/// e^{2 pi i jk / len}`; with `real_inverse` (one-sided inverse) the input bins are the
/// Hermitian half, bins `0 < j < len - j` count twice and only the real part is produced.
/// `weights` scale the input elements (an `STFT` window).
#[allow(clippy::too_many_arguments)]
fn dft_matrix(
    n_in: usize,
    c_in: usize,
    n_out: usize,
    c_out: usize,
    len: usize,
    inverse: bool,
    real_inverse: bool,
    weights: Option<&[f64]>,
) -> Vec<f32> {
    let cols = n_out * c_out;
    let mut m = vec![0f32; n_in * c_in * cols];
    let l = len as u64;
    for j in 0..n_in.min(len) {
        let w = weights.map_or(1.0, |w| w[j]);
        for k in 0..n_out {
            let phase = 2.0 * PI * ((j as u64 * k as u64) % l) as f64 / len as f64;
            let (s, c) = phase.sin_cos();
            let (re_a, re_b, im_a, im_b) = if inverse {
                let scale = if real_inverse && j != 0 && 2 * j != len {
                    2.0
                } else {
                    1.0
                } / len as f64;
                // (a + ib)(cos + i sin) / len
                (c * scale, -s * scale, s * scale, c * scale)
            } else {
                // (a + ib)(cos - i sin)
                (c, s, -s, c)
            };
            let row_a = (j * c_in) * cols;
            m[row_a + k * c_out] = (w * re_a) as f32;
            if c_out == 2 {
                m[row_a + k * c_out + 1] = (w * im_a) as f32;
            }
            if c_in == 2 {
                let row_b = (j * c_in + 1) * cols;
                m[row_b + k * c_out] = (w * re_b) as f32;
                if c_out == 2 {
                    m[row_b + k * c_out + 1] = (w * im_b) as f32;
                }
            }
        }
    }
    m
}

/// `[rows, n*c] x [n*c, cols]` on the device with a host matrix.
fn apply_matrix(ctx: &OpContext, x: Tensor<2>, m: Vec<f32>, cols: usize) -> Tensor<2> {
    let inner = x.dims()[1];
    let mat: Tensor<2> = Tensor::from_data(TensorData::new(m, vec![inner, cols]), ctx.device);
    x.matmul(mat)
}

/// `DFT` (`inverse`, `onesided`; `axis` an attribute up to opset 19, input 2 from opset 20)
/// of a real `[.., 1]` or complex `[.., 2]` signal, with the optional `dft_length` input.
pub fn dft(ctx: &OpContext, mut inputs: Inputs) -> OpResult<OpOutput> {
    let x = inputs.float(0, "input", ctx.device)?;
    let dft_length = scalar_int(&mut inputs, 1, "dft_length")?;
    let axis = if ctx.opset >= 20 {
        scalar_int(&mut inputs, 2, "axis")?.unwrap_or(-2)
    } else {
        ctx.attrs.int("axis", 1)?
    };
    let inverse = ctx.attrs.int("inverse", 0)? != 0;
    let onesided = ctx.attrs.int("onesided", 0)? != 0;
    let shape = x.shape();
    let r = shape.len();
    if r < 2 {
        op_bail!("input must be [.., n, .., 1 or 2], got {shape:?}");
    }
    let c_in = shape[r - 1];
    if c_in != 1 && c_in != 2 {
        op_bail!("the last dimension of the input must be 1 (real) or 2 (complex), got {shape:?}");
    }
    let axis = norm_axis(axis, r)?;
    if axis == r - 1 {
        op_bail!("axis cannot be the last (real/imaginary) dimension of {shape:?}");
    }
    let n_in = shape[axis];
    let len = match dft_length {
        Some(l) if l < 1 => op_bail!("dft_length must be positive, got {l}"),
        Some(l) => l as usize,
        None if inverse && onesided => 2 * n_in.saturating_sub(1),
        None => n_in,
    };
    if len == 0 {
        op_bail!("the DFT length is 0 for input {shape:?}");
    }
    let (n_out, c_out, real_inverse) = match (inverse, onesided) {
        (false, false) => (len, 2, false),
        (false, true) => (len / 2 + 1, 2, false),
        (true, false) => (len, 2, false),
        (true, true) => (len, 1, true),
    };
    // For the one-sided inverse only the Hermitian half of the input is read.
    let n_read = if real_inverse {
        n_in.min(len / 2 + 1)
    } else {
        n_in
    };
    let mut m = dft_matrix(n_in, c_in, n_out, c_out, len, inverse, real_inverse, None);
    if n_read < n_in {
        let cols = n_out * c_out;
        m[n_read * c_in * cols..].iter_mut().for_each(|v| *v = 0.0);
    }
    let a: usize = shape[..axis].iter().product();
    let mid: usize = shape[axis + 1..r - 1].iter().product();
    let mut out_shape = shape.clone();
    out_shape[axis] = n_out;
    out_shape[r - 1] = c_out;
    if a * mid * n_in == 0 {
        let z = PhysTensor::zeros(padded(&out_shape)?, ctx.device);
        return Ok(Value::Float(FloatValue::new(z, r)).into());
    }
    let t = x
        .reshape(&[a, n_in, mid, c_in])?
        .into_rank::<4>()?
        .swap_dims(1, 2)
        .reshape([a * mid, n_in * c_in]);
    let y = apply_matrix(ctx, t, m, n_out * c_out)
        .reshape([a, mid, n_out, c_out])
        .swap_dims(1, 2);
    Ok(Value::Float(FloatValue::from_rank(y)?.reshape(&out_shape)?).into())
}

/// `STFT` (`onesided`, default 1) of `signal` `[batch, length, 1 or 2]` with `frame_step`,
/// optional `window` `[frame_length]` and `frame_length`: `[batch, frames, bins, 2]`.
pub fn stft(ctx: &OpContext, mut inputs: Inputs) -> OpResult<OpOutput> {
    let x = inputs.float(0, "signal", ctx.device)?;
    let step = scalar_int(&mut inputs, 1, "frame_step")?
        .ok_or_else(|| crate::error::OpError("missing required input 1 (frame_step)".into()))?;
    let window: Option<Vec<f64>> = match inputs.opt(2) {
        None => None,
        Some(w) => Some(
            w.into_float(ctx.device)?
                .to_array()?
                .iter()
                .map(|&v| f64::from(v))
                .collect(),
        ),
    };
    let frame_length = scalar_int(&mut inputs, 3, "frame_length")?;
    let onesided = ctx.attrs.int("onesided", 1)? != 0;
    let shape = x.shape();
    if shape.len() != 3 || !(shape[2] == 1 || shape[2] == 2) {
        op_bail!("signal must be [batch, length, 1 or 2], got {shape:?}");
    }
    let (b, length, c_in) = (shape[0], shape[1], shape[2]);
    let fl = match (frame_length, &window) {
        (Some(l), _) if l < 1 => op_bail!("frame_length must be positive, got {l}"),
        (Some(l), _) => l as usize,
        (None, Some(w)) => w.len(),
        (None, None) => length,
    };
    if let Some(w) = &window
        && w.len() != fl
    {
        op_bail!("window has {} points but frame_length is {fl}", w.len());
    }
    if step < 1 {
        op_bail!("frame_step must be positive, got {step}");
    }
    let step = step as usize;
    if fl > length {
        op_bail!("frame_length {fl} is longer than the signal ({length})");
    }
    let frames = 1 + (length - fl) / step;
    let bins = if onesided { fl / 2 + 1 } else { fl };
    let out_shape = [b, frames, bins, 2];
    if b == 0 {
        let z = PhysTensor::zeros(padded(&out_shape)?, ctx.device);
        return Ok(Value::Float(FloatValue::new(z, 4)).into());
    }
    let positions: Vec<i64> = (0..frames)
        .flat_map(|f| (0..fl).map(move |j| (f * step + j) as i64))
        .collect();
    let framed = x
        .into_rank::<3>()?
        .select(1, int_tensor_1d(positions, ctx.device))
        .reshape([b * frames, fl * c_in]);
    let m = dft_matrix(fl, c_in, bins, 2, fl, false, false, window.as_deref());
    let y = apply_matrix(ctx, framed, m, bins * 2).reshape(out_shape);
    Ok(Value::Float(FloatValue::from_rank(y)?).into())
}

/// `MelWeightMatrix(num_mel_bins, dft_length, sample_rate, lower_edge_hertz,
/// upper_edge_hertz)` (`output_datatype`): `[dft_length / 2 + 1, num_mel_bins]` triangular
/// filters, evenly spaced on the mel scale.
pub fn mel_weight_matrix(ctx: &OpContext, mut inputs: Inputs) -> OpResult<OpOutput> {
    let int = |inputs: &mut Inputs, i: usize, what: &str| -> OpResult<i64> {
        match scalar_int(inputs, i, what)? {
            Some(v) => Ok(v),
            None => op_bail!("missing required input {i} ({what})"),
        }
    };
    let num_mel = int(&mut inputs, 0, "num_mel_bins")?;
    let dft_length = int(&mut inputs, 1, "dft_length")?;
    let sample_rate = int(&mut inputs, 2, "sample_rate")?;
    let lower = inputs
        .take(3, "lower_edge_hertz")?
        .scalar_f32("lower_edge_hertz")?;
    let upper = inputs
        .take(4, "upper_edge_hertz")?
        .scalar_f32("upper_edge_hertz")?;
    if num_mel < 0 || dft_length < 1 || sample_rate < 1 {
        op_bail!(
            "num_mel_bins ({num_mel}) must be non-negative, dft_length ({dft_length}) and \
             sample_rate ({sample_rate}) positive"
        );
    }
    let num_mel = num_mel as usize;
    let spec_bins = (dft_length / 2 + 1) as usize;
    // In f32 as the ONNX reference (the bin edges are floored, so precision shows).
    let to_mel = |hz: f32| 2595f32 * (1f32 + hz / 700f32).log10();
    let low_mel = to_mel(lower);
    let high_mel = to_mel(upper);
    let step = (high_mel - low_mel) / (num_mel + 2) as f32;
    let edges: Vec<i64> = (0..num_mel + 2)
        .map(|i| {
            let mel = f64::from(i as f32 * step + low_mel);
            let hz = 700.0 * (10f64.powf(mel / 2595.0) - 1.0);
            (((dft_length + 1) as f64 * hz) / sample_rate as f64).floor() as i64
        })
        .collect();
    let mut out = vec![0f64; spec_bins * num_mel];
    let mut set = |j: i64, i: usize, v: f64| -> OpResult<()> {
        if j < 0 || j as usize >= spec_bins {
            op_bail!("mel filter edge {j} is outside the {spec_bins} spectrogram bins");
        }
        out[j as usize * num_mel + i] = v;
        Ok(())
    };
    for i in 0..num_mel {
        let (lo, center, hi) = (edges[i], edges[i + 1], edges[i + 2]);
        if center == lo {
            set(center, i, 1.0)?;
        } else {
            for j in lo..=center {
                set(j, i, (j - lo) as f64 / (center - lo) as f64)?;
            }
        }
        if hi > center {
            for j in center..hi {
                set(j, i, (hi - j) as f64 / (hi - center) as f64)?;
            }
        }
    }
    let to = ctx.attrs.int("output_datatype", i64::from(dtype::FLOAT))? as i32;
    let shape = IxDyn(&[spec_bins, num_mel]);
    Ok(if dtype::is_float(to) {
        let a = ArrayD::from_shape_vec(shape, out.iter().map(|&v| v as f32).collect())?;
        Value::Float(FloatValue::from_array(&a, ctx.device)?)
    } else if dtype::is_int(to) {
        Value::Int(ArrayD::from_shape_vec(
            shape,
            out.iter().map(|&v| v as i64).collect(),
        )?)
    } else {
        op_bail!("output_datatype {to} is not a numeric type")
    }
    .into())
}
