//! The rest of the element-wise float ops: inverse and hyperbolic trigonometry (`Tan`,
//! `Asin` ... `Atanh`), the less common activations (`Selu`, `Celu`, `Mish`, `Swish`,
//! `Softsign`, `ThresholdedRelu`, `Shrink`), the variadic `Mean`, and the float tests
//! `IsNaN` / `IsInf` (host booleans, as the comparisons give).
//!
//! Every float op here is composed of differentiable Burn ops, so it trains.

use burn::tensor::activation;

use super::elementwise::unary;
use super::{Inputs, OpContext, OpOutput};
use crate::error::OpResult;
use crate::op_bail;
use crate::value::{FloatValue, PhysTensor, Value};

/// `Tan`
pub fn tan(ctx: &OpContext, inputs: Inputs) -> OpResult<OpOutput> {
    unary(ctx, inputs, |x| x.tan())
}

/// `Asin`
pub fn asin(ctx: &OpContext, inputs: Inputs) -> OpResult<OpOutput> {
    unary(ctx, inputs, |x| x.asin())
}

/// `Acos`
pub fn acos(ctx: &OpContext, inputs: Inputs) -> OpResult<OpOutput> {
    unary(ctx, inputs, |x| x.acos())
}

/// `Atan`
pub fn atan(ctx: &OpContext, inputs: Inputs) -> OpResult<OpOutput> {
    unary(ctx, inputs, |x| x.atan())
}

/// `Sinh`
pub fn sinh(ctx: &OpContext, inputs: Inputs) -> OpResult<OpOutput> {
    unary(ctx, inputs, |x| x.sinh())
}

/// `Cosh`
pub fn cosh(ctx: &OpContext, inputs: Inputs) -> OpResult<OpOutput> {
    unary(ctx, inputs, |x| x.cosh())
}

/// `Asinh`
pub fn asinh(ctx: &OpContext, inputs: Inputs) -> OpResult<OpOutput> {
    unary(ctx, inputs, |x| x.asinh())
}

/// `Acosh`
pub fn acosh(ctx: &OpContext, inputs: Inputs) -> OpResult<OpOutput> {
    unary(ctx, inputs, |x| x.acosh())
}

/// `Atanh`
pub fn atanh(ctx: &OpContext, inputs: Inputs) -> OpResult<OpOutput> {
    unary(ctx, inputs, |x| x.atanh())
}

/// `alpha * (exp(min(x, 0) / scale) - 1)`: the negative branch of ELU-like activations,
/// zero for positive `x` (and its gradient there too).
fn exp_branch(x: PhysTensor, alpha: f64, scale: f64) -> PhysTensor {
    x.clamp_max(0.0)
        .div_scalar(scale)
        .exp()
        .sub_scalar(1.0)
        .mul_scalar(alpha)
}

/// `Selu`: `gamma * (x if x > 0 else alpha * (exp(x) - 1))`
pub fn selu(ctx: &OpContext, inputs: Inputs) -> OpResult<OpOutput> {
    let alpha = f64::from(ctx.attrs.float("alpha", 1.673_263_2)?);
    let gamma = f64::from(ctx.attrs.float("gamma", 1.050_701)?);
    unary(ctx, inputs, |x| {
        (activation::relu(x.clone()) + exp_branch(x, alpha, 1.0)).mul_scalar(gamma)
    })
}

/// `Celu`: `max(0, x) + min(0, alpha * (exp(x / alpha) - 1))`
pub fn celu(ctx: &OpContext, inputs: Inputs) -> OpResult<OpOutput> {
    let alpha = f64::from(ctx.attrs.float("alpha", 1.0)?);
    if alpha == 0.0 {
        op_bail!("attribute `alpha` must not be 0");
    }
    unary(ctx, inputs, |x| {
        activation::relu(x.clone()) + exp_branch(x, alpha, alpha)
    })
}

/// `Mish`: `x * tanh(softplus(x))`
pub fn mish(ctx: &OpContext, inputs: Inputs) -> OpResult<OpOutput> {
    unary(ctx, inputs, |x| {
        x.clone() * activation::softplus(x, 1.0).tanh()
    })
}

