//! `Softmax` and `LogSoftmax` (opset 13 semantics: along one axis; before opset 13 the
//! input is flattened at `axis` into 2-D first, as the older spec says).

use burn::tensor::activation;

use super::{Inputs, OpContext, OpOutput};
use crate::error::OpResult;
use crate::value::{FloatValue, PhysTensor, Value, norm_axis};

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

/// `Softmax`
pub fn softmax(ctx: &OpContext, inputs: Inputs) -> OpResult<OpOutput> {
    along_axis(ctx, inputs, crate::kernels::softmax)
}

/// `LogSoftmax`
pub fn log_softmax(ctx: &OpContext, inputs: Inputs) -> OpResult<OpOutput> {
    along_axis(ctx, inputs, |t, d| activation::log_softmax(t, d))
}
