//! `Slice` with ONNX clamping rules, negative indices and arbitrary (also negative) steps.

use ndarray::Axis;

use super::{Inputs, OpContext, OpOutput};
use crate::error::OpResult;
use crate::op_bail;
use crate::value::{FloatValue, Value, int_tensor_1d, norm_axis};

/// One axis of a slice, resolved to concrete indices.
enum AxisSlice {
    /// `start..start + len`, step 1.
    Range(usize, usize),
    /// Any other step: the exact indices.
    Indices(Vec<usize>),
}

fn resolve(start: i64, end: i64, step: i64, dim: usize) -> OpResult<AxisSlice> {
    if step == 0 {
        op_bail!("slice step cannot be 0");
    }
    let d = dim as i64;
    let norm = |v: i64| if v < 0 { v + d } else { v };
    let (s, e) = if step > 0 {
        (norm(start).clamp(0, d), norm(end).clamp(0, d))
    } else {
        (norm(start).clamp(0, d - 1), norm(end).clamp(-1, d - 1))
    };
    if step == 1 {
        return Ok(AxisSlice::Range(s as usize, (e - s).max(0) as usize));
    }
    let mut idx = Vec::new();
    let mut i = s;
    while (step > 0 && i < e) || (step < 0 && i > e) {
        idx.push(i as usize);
        i += step;
    }
    Ok(AxisSlice::Indices(idx))
}

/// `Slice`
pub fn slice(ctx: &OpContext, mut inputs: Inputs) -> OpResult<OpOutput> {
    let data = inputs.take(0, "data")?;
    let shape = data.shape();
    let (starts, ends, axes, steps) = if ctx.opset >= 10 {
        let Some(starts) = inputs.int_list(1, "starts")? else {
            op_bail!("input `starts` is required")
        };
        let Some(ends) = inputs.int_list(2, "ends")? else {
            op_bail!("input `ends` is required")
        };
        (
            starts,
            ends,
            inputs.int_list(3, "axes")?,
            inputs.int_list(4, "steps")?,
        )
    } else {
        let Some(starts) = ctx.attrs.ints("starts")? else {
            op_bail!("attribute `starts` is required")
        };
        let Some(ends) = ctx.attrs.ints("ends")? else {
            op_bail!("attribute `ends` is required")
        };
        (starts, ends, ctx.attrs.ints("axes")?, None)
    };
    let axes = axes.unwrap_or_else(|| (0..starts.len() as i64).collect());
    let steps = steps.unwrap_or_else(|| vec![1; starts.len()]);
    if ends.len() != starts.len() || axes.len() != starts.len() || steps.len() != starts.len() {
        op_bail!("starts, ends, axes and steps have different lengths");
    }
    let mut out = data;
    for i in 0..starts.len() {
        let axis = norm_axis(axes[i], shape.len())?;
        let sl = resolve(starts[i], ends[i], steps[i], shape[axis])?;
        out = match (out, sl) {
            (Value::Str(_), _) => op_bail!("expected a numeric tensor, got strings"),
            (Value::Sequence(_), _) => op_bail!("expected a tensor, got a sequence"),
            (Value::Float(f), AxisSlice::Range(s, len)) => {
                let phys = f.axis(axis as i64)?;
                Value::Float(f.narrow(phys, s, len))
            }
            (Value::Float(f), AxisSlice::Indices(idx)) => {
                let phys = f.axis(axis as i64)?;
                let idx = int_tensor_1d(idx.into_iter().map(|v| v as i64).collect(), ctx.device);
                Value::Float(FloatValue::new(f.tensor.select(phys, idx), f.rank))
            }
            (Value::Int(a), sl) => Value::Int(a.select(Axis(axis), &sl.indices())),
            (Value::Bool(a), sl) => Value::Bool(a.select(Axis(axis), &sl.indices())),
        };
    }
    Ok(out.into())
}

impl AxisSlice {
    fn indices(self) -> Vec<usize> {
        match self {
            AxisSlice::Range(s, len) => (s..s + len).collect(),
            AxisSlice::Indices(v) => v,
        }
    }
}
