//! Trigonometric and rounding element-wise ops: `Sin`, `Cos`, `Floor`, `Ceil`, `Round`
//! (half to even, as ONNX and NumPy), `Sign`. Integer inputs of the rounding ops stay
//! integers on the host.

use super::{Inputs, OpContext, OpOutput};
use crate::error::OpResult;
use crate::value::{FloatValue, PhysTensor, Value};

fn float_or_int(
    ctx: &OpContext,
    mut inputs: Inputs,
    f: fn(PhysTensor) -> PhysTensor,
    int: fn(i64) -> i64,
) -> OpResult<OpOutput> {
    Ok(match inputs.take(0, "X")? {
        Value::Int(a) => Value::Int(a.mapv(int)),
        other => {
            let x = other.into_float(ctx.device)?;
            Value::Float(FloatValue::new(f(x.tensor), x.rank))
        }
    }
    .into())
}

/// `Sin`
pub fn sin(ctx: &OpContext, inputs: Inputs) -> OpResult<OpOutput> {
    float_or_int(ctx, inputs, |t| t.sin(), |v| v)
}

/// `Cos`
pub fn cos(ctx: &OpContext, inputs: Inputs) -> OpResult<OpOutput> {
    float_or_int(ctx, inputs, |t| t.cos(), |v| v)
}

/// `Floor`
pub fn floor(ctx: &OpContext, inputs: Inputs) -> OpResult<OpOutput> {
    float_or_int(ctx, inputs, |t| t.floor(), |v| v)
}

/// `Ceil`
pub fn ceil(ctx: &OpContext, inputs: Inputs) -> OpResult<OpOutput> {
    float_or_int(ctx, inputs, |t| t.ceil(), |v| v)
}

/// `Round` (ties to even)
pub fn round(ctx: &OpContext, inputs: Inputs) -> OpResult<OpOutput> {
    float_or_int(ctx, inputs, |t| t.round(), |v| v)
}

/// `Sign`
pub fn sign(ctx: &OpContext, inputs: Inputs) -> OpResult<OpOutput> {
    float_or_int(ctx, inputs, |t| t.sign(), i64::signum)
}
