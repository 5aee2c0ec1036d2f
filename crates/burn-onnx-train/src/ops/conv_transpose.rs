//! `ConvTranspose` (1-D and 2-D, grouped, dilated, with `pads`, `output_padding`,
//! `output_shape` and `auto_pad`): Burn's `conv_transpose2d` without padding, then the
//! ONNX pads cropped from the full result, which handles asymmetric pads exactly.

use burn::tensor::module::conv_transpose2d;
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
    if xs.len() != ws.len() || !(3..=4).contains(&xs.len()) || ws[0] != xs[1] {
        op_bail!(
            "expects X [N, C, ...] and W [C, M/group, ...] of rank 3 or 4, got {xs:?} and {ws:?}"
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
    let pads: Vec<(usize, usize)> = if let Some(target) = ctx.attrs.ints("output_shape")? {
        let target = &target[target.len().saturating_sub(n)..];
        (0..n)
            .map(|i| {
                let total = full[i] as i64 - target[i];
                if total < 0 {
                    return Err(format!(
                        "output_shape {target:?} is larger than the full output {full:?}"
                    )
                    .into());
                }
                let (small, large) = ((total / 2) as usize, (total - total / 2) as usize);
                Ok(if auto_pad == "SAME_UPPER" {
                    (small, large)
                } else {
                    (large, small)
                })
            })
            .collect::<OpResult<_>>()?
    } else if auto_pad == "SAME_UPPER" || auto_pad == "SAME_LOWER" {
        (0..n)
            .map(|i| {
                let total = full[i].saturating_sub(xs[2 + i] * strides[i]);
                let small = total / 2;
                if auto_pad == "SAME_UPPER" {
                    (small, total - small)
                } else {
                    (total - small, small)
                }
            })
            .collect()
    } else {
        let p = spatial_list(ctx, "pads", 2 * n, 0)?;
        (0..n).map(|i| (p[i], p[i + n])).collect()
    };
    let lift = |v: &[usize], neutral: usize| {
        if n == 1 {
            [neutral, v[0]]
        } else {
            [v[0], v[1]]
        }
    };
    for i in 0..n {
        if out_pad[i] >= strides[i].max(dilations[i]) {
            op_bail!("output_padding {out_pad:?} must be smaller than the stride or dilation");
        }
        if pads[i].0 + pads[i].1 >= full[i] {
            op_bail!("pads {pads:?} remove the whole output {full:?}");
        }
    }
    let (x4, w4) = if n == 1 {
        (
            x.reshape(&[xs[0], xs[1], 1, xs[2]])?,
            w.reshape(&[ws[0], ws[1], 1, ws[2]])?,
        )
    } else {
        (x, w)
    };
    let options = ConvTransposeOptions {
        stride: lift(&strides, 1),
        padding: [0, 0],
        padding_out: lift(&out_pad, 0),
        dilation: lift(&dilations, 1),
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
    let mut y = y.into_rank::<4>()?;
    let base = 4 - n;
    for i in 0..n {
        let (begin, end) = pads[i];
        y = y.narrow(base + i, begin, full[i] - begin - end);
    }
    let y = FloatValue::from_rank(y)?;
    let y = if n == 1 {
        let s = y.shape();
        y.reshape(&[s[0], s[1], s[3]])?
    } else {
        y
    };
    Ok(Value::Float(y).into())
}
