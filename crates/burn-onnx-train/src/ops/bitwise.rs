//! Integer bit operations and boolean `Xor`, on the host: `BitwiseAnd`, `BitwiseOr`,
//! `BitwiseXor`, `BitwiseNot`, `BitShift` (`direction` LEFT or RIGHT) and `Xor`.
//!
//! Integers are held as i64; narrower and unsigned types come out right once the result is
//! written back in the declared type (two's complement wraps the same way), as long as a
//! right shift's operand is not a negative i64 standing for a large unsigned value.

use super::broadcast::host_binary;
use super::{Inputs, OpContext, OpOutput};
use crate::error::OpResult;
use crate::op_bail;
use crate::value::Value;

fn int_binary(mut inputs: Inputs, f: impl Fn(i64, i64) -> i64) -> OpResult<OpOutput> {
    let a = inputs.take(0, "A")?;
    let b = inputs.take(1, "B")?;
    if let (Value::Bool(a), Value::Bool(b)) = (&a, &b) {
        let out = host_binary(a, b, |x, y| f(i64::from(*x), i64::from(*y)) != 0)?;
        return Ok(Value::Bool(out).into());
    }
    let (a, b) = (int_operand(a)?, int_operand(b)?);
    Ok(Value::Int(host_binary(&a, &b, |x, y| f(*x, *y))?).into())
}

fn int_operand(v: Value) -> OpResult<ndarray::ArrayD<i64>> {
    match v {
        Value::Float(_) => op_bail!("expects an integer tensor, got float"),
        other => other.into_int(),
    }
}

/// `BitwiseAnd`
pub fn bitwise_and(_ctx: &OpContext, inputs: Inputs) -> OpResult<OpOutput> {
    int_binary(inputs, |a, b| a & b)
}

/// `BitwiseOr`
pub fn bitwise_or(_ctx: &OpContext, inputs: Inputs) -> OpResult<OpOutput> {
    int_binary(inputs, |a, b| a | b)
}

/// `BitwiseXor`
pub fn bitwise_xor(_ctx: &OpContext, inputs: Inputs) -> OpResult<OpOutput> {
    int_binary(inputs, |a, b| a ^ b)
}

/// `Xor` (booleans)
pub fn xor(_ctx: &OpContext, mut inputs: Inputs) -> OpResult<OpOutput> {
    let a = inputs.take(0, "A")?.into_bool()?;
    let b = inputs.take(1, "B")?.into_bool()?;
    Ok(Value::Bool(host_binary(&a, &b, |x, y| x ^ y)?).into())
}

/// `BitwiseNot`
pub fn bitwise_not(_ctx: &OpContext, mut inputs: Inputs) -> OpResult<OpOutput> {
    Ok(Value::Int(int_operand(inputs.take(0, "X")?)?.mapv(|v| !v)).into())
}

/// `BitShift` (unsigned types only, as the spec says: shifts past the width give 0)
pub fn bit_shift(ctx: &OpContext, inputs: Inputs) -> OpResult<OpOutput> {
    let left = match ctx.attrs.string("direction", "")?.as_str() {
        "LEFT" => true,
        "RIGHT" => false,
        other => op_bail!("attribute `direction` must be \"LEFT\" or \"RIGHT\", got {other:?}"),
    };
    int_binary(inputs, move |x, s| {
        let (x, s) = (x as u64, s as u64);
        match (left, s) {
            (_, 64..) => 0,
            (true, s) => (x << s) as i64,
            (false, s) => (x >> s) as i64,
        }
    })
}
