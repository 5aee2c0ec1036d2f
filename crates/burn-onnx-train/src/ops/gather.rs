//! `Gather` and `GatherElements`. `Gather`: embedding lookups on float tables (differentiable, repeated indices
//! accumulate their gradients) and index picking on host integer tensors.

use ndarray::Axis;

use super::{Inputs, OpContext, OpOutput};
use crate::error::OpResult;
use burn::tensor::{Int, Tensor, TensorData};

use crate::op_bail;
use crate::value::{FloatValue, MAX_RANK, Value, norm_axis, padded};

/// `Gather`
pub fn gather(ctx: &OpContext, mut inputs: Inputs) -> OpResult<OpOutput> {
    let data = inputs.take(0, "data")?;
    let indices = inputs.take(1, "indices")?.into_int()?;
    let shape = data.shape();
    let axis = norm_axis(ctx.attrs.int("axis", 0)?, shape.len())?;
    let dim = shape[axis] as i64;
    let flat: Vec<usize> = indices
        .iter()
        .map(|&i| {
            let j = if i < 0 { i + dim } else { i };
            if j < 0 || j >= dim {
                Err(format!("index {i} is out of bounds for axis {axis} of size {dim}").into())
            } else {
                Ok(j as usize)
            }
        })
        .collect::<OpResult<_>>()?;
    let mut out_shape = shape[..axis].to_vec();
    out_shape.extend_from_slice(indices.shape());
    out_shape.extend_from_slice(&shape[axis + 1..]);
    let out = match data {
        Value::Str(_) => op_bail!("expected a numeric tensor, got strings"),
        Value::Sequence(_) => op_bail!("expected a tensor, got a sequence"),
        // An embedding lookup: rows of a `[dim, rest]` table. Burn's select (and its
        // backward, a scatter-add of rows) has a row-by-row path for rank 2 only; at the
        // physical rank it computes every element's index (~2% of a gpt2_tiny step).
        Value::Float(f) if axis == 0 => {
            let rest: usize = shape[1..].iter().product();
            let table = f.reshape(&[shape[0], rest])?.into_rank::<2>()?;
            let idx = ctx.memo.uploads().ints(&as_i64(&flat), ctx.device);
            let picked = FloatValue::from_rank(table.select(0, idx))?;
            Value::Float(picked.reshape(&out_shape)?)
        }
        Value::Float(f) => {
            let phys = f.axis(axis as i64)?;
            let idx = ctx.memo.uploads().ints(&as_i64(&flat), ctx.device);
            let picked = FloatValue::new(f.tensor.select(phys, idx), f.rank);
            Value::Float(picked.reshape(&out_shape)?)
        }
        Value::Int(a) => Value::Int(
            a.select(Axis(axis), &flat)
                .into_shape_with_order(out_shape)?,
        ),
        Value::Bool(a) => Value::Bool(
            a.select(Axis(axis), &flat)
                .into_shape_with_order(out_shape)?,
        ),
    };
    Ok(out.into())
}

/// Indices as the device's integers are made from.
fn as_i64(flat: &[usize]) -> Vec<i64> {
    flat.iter().map(|&v| v as i64).collect()
}

/// `GatherElements`: `out[i][j][k] = data[index[i][j][k]][j][k]` along `axis` (float data is
/// differentiable).
pub fn gather_elements(ctx: &OpContext, mut inputs: Inputs) -> OpResult<OpOutput> {
    let data = inputs.take(0, "data")?;
    let indices = inputs.take(1, "indices")?.into_int()?;
    let shape = data.shape();
    let axis = norm_axis(ctx.attrs.int("axis", 0)?, shape.len())?;
    if indices.ndim() != shape.len() {
        op_bail!(
            "indices {:?} must have the rank of data {shape:?}",
            indices.shape()
        );
    }
    let dim = shape[axis] as i64;
    let mut flat = Vec::with_capacity(indices.len());
    for &i in indices.iter() {
        let j = if i < 0 { i + dim } else { i };
        if j < 0 || j >= dim {
            op_bail!("index {i} is out of bounds for axis {axis} of size {dim}");
        }
        flat.push(j);
    }
    let out_shape = indices.shape().to_vec();
    Ok(match data {
        Value::Float(f) => {
            let phys = f.axis(axis as i64)?;
            let idx: Tensor<MAX_RANK, Int> = Tensor::from_data(
                TensorData::new(flat, padded(&out_shape)?.to_vec()),
                ctx.device,
            );
            Value::Float(FloatValue::new(f.tensor.gather(phys, idx), f.rank))
        }
        other => {
            let a = other.into_int()?;
            let mut k = 0;
            let out = ndarray::ArrayD::from_shape_fn(ndarray::IxDyn(&out_shape), |mut ix| {
                ix[axis] = flat[k] as usize;
                k += 1;
                a[ix]
            });
            Value::Int(out)
        }
    }
    .into())
}
