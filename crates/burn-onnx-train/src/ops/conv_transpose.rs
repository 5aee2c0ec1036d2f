//! `ConvTranspose` (1-D, 2-D and 3-D, grouped, dilated, with `pads`, `output_padding`,
//! `output_shape` and `auto_pad`): Burn's `conv_transpose2d` (1-D lifted to 2-D) or
//! `conv_transpose3d` without padding, then the ONNX pads cropped from the full result,
//! which handles asymmetric pads exactly. An `output_shape` larger than the full result
//! (negative implied pads) appends zeros, and the bias is then added after the padding.

use burn::tensor::Tensor;
use burn::tensor::module::{conv_transpose2d, conv_transpose3d};
use burn::tensor::ops::ConvTransposeOptions;

use super::{Inputs, OpContext, OpOutput};
use crate::error::OpResult;
use crate::op_bail;
use crate::value::{FloatValue, Value};

fn spatial_list(ctx: &OpContext, name: &str, n: usize, default: i64) -> OpResult<Vec<usize>> {
    let v = ctx.attrs.ints(name)?.unwrap_or_else(|| vec![default; n]);
    if v.len() != n || v.iter().any(|&x| x < 0) {
        op_bail!("attribute `{name}` = {v:?} does not fit {n} spatial dims");
    }
    Ok(v.into_iter().map(|x| x as usize).collect())
}

/// `ConvTranspose`
pub fn conv_transpose(ctx: &OpContext, mut inputs: Inputs) -> OpResult<OpOutput> {
    let x = inputs.float(0, "X", ctx.device)?;
    let w = inputs.float(1, "W", ctx.device)?;
    let b = inputs
        .opt(2)
        .map(|v| v.into_float(ctx.device))
        .transpose()?;
    let (xs, ws) = (x.shape(), w.shape());
    if xs.len() != ws.len() || !(3..=5).contains(&xs.len()) || ws[0] != xs[1] {
        op_bail!(
            "expects X [N, C, ...] and W [C, M/group, ...] of rank 3 to 5, got {xs:?} and {ws:?}"
        );
    }
    let n = xs.len() - 2;
    let group = ctx.attrs.int("group", 1)?.max(1) as usize;
    let strides = spatial_list(ctx, "strides", n, 1)?;
    let dilations = spatial_list(ctx, "dilations", n, 1)?;
    let out_pad = spatial_list(ctx, "output_padding", n, 0)?;
    let kernel = &ws[2..];
    let full: Vec<usize> = (0..n)
        .map(|i| strides[i] * (xs[2 + i] - 1) + out_pad[i] + (kernel[i] - 1) * dilations[i] + 1)
        .collect();
    let auto_pad = ctx.attrs.string("auto_pad", "NOTSET")?;
    // Pads may be negative when `output_shape` exceeds the full output: zeros appended.
    let pads: Vec<(i64, i64)> = if let Some(target) = ctx.attrs.ints("output_shape")? {
        if target.len() < n || target.iter().any(|&t| t <= 0) {
            op_bail!("output_shape {target:?} does not fit {n} spatial dims");
        }
        let target = &target[target.len() - n..];
        (0..n)
            .map(|i| {
                let total = full[i] as i64 - target[i];
                let (small, large) = (total.div_euclid(2), total - total.div_euclid(2));
                if auto_pad == "SAME_UPPER" {
                    (small, large)
                } else {
                    (large, small)
                }
            })
            .collect()
    } else if auto_pad == "SAME_UPPER" || auto_pad == "SAME_LOWER" {
        (0..n)
            .map(|i| {
                let total = full[i].saturating_sub(xs[2 + i] * strides[i]);
                let small = total / 2;
                let (small, large) = (small as i64, (total - small) as i64);
                if auto_pad == "SAME_UPPER" {
                    (small, large)
                } else {
                    (large, small)
                }
            })
            .collect()
    } else {
        let p = spatial_list(ctx, "pads", 2 * n, 0)?;
        (0..n).map(|i| (p[i] as i64, p[i + n] as i64)).collect()
    };
    for i in 0..n {
        if out_pad[i] >= strides[i].max(dilations[i]) {
            op_bail!("output_padding {out_pad:?} must be smaller than the stride or dilation");
        }
        if pads[i].0 + pads[i].1 >= full[i] as i64 {
            op_bail!("pads {pads:?} remove the whole output {full:?}");
        }
    }
    let sizes: Vec<usize> = (0..n)
        .map(|i| (full[i] as i64 - pads[i].0 - pads[i].1) as usize)
        .collect();
    let negative = pads.iter().any(|&(a, b)| a < 0 || b < 0);
    // With negative pads the bias also covers the appended zeros, so it is added last.
    let (b_inner, b_after) = if negative { (None, b) } else { (b, None) };
    let y = if n == 3 {
        let options = ConvTransposeOptions {
            stride: [strides[0], strides[1], strides[2]],
            padding: [0, 0, 0],
            padding_out: [out_pad[0], out_pad[1], out_pad[2]],
            dilation: [dilations[0], dilations[1], dilations[2]],
            groups: group,
        };
        let bias = ctx.autocast_bias(b_inner.map(|b| b.into_rank::<1>()).transpose()?);
        let y = ctx.autocast([x, w], |[x, w]| {
            FloatValue::from_rank(conv_transpose3d(
                x.into_rank::<5>()?,
                w.into_rank::<5>()?,
                bias,
                options,
            ))
        })?;
        FloatValue::from_rank(crop_or_pad(y.into_rank::<5>()?, 2, &pads, &full))?
    } else {
        conv_transpose_2d(
            ctx, x, w, b_inner, n, &strides, &out_pad, &dilations, group, &pads, &full,
        )?
    };
    let y = match b_after {
        Some(b) => {
            let m = b.numel();
            let mut shape = vec![1; n + 2];
            shape[1] = m;
            let b = b.reshape(&shape)?;
            FloatValue::new(y.tensor + b.tensor, n + 2)
        }
        None => y,
    };
    let s = y.shape();
    if s[2..] != sizes[..] {
        op_bail!("internal shape mismatch: {s:?} vs spatial {sizes:?}");
    }
    Ok(Value::Float(y).into())
}

