//! `LayerNormalization`, `RMSNormalization`, `InstanceNormalization`, `GroupNormalization`
//! and `BatchNormalization` (inference and training mode).
//!
//! In training mode batch normalisation uses the batch statistics and returns updated
//! running statistics, moving by `1 - momentum` (ONNX's momentum convention). The node's
//! optional running-statistics outputs follow the ONNX spec (population variance); the
//! state written back into the model follows `torch.nn.BatchNorm` in `train()` (unbiased
//! variance), since that is how the weights were trained in the first place.

use burn::tensor::{DType, FloatDType};

use super::broadcast::float_binary;
use super::{Inputs, OpContext, OpOutput};
use crate::error::OpResult;
use crate::graph::attributes::LOW_PRECISION_RESULT;
use crate::op_bail;
use crate::value::{FloatValue, Value, norm_axis};

/// `LayerNormalization` (opset 17): the fused kernel ([`crate::kernels::layer_norm`]) for
/// f32 on the CPU when `Scale` and `B` are f32 and cover the normalised dims element for
/// element and only `Y` is asked for, else Burn's composition, which also gives the
/// optional `Mean` and `InvStdDev` outputs (the input's shape with the normalised dims 1).
pub fn layer_norm(ctx: &OpContext, mut inputs: Inputs) -> OpResult<OpOutput> {
    let x = inputs.float(0, "X", ctx.device)?;
    let scale = inputs.float(1, "Scale", ctx.device)?;
    let bias = inputs
        .opt(2)
        .map(|v| v.into_float(ctx.device))
        .transpose()?;
    let eps = ctx.attrs.float("epsilon", 1e-5)? as f64;
    let shape = x.shape();
    let axis = norm_axis(ctx.attrs.int("axis", -1)?, shape.len())?;
    let outer: usize = shape[..axis].iter().product();
    let inner: usize = shape[axis..].iter().product();
    let x2 = x.reshape(&[outer, inner])?.into_rank::<2>()?;
    let fits = |v: &FloatValue| {
        v.shape().iter().product::<usize>() == inner && v.tensor.dtype() == DType::F32
    };
    if ctx.num_outputs == 1
        && crate::kernels::layer_norm_fused_here(&x2)
        && fits(&scale)
        && bias.as_ref().is_none_or(fits)
    {
        let flat = |v: FloatValue| v.tensor.reshape([inner]);
        let bias = match bias {
            Some(b) => flat(b),
            None => burn::tensor::Tensor::zeros([inner], &x2.device()),
        };
        // Marked for the autocast precision (its readers are products, which read it so):
        // written in it on CubeCL devices, `crate::model::activation_precision`.
        let out = match ctx.autocast {
            Some(low)
                if ctx.attrs.int(LOW_PRECISION_RESULT, 0)? != 0
                    && crate::kernels::runs_cubecl(ctx.device) =>
            {
                low
            }
            _ => FloatDType::F32,
        };
        let y = crate::kernels::layer_norm_in(x2, flat(scale), bias, eps as f32, out);
        return Ok(Value::Float(FloatValue::from_rank(y)?.reshape(&shape)?).into());
    }
    let mean = x2.clone().mean_dim(1);
    let centered = x2 - mean.clone();
    let var = centered.clone().square().mean_dim(1);
    let inv_std = var.add_scalar(eps).sqrt().recip();
    let normed = centered * inv_std.clone();
    let normed = FloatValue::from_rank(normed)?.reshape(&shape)?;
    let stat_shape: Vec<usize> = (0..shape.len())
        .map(|d| if d < axis { shape[d] } else { 1 })
        .collect();
    let stat = |t| -> OpResult<Value> {
        Ok(Value::Float(
            FloatValue::from_rank(t)?.reshape(&stat_shape)?,
        ))
    };
    let scale = broadcast_check(scale, &shape[axis..], "Scale")?;
    let mut y = float_binary(normed, scale, |x, s| x * s)?;
    if let Some(b) = bias {
        let b = broadcast_check(b, &shape[axis..], "B")?;
        y = float_binary(y, b, |x, b| x + b)?;
    }
    let mut out = vec![Value::Float(y)];
    if ctx.num_outputs > 1 {
        out.push(stat(mean)?);
        out.push(stat(inv_std)?);
    }
    Ok(out.into())
}

