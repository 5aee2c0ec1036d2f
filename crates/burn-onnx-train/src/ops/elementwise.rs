//! Element-wise arithmetic (Add, Sub, Mul, Div, Pow, Max, Min, Sum) and activations.
//!
//! Arithmetic on two integer inputs stays on the host (shape computations); anything
//! involving a float goes to the device.

use burn::tensor::activation;

use super::broadcast::{float_binary, host_binary};
use super::{Inputs, OpContext, OpOutput};
use crate::error::OpResult;
use crate::op_bail;
use crate::value::{FloatValue, PhysTensor, Value};

fn binary(
    ctx: &OpContext,
    mut inputs: Inputs,
    int_op: fn(i64, i64) -> OpResult<i64>,
    float_op: fn(PhysTensor, PhysTensor) -> PhysTensor,
) -> OpResult<OpOutput> {
    let a = inputs.take(0, "A")?;
    let b = inputs.take(1, "B")?;
    match (a, b) {
        (Value::Int(a), Value::Int(b)) => {
            let out = host_binary(&a, &b, |x, y| int_op(*x, *y))?;
            let values: OpResult<Vec<i64>> = out.iter().cloned().collect();
            Ok(Value::Int(ndarray::ArrayD::from_shape_vec(out.raw_dim(), values?)?).into())
        }
        (a, b) => {
            let (a, b) = (a.into_float(ctx.device)?, b.into_float(ctx.device)?);
            Ok(Value::Float(float_binary(a, b, float_op)?).into())
        }
    }
}

/// `Add`. Three inputs `[x, bias, residual]` are a product's bias and the residual it
/// feeds, folded in on load (`onnx::fusion::fuse_bias_residual`).
pub fn add(ctx: &OpContext, mut inputs: Inputs) -> OpResult<OpOutput> {
    if inputs.0.len() == 3 {
        let x = inputs.float(0, "A", ctx.device)?;
        let bias = inputs.float(1, "bias", ctx.device)?;
        let residual = inputs.float(2, "residual", ctx.device)?;
        let rank = x.rank.max(bias.rank).max(residual.rank);
        let y = crate::kernels::add_bias_residual(x.tensor, bias.tensor, residual.tensor);
        return Ok(Value::Float(FloatValue::new(y, rank)).into());
    }
    binary(ctx, inputs, |a, b| Ok(a.wrapping_add(b)), |a, b| a + b)
}

/// `Sub`
pub fn sub(ctx: &OpContext, inputs: Inputs) -> OpResult<OpOutput> {
    binary(ctx, inputs, |a, b| Ok(a.wrapping_sub(b)), |a, b| a - b)
}

/// `Mul`
pub fn mul(ctx: &OpContext, inputs: Inputs) -> OpResult<OpOutput> {
    binary(ctx, inputs, |a, b| Ok(a.wrapping_mul(b)), |a, b| a * b)
}

/// `Div` (integer division truncates, as in onnxruntime)
pub fn div(ctx: &OpContext, inputs: Inputs) -> OpResult<OpOutput> {
    binary(
        ctx,
        inputs,
        |a, b| {
            if b == 0 {
                Err("integer division by zero".into())
            } else {
                Ok(a / b)
            }
        },
        |a, b| a / b,
    )
}

/// `Pow` (a constant scalar exponent of 2 or 3, as GPT-2's GELU and LayerNorm decompositions
/// use, becomes a multiplication so its gradient is exact at zero)
pub fn pow(ctx: &OpContext, mut inputs: Inputs) -> OpResult<OpOutput> {
    let a = inputs.take(0, "X")?;
    let b = inputs.take(1, "Y")?;
    if let (Value::Int(a), Value::Int(b)) = (&a, &b) {
        let out = host_binary(a, b, |x, y| {
            x.wrapping_pow((*y).clamp(0, u32::MAX as i64) as u32)
        })?;
        return Ok(Value::Int(out).into());
    }
    let a = a.into_float(ctx.device)?;
    let exponent = if b.shape().iter().product::<usize>() == 1 && b.rank() <= a.rank {
        b.scalar_f32("Y").ok()
    } else {
        None
    };
    let out = match exponent {
        Some(e) if e == 1.0 => a,
        Some(e) if e == 2.0 => FloatValue::new(a.tensor.clone() * a.tensor, a.rank),
        Some(e) if e == 3.0 => {
            FloatValue::new(a.tensor.clone() * a.tensor.clone() * a.tensor, a.rank)
        }
        Some(e) => FloatValue::new(a.tensor.powf_scalar(e), a.rank),
        None => float_binary(a, b.into_float(ctx.device)?, |x, y| x.powf(y))?,
    };
    Ok(Value::Float(out).into())
}

