//! Comparisons, boolean logic and `Where`.
//!
//! Comparisons produce host booleans: they appear in masks and shape logic, where the
//! operands are small. `Where` with float branches runs on the device and is
//! differentiable in both branches.

use std::sync::Arc;

use burn::tensor::{Bool, Tensor, TensorData};
use ndarray::ArrayD;

use super::broadcast::{broadcast_shapes, host_binary};
use super::{Inputs, OpContext, OpOutput};
use crate::error::OpResult;
use crate::kernels::{masked_fill, masked_fill_fused_here};
use crate::op_bail;
use crate::value::{FloatValue, Value, padded};

fn compare(
    mut inputs: Inputs,
    int_cmp: fn(&i64, &i64) -> bool,
    float_cmp: fn(&f32, &f32) -> bool,
) -> OpResult<OpOutput> {
    let a = inputs.take(0, "A")?;
    let b = inputs.take(1, "B")?;
    let out = match (a, b) {
        (Value::Int(a), Value::Int(b)) => host_binary(&a, &b, int_cmp)?,
        (Value::Bool(a), Value::Bool(b)) => {
            host_binary(&a, &b, |x, y| int_cmp(&i64::from(*x), &i64::from(*y)))?
        }
        (a, b) => {
            let a = to_host_f32(a)?;
            let b = to_host_f32(b)?;
            host_binary(&a, &b, float_cmp)?
        }
    };
    Ok(Value::Bool(out).into())
}

fn to_host_f32(v: Value) -> OpResult<ArrayD<f32>> {
    Ok(match v {
        Value::Str(_) => op_bail!("expected a numeric tensor, got strings"),
        Value::Sequence(_) => op_bail!("expected a tensor, got a sequence"),
        Value::Float(f) => f.to_array()?,
        Value::Int(a) => a.mapv(|x| x as f32),
        Value::Bool(a) => a.mapv(|x| if x { 1.0 } else { 0.0 }),
    })
}

/// `Equal` (numbers, booleans or strings)
pub fn equal(_ctx: &OpContext, inputs: Inputs) -> OpResult<OpOutput> {
    if let [Some(Value::Str(a)), Some(Value::Str(b)), ..] = &inputs.0[..] {
        return Ok(Value::Bool(host_binary(a, b, |x, y| x == y)?).into());
    }
    compare(inputs, |a, b| a == b, |a, b| a == b)
}

/// `Less`
pub fn less(_ctx: &OpContext, inputs: Inputs) -> OpResult<OpOutput> {
    compare(inputs, |a, b| a < b, |a, b| a < b)
}

/// `LessOrEqual`
pub fn less_or_equal(_ctx: &OpContext, inputs: Inputs) -> OpResult<OpOutput> {
    compare(inputs, |a, b| a <= b, |a, b| a <= b)
}

/// `Greater`
pub fn greater(_ctx: &OpContext, inputs: Inputs) -> OpResult<OpOutput> {
    compare(inputs, |a, b| a > b, |a, b| a > b)
}

/// `GreaterOrEqual`
pub fn greater_or_equal(_ctx: &OpContext, inputs: Inputs) -> OpResult<OpOutput> {
    compare(inputs, |a, b| a >= b, |a, b| a >= b)
}

/// `Not`
pub fn not(_ctx: &OpContext, mut inputs: Inputs) -> OpResult<OpOutput> {
    Ok(Value::Bool(inputs.take(0, "X")?.into_bool()?.mapv(|v| !v)).into())
}

fn logic(mut inputs: Inputs, f: fn(&bool, &bool) -> bool) -> OpResult<OpOutput> {
    let a = inputs.take(0, "A")?.into_bool()?;
    let b = inputs.take(1, "B")?.into_bool()?;
    Ok(Value::Bool(host_binary(&a, &b, f)?).into())
}

/// `And`
pub fn and(_ctx: &OpContext, inputs: Inputs) -> OpResult<OpOutput> {
    logic(inputs, |a, b| *a && *b)
}

/// `Or`
pub fn or(_ctx: &OpContext, inputs: Inputs) -> OpResult<OpOutput> {
    logic(inputs, |a, b| *a || *b)
}