/// `RMSNormalization` (opset 23): `X / sqrt(mean(X^2) + epsilon) * Scale`, the mean over
/// the dims from `axis` on, `Scale` broadcast over those dims. `stash_type` (the precision
/// of the statistics) is not consulted: they are computed in the values' own precision
/// (f32), which is what the default `stash_type = 1` asks for.
pub fn rms_norm(ctx: &OpContext, mut inputs: Inputs) -> OpResult<OpOutput> {
    let x = inputs.float(0, "X", ctx.device)?;
    let scale = inputs.float(1, "Scale", ctx.device)?;
    let eps = ctx.attrs.float("epsilon", 1e-5)? as f64;
    let shape = x.shape();
    let axis = norm_axis(ctx.attrs.int("axis", -1)?, shape.len())?;
    let scale = broadcast_check(scale, &shape[axis..], "Scale")?;
    let outer: usize = shape[..axis].iter().product();
    let inner: usize = shape[axis..].iter().product();
    let x2 = x.reshape(&[outer, inner])?.into_rank::<2>()?;
    let inv_rms = x2
        .clone()
        .square()
        .mean_dim(1)
        .add_scalar(eps)
        .sqrt()
        .recip();
    let normed = FloatValue::from_rank(x2 * inv_rms)?.reshape(&shape)?;
    let y = FloatValue::new(normed.tensor * scale.tensor, shape.len());
    Ok(Value::Float(y).into())
}

/// Check that a parameter broadcasts onto the normalised dims.
fn broadcast_check(v: FloatValue, dims: &[usize], what: &str) -> OpResult<FloatValue> {
    let s = v.shape();
    if s.len() > dims.len()
        || s.iter()
            .rev()
            .zip(dims.iter().rev())
            .any(|(a, b)| *a != *b && *a != 1)
    {
        op_bail!("{what} of shape {s:?} does not broadcast to the normalised dims {dims:?}");
    }
    Ok(v)
}

/// `InstanceNormalization`: per sample and channel over the spatial dims.
pub fn instance_norm(ctx: &OpContext, mut inputs: Inputs) -> OpResult<OpOutput> {
    let x = inputs.float(0, "input", ctx.device)?;
    let scale = inputs.float(1, "scale", ctx.device)?;
    let bias = inputs.float(2, "B", ctx.device)?;
    let eps = ctx.attrs.float("epsilon", 1e-5)? as f64;
    let shape = x.shape();
    if shape.len() < 3 || scale.shape() != [shape[1]] || bias.shape() != [shape[1]] {
        op_bail!(
            "expects input [N, C, ...] with scale and B of [C], got {shape:?}, {:?}, {:?}",
            scale.shape(),
            bias.shape()
        );
    }
    let (n, c) = (shape[0], shape[1]);
    let spatial: usize = shape[2..].iter().product();
    let x3 = x.reshape(&[n, c, spatial])?.into_rank::<3>()?;
    let centered = x3.clone() - x3.mean_dim(2);
    let var = centered.clone().square().mean_dim(2);
    let normed = FloatValue::from_rank(centered / var.add_scalar(eps).sqrt())?.reshape(&shape)?;
    let mut channel_shape = vec![c];
    channel_shape.extend(std::iter::repeat_n(1, shape.len() - 2));
    let y = normed.tensor * scale.reshape(&channel_shape)?.tensor
        + bias.reshape(&channel_shape)?.tensor;
    Ok(Value::Float(FloatValue::new(y, shape.len())).into())
}

/// `GroupNormalization`: statistics per sample over groups of channels and the spatial
/// dims; `scale` and `bias` per group (opset 18) or per channel (opset 21).
pub fn group_norm(ctx: &OpContext, mut inputs: Inputs) -> OpResult<OpOutput> {
    let x = inputs.float(0, "X", ctx.device)?;
    let scale = inputs.float(1, "scale", ctx.device)?;
    let bias = inputs.float(2, "bias", ctx.device)?;
    let eps = ctx.attrs.float("epsilon", 1e-5)? as f64;
    let groups = ctx.attrs.int("num_groups", 0)?;
    let shape = x.shape();
    if shape.len() < 3 || groups < 1 || shape[1] % groups as usize != 0 {
        op_bail!("expects X [N, C, ...] with C divisible by num_groups ({groups}), got {shape:?}");
    }
    let (n, c, g) = (shape[0], shape[1], groups as usize);
    let spatial: usize = shape[2..].iter().product();
    let x3 = x.reshape(&[n, g, c / g * spatial])?.into_rank::<3>()?;
    let centered = x3.clone() - x3.mean_dim(2);
    let var = centered.clone().square().mean_dim(2);
    let normed =
        FloatValue::from_rank(centered / var.add_scalar(eps).sqrt())?.reshape(&[n, c, spatial])?;
    // Per-group parameters apply to each of the group's channels.
    let per_channel = |v: FloatValue, what: &str| -> OpResult<FloatValue> {
        match v.shape()[..] {
            [k] if k == c => v.reshape(&[c, 1]),
            [k] if k == g => {
                let t = v.reshape(&[g, 1])?.into_rank::<2>()?.repeat(&[1, c / g]);
                FloatValue::from_rank(t)?.reshape(&[c, 1])
            }
            _ => op_bail!("{what} has shape {:?}, expected [{g}] or [{c}]", v.shape()),
        }
    };
    let y = normed.tensor * per_channel(scale, "scale")?.tensor + per_channel(bias, "bias")?.tensor;
    Ok(Value::Float(FloatValue::new(y, 3).reshape(&shape)?).into())
}

