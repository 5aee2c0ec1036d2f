//! `Pad` (constant, reflect and edge modes; negative pads crop) and `Tile`.

use burn::tensor::ops::PadMode;
use ndarray::{ArrayD, Axis, IxDyn};

use super::{Inputs, OpContext, OpOutput};
use crate::error::OpResult;
use crate::op_bail;
use crate::value::{FloatValue, MAX_RANK, Value, norm_axis};

/// `Pad`
pub fn pad(ctx: &OpContext, mut inputs: Inputs) -> OpResult<OpOutput> {
    let data = inputs.take(0, "data")?;
    let shape = data.shape();
    let rank = shape.len();
    let (pads, value, axes) = if ctx.opset >= 11 {
        let Some(p) = inputs.int_list(1, "pads")? else {
            op_bail!("input `pads` is required")
        };
        let v = inputs
            .opt(2)
            .map(|v| v.scalar_f32("constant_value"))
            .transpose()?
            .unwrap_or(0.0);
        (p, v, inputs.int_list(3, "axes")?)
    } else {
        let Some(p) = ctx.attrs.ints("pads")? else {
            op_bail!("attribute `pads` is required")
        };
        (p, ctx.attrs.float("value", 0.0)?, None)
    };
    let axes: Vec<usize> = match axes {
        Some(a) => a
            .iter()
            .map(|&x| norm_axis(x, rank))
            .collect::<OpResult<_>>()?,
        None => (0..rank).collect(),
    };
    if pads.len() != 2 * axes.len() {
        op_bail!("pads has {} entries for {} axes", pads.len(), axes.len());
    }
    let mut begin = vec![0i64; rank];
    let mut end = vec![0i64; rank];
    for (i, &a) in axes.iter().enumerate() {
        begin[a] = pads[i];
        end[a] = pads[i + axes.len()];
    }
    let mode = match ctx.attrs.string("mode", "constant")?.as_str() {
        "constant" => PadMode::Constant(value),
        "reflect" => PadMode::Reflect,
        "edge" => PadMode::Edge,
        other => op_bail!("pad mode {other:?} is not supported (constant, reflect, edge)"),
    };
    let Value::Float(x) = data else {
        op_bail!("Pad supports float tensors, got {}", data.kind())
    };
    let offset = MAX_RANK - rank;
    let mut pairs = [(0usize, 0usize); MAX_RANK];
    for a in 0..rank {
        pairs[a + offset] = (begin[a].max(0) as usize, end[a].max(0) as usize);
        if matches!(mode, PadMode::Reflect)
            && (pairs[a + offset].0 >= shape[a] || pairs[a + offset].1 >= shape[a])
        {
            op_bail!(
                "reflect padding {:?} must be smaller than dim {a} ({})",
                pairs[a + offset],
                shape[a]
            );
        }
    }
    let mut t = x.tensor.pad(pairs, mode);
    // Negative pads remove elements.
    for a in 0..rank {
        let (b, e) = (
            begin[a].min(0).unsigned_abs() as usize,
            end[a].min(0).unsigned_abs() as usize,
        );
        if b + e > 0 {
            let len = t.dims()[a + offset];
            if b + e > len {
                op_bail!("negative pads {b}+{e} exceed dim {a} ({len})");
            }
            t = t.narrow(a + offset, b, len - b - e);
        }
    }
    Ok(Value::Float(FloatValue::new(t, rank)).into())
}

fn host_tile<T: Clone>(a: &ArrayD<T>, reps: &[usize]) -> OpResult<ArrayD<T>> {
    let mut out = a.clone();
    for (axis, &r) in reps.iter().enumerate() {
        let views: Vec<_> = (0..r).map(|_| out.view()).collect();
        out = if r == 0 {
            let mut s = out.shape().to_vec();
            s[axis] = 0;
            ArrayD::from_shape_vec(IxDyn(&s), Vec::new())?
        } else {
            ndarray::concatenate(Axis(axis), &views)?
        };
    }
    Ok(out)
}

/// `Tile`
pub fn tile(_ctx: &OpContext, mut inputs: Inputs) -> OpResult<OpOutput> {
    let data = inputs.take(0, "input")?;
    let reps = inputs.take(1, "repeats")?.dims_list("repeats")?;
    if reps.len() != data.rank() {
        op_bail!(
            "repeats has {} entries for rank {}",
            reps.len(),
            data.rank()
        );
    }
    Ok(match data {
        Value::Float(x) => {
            let mut sizes = vec![1; MAX_RANK - x.rank];
            sizes.extend(&reps);
            Value::Float(FloatValue::new(x.tensor.repeat(&sizes), x.rank))
        }
        Value::Int(a) => Value::Int(host_tile(&a, &reps)?),
        Value::Bool(a) => Value::Bool(host_tile(&a, &reps)?),
    }
    .into())
}