/// `Where(condition, X, Y)`
pub fn where_op(ctx: &OpContext, mut inputs: Inputs) -> OpResult<OpOutput> {
    let cond = inputs.take(0, "condition")?.into_bool()?;
    let x = inputs.take(1, "X")?;
    let y = inputs.take(2, "Y")?;
    match (x, y) {
        (Value::Int(x), Value::Int(y)) => {
            let xy = host_binary(&x, &y, |a, b| (*a, *b))?;
            Ok(Value::Int(host_binary(
                &cond,
                &xy,
                |c, (a, b)| if *c { *a } else { *b },
            )?)
            .into())
        }
        (x, y) => {
            let x = x.into_float(ctx.device)?;
            let y = y.into_float(ctx.device)?;
            Ok(Value::Float(where_floats(ctx, &cond, x, y)?).into())
        }
    }
}

/// `Where` of float branches: `x` where `cond`, `y` elsewhere, all three broadcast.
pub(super) fn where_floats(
    ctx: &OpContext,
    cond: &ArrayD<bool>,
    x: FloatValue,
    y: FloatValue,
) -> OpResult<FloatValue> {
    let shape = broadcast_shapes(&broadcast_shapes(cond.shape(), &x.shape())?, &y.shape())?;
    let (x, y) = match scalar_branch_fill(cond, x, y, &shape)? {
        Ok(out) => return Ok(out),
        Err(branches) => branches,
    };
    let x = x.broadcast_to(&shape)?;
    let y = y.broadcast_to(&shape)?;
    // The condition travels at its own shape and is broadcast where the tensors live (a
    // causal mask is T x T, the scores it selects batch x heads x T x T).
    let cond_dims = padded(cond.shape())?.to_vec();
    let cond: Vec<bool> = cond.iter().copied().collect();
    let mask = Tensor::<{ crate::value::MAX_RANK }, Bool>::from_data(
        TensorData::new(cond, cond_dims),
        ctx.device,
    )
    .expand(padded(&shape)?);
    // y where the mask is false, x where it is true.
    let out = y.tensor.mask_where(mask, x.tensor);
    Ok(FloatValue::new(out, shape.len()))
}

/// `Where` with one branch a constant scalar and the other already of the output's shape
/// (an attention mask: `Where(mask, scores, -inf)`) as the fused masked fill; otherwise the
/// branches back, for the general path.
fn scalar_branch_fill(
    cond: &ArrayD<bool>,
    x: FloatValue,
    y: FloatValue,
    shape: &[usize],
) -> OpResult<Result<FloatValue, (FloatValue, FloatValue)>> {
    let constant_scalar = |v: &FloatValue| v.numel() == 1 && !v.tensor.is_require_grad();
    let full = |v: &FloatValue| v.shape() == shape && masked_fill_fused_here(&v.tensor);
    let (tensor, fill, keep_when) = if full(&x) && constant_scalar(&y) {
        (x, y, true)
    } else if full(&y) && constant_scalar(&x) {
        (y, x, false)
    } else {
        return Ok(Err((x, y)));
    };
    let fill = Value::Float(fill).scalar_f32("the scalar branch")?;
    let keep = periodic_mask(cond, shape, keep_when)?;
    Ok(Ok(FloatValue::new(
        masked_fill(tensor.tensor, keep, fill),
        shape.len(),
    )))
}

/// `cond == keep_when` broadcast to `shape`, as its shortest period: `cond`'s own elements
/// when it broadcasts over leading dimensions only (a causal mask over batch and heads),
/// otherwise the whole broadcast.
fn periodic_mask(cond: &ArrayD<bool>, shape: &[usize], keep_when: bool) -> OpResult<Arc<[bool]>> {
    let padded: Vec<usize> = std::iter::repeat_n(1, shape.len() - cond.ndim())
        .chain(cond.shape().iter().copied())
        .collect();
    let first = padded.iter().position(|&d| d != 1).unwrap_or(shape.len());
    let keep = |&c: &bool| c == keep_when;
    if padded[first..] == shape[first..] {
        return Ok(cond.iter().map(keep).collect());
    }
    match cond.broadcast(ndarray::IxDyn(shape)) {
        Some(full) => Ok(full.iter().map(keep).collect()),
        None => crate::op_bail!("condition does not broadcast to {shape:?}"),
    }
}
