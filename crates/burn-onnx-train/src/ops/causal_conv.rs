//! `CausalConvWithState` (opset 27): a depthwise causal 1-D convolution that carries its
//! left context between calls, as Mamba and gated-delta-net blocks use it.
//!
//! The input `[batch, channels, length]` is left-padded with `past_state`
//! (`[batch, channels, k - 1]`, zeros when omitted), convolved channel by channel with the
//! `[channels, 1, k]` kernel (valid padding, stride 1), optionally followed by SiLU; the
//! last `k - 1` positions of the padded input are the `present_state`. The convolution is a
//! sum of `k` shifted products, so it is differentiable in the input, weight, bias and past
//! state.

use burn::tensor::{Tensor, activation};

use super::{Inputs, OpContext, OpOutput};
use crate::error::OpResult;
use crate::op_bail;
use crate::value::{FloatValue, PhysTensor, Value, padded};

/// `CausalConvWithState`: inputs `input`, `weight`, optional `bias` and `past_state`;
/// outputs `output` `[batch, channels, length]` and `present_state`
/// `[batch, channels, k - 1]`. Attribute `activation` is `none`, `silu` or `swish`.
pub fn causal_conv_with_state(ctx: &OpContext, mut inputs: Inputs) -> OpResult<OpOutput> {
    let x = inputs.float(0, "input", ctx.device)?;
    let w = inputs.float(1, "weight", ctx.device)?;
    let bias = inputs
        .opt(2)
        .map(|v| v.into_float(ctx.device))
        .transpose()?;
    let past = inputs
        .opt(3)
        .map(|v| v.into_float(ctx.device))
        .transpose()?;
    let act = ctx.attrs.string("activation", "none")?;
    let silu = match act.as_str() {
        "none" => false,
        "silu" | "swish" => true,
        other => op_bail!("unsupported activation '{other}' (expected none, silu or swish)"),
    };

    let (b, c, l) = match x.shape()[..] {
        [b, c, l] => (b, c, l),
        _ => op_bail!(
            "input must be [batch, channels, length], got shape {:?}",
            x.shape()
        ),
    };
    let k = match w.shape()[..] {
        [wc, 1, k] if wc == c && k > 0 => k,
        _ => op_bail!(
            "weight must be [channels = {c}, 1, k] with k > 0, got shape {:?}",
            w.shape()
        ),
    };
    if l == 0 {
        op_bail!("input has zero length; at least one position is needed");
    }
    let x = x.into_rank::<3>()?;
    let w = w.into_rank::<3>()?.reshape([1, c, k]);

    // Left context: past_state or zeros, [B, C, k - 1].
    let padded_x = if k == 1 {
        x
    } else {
        let pad = match past {
            Some(p) => {
                if p.shape() != [b, c, k - 1] {
                    op_bail!(
                        "past_state must have shape [{b}, {c}, {}], got {:?}",
                        k - 1,
                        p.shape()
                    );
                }
                p.into_rank::<3>()?
            }
            None => Tensor::<3>::zeros([b, c, k - 1], ctx.device),
        };
        Tensor::cat(vec![pad, x], 2)
    };

    let mut out = padded_x.clone().narrow(2, 0, l) * w.clone().narrow(2, 0, 1);
    for j in 1..k {
        out = out + padded_x.clone().narrow(2, j, l) * w.clone().narrow(2, j, 1);
    }
    if let Some(bias) = bias {
        if bias.shape() != [c] {
            op_bail!("bias must have shape [{c}], got {:?}", bias.shape());
        }
        out = out + bias.into_rank::<1>()?.reshape([1, c, 1]);
    }
    if silu {
        out = out.clone() * activation::sigmoid(out);
    }

    let present = if k == 1 {
        FloatValue::new(PhysTensor::zeros(padded(&[b, c, 0])?, ctx.device), 3)
    } else {
        FloatValue::from_rank(padded_x.narrow(2, l, k - 1))?
    };
    Ok(vec![
        Value::Float(FloatValue::from_rank(out)?),
        Value::Float(present),
    ]
    .into())
}
