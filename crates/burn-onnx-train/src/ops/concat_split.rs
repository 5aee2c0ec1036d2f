//! `Concat` and `Split` (sizes from the input, the `split` attribute, or `num_outputs`).

use std::sync::Arc;

use burn::tensor::Tensor;
use ndarray::{ArrayD, Axis};

use super::{Inputs, OpContext, OpOutput};
use crate::error::OpResult;
use crate::kernels::{self, SplitPieces};
use crate::op_bail;
use crate::value::{FloatValue, Value, norm_axis};

fn host_concat<T: Clone>(parts: Vec<ArrayD<T>>, axis: usize) -> OpResult<ArrayD<T>> {
    let views: Vec<_> = parts.iter().map(|a| a.view()).collect();
    Ok(ndarray::concatenate(Axis(axis), &views)?)
}

/// `Concat`
pub fn concat(ctx: &OpContext, inputs: Inputs) -> OpResult<OpOutput> {
    let values: Vec<Value> = inputs.0.into_iter().flatten().collect();
    Ok(concat_values(ctx, values, ctx.attrs.int("axis", 0)?)?.into())
}

/// `values` joined along `axis` (negative counts from the end): floats on the device (any
/// float among them makes the result float), booleans and integers on the host.
pub(super) fn concat_values(ctx: &OpContext, values: Vec<Value>, axis: i64) -> OpResult<Value> {
    let Some(first) = values.first() else {
        op_bail!("Concat needs at least one input")
    };
    let rank = first.rank();
    let axis = norm_axis(axis, rank)?;
    let shape0 = first.shape();
    for v in &values {
        let s = v.shape();
        if s.len() != rank
            || s.iter()
                .zip(&shape0)
                .enumerate()
                .any(|(i, (a, b))| i != axis && a != b)
        {
            op_bail!(
                "input shapes differ outside axis {axis}: {:?}",
                values.iter().map(Value::shape).collect::<Vec<_>>()
            );
        }
    }
    let any_float = values.iter().any(|v| matches!(v, Value::Float(_)));
    let all_bool = values.iter().all(|v| matches!(v, Value::Bool(_)));
    let out = if any_float {
        let parts: Vec<FloatValue> = values
            .into_iter()
            .map(|v| v.into_float(ctx.device))
            .collect::<OpResult<_>>()?;
        let phys = parts[0].axis(axis as i64)?;
        Value::Float(FloatValue::new(
            Tensor::cat(parts.into_iter().map(|p| p.tensor).collect(), phys),
            rank,
        ))
    } else if all_bool {
        Value::Bool(host_concat(
            values
                .into_iter()
                .map(Value::into_bool)
                .collect::<OpResult<_>>()?,
            axis,
        )?)
    } else {
        Value::Int(host_concat(
            values
                .into_iter()
                .map(Value::into_int)
                .collect::<OpResult<_>>()?,
            axis,
        )?)
    };
    Ok(out)
}

/// Sizes of the pieces of a `Split`.
fn split_sizes(ctx: &OpContext, inputs: &mut Inputs, dim: usize) -> OpResult<Vec<usize>> {
    let explicit = if ctx.opset >= 13 {
        inputs.int_list(1, "split")?
    } else {
        ctx.attrs.ints("split")?
    };
    if let Some(s) = explicit {
        let sizes: Vec<usize> = s.iter().map(|&x| x.max(0) as usize).collect();
        if sizes.iter().sum::<usize>() != dim {
            op_bail!("split sizes {s:?} do not add up to the axis length {dim}");
        }
        return Ok(sizes);
    }
    let n = if ctx.attrs.has("num_outputs") {
        ctx.attrs.int("num_outputs", 1)? as usize
    } else {
        ctx.num_outputs
    };
    if n == 0 {
        op_bail!("Split needs at least one output");
    }
    // Opset 18: the last chunk is smaller when the length does not divide evenly.
    let chunk = dim.div_ceil(n);
    let mut sizes = Vec::with_capacity(n);
    let mut left = dim;
    for _ in 0..n {
        let s = chunk.min(left);
        sizes.push(s);
        left -= s;
    }
    Ok(sizes)
}

/// `Split`
pub fn split(ctx: &OpContext, mut inputs: Inputs) -> OpResult<OpOutput> {
    let x = inputs.take(0, "input")?;
    let shape = x.shape();
    let axis = norm_axis(ctx.attrs.int("axis", 0)?, shape.len())?;
    let sizes = split_sizes(ctx, &mut inputs, shape[axis])?;
    Ok(split_value(x, axis, &sizes)?.into())
}

/// `x` cut along logical `axis` into consecutive pieces of `sizes`.
pub(super) fn split_value(x: Value, axis: usize, sizes: &[usize]) -> OpResult<Vec<Value>> {
    let sizes = sizes.iter().copied();
    let mut out = Vec::with_capacity(sizes.len());
    let mut start = 0;
    match x {
        Value::Str(_) => op_bail!("expected a numeric tensor, got strings"),
        Value::Sequence(_) => op_bail!("expected a tensor, got a sequence"),
        Value::Float(f) => {
            let phys = f.axis(axis as i64)?;
            let pieces = Arc::new(SplitPieces::default());
            for s in sizes {
                let piece = match s {
                    0 => f.clone().narrow(phys, start, 0),
                    s => FloatValue::new(
                        kernels::narrow(f.tensor.clone(), phys, start, s, &pieces),
                        f.rank,
                    ),
                };
                out.push(Value::Float(piece));
                start += s;
            }
        }
        Value::Int(a) => {
            for s in sizes {
                let part = a.slice_axis(Axis(axis), ndarray::Slice::from(start..start + s));
                out.push(Value::Int(part.to_owned()));
                start += s;
            }
        }
        Value::Bool(a) => {
            for s in sizes {
                let part = a.slice_axis(Axis(axis), ndarray::Slice::from(start..start + s));
                out.push(Value::Bool(part.to_owned()));
                start += s;
            }
        }
    }
    Ok(out)
}
