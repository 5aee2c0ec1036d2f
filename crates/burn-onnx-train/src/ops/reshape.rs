//! Shape movement: `Reshape`, `Flatten`, `Transpose`, `Squeeze`, `Unsqueeze`, `Expand`.
//! They work on every value kind: device floats and host ints/bools alike.

use ndarray::{ArrayD, IxDyn};

use super::broadcast::broadcast_shapes;
use super::{Inputs, OpContext, OpOutput};
use crate::error::OpResult;
use crate::kernels;
use crate::op_bail;
use crate::value::{FloatValue, MAX_RANK, Value, norm_axis, padded};

fn host_reshape<T: Clone>(a: ArrayD<T>, shape: &[usize]) -> OpResult<ArrayD<T>> {
    let a = a.as_standard_layout().into_owned();
    Ok(a.into_shape_with_order(IxDyn(shape))?)
}

/// Reshape any value to a logical shape with the same element count.
pub fn reshape_value(v: Value, shape: &[usize]) -> OpResult<Value> {
    let n: usize = shape.iter().product();
    let have: usize = v.shape().iter().product();
    if n != have {
        op_bail!(
            "cannot reshape {:?} ({have} elements) to {shape:?}",
            v.shape()
        );
    }
    Ok(match v {
        Value::Str(_) => op_bail!("expected a numeric tensor, got strings"),
        Value::Sequence(_) => op_bail!("expected a tensor, got a sequence"),
        Value::Float(f) => Value::Float(reshape_float(f, shape)?),
        Value::Int(a) => Value::Int(host_reshape(a, shape)?),
        Value::Bool(a) => Value::Bool(host_reshape(a, shape)?),
    })
}

/// A float value reshaped: a view where the strides allow ([`kernels::reshape`]).
fn reshape_float(f: FloatValue, shape: &[usize]) -> OpResult<FloatValue> {
    if shape.contains(&0) {
        return f.reshape(shape);
    }
    Ok(FloatValue::new(
        kernels::reshape(f.tensor, padded(shape)?),
        shape.len(),
    ))
}

/// Resolve an ONNX `Reshape` target (`0` copies a dim unless `allowzero`, `-1` is inferred).
fn resolve_shape(input: &[usize], target: &[i64], allowzero: bool) -> OpResult<Vec<usize>> {
    let total: usize = input.iter().product();
    let mut out = Vec::with_capacity(target.len());
    let mut infer = None;
    for (i, &d) in target.iter().enumerate() {
        match d {
            -1 if infer.is_none() => {
                infer = Some(i);
                out.push(1);
            }
            -1 => op_bail!("shape {target:?} has more than one -1"),
            0 if !allowzero => match input.get(i) {
                Some(&x) => out.push(x),
                None => op_bail!("shape {target:?} copies dim {i} which input {input:?} lacks"),
            },
            d if d >= 0 => out.push(d as usize),
            d => op_bail!("invalid dimension {d} in shape {target:?}"),
        }
    }
    if let Some(i) = infer {
        let known: usize = out.iter().product();
        if known == 0 || total % known != 0 {
            op_bail!("cannot infer -1 in {target:?} for input {input:?}");
        }
        out[i] = total / known;
    }
    Ok(out)
}

/// `Reshape`
pub fn reshape(ctx: &OpContext, mut inputs: Inputs) -> OpResult<OpOutput> {
    let data = inputs.take(0, "data")?;
    let target = inputs.take(1, "shape")?.int_list("shape")?;
    let allowzero = ctx.attrs.int("allowzero", 0)? != 0;
    let shape = resolve_shape(&data.shape(), &target, allowzero)?;
    Ok(reshape_value(data, &shape)?.into())
}

/// `Flatten`
pub fn flatten(ctx: &OpContext, mut inputs: Inputs) -> OpResult<OpOutput> {
    let data = inputs.take(0, "input")?;
    let shape = data.shape();
    let axis = ctx.attrs.int("axis", 1)?;
    let r = shape.len() as i64;
    let axis = if axis < 0 { axis + r } else { axis };
    if !(0..=r).contains(&axis) {
        op_bail!("axis {axis} out of range for rank {r}");
    }
    let outer: usize = shape[..axis as usize].iter().product();
    let inner: usize = shape[axis as usize..].iter().product();
    Ok(reshape_value(data, &[outer, inner])?.into())
}

