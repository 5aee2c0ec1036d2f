//! Index-addressed reads and writes: `GatherND`, `ScatterND`, `ScatterElements` (and its
//! deprecated name `Scatter`).
//!
//! Each is reduced to rows of a `[rows, inner]` view of the data: the indices are resolved
//! on the host (they are small integer tensors) into one row number per gathered or
//! written slice, and the float data moves on the device with Burn's row `select` /
//! `select_assign`, which are differentiable. A scatter without reduction zeroes the
//! written rows and adds the updates there (gradients reach both `data` and `updates`);
//! `add` adds; `mul`, `max` and `min` are computed on the host and do not propagate
//! gradients.

use burn::tensor::{Bool, IndexingUpdateOp, Tensor, TensorData};
use ndarray::{ArrayD, Dimension, IxDyn};

use super::{Inputs, OpContext, OpOutput};
use crate::error::OpResult;
use crate::op_bail;
use crate::value::{FloatValue, Value, int_tensor_1d, norm_axis};

/// Resolve a possibly negative index along a dimension of size `dim`.
fn resolve(i: i64, dim: usize, what: &str) -> OpResult<usize> {
    let j = if i < 0 { i + dim as i64 } else { i };
    if j < 0 || j >= dim as i64 {
        op_bail!("{what} index {i} is out of bounds for a dimension of size {dim}");
    }
    Ok(j as usize)
}

/// Row-major strides of a shape.
fn strides(shape: &[usize]) -> Vec<usize> {
    let mut s = vec![1; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        s[i] = s[i + 1] * shape[i + 1];
    }
    s
}

/// For `GatherND`/`ScatterND`: the row of the `[rows, inner]` view of `data` that each
/// index tuple (the last axis of `indices`, after `batch_dims` leading batch axes) names.
fn nd_rows(
    shape: &[usize],
    indices: &ArrayD<i64>,
    batch_dims: usize,
) -> OpResult<(Vec<usize>, usize)> {
    let ishape = indices.shape();
    let Some(&k) = ishape.last() else {
        op_bail!("indices must have rank >= 1");
    };
    if batch_dims + k > shape.len() || batch_dims >= ishape.len() {
        op_bail!("indices {ishape:?} with batch_dims {batch_dims} do not fit data {shape:?}");
    }
    if ishape[..batch_dims] != shape[..batch_dims] {
        op_bail!("batch dimensions of indices {ishape:?} and data {shape:?} differ");
    }
    let addressed = &shape[..batch_dims + k];
    let st = strides(addressed);
    let batch: usize = shape[..batch_dims].iter().product();
    let per_batch: usize = shape[batch_dims..batch_dims + k].iter().product();
    let tuples: Vec<&[i64]> = indices
        .as_slice()
        .ok_or("indices not contiguous")?
        .chunks(k.max(1))
        .collect();
    let tuples_per_batch = if batch == 0 { 0 } else { tuples.len() / batch };
    let mut rows = Vec::with_capacity(tuples.len());
    for (t, tuple) in tuples.iter().enumerate() {
        let b = if tuples_per_batch == 0 {
            0
        } else {
            t / tuples_per_batch
        };
        let mut row = b * per_batch;
        for (j, &i) in tuple.iter().take(k).enumerate() {
            row += resolve(i, shape[batch_dims + j], "GatherND/ScatterND")? * st[batch_dims + j];
        }
        rows.push(row);
    }
    let inner: usize = shape[batch_dims + k..].iter().product();
    Ok((rows, inner))
}

/// Inputs 0 and 1: the data and its (row-major) integer indices.
fn data_and_indices(inputs: &mut Inputs) -> OpResult<(Value, ArrayD<i64>)> {
    let data = inputs.take(0, "data")?;
    let indices = inputs.take(1, "indices")?.into_int()?;
    Ok((data, indices.as_standard_layout().into_owned()))
}

/// `GatherND` (`batch_dims`)
pub fn gather_nd(ctx: &OpContext, mut inputs: Inputs) -> OpResult<OpOutput> {
    let (data, indices) = data_and_indices(&mut inputs)?;
    let batch_dims = ctx.attrs.int("batch_dims", 0)? as usize;
    let shape = data.shape();
    let (rows, inner) = nd_rows(&shape, &indices, batch_dims)?;
    let ishape = indices.shape();
    let k = ishape[ishape.len() - 1];
    let mut out_shape = ishape[..ishape.len() - 1].to_vec();
    out_shape.extend_from_slice(&shape[batch_dims + k..]);
    let total: usize = shape.iter().product();
    let all_rows = if inner == 0 { 0 } else { total / inner };
    Ok(select_rows(ctx, data, all_rows, inner, &rows)?
        .reshape_to(&out_shape)?
        .into())
}

/// `ScatterND` (`reduction`: none, add, mul, max, min)
pub fn scatter_nd(ctx: &OpContext, mut inputs: Inputs) -> OpResult<OpOutput> {
    let (data, indices) = data_and_indices(&mut inputs)?;
    let updates = inputs.take(2, "updates")?;
    let shape = data.shape();
    let (rows, inner) = nd_rows(&shape, &indices, 0)?;
    let reduction = ctx.attrs.string("reduction", "none")?;
    scatter_rows(ctx, data, &rows, inner, updates, &reduction)
}