/// `Swish` (opset 24): `x * sigmoid(alpha * x)`
pub fn swish(ctx: &OpContext, inputs: Inputs) -> OpResult<OpOutput> {
    let alpha = f64::from(ctx.attrs.float("alpha", 1.0)?);
    unary(ctx, inputs, |x| {
        x.clone() * activation::sigmoid(x.mul_scalar(alpha))
    })
}

/// `Softsign`: `x / (1 + |x|)`
pub fn softsign(ctx: &OpContext, inputs: Inputs) -> OpResult<OpOutput> {
    unary(ctx, inputs, |x| x.clone() / x.abs().add_scalar(1.0))
}

/// `ThresholdedRelu`: `x if x > alpha else 0`
pub fn thresholded_relu(ctx: &OpContext, inputs: Inputs) -> OpResult<OpOutput> {
    let alpha = ctx.attrs.float("alpha", 1.0)?;
    unary(ctx, inputs, |x| {
        let below = x.clone().lower_equal_elem(alpha);
        x.mask_fill(below, 0.0)
    })
}

/// `Shrink`: `x + bias` below `-lambd`, `x - bias` above `lambd`, 0 between (integer
/// inputs stay integers on the host).
pub fn shrink(ctx: &OpContext, mut inputs: Inputs) -> OpResult<OpOutput> {
    let lambd = ctx.attrs.float("lambd", 0.5)?;
    let bias = ctx.attrs.float("bias", 0.0)?;
    let x = inputs.take(0, "input")?;
    if let Value::Int(a) = x {
        let (l, b) = (f64::from(lambd), f64::from(bias));
        return Ok(Value::Int(a.mapv(|v| {
            let f = v as f64;
            if f < -l {
                (f + b) as i64
            } else if f > l {
                (f - b) as i64
            } else {
                0
            }
        }))
        .into());
    }
    unary(ctx, Inputs(vec![Some(x)]), |x| {
        let low = x.clone().lower_elem(-lambd);
        let high = x.clone().greater_elem(lambd);
        let zero = x.zeros_like();
        zero.mask_where(low, x.clone().add_scalar(bias))
            .mask_where(high, x.sub_scalar(bias))
    })
}

/// `Mean` (variadic, broadcasting)
pub fn mean(ctx: &OpContext, inputs: Inputs) -> OpResult<OpOutput> {
    let n = inputs.0.iter().flatten().count();
    let sum = super::elementwise::sum(ctx, inputs)?;
    let Some(Value::Float(s)) = sum.values.into_iter().next() else {
        op_bail!("Mean needs float inputs");
    };
    Ok(Value::Float(FloatValue::new(s.tensor.div_scalar(n as f64), s.rank)).into())
}

/// `IsNaN`
pub fn is_nan(_ctx: &OpContext, mut inputs: Inputs) -> OpResult<OpOutput> {
    let x = float_on_host(inputs.take(0, "X")?)?;
    Ok(Value::Bool(x.mapv(f32::is_nan)).into())
}

/// `IsInf` (`detect_positive`, `detect_negative`)
pub fn is_inf(ctx: &OpContext, mut inputs: Inputs) -> OpResult<OpOutput> {
    let pos = ctx.attrs.int("detect_positive", 1)? != 0;
    let neg = ctx.attrs.int("detect_negative", 1)? != 0;
    let x = float_on_host(inputs.take(0, "X")?)?;
    Ok(Value::Bool(x.mapv(|v| v.is_infinite() && ((v > 0.0 && pos) || (v < 0.0 && neg)))).into())
}

fn float_on_host(v: Value) -> OpResult<ndarray::ArrayD<f32>> {
    match v {
        Value::Str(_) => op_bail!("expected a numeric tensor, got strings"),
        Value::Sequence(_) => op_bail!("expected a tensor, got a sequence"),
        Value::Float(f) => f.to_array(),
        Value::Int(a) => Ok(a.mapv(|x| x as f32)),
        Value::Bool(_) => op_bail!("expects a float tensor, got bool"),
    }
}