/// `Transpose`
pub fn transpose(ctx: &OpContext, mut inputs: Inputs) -> OpResult<OpOutput> {
    let data = inputs.take(0, "data")?;
    let rank = data.rank();
    let perm: Vec<usize> = match ctx.attrs.ints("perm")? {
        Some(p) => p
            .iter()
            .map(|&a| norm_axis(a, rank))
            .collect::<OpResult<_>>()?,
        None => (0..rank).rev().collect(),
    };
    let mut seen = perm.clone();
    seen.sort_unstable();
    if seen != (0..rank).collect::<Vec<_>>() {
        op_bail!("perm {perm:?} is not a permutation of 0..{rank}");
    }
    Ok(match data {
        Value::Str(_) => op_bail!("expected a numeric tensor, got strings"),
        Value::Sequence(_) => op_bail!("expected a tensor, got a sequence"),
        Value::Float(f) => {
            let offset = MAX_RANK - rank;
            let mut phys = [0usize; MAX_RANK];
            for (i, p) in phys.iter_mut().enumerate() {
                *p = if i < offset {
                    i
                } else {
                    perm[i - offset] + offset
                };
            }
            Value::Float(FloatValue::new(f.tensor.permute(phys), rank))
        }
        Value::Int(a) => Value::Int(
            a.permuted_axes(IxDyn(&perm))
                .as_standard_layout()
                .into_owned(),
        ),
        Value::Bool(a) => Value::Bool(
            a.permuted_axes(IxDyn(&perm))
                .as_standard_layout()
                .into_owned(),
        ),
    }
    .into())
}

fn axes_of(ctx: &OpContext, inputs: &mut Inputs) -> OpResult<Option<Vec<i64>>> {
    if ctx.opset >= 13 {
        inputs.int_list(1, "axes")
    } else {
        ctx.attrs.ints("axes")
    }
}

/// `Squeeze`
pub fn squeeze(ctx: &OpContext, mut inputs: Inputs) -> OpResult<OpOutput> {
    let data = inputs.take(0, "data")?;
    let shape = data.shape();
    let axes = axes_of(ctx, &mut inputs)?;
    let drop: Vec<usize> = match axes {
        Some(a) => a
            .iter()
            .map(|&x| norm_axis(x, shape.len()))
            .collect::<OpResult<_>>()?,
        None => (0..shape.len()).filter(|&i| shape[i] == 1).collect(),
    };
    if let Some(&bad) = drop.iter().find(|&&i| shape[i] != 1) {
        op_bail!(
            "cannot squeeze axis {bad} of size {} (shape {shape:?})",
            shape[bad]
        );
    }
    let new: Vec<usize> = shape
        .iter()
        .enumerate()
        .filter(|(i, _)| !drop.contains(i))
        .map(|(_, &d)| d)
        .collect();
    Ok(reshape_value(data, &new)?.into())
}

/// `Unsqueeze`
pub fn unsqueeze(ctx: &OpContext, mut inputs: Inputs) -> OpResult<OpOutput> {
    let data = inputs.take(0, "data")?;
    let shape = data.shape();
    let Some(axes) = axes_of(ctx, &mut inputs)? else {
        op_bail!("axes are required")
    };
    let out_rank = shape.len() + axes.len();
    let mut axes: Vec<usize> = axes
        .iter()
        .map(|&a| norm_axis(a, out_rank))
        .collect::<OpResult<_>>()?;
    axes.sort_unstable();
    let mut new = shape.clone();
    for a in axes {
        new.insert(a, 1);
    }
    Ok(reshape_value(data, &new)?.into())
}

/// `Expand`
pub fn expand(_ctx: &OpContext, mut inputs: Inputs) -> OpResult<OpOutput> {
    let data = inputs.take(0, "input")?;
    let target = inputs.take(1, "shape")?.dims_list("shape")?;
    let shape = broadcast_shapes(&data.shape(), &target)?;
    let bc = |s: &[usize]| IxDyn(s);
    Ok(match data {
        Value::Str(_) => op_bail!("expected a numeric tensor, got strings"),
        Value::Sequence(_) => op_bail!("expected a tensor, got a sequence"),
        Value::Float(f) => Value::Float(f.broadcast_to(&shape)?),
        Value::Int(a) => match a.broadcast(bc(&shape)) {
            Some(v) => Value::Int(v.to_owned()),
            None => op_bail!("cannot expand {:?} to {shape:?}", a.shape()),
        },
        Value::Bool(a) => match a.broadcast(bc(&shape)) {
            Some(v) => Value::Bool(v.to_owned()),
            None => op_bail!("cannot expand {:?} to {shape:?}", a.shape()),
        },
    }
    .into())
}
