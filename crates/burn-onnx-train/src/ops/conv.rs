//! `Conv` (1-D and 2-D, grouped, dilated, padded) on [`crate::kernels::conv2d`] (im2col +
//! GEMM on the CPU, Burn's `conv2d` elsewhere), with the ReLU that
//! [`crate::onnx::fusion::fuse_conv_relu`] folded into it.

use burn::tensor::ops::ConvOptions;

use super::window::Window2d;
use super::{Inputs, OpContext, OpOutput};
use crate::error::OpResult;
use crate::graph::attributes::FUSED_ACTIVATION;
use crate::kernels::conv2d;
use crate::op_bail;
use crate::value::{FloatValue, Value};

/// `Conv`
pub fn conv(ctx: &OpContext, mut inputs: Inputs) -> OpResult<OpOutput> {
    let x = inputs.float(0, "X", ctx.device)?;
    let w = inputs.float(1, "W", ctx.device)?;
    let b = inputs
        .opt(2)
        .map(|v| v.into_float(ctx.device))
        .transpose()?;
    let (xs, ws) = (x.shape(), w.shape());
    if xs.len() != ws.len() || !(3..=4).contains(&xs.len()) {
        op_bail!(
            "Conv supports 1-D and 2-D inputs with matching weights, got X {xs:?} and W {ws:?}"
        );
    }
    let group = ctx.attrs.int("group", 1)?;
    if group < 1 || ws[1] * group as usize != xs[1] || ws[0] % group as usize != 0 {
        op_bail!("X {xs:?}, W {ws:?} and group {group} are inconsistent");
    }
    if let Some(b) = &b
        && b.shape() != [ws[0]]
    {
        op_bail!("bias shape {:?} should be [{}]", b.shape(), ws[0]);
    }
    let win = Window2d::from_attrs(ctx.attrs, &xs[2..], &ws[2..])?;
    let one_d = xs.len() == 3;
    let (x4, w4) = if one_d {
        (
            x.reshape(&[xs[0], xs[1], 1, xs[2]])?,
            w.reshape(&[ws[0], ws[1], 1, ws[2]])?,
        )
    } else {
        (x, w)
    };
    let (h, wd) = (
        x4.shape()[2] + win.pads[0].0 + win.pads[0].1,
        x4.shape()[3] + win.pads[1].0 + win.pads[1].1,
    );
    for (i, size) in [h, wd].into_iter().enumerate() {
        if (win.kernel[i] - 1) * win.dilations[i] + 1 > size {
            op_bail!(
                "kernel {:?} (dilations {:?}) is larger than the padded input {:?}",
                win.kernel,
                win.dilations,
                [h, wd]
            );
        }
    }
    let options = ConvOptions {
        stride: win.strides,
        padding: win.pads,
        dilation: win.dilations,
        groups: group as usize,
    };
    let relu = match ctx.attrs.string(FUSED_ACTIVATION, "")?.as_str() {
        "" => false,
        "Relu" => true,
        other => op_bail!("unknown fused activation {other:?}"),
    };
    let bias = ctx.autocast_bias(b.map(|b| b.into_rank::<1>()).transpose()?);
    let y = ctx.autocast([x4, w4], |[x4, w4]| {
        FloatValue::from_rank(conv2d(
            x4.into_rank::<4>()?,
            w4.into_rank::<4>()?,
            bias,
            options,
            relu,
        ))
    })?;
    let y = if one_d {
        let s = y.shape();
        y.reshape(&[s[0], s[1], s[3]])?
    } else {
        y
    };
    Ok(Value::Float(y).into())
}