/// Crop `(begin, end)` from each spatial axis (from `base` on), or append zeros where negative.
fn crop_or_pad<const D: usize>(
    mut y: Tensor<D>,
    base: usize,
    pads: &[(i64, i64)],
    full: &[usize],
) -> Tensor<D> {
    for (i, &(begin, end)) in pads.iter().enumerate() {
        let d = base + i;
        let (cb, ce) = (begin.max(0) as usize, end.max(0) as usize);
        y = y.narrow(d, cb, full[i] - cb - ce);
        for (extra, front) in [(-begin, true), (-end, false)] {
            if extra > 0 {
                let zeros = y
                    .clone()
                    .narrow(d, 0, 1)
                    .zeros_like()
                    .repeat_dim(d, extra as usize);
                y = if front {
                    Tensor::cat(vec![zeros, y], d)
                } else {
                    Tensor::cat(vec![y, zeros], d)
                };
            }
        }
    }
    y
}

/// The 1-D and 2-D cases through `conv_transpose2d` (1-D as height 1).
#[allow(clippy::too_many_arguments)]
fn conv_transpose_2d(
    ctx: &OpContext,
    x: FloatValue,
    w: FloatValue,
    b: Option<FloatValue>,
    n: usize,
    strides: &[usize],
    out_pad: &[usize],
    dilations: &[usize],
    group: usize,
    pads: &[(i64, i64)],
    full: &[usize],
) -> OpResult<FloatValue> {
    let (xs, ws) = (x.shape(), w.shape());
    let lift = |v: &[usize], neutral: usize| {
        if n == 1 {
            [neutral, v[0]]
        } else {
            [v[0], v[1]]
        }
    };
    let (x4, w4) = if n == 1 {
        (
            x.reshape(&[xs[0], xs[1], 1, xs[2]])?,
            w.reshape(&[ws[0], ws[1], 1, ws[2]])?,
        )
    } else {
        (x, w)
    };
    let options = ConvTransposeOptions {
        stride: lift(strides, 1),
        padding: [0, 0],
        padding_out: lift(out_pad, 0),
        dilation: lift(dilations, 1),
        groups: group,
    };
    let bias = ctx.autocast_bias(b.map(|b| b.into_rank::<1>()).transpose()?);
    let y = ctx.autocast([x4, w4], |[x4, w4]| {
        FloatValue::from_rank(conv_transpose2d(
            x4.into_rank::<4>()?,
            w4.into_rank::<4>()?,
            bias,
            options,
        ))
    })?;
    let y = FloatValue::from_rank(crop_or_pad(y.into_rank::<4>()?, 4 - n, pads, full))?;
    if n == 1 {
        let s = y.shape();
        y.reshape(&[s[0], s[1], s[3]])
    } else {
        Ok(y)
    }
}