/// `BatchNormalization`
pub fn batch_norm(ctx: &OpContext, mut inputs: Inputs) -> OpResult<OpOutput> {
    let x = inputs.float(0, "X", ctx.device)?;
    let scale = inputs.float(1, "scale", ctx.device)?;
    let bias = inputs.float(2, "B", ctx.device)?;
    let mean = inputs.float(3, "input_mean", ctx.device)?;
    let var = inputs.float(4, "input_var", ctx.device)?;
    let eps = ctx.attrs.float("epsilon", 1e-5)? as f64;
    let momentum = ctx.attrs.float("momentum", 0.9)? as f64;
    let shape = x.shape();
    if shape.len() < 2 {
        op_bail!("X must be [N, C, ...], got {shape:?}");
    }
    let c = shape[1];
    for (v, what) in [
        (&scale, "scale"),
        (&bias, "B"),
        (&mean, "input_mean"),
        (&var, "input_var"),
    ] {
        if v.shape() != [c] {
            op_bail!("{what} has shape {:?}, expected [{c}]", v.shape());
        }
    }
    // Per-channel parameters as [C, 1, .., 1] so they broadcast against [N, C, ...].
    let mut channel_shape = vec![c];
    channel_shape.extend(std::iter::repeat_n(1, shape.len() - 2));
    let per_channel = |v: FloatValue| v.reshape(&channel_shape);
    let train = ctx.train || ctx.attrs.int("training_mode", 0)? != 0;
    if !train {
        let inv = per_channel(var)?.tensor.add_scalar(eps).sqrt().recip();
        let y = (x.tensor - per_channel(mean)?.tensor) * inv * per_channel(scale)?.tensor
            + per_channel(bias)?.tensor;
        return Ok(Value::Float(FloatValue::new(y, shape.len())).into());
    }
    let n = shape[0];
    let spatial: usize = shape[2..].iter().product();
    let count = n * spatial;
    let x3 = x.reshape(&[n, c, spatial])?.into_rank::<3>()?;
    let batch_mean = x3.clone().mean_dim(2).mean_dim(0); // [1, C, 1]
    let centered = x3 - batch_mean.clone();
    let batch_var = centered.clone().square().mean_dim(2).mean_dim(0);
    let normed = centered / batch_var.clone().add_scalar(eps).sqrt();
    let normed = FloatValue::from_rank(normed)?.reshape(&shape)?;
    let y = normed.tensor * per_channel(scale)?.tensor + per_channel(bias)?.tensor;
    let y = FloatValue::new(y, shape.len());

    let batch_mean = FloatValue::from_rank(batch_mean.detach())?
        .reshape(&[c])?
        .tensor;
    let batch_var = FloatValue::from_rank(batch_var.detach())?
        .reshape(&[c])?
        .tensor;
    let running = |old: FloatValue, batch: crate::value::PhysTensor, factor: f64| {
        FloatValue::new(
            old.tensor.detach().mul_scalar(momentum) + batch.mul_scalar((1.0 - momentum) * factor),
            1,
        )
    };
    // Graph outputs follow the ONNX spec (population variance); the state written back to
    // the model follows PyTorch (unbiased variance), whose models these usually are.
    let unbiased = if count > 1 {
        count as f64 / (count - 1) as f64
    } else {
        1.0
    };
    let out_mean = running(mean.clone(), batch_mean.clone(), 1.0);
    let out_var = running(var.clone(), batch_var.clone(), 1.0);
    let state_var = running(var, batch_var, unbiased);
    Ok(OpOutput {
        values: vec![
            Value::Float(y),
            Value::Float(out_mean.clone()),
            Value::Float(out_var),
        ],
        state_updates: vec![(3, out_mean), (4, state_var)],
    })
}