/// A variadic op: integers only stay integers on the host (shape arithmetic), anything
/// else folds on the device.
fn variadic(
    ctx: &OpContext,
    inputs: Inputs,
    name: &str,
    int_op: fn(i64, i64) -> i64,
    op: fn(PhysTensor, PhysTensor) -> PhysTensor,
) -> OpResult<OpOutput> {
    if inputs
        .0
        .iter()
        .flatten()
        .all(|v| matches!(v, Value::Int(_)))
    {
        let mut acc: Option<ndarray::ArrayD<i64>> = None;
        for v in inputs.0.into_iter().flatten() {
            let v = v.into_int()?;
            acc = Some(match acc {
                None => v,
                Some(a) => host_binary(&a, &v, |x, y| int_op(*x, *y))?,
            });
        }
        return match acc {
            Some(a) => Ok(Value::Int(a).into()),
            None => op_bail!("{name} needs at least one input"),
        };
    }
    let mut acc: Option<FloatValue> = None;
    for v in inputs.0.into_iter().flatten() {
        let v = v.into_float(ctx.device)?;
        acc = Some(match acc {
            None => v,
            Some(a) => float_binary(a, v, op)?,
        });
    }
    match acc {
        Some(a) => Ok(Value::Float(a).into()),
        None => op_bail!("{name} needs at least one input"),
    }
}

/// `Max` (variadic)
pub fn max(ctx: &OpContext, inputs: Inputs) -> OpResult<OpOutput> {
    variadic(ctx, inputs, "Max", i64::max, |a, b| a.max_pair(b))
}

/// `Min` (variadic)
pub fn min(ctx: &OpContext, inputs: Inputs) -> OpResult<OpOutput> {
    variadic(ctx, inputs, "Min", i64::min, |a, b| a.min_pair(b))
}

/// `Sum` (variadic)
pub fn sum(ctx: &OpContext, inputs: Inputs) -> OpResult<OpOutput> {
    variadic(ctx, inputs, "Sum", i64::wrapping_add, |a, b| a + b)
}

/// `f` of the float input `X`, as a one-output op.
pub(super) fn unary(
    ctx: &OpContext,
    mut inputs: Inputs,
    f: impl FnOnce(PhysTensor) -> PhysTensor,
) -> OpResult<OpOutput> {
    let x = inputs.float(0, "X", ctx.device)?;
    Ok(Value::Float(FloatValue::new(f(x.tensor), x.rank)).into())
}

/// `Relu`
pub fn relu(ctx: &OpContext, inputs: Inputs) -> OpResult<OpOutput> {
    unary(ctx, inputs, activation::relu)
}

/// `LeakyRelu`
pub fn leaky_relu(ctx: &OpContext, inputs: Inputs) -> OpResult<OpOutput> {
    let alpha = ctx.attrs.float("alpha", 0.01)? as f64;
    unary(ctx, inputs, |x| activation::leaky_relu(x, alpha))
}

/// `Elu`
pub fn elu(ctx: &OpContext, inputs: Inputs) -> OpResult<OpOutput> {
    let alpha = ctx.attrs.float("alpha", 1.0)? as f64;
    unary(ctx, inputs, |x| activation::elu(x, alpha))
}

/// `Sigmoid`
pub fn sigmoid(ctx: &OpContext, inputs: Inputs) -> OpResult<OpOutput> {
    unary(ctx, inputs, activation::sigmoid)
}

/// `HardSigmoid`
pub fn hard_sigmoid(ctx: &OpContext, inputs: Inputs) -> OpResult<OpOutput> {
    let alpha = ctx.attrs.float("alpha", 0.2)? as f64;
    let beta = ctx.attrs.float("beta", 0.5)? as f64;
    unary(ctx, inputs, |x| activation::hard_sigmoid(x, alpha, beta))
}

/// `Tanh`
pub fn tanh(ctx: &OpContext, inputs: Inputs) -> OpResult<OpOutput> {
    unary(ctx, inputs, crate::kernels::tanh)
}

/// `Gelu` (opset 20; `approximate` = "none" or "tanh"). A second input is the bias of the
/// product before it, folded in on load (`onnx::fusion::fuse_gelu_bias`, tanh form only).
pub fn gelu(ctx: &OpContext, mut inputs: Inputs) -> OpResult<OpOutput> {
    let approximate = ctx.attrs.string("approximate", "none")?;
    if inputs.0.len() == 2 && approximate == "tanh" {
        let x = inputs.float(0, "X", ctx.device)?;
        let bias = inputs.float(1, "bias", ctx.device)?;
        let rank = x.rank.max(bias.rank);
        let y = crate::kernels::gelu_tanh_biased(x.tensor, bias.tensor);
        return Ok(Value::Float(FloatValue::new(y, rank)).into());
    }
    match approximate.as_str() {
        "none" => unary(ctx, inputs, activation::gelu),
        "tanh" => unary(ctx, inputs, crate::kernels::gelu_tanh),
        other => op_bail!("attribute `approximate` must be \"none\" or \"tanh\", got {other:?}"),
    }
}

/// `Erf`
pub fn erf(ctx: &OpContext, inputs: Inputs) -> OpResult<OpOutput> {
    unary(ctx, inputs, |x| x.erf())
}

/// `Exp`
pub fn exp(ctx: &OpContext, inputs: Inputs) -> OpResult<OpOutput> {
    unary(ctx, inputs, |x| x.exp())
}

