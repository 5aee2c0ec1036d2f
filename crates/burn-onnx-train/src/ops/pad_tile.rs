//! `Pad` (constant, reflect, edge and wrap modes; negative pads crop) and `Tile`. Integer
//! data is padded through f32 (exact up to 2^24 in magnitude) and comes back as integers.

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
        "constant" => Some(PadMode::Constant(value)),
        "reflect" => Some(PadMode::Reflect),
        "edge" => Some(PadMode::Edge),
        "wrap" => None,
        other => op_bail!("pad mode {other:?} is not supported (constant, reflect, edge, wrap)"),
    };
    let (x, int) = match data {
        Value::Str(_) => op_bail!("expected a numeric tensor, got strings"),
        Value::Sequence(_) => op_bail!("expected a tensor, got a sequence"),
        Value::Float(x) => (x, false),
        Value::Int(_) => (data.into_float(ctx.device)?, true),
        Value::Bool(_) => op_bail!("Pad supports float and integer tensors, got bool"),
    };
    let padded = pad_float(ctx, x, &shape, &begin, &end, mode)?;
    Ok(if int {
        Value::Int(padded.to_array()?.mapv(|v| v as i64))
    } else {
        Value::Float(padded)
    }
    .into())
}

/// Pad (or with negative pads crop) a float value; `None` is wrap mode.
fn pad_float(
    ctx: &OpContext,
    x: FloatValue,
    shape: &[usize],
    begin: &[i64],
    end: &[i64],
    mode: Option<PadMode>,
) -> OpResult<FloatValue> {
    let rank = shape.len();
    let Some(mode) = mode else {
        return wrap(ctx, x, shape, begin, end);
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
    Ok(FloatValue::new(t, rank))
}

/// Wrap-mode padding: along each axis, negative pads crop first (as onnxruntime does), then
/// output position `i` reads cropped position `(i - begin) mod m`, a differentiable
/// `select`.
fn wrap(
    ctx: &OpContext,
    mut x: FloatValue,
    shape: &[usize],
    begin: &[i64],
    end: &[i64],
) -> OpResult<FloatValue> {
    for a in 0..shape.len() {
        let n = shape[a] as i64;
        if begin[a] == 0 && end[a] == 0 {
            continue;
        }
        let (start, stop) = ((-begin[a]).max(0), n - (-end[a]).max(0));
        let m = stop - start;
        let (pb, pe) = (begin[a].max(0), end[a].max(0));
        if m <= 0 {
            op_bail!(
                "cannot wrap-pad dim {a} of size {n} by {} and {}",
                begin[a],
                end[a]
            );
        }
        let idx: Vec<i64> = (0..m + pb + pe)
            .map(|i| start + (i - pb).rem_euclid(m))
            .collect();
        let phys = x.axis(a as i64)?;
        let idx = crate::value::int_tensor_1d(idx, ctx.device);
        x = FloatValue::new(x.tensor.select(phys, idx), x.rank);
    }
    Ok(x)
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
        Value::Str(_) => op_bail!("expected a numeric tensor, got strings"),
        Value::Sequence(_) => op_bail!("expected a tensor, got a sequence"),
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
