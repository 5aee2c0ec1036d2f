//! Selection ops: `TopK`, `Compress`, `NonZero`, `OneHot`, `Hardmax`, `EyeLike`.
//!
//! Which elements are chosen is decided on the host (indices are small); float values
//! that pass through (`TopK`'s values, `Compress`'s kept slices) are picked on the device
//! with differentiable gathers, so gradients flow back to the chosen elements.

use burn::tensor::{Int, Tensor, TensorData};
use ndarray::{ArrayD, Axis, Dimension, IxDyn};

use super::{Inputs, OpContext, OpOutput};
use crate::error::OpResult;
use crate::op_bail;
use crate::value::{FloatValue, MAX_RANK, Value, int_tensor_1d, norm_axis, padded};

/// The values of `v` on the host as f64 (for ordering and tests of non-zero).
fn host_f64(v: &Value) -> OpResult<ArrayD<f64>> {
    Ok(match v {
        Value::Str(_) => op_bail!("expected a numeric tensor, got strings"),
        Value::Sequence(_) => op_bail!("expected a tensor, got a sequence"),
        Value::Float(f) => f.to_array()?.mapv(f64::from),
        Value::Int(a) => a.mapv(|x| x as f64),
        Value::Bool(a) => a.mapv(|x| if x { 1.0 } else { 0.0 }),
    })
}

/// `TopK` (`axis`, `largest`, `sorted`): ties keep the lower index first, as onnxruntime.
pub fn top_k(ctx: &OpContext, mut inputs: Inputs) -> OpResult<OpOutput> {
    let x = inputs.take(0, "X")?;
    let k = match ctx.opset {
        ..10 => ctx.attrs.int("k", 0)?,
        _ => match inputs.take(1, "K")?.int_list("K")?[..] {
            [k] => k,
            _ => op_bail!("K must hold one value"),
        },
    };
    let shape = x.shape();
    let axis = norm_axis(ctx.attrs.int("axis", -1)?, shape.len())?;
    let largest = ctx.attrs.int("largest", 1)? != 0;
    if k < 0 || k as usize > shape[axis] {
        op_bail!(
            "K = {k} is outside 0..={} (axis {axis} of {shape:?})",
            shape[axis]
        );
    }
    let k = k as usize;
    let host = host_f64(&x)?;
    let mut out_shape = shape.clone();
    out_shape[axis] = k;
    let mut idx = ArrayD::<i64>::zeros(IxDyn(&out_shape));
    for (lane, mut out) in host
        .lanes(Axis(axis))
        .into_iter()
        .zip(idx.lanes_mut(Axis(axis)))
    {
        let mut order: Vec<usize> = (0..lane.len()).collect();
        order.sort_by(|&a, &b| {
            let (va, vb) = (lane[a], lane[b]);
            let o = if largest {
                vb.total_cmp(&va)
            } else {
                va.total_cmp(&vb)
            };
            o.then(a.cmp(&b))
        });
        for (slot, &i) in out.iter_mut().zip(&order[..k]) {
            *slot = i as i64;
        }
    }
    let values = match x {
        Value::Float(f) => {
            let phys = f.axis(axis as i64)?;
            let i: Tensor<MAX_RANK, Int> = Tensor::from_data(
                TensorData::new(idx.iter().copied().collect(), padded(&out_shape)?.to_vec()),
                ctx.device,
            );
            Value::Float(FloatValue::new(f.tensor.gather(phys, i), f.rank))
        }
        other => {
            let a = other.into_int()?;
            let mut n = idx.iter();
            Value::Int(ArrayD::from_shape_fn(IxDyn(&out_shape), |mut ix| {
                ix[axis] = *n.next().unwrap_or(&0) as usize;
                a[ix]
            }))
        }
    };
    Ok(vec![values, Value::Int(idx)].into())
}

/// `Compress` (`axis`; without it, on the flattened input)
pub fn compress(ctx: &OpContext, mut inputs: Inputs) -> OpResult<OpOutput> {
    let x = inputs.take(0, "input")?;
    let cond = inputs.take(1, "condition")?.into_bool()?;
    let (x, axis) = match ctx.attrs.get("axis") {
        Some(_) => {
            let axis = norm_axis(ctx.attrs.int("axis", 0)?, x.rank())?;
            (x, axis)
        }
        None => {
            let n = x.shape().iter().product();
            (x.reshape_to(&[n])?, 0)
        }
    };
    let dim = x.shape()[axis];
    if cond.len() > dim {
        op_bail!(
            "condition has {} entries, axis {axis} only {dim}",
            cond.len()
        );
    }
    let keep: Vec<usize> = cond
        .iter()
        .enumerate()
        .filter(|(_, c)| **c)
        .map(|(i, _)| i)
        .collect();
    Ok(match x {
        Value::Str(_) => op_bail!("expected a numeric tensor, got strings"),
        Value::Sequence(_) => op_bail!("expected a tensor, got a sequence"),
        Value::Float(f) => {
            let phys = f.axis(axis as i64)?;
            let idx = int_tensor_1d(keep.iter().map(|&i| i as i64).collect(), ctx.device);
            Value::Float(FloatValue::new(f.tensor.select(phys, idx), f.rank))
        }
        Value::Int(a) => Value::Int(a.select(Axis(axis), &keep)),
        Value::Bool(a) => Value::Bool(a.select(Axis(axis), &keep)),
    }
    .into())
}

