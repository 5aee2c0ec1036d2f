//! `Softmax` and `LogSoftmax` (opset 13 semantics: along one axis; before opset 13 the
//! input is flattened at `axis` into 2-D first, as the older spec says).

use burn::tensor::{TensorData, activation};
use ndarray::ArrayD;

use super::broadcast::{broadcast_shapes, float_binary};
use super::compare::where_floats;
use super::{Inputs, OpContext, OpOutput};
use crate::error::OpResult;
use crate::graph::attributes::MASKED_SOFTMAX;
use crate::kernels::{self, masked_softmax_fused_here};
use crate::op_bail;
use crate::value::{FloatValue, MAX_RANK, PhysTensor, Value, norm_axis, padded};

fn along_axis(
    ctx: &OpContext,
    mut inputs: Inputs,
    f: fn(PhysTensor, usize) -> PhysTensor,
) -> OpResult<OpOutput> {
    let x = inputs.float(0, "input", ctx.device)?;
    let shape = x.shape();
    let default_axis = if ctx.opset >= 13 { -1 } else { 1 };
    let axis = norm_axis(ctx.attrs.int("axis", default_axis)?, shape.len())?;
    if ctx.opset >= 13 {
        let phys = x.axis(axis as i64)?;
        return Ok(Value::Float(FloatValue::new(f(x.tensor, phys), x.rank)).into());
    }
    let outer: usize = shape[..axis].iter().product();
    let inner: usize = shape[axis..].iter().product();
    let flat = x.reshape(&[outer, inner])?;
    let phys = flat.axis(1)?;
    let y = FloatValue::new(f(flat.tensor, phys), 2);
    Ok(Value::Float(y.reshape(&shape)?).into())
}

/// `Softmax`, with the scaling and masking of its input folded in where the graph had
/// them ([`MASKED_SOFTMAX`]).
pub fn softmax(ctx: &OpContext, inputs: Inputs) -> OpResult<OpOutput> {
    match ctx.attrs.floats(MASKED_SOFTMAX)? {
        Some(mark) => masked_softmax(ctx, inputs, mark),
        None => along_axis(ctx, inputs, crate::kernels::softmax),
    }
}

/// `softmax(where(mask == keep_when, x * c or x / c, fill) + bias)` (opset 13 and
/// later): one kernel each way on CubeCL devices ([`kernels::masked_softmax`]) when the
/// mask and the bias fit the scores' shape and the bias needs no gradient, the graph's
/// own composition otherwise.
fn masked_softmax(ctx: &OpContext, mut inputs: Inputs, mark: &[f32]) -> OpResult<OpOutput> {
    let &[c, divide, fill, keep_when] = mark else {
        op_bail!("malformed `{MASKED_SOFTMAX}` mark {mark:?}")
    };
    let x = inputs.float(0, "input", ctx.device)?;
    let cond = inputs.opt(1).map(Value::into_bool).transpose()?;
    let bias = inputs
        .opt(2)
        .map(|b| b.into_float(ctx.device))
        .transpose()?;
    let (shape, rank) = (x.shape(), x.rank);
    let axis = norm_axis(ctx.attrs.int("axis", -1)?, rank)?;
    let fits = |s: &[usize]| broadcast_shapes(s, &shape).is_ok_and(|b| b == shape);
    let fused = axis + 1 == rank
        && cond.as_ref().is_none_or(|m| fits(m.shape()))
        && bias
            .as_ref()
            .is_none_or(|b| fits(&b.shape()) && !b.tensor.is_require_grad())
        && masked_softmax_fused_here(&x.tensor);
    if fused {
        let scale = if divide == 1.0 { 1.0 / c } else { c };
        let keep = keep_values(cond.as_ref(), keep_when == 1.0, &x.tensor)?;
        let bias = match bias {
            Some(b) => b.tensor,
            None => constant_like(0.0, &x.tensor),
        };
        let y = kernels::masked_softmax(x.tensor, keep, bias, scale, fill);
        return Ok(Value::Float(FloatValue::new(y, rank)).into());
    }
    let scaled = match (c, divide == 1.0) {
        (1.0, _) => x,
        (c, true) => FloatValue::new(x.tensor.div_scalar(c), rank),
        (c, false) => FloatValue::new(x.tensor.mul_scalar(c), rank),
    };
    let masked = match cond {
        Some(cond) => {
            let fill = FloatValue::new(constant_like(fill, &scaled.tensor), 0);
            if keep_when == 1.0 {
                where_floats(ctx, &cond, scaled, fill)?
            } else {
                where_floats(ctx, &cond, fill, scaled)?
            }
        }
        None => scaled,
    };
    let biased = match bias {
        Some(bias) => float_binary(masked, bias, |a, b| a + b)?,
        None => masked,
    };
    let phys = biased.axis(axis as i64)?;
    let y = crate::kernels::softmax(biased.tensor, phys);
    Ok(Value::Float(FloatValue::new(y, biased.rank)).into())
}

/// A one-element tensor holding `v` on `like`'s device.
fn constant_like(v: f32, like: &PhysTensor) -> PhysTensor {
    PhysTensor::from_data(TensorData::new(vec![v], [1; MAX_RANK]), &like.device())
}

/// The mask as the fused kernel reads it: 1 where the score is kept, 0 where filled, at
/// the condition's own (padded) shape; all ones without a condition.
fn keep_values(
    cond: Option<&ArrayD<bool>>,
    keep_when: bool,
    like: &PhysTensor,
) -> OpResult<PhysTensor> {
    let Some(cond) = cond else {
        return Ok(constant_like(1.0, like));
    };
    let values: Vec<f32> = cond
        .iter()
        .map(|&c| if c == keep_when { 1.0 } else { 0.0 })
        .collect();
    Ok(PhysTensor::from_data(
        TensorData::new(values, padded(cond.shape())?),
        &like.device(),
    ))
}

/// `LogSoftmax`
pub fn log_softmax(ctx: &OpContext, inputs: Inputs) -> OpResult<OpOutput> {
    along_axis(ctx, inputs, |t, d| activation::log_softmax(t, d))
}