/// `Log`
pub fn log(ctx: &OpContext, inputs: Inputs) -> OpResult<OpOutput> {
    unary(ctx, inputs, |x| x.log())
}

/// `Sqrt`
pub fn sqrt(ctx: &OpContext, inputs: Inputs) -> OpResult<OpOutput> {
    unary(ctx, inputs, |x| x.sqrt())
}

/// `Reciprocal`
pub fn reciprocal(ctx: &OpContext, inputs: Inputs) -> OpResult<OpOutput> {
    unary(ctx, inputs, |x| x.recip())
}

/// `Neg` (integers stay on the host)
pub fn neg(ctx: &OpContext, mut inputs: Inputs) -> OpResult<OpOutput> {
    match inputs.take(0, "X")? {
        Value::Int(a) => Ok(Value::Int(a.mapv(i64::wrapping_neg)).into()),
        other => unary(ctx, Inputs(vec![Some(other)]), |x| x.neg()),
    }
}

/// `Abs` (integers stay on the host)
pub fn abs(ctx: &OpContext, mut inputs: Inputs) -> OpResult<OpOutput> {
    match inputs.take(0, "X")? {
        Value::Int(a) => Ok(Value::Int(a.mapv(i64::wrapping_abs)).into()),
        other => unary(ctx, Inputs(vec![Some(other)]), |x| x.abs()),
    }
}

/// `Softplus`
pub fn softplus(ctx: &OpContext, inputs: Inputs) -> OpResult<OpOutput> {
    unary(ctx, inputs, |x| activation::softplus(x, 1.0))
}

/// `Clip` (bounds as attributes before opset 11, as optional inputs after)
pub fn clip(ctx: &OpContext, mut inputs: Inputs) -> OpResult<OpOutput> {
    let x = inputs.take(0, "input")?;
    let (min, max) = if ctx.opset < 11 {
        (
            Some(ctx.attrs.float("min", f32::MIN)?),
            Some(ctx.attrs.float("max", f32::MAX)?),
        )
    } else {
        (
            inputs.opt(1).map(|v| v.scalar_f32("min")).transpose()?,
            inputs.opt(2).map(|v| v.scalar_f32("max")).transpose()?,
        )
    };
    if let Value::Int(a) = x {
        let lo = min.map_or(i64::MIN, |v| v as i64);
        let hi = max.map_or(i64::MAX, |v| v as i64);
        return Ok(Value::Int(a.mapv(|v| v.clamp(lo, hi))).into());
    }
    unary(ctx, Inputs(vec![Some(x)]), |t| {
        let t = match min {
            Some(m) => t.clamp_min(m),
            None => t,
        };
        match max {
            Some(m) => t.clamp_max(m),
            None => t,
        }
    })
}

/// `PRelu`: `x` where positive, `slope * x` elsewhere (slope broadcasts).
pub fn prelu(ctx: &OpContext, mut inputs: Inputs) -> OpResult<OpOutput> {
    let x = inputs.float(0, "X", ctx.device)?;
    let slope = inputs.float(1, "slope", ctx.device)?;
    let rank = x.rank;
    let neg = float_binary(
        FloatValue::new(x.tensor.clone().clamp_max(0.0), rank),
        slope,
        |a, b| a * b,
    )?;
    Ok(Value::Float(FloatValue::new(
        x.tensor.clamp_min(0.0) + neg.tensor,
        neg.rank,
    ))
    .into())
}

/// `HardSwish`: `x * max(0, min(1, x / 6 + 1 / 2))`
pub fn hard_swish(ctx: &OpContext, inputs: Inputs) -> OpResult<OpOutput> {
    unary(ctx, inputs, |x| {
        x.clone() * activation::hard_sigmoid(x, 1.0 / 6.0, 0.5)
    })
}

/// `Mod`: the sign of the divisor (`fmod = 0`, integers only) or of the dividend
/// (`fmod = 1`, C `fmod`).
pub fn modulo(ctx: &OpContext, mut inputs: Inputs) -> OpResult<OpOutput> {
    let fmod = ctx.attrs.int("fmod", 0)? != 0;
    let a = inputs.take(0, "A")?;
    let b = inputs.take(1, "B")?;
    if let (Value::Int(x), Value::Int(y)) = (&a, &b) {
        let out = host_binary(x, y, |p, q| {
            if *q == 0 {
                0
            } else if fmod {
                p % q
            } else {
                ((p % q) + q) % q
            }
        })?;
        return Ok(Value::Int(out).into());
    }
    if !fmod {
        op_bail!("Mod on floats requires fmod = 1 (the ONNX spec)");
    }
    let (a, b) = (a.into_float(ctx.device)?, b.into_float(ctx.device)?);
    Ok(Value::Float(float_binary(a, b, |x, y| x.fmod(y))?).into())
}

/// `Identity`
pub fn identity(_ctx: &OpContext, mut inputs: Inputs) -> OpResult<OpOutput> {
    Ok(inputs.take(0, "input")?.into())
}
