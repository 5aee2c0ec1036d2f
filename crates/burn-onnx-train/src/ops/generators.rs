//! Ops that make values from shapes and types: `Shape`, `Size`, `Range`,
//! `ConstantOfShape`, `Cast`, `CastLike`.

use ndarray::{ArrayD, IxDyn};

use super::quant::CAST_LIKE_TYPE;
use super::{Inputs, OpContext, OpOutput};
use crate::error::OpResult;
use crate::op_bail;
use crate::value::host_tensor::{HostTensor, dtype, low_precision};
use crate::value::{FloatValue, Value};

/// `Shape` (with opset-15 `start`/`end`)
pub fn shape(ctx: &OpContext, mut inputs: Inputs) -> OpResult<OpOutput> {
    shape_of(ctx, &inputs.take(0, "data")?.shape())
}

/// `Shape`'s output for an input of `shape` (the node's `start`/`end` applied).
pub fn shape_of(ctx: &OpContext, shape: &[usize]) -> OpResult<OpOutput> {
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

/// `Cast`: to a float type (computed as f32; a cast to float16 or bfloat16 rounds to that
/// type's precision, differentiably; a cast to float8, float4 or e8m0 rounds to that type's
/// grid per `saturate` and `round_mode`, with a straight-through gradient), an integer type
/// (held as i64, wrapped to the target's width as a C cast) or bool.
pub fn cast(ctx: &OpContext, mut inputs: Inputs) -> OpResult<OpOutput> {
    let x = inputs.take(0, "input")?;
    let to = ctx.attrs.int("to", 0)? as i32;
    Ok(cast_to(ctx, x, to)?.into())
}

/// `CastLike(input, target_type)`: `Cast` to the element type of `target_type`, as the
/// graph declares it (recorded at load time under [`CAST_LIKE_TYPE`]), else to its element
/// family (float, integer or bool: the interpreter holds no finer type at run time).
pub fn cast_like(ctx: &OpContext, mut inputs: Inputs) -> OpResult<OpOutput> {
    let x = inputs.take(0, "input")?;
    let recorded = ctx.attrs.int(CAST_LIKE_TYPE, 0)? as i32;
    let to = match inputs.take(1, "target_type")? {
        Value::Str(_) => op_bail!("expected a numeric tensor, got strings"),
        Value::Sequence(_) => op_bail!("expected a tensor, got a sequence"),
        Value::Float(_) if dtype::is_float(recorded) => recorded,
        Value::Int(_) if dtype::is_int(recorded) => recorded,
        Value::Float(_) => dtype::FLOAT,
        Value::Int(_) => dtype::INT64,
        Value::Bool(_) => dtype::BOOL,
    };
    Ok(cast_to(ctx, x, to)?.into())
}

/// `x` cast to the ONNX type `to` (the body of `Cast`).
pub(super) fn cast_to(ctx: &OpContext, x: Value, to: i32) -> OpResult<Value> {
    use burn::tensor::FloatDType;
    Ok(
        if low_precision::is_low_precision(to) && dtype::is_float(to) {
            let saturate = ctx.attrs.int("saturate", 1)? != 0;
            let round_mode = ctx.attrs.string("round_mode", "up")?;
            let f = x.into_float(ctx.device)?;
            let rounded = f
                .to_array()?
                .mapv(|v| low_precision::round_float(to, v, saturate, &round_mode));
            let r = FloatValue::from_array(&rounded, ctx.device)?;
            Value::Float(if f.tensor.is_tracked() {
                // Straight-through: the value is the rounded one, the gradient the identity's.
                let t = f.tensor.clone() - f.tensor.detach();
                FloatValue::new(r.tensor + t, r.rank)
            } else {
                r
            })
        } else if dtype::is_float(to) {
            let f = x.into_float(ctx.device)?;
            let low = match to {
                dtype::FLOAT16 => Some(FloatDType::F16),
                dtype::BFLOAT16 => Some(FloatDType::BF16),
                _ => None,
            };
            Value::Float(match low {
                Some(low) => FloatValue::new(f.tensor.cast(low).cast(FloatDType::F32), f.rank),
                None => f,
            })
        } else if low_precision::is_low_precision(to) && dtype::is_int(to) {
            Value::Int(match x {
                Value::Float(f) => f
                    .to_array()?
                    .mapv(|v| low_precision::convert_float_to_int(v, to)),
                other => other
                    .into_int()?
                    .mapv(|v| low_precision::convert_int(v, to)),
            })
        } else if dtype::is_int(to) {
            Value::Int(x.into_int()?.mapv(|v| wrap_int(v, to)))
        } else if to == dtype::BOOL {
            Value::Bool(x.into_bool()?)
        } else {
            op_bail!("cannot cast to {}", dtype::name(to))
        },
    )
}

/// An i64 wrapped to the width of the integer type `to`, as a C cast.
fn wrap_int(v: i64, to: i32) -> i64 {
    match to {
        dtype::INT8 => i64::from(v as i8),
        dtype::UINT8 => i64::from(v as u8),
        dtype::INT16 => i64::from(v as i16),
        dtype::UINT16 => i64::from(v as u16),
        dtype::INT32 => i64::from(v as i32),
        dtype::UINT32 => i64::from(v as u32),
        _ => v,
    }
}
