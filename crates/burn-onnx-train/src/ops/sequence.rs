//! The sequence ops (ONNX `seq(tensor)` values, [`Value::Sequence`]): `SequenceEmpty`,
//! `SequenceConstruct`, `SequenceInsert`, `SequenceAt`, `SequenceErase`, `SequenceLength`,
//! `SplitToSequence`, `ConcatFromSequence` and `SequenceMap` (a subgraph run on each
//! position). Float elements stay on the device, so gradients flow through a sequence as
//! through the tensors it holds.

use ndarray::{ArrayD, IxDyn};

use super::concat_split::{concat_values, split_value};
use super::control_flow::{Runner, split_inputs};
use super::{Inputs, OpContext, OpOutput};
use crate::error::OpResult;
use crate::op_bail;
use crate::value::{Value, norm_axis};

/// The sequence input `i`, or an error naming it.
fn sequence(inputs: &mut Inputs, i: usize, what: &str) -> OpResult<Vec<Value>> {
    match inputs.take(i, what)? {
        Value::Sequence(items) => Ok(items),
        other => op_bail!("{what} must be a sequence, got a {} tensor", other.kind()),
    }
}

/// A position of a sequence of `len` (negative counts from the end); `end_ok` also allows
/// `len` itself (an insertion after the last element).
fn position(inputs: &mut Inputs, i: usize, len: usize, end_ok: bool) -> OpResult<Option<usize>> {
    let Some(p) = inputs.opt(i) else {
        return Ok(None);
    };
    let [p] = p.int_list("position")?[..] else {
        op_bail!("position must hold one element")
    };
    let n = len as i64;
    let at = if p < 0 { p + n } else { p };
    let last = if end_ok { n } else { n - 1 };
    if at < 0 || at > last {
        op_bail!("position {p} is outside a sequence of {len} element(s)");
    }
    Ok(Some(at as usize))
}

/// `SequenceEmpty`: a sequence of no tensors.
pub fn sequence_empty(_ctx: &OpContext, _inputs: Inputs) -> OpResult<OpOutput> {
    Ok(Value::Sequence(Vec::new()).into())
}

/// `SequenceConstruct(inputs...)`: the inputs, in order.
pub fn sequence_construct(_ctx: &OpContext, inputs: Inputs) -> OpResult<OpOutput> {
    let items: Vec<Value> = inputs.0.into_iter().flatten().collect();
    if let Some(s) = items.iter().find(|v| matches!(v, Value::Sequence(_))) {
        op_bail!("a sequence holds tensors, got a {}", s.kind());
    }
    Ok(Value::Sequence(items).into())
}

/// `SequenceInsert(seq, tensor, position?)`: the tensor inserted before `position`
/// (default: at the end).
pub fn sequence_insert(_ctx: &OpContext, mut inputs: Inputs) -> OpResult<OpOutput> {
    let mut items = sequence(&mut inputs, 0, "input_sequence")?;
    let tensor = inputs.take(1, "tensor")?;
    if matches!(tensor, Value::Sequence(_)) {
        op_bail!("tensor must be a tensor, got a sequence");
    }
    let at = position(&mut inputs, 2, items.len(), true)?.unwrap_or(items.len());
    items.insert(at, tensor);
    Ok(Value::Sequence(items).into())
}

/// `SequenceAt(seq, position)`: the tensor at `position`.
pub fn sequence_at(_ctx: &OpContext, mut inputs: Inputs) -> OpResult<OpOutput> {
    let mut items = sequence(&mut inputs, 0, "input_sequence")?;
    let Some(at) = position(&mut inputs, 1, items.len(), false)? else {
        op_bail!("missing required input 1 (position)")
    };
    Ok(items.swap_remove(at).into())
}

/// `SequenceErase(seq, position?)`: the sequence without the tensor at `position`
/// (default: the last).
pub fn sequence_erase(_ctx: &OpContext, mut inputs: Inputs) -> OpResult<OpOutput> {
    let mut items = sequence(&mut inputs, 0, "input_sequence")?;
    if items.is_empty() {
        op_bail!("cannot erase from an empty sequence");
    }
    let at = position(&mut inputs, 1, items.len(), false)?.unwrap_or(items.len() - 1);
    items.remove(at);
    Ok(Value::Sequence(items).into())
}

/// `SequenceLength(seq)`: its length, an int64 scalar.
pub fn sequence_length(_ctx: &OpContext, mut inputs: Inputs) -> OpResult<OpOutput> {
    let n = sequence(&mut inputs, 0, "input_sequence")?.len() as i64;
    Ok(Value::Int(ArrayD::from_elem(IxDyn(&[]), n)).into())
}

