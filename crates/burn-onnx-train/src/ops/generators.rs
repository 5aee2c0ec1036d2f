//! Ops that make values from shapes and types: `Shape`, `Size`, `Range`,
//! `ConstantOfShape`, `Cast`.

use ndarray::{ArrayD, IxDyn};

use super::{Inputs, OpContext, OpOutput};
use crate::error::OpResult;
use crate::host_tensor::{HostTensor, dtype};
use crate::op_bail;
use crate::value::{FloatValue, Value};

/// `Shape` (with opset-15 `start`/`end`)
pub fn shape(ctx: &OpContext, mut inputs: Inputs) -> OpResult<OpOutput> {
    let shape = inputs.take(0, "data")?.shape();
    let r = shape.len() as i64;
    let clamp = |v: i64| (if v < 0 { v + r } else { v }).clamp(0, r) as usize;
    let start = clamp(ctx.attrs.int("start", 0)?);
    let end = clamp(ctx.attrs.int("end", r)?);
    let dims: Vec<i64> = shape[start..end.max(start)]
        .iter()
        .map(|&d| d as i64)
        .collect();
    Ok(Value::Int(ArrayD::from_shape_vec(IxDyn(&[dims.len()]), dims)?).into())
}

/// `Size`
pub fn size(_ctx: &OpContext, mut inputs: Inputs) -> OpResult<OpOutput> {
    let n: usize = inputs.take(0, "data")?.shape().iter().product();
    Ok(Value::Int(ArrayD::from_elem(IxDyn(&[]), n as i64)).into())
}

/// `Range`
pub fn range(ctx: &OpContext, mut inputs: Inputs) -> OpResult<OpOutput> {
    let start = inputs.take(0, "start")?;
    let limit = inputs.take(1, "limit")?;
    let delta = inputs.take(2, "delta")?;
    if let (Value::Int(s), Value::Int(l), Value::Int(d)) = (&start, &limit, &delta) {
        let (s, l, d) = (scalar(s)?, scalar(l)?, scalar(d)?);
        if d == 0 {
            op_bail!("delta cannot be 0");
        }
        let n = ((l - s) as f64 / d as f64).ceil().max(0.0) as usize;
        let v: Vec<i64> = (0..n as i64).map(|i| s + i * d).collect();
        return Ok(Value::Int(ArrayD::from_shape_vec(IxDyn(&[n]), v)?).into());
    }
    let (s, l, d) = (
        start.scalar_f32("start")?,
        limit.scalar_f32("limit")?,
        delta.scalar_f32("delta")?,
    );
    if d == 0.0 {
        op_bail!("delta cannot be 0");
    }
    let n = ((l - s) / d).ceil().max(0.0) as usize;
    let v: Vec<f32> = (0..n).map(|i| s + i as f32 * d).collect();
    let a = ArrayD::from_shape_vec(IxDyn(&[n]), v)?;
    Ok(Value::Float(FloatValue::from_array(&a, ctx.device)?).into())
}

fn scalar(a: &ArrayD<i64>) -> OpResult<i64> {
    match a.iter().collect::<Vec<_>>().as_slice() {
        [x] => Ok(**x),
        _ => op_bail!("expected a scalar, got shape {:?}", a.shape()),
    }
}

/// `ConstantOfShape`
pub fn constant_of_shape(ctx: &OpContext, mut inputs: Inputs) -> OpResult<OpOutput> {
    let dims = inputs.take(0, "input")?.dims_list("input")?;
    let shape = IxDyn(&dims);
    Ok(match ctx.attrs.tensor("value")? {
        None => Value::Float(FloatValue::from_array(&ArrayD::zeros(shape), ctx.device)?),
        Some(HostTensor::Float(v)) => {
            let x = *v.iter().next().ok_or("attribute `value` is empty")?;
            Value::Float(FloatValue::from_array(
                &ArrayD::from_elem(shape, x),
                ctx.device,
            )?)
        }
        Some(HostTensor::Int(v)) => Value::Int(ArrayD::from_elem(
            shape,
            *v.iter().next().ok_or("attribute `value` is empty")?,
        )),
        Some(HostTensor::Bool(v)) => Value::Bool(ArrayD::from_elem(
            shape,
            *v.iter().next().ok_or("attribute `value` is empty")?,
        )),
    }
    .into())
}

/// `Cast`: to a float type (computed as f32), an integer type (i64) or bool.
pub fn cast(ctx: &OpContext, mut inputs: Inputs) -> OpResult<OpOutput> {
    let x = inputs.take(0, "input")?;
    let to = ctx.attrs.int("to", 0)? as i32;
    Ok(if dtype::is_float(to) {
        Value::Float(x.into_float(ctx.device)?)
    } else if dtype::is_int(to) {
        Value::Int(x.into_int()?)
    } else if to == dtype::BOOL {
        Value::Bool(x.into_bool()?)
    } else {
        op_bail!("cannot cast to {}", dtype::name(to))
    }
    .into())
}