/// `ScatterElements` / `Scatter` (`axis`, `reduction`)
pub fn scatter_elements(ctx: &OpContext, mut inputs: Inputs) -> OpResult<OpOutput> {
    let data = inputs.take(0, "data")?;
    let indices = inputs.take(1, "indices")?.into_int()?;
    let updates = inputs.take(2, "updates")?;
    let shape = data.shape();
    let axis = norm_axis(ctx.attrs.int("axis", 0)?, shape.len())?;
    if indices.ndim() != shape.len() || updates.shape() != indices.shape() {
        op_bail!(
            "indices {:?} and updates {:?} must have the rank of data {shape:?} and one shape",
            indices.shape(),
            updates.shape()
        );
    }
    let st = strides(&shape);
    let mut rows = Vec::with_capacity(indices.len());
    for (ix, &i) in indices.indexed_iter() {
        let mut flat = 0;
        for (d, &c) in ix.slice().iter().enumerate() {
            let c = if d == axis {
                resolve(i, shape[axis], "ScatterElements")?
            } else {
                c
            };
            if c >= shape[d] {
                op_bail!(
                    "indices {:?} exceed data {shape:?} on axis {d}",
                    indices.shape()
                );
            }
            flat += c * st[d];
        }
        rows.push(flat);
    }
    let reduction = ctx.attrs.string("reduction", "none")?;
    scatter_rows(ctx, data, &rows, 1, updates, &reduction)
}

/// Rows `rows` of the `[all_rows, inner]` view of `data`, as `[rows.len(), inner]`.
fn select_rows(
    ctx: &OpContext,
    data: Value,
    all_rows: usize,
    inner: usize,
    rows: &[usize],
) -> OpResult<Value> {
    let n = rows.len();
    Ok(match data {
        Value::Str(_) => op_bail!("expected a numeric tensor, got strings"),
        Value::Sequence(_) => op_bail!("expected a tensor, got a sequence"),
        Value::Float(f) => {
            let table = f.reshape(&[all_rows, inner])?.into_rank::<2>()?;
            let idx = int_tensor_1d(rows.iter().map(|&r| r as i64).collect(), ctx.device);
            Value::Float(FloatValue::from_rank(table.select(0, idx))?)
        }
        Value::Int(a) => Value::Int(host_rows(&a, inner, rows, n)?),
        Value::Bool(a) => Value::Bool(host_rows(&a, inner, rows, n)?),
    })
}

fn host_rows<T: Clone>(
    a: &ArrayD<T>,
    inner: usize,
    rows: &[usize],
    n: usize,
) -> OpResult<ArrayD<T>> {
    let flat: Vec<T> = a.iter().cloned().collect();
    let mut out = Vec::with_capacity(n * inner);
    for &r in rows {
        out.extend_from_slice(&flat[r * inner..(r + 1) * inner]);
    }
    Ok(ArrayD::from_shape_vec(IxDyn(&[n, inner]), out)?)
}

/// Write `updates` (viewed as `[rows.len(), inner]`) into the rows `rows` of the
/// `[_, inner]` view of `data`, combining by `reduction`.
fn scatter_rows(
    ctx: &OpContext,
    data: Value,
    rows: &[usize],
    inner: usize,
    updates: Value,
    reduction: &str,
) -> OpResult<OpOutput> {
    let shape = data.shape();
    let total: usize = shape.iter().product();
    let all_rows = if inner == 0 { 0 } else { total / inner };
    if updates.shape().iter().product::<usize>() != rows.len() * inner {
        op_bail!(
            "updates {:?} do not hold {} slices of {inner} elements",
            updates.shape(),
            rows.len()
        );
    }
    if !matches!(reduction, "none" | "add" | "mul" | "max" | "min") {
        op_bail!("attribute `reduction` must be none, add, mul, max or min, got {reduction:?}");
    }
    if let (Value::Float(d), "none" | "add") = (&data, reduction) {
        let table = d.clone().reshape(&[all_rows, inner])?.into_rank::<2>()?;
        let upd = updates
            .into_float(ctx.device)?
            .reshape(&[rows.len(), inner])?
            .into_rank::<2>()?;
        let base = if reduction == "none" {
            let mut hit = vec![false; all_rows * inner];
            for &r in rows {
                hit[r * inner..(r + 1) * inner].fill(true);
            }
            let mask: Tensor<2, Bool> =
                Tensor::from_data(TensorData::new(hit, vec![all_rows, inner]), ctx.device);
            table.mask_fill(mask, 0.0)
        } else {
            table
        };
        let idx = int_tensor_1d(rows.iter().map(|&r| r as i64).collect(), ctx.device);
        let out = base.select_assign(0, idx, upd, IndexingUpdateOp::Add);
        return Ok(Value::Float(FloatValue::from_rank(out)?.reshape(&shape)?).into());
    }
    let is_float = matches!(data, Value::Float(_));
    let mut acc: Vec<f64> = match data {
        Value::Float(f) => f.to_array()?.iter().map(|&v| f64::from(v)).collect(),
        other => other.into_int()?.iter().map(|&v| v as f64).collect(),
    };
    let upd: Vec<f64> = match updates {
        Value::Float(f) => f.to_array()?.iter().map(|&v| f64::from(v)).collect(),
        other => other.into_int()?.iter().map(|&v| v as f64).collect(),
    };
    for (k, &r) in rows.iter().enumerate() {
        for j in 0..inner {
            let (slot, u) = (&mut acc[r * inner + j], upd[k * inner + j]);
            *slot = match reduction {
                "none" => u,
                "add" => *slot + u,
                "mul" => *slot * u,
                "max" => slot.max(u),
                _ => slot.min(u),
            };
        }
    }
    Ok(if is_float {
        let a = ArrayD::from_shape_vec(IxDyn(&shape), acc.iter().map(|&v| v as f32).collect())?;
        Value::Float(FloatValue::from_array(&a, ctx.device)?)
    } else {
        Value::Int(ArrayD::from_shape_vec(
            IxDyn(&shape),
            acc.iter().map(|&v| v as i64).collect(),
        )?)
    }
    .into())
}