/// `SplitToSequence(input, split?)` (`axis`, `keepdims`): pieces along `axis` of the sizes
/// `split` lists, or of its one size (the last piece smaller), or of 1 without it (then
/// without the axis unless `keepdims`).
pub fn split_to_sequence(ctx: &OpContext, mut inputs: Inputs) -> OpResult<OpOutput> {
    let x = inputs.take(0, "input")?;
    let shape = x.shape();
    let axis = norm_axis(ctx.attrs.int("axis", 0)?, shape.len())?;
    let dim = shape[axis];
    let split = match inputs.opt(1) {
        Some(s) => Some((s.rank(), s.int_list("split")?)),
        None => None,
    };
    let sizes: Vec<usize> = match &split {
        None => vec![1; dim],
        Some((0, s)) => {
            let chunk = usize::try_from(s[0])
                .ok()
                .filter(|&c| c > 0)
                .ok_or_else(|| crate::error::OpError(format!("split {} must be positive", s[0])))?;
            (0..dim.div_ceil(chunk))
                .map(|k| chunk.min(dim - k * chunk))
                .collect()
        }
        Some((_, s)) => {
            let sizes: Vec<usize> = s.iter().map(|&v| v.max(0) as usize).collect();
            if sizes.iter().sum::<usize>() != dim {
                op_bail!("split sizes {s:?} do not add up to the axis length {dim}");
            }
            sizes
        }
    };
    let mut pieces = split_value(x, axis, &sizes)?;
    if split.is_none() && ctx.attrs.int("keepdims", 1)? == 0 {
        let mut squeezed = shape.clone();
        squeezed.remove(axis);
        pieces = pieces
            .into_iter()
            .map(|p| p.reshape_to(&squeezed))
            .collect::<OpResult<_>>()?;
    }
    Ok(Value::Sequence(pieces).into())
}

/// `ConcatFromSequence(seq)` (`axis`, `new_axis`): the tensors joined along `axis`, or
/// stacked along a new `axis` with `new_axis = 1`.
pub fn concat_from_sequence(ctx: &OpContext, mut inputs: Inputs) -> OpResult<OpOutput> {
    let items = sequence(&mut inputs, 0, "input_sequence")?;
    let Some(first) = items.first() else {
        op_bail!("cannot concatenate an empty sequence")
    };
    let axis = ctx.attrs.int("axis", 0)?;
    if ctx.attrs.int("new_axis", 0)? == 0 {
        return Ok(concat_values(ctx, items, axis)?.into());
    }
    let rank = first.rank();
    let at = norm_axis(axis, rank + 1)?;
    let stacked = items
        .into_iter()
        .map(|v| {
            let mut shape = v.shape();
            shape.insert(at, 1);
            v.reshape_to(&shape)
        })
        .collect::<OpResult<Vec<_>>>()?;
    Ok(concat_values(ctx, stacked, at as i64)?.into())
}

/// `SequenceMap(input_sequence, additional_inputs...)` (`body`): the body run on each
/// position, fed the sequences' elements there and the tensors as they are; each body
/// output becomes a sequence of the per-position results.
pub fn sequence_map(ctx: &OpContext, inputs: Inputs) -> OpResult<OpOutput> {
    let (formal, outer) = split_inputs(ctx, inputs)?;
    let body = ctx.attrs.graph("body")?;
    let formal: Vec<Value> = formal
        .into_iter()
        .enumerate()
        .map(|(i, v)| v.ok_or_else(|| crate::error::OpError(format!("input {i} is missing"))))
        .collect::<OpResult<_>>()?;
    let len = match formal.first() {
        Some(Value::Sequence(items)) => items.len(),
        _ => op_bail!("input 0 must be a sequence"),
    };
    for (i, v) in formal.iter().enumerate() {
        if let Value::Sequence(items) = v
            && items.len() != len
        {
            op_bail!(
                "input {i} holds {} element(s), input 0 holds {len}",
                items.len()
            );
        }
    }
    let runner = Runner::new(ctx, body, &outer)?;
    let mut outputs: Vec<Vec<Value>> = vec![Vec::with_capacity(len); body.outputs.len()];
    for k in 0..len {
        let args = formal
            .iter()
            .map(|v| match v {
                Value::Sequence(items) => items[k].clone(),
                tensor => tensor.clone(),
            })
            .collect();
        for (out, v) in outputs.iter_mut().zip(runner.run(args, k as u64)?) {
            out.push(v);
        }
    }
    Ok(OpOutput {
        values: outputs.into_iter().map(Value::Sequence).collect(),
        state_updates: runner.state_updates(formal.len()),
    })
}