/// `NonZero`: the indices of the non-zero elements, `[rank, count]`, in row-major order.
pub fn non_zero(_ctx: &OpContext, mut inputs: Inputs) -> OpResult<OpOutput> {
    let x = host_f64(&inputs.take(0, "X")?)?;
    let hits: Vec<Vec<usize>> = x
        .indexed_iter()
        .filter(|(_, v)| **v != 0.0)
        .map(|(ix, _)| ix.slice().to_vec())
        .collect();
    let rank = x.ndim();
    let out = ArrayD::from_shape_fn(IxDyn(&[rank, hits.len()]), |ix| hits[ix[1]][ix[0]] as i64);
    Ok(Value::Int(out).into())
}

/// `OneHot(indices, depth, values)` (`axis`): `values[1]` at each index, `values[0]`
/// elsewhere; negative indices count from the end, out-of-range ones give a row of off
/// values.
pub fn one_hot(ctx: &OpContext, mut inputs: Inputs) -> OpResult<OpOutput> {
    let indices = host_f64(&inputs.take(0, "indices")?)?;
    let depth = match inputs.take(1, "depth")?.scalar_f32("depth")? {
        d if d >= 1.0 => d as usize,
        d => op_bail!("depth must be at least 1, got {d}"),
    };
    let values = inputs.take(2, "values")?;
    if values.shape().iter().product::<usize>() != 2 {
        op_bail!(
            "values must hold two elements (off, on), got shape {:?}",
            values.shape()
        );
    }
    let rank = indices.ndim() + 1;
    let axis = norm_axis(ctx.attrs.int("axis", -1)?, rank)?;
    let mut shape = indices.shape().to_vec();
    shape.insert(axis, depth);
    let hot = |ix: &IxDyn| {
        let mut at: Vec<usize> = ix.slice().to_vec();
        let c = at.remove(axis);
        let i = indices[IxDyn(&at)] as i64;
        let i = if i < 0 { i + depth as i64 } else { i };
        i == c as i64
    };
    Ok(match values {
        Value::Int(v) => {
            let (off, on) = (
                v.iter().copied().next().unwrap_or(0),
                v.iter().copied().nth(1).unwrap_or(1),
            );
            Value::Int(ArrayD::from_shape_fn(IxDyn(&shape), |ix| {
                if hot(&ix) { on } else { off }
            }))
        }
        other => {
            let v = host_f64(&other)?;
            let (off, on) = (
                v.iter().copied().next().unwrap_or(0.0) as f32,
                v.iter().copied().nth(1).unwrap_or(1.0) as f32,
            );
            let a = ArrayD::from_shape_fn(IxDyn(&shape), |ix| if hot(&ix) { on } else { off });
            Value::Float(FloatValue::from_array(&a, ctx.device)?)
        }
    }
    .into())
}

/// `Hardmax` (`axis`; before opset 13 on the input flattened to 2-D at `axis`): 1 at the
/// first maximum of each lane, 0 elsewhere. Its gradient is zero, so it is a host op.
pub fn hardmax(ctx: &OpContext, mut inputs: Inputs) -> OpResult<OpOutput> {
    let x = inputs.take(0, "input")?;
    let shape = x.shape();
    let default_axis = if ctx.opset >= 13 { -1 } else { 1 };
    let axis = norm_axis(ctx.attrs.int("axis", default_axis)?, shape.len())?;
    let (view, lane_axis) = if ctx.opset >= 13 {
        (host_f64(&x)?, axis)
    } else {
        let outer: usize = shape[..axis].iter().product();
        let inner: usize = shape[axis..].iter().product();
        (
            host_f64(&x)?.into_shape_with_order(IxDyn(&[outer, inner]))?,
            1,
        )
    };
    let mut out = ArrayD::<f32>::zeros(view.raw_dim());
    for (lane, mut o) in view
        .lanes(Axis(lane_axis))
        .into_iter()
        .zip(out.lanes_mut(Axis(lane_axis)))
    {
        let best = (0..lane.len()).fold(None, |b: Option<usize>, i| match b {
            Some(j) if lane[j] >= lane[i] => Some(j),
            _ => Some(i),
        });
        if let Some(i) = best {
            o[i] = 1.0;
        }
    }
    let out = out.into_shape_with_order(IxDyn(&shape))?;
    Ok(Value::Float(FloatValue::from_array(&out, ctx.device)?).into())
}

/// `EyeLike` (`k`, `dtype`): ones on the `k`-th diagonal of a 2-D shape.
pub fn eye_like(ctx: &OpContext, mut inputs: Inputs) -> OpResult<OpOutput> {
    use crate::value::host_tensor::dtype;
    let x = inputs.take(0, "input")?;
    let shape = x.shape();
    let [rows, cols] = shape[..] else {
        op_bail!("input must be 2-D, got shape {shape:?}");
    };
    let k = ctx.attrs.int("k", 0)?;
    let on = |r: usize, c: usize| c as i64 - r as i64 == k;
    let to = ctx.attrs.int("dtype", 0)? as i32;
    let int_out = if to == 0 {
        !matches!(x, Value::Float(_))
    } else {
        !dtype::is_float(to)
    };
    Ok(if int_out {
        Value::Int(ArrayD::from_shape_fn(IxDyn(&[rows, cols]), |ix| {
            i64::from(on(ix[0], ix[1]))
        }))
    } else {
        let a = ArrayD::from_shape_fn(IxDyn(&[rows, cols]), |ix| {
            if on(ix[0], ix[1]) { 1.0 } else { 0.0 }
        });
        Value::Float(FloatValue::from_array(&a, ctx.device)?)
    }
    .into())
}
