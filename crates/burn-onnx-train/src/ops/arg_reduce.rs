//! `ArgMax` and `ArgMin` (with `keepdims` and `select_last_index`); the indices come back to
//! the host as int64.

use ndarray::{ArrayD, IxDyn};

use super::{Inputs, OpContext, OpOutput};
use crate::error::OpResult;
use crate::op_bail;
use crate::value::{Value, norm_axis};

fn arg(ctx: &OpContext, mut inputs: Inputs, max: bool) -> OpResult<OpOutput> {
    let x = inputs.take(0, "data")?;
    let shape = x.shape();
    let axis = norm_axis(ctx.attrs.int("axis", 0)?, shape.len())?;
    let keepdims = ctx.attrs.int("keepdims", 1)? != 0;
    let last = ctx.attrs.int("select_last_index", 0)? != 0;
    let a = match x {
        Value::Str(_) => op_bail!("expected a numeric tensor, got strings"),
        Value::Sequence(_) => op_bail!("expected a tensor, got a sequence"),
        Value::Int(a) => a.mapv(|v| v as f64),
        Value::Bool(a) => a.mapv(|v| if v { 1.0 } else { 0.0 }),
        Value::Float(f) => f.to_array()?.mapv(f64::from),
    };
    let better = |cand: f64, best: f64| {
        if max {
            cand > best || (last && cand == best)
        } else {
            cand < best || (last && cand == best)
        }
    };
    let out = a.map_axis(ndarray::Axis(axis), |lane| {
        let mut best = 0usize;
        for (i, &v) in lane.iter().enumerate().skip(1) {
            if better(v, lane[best]) {
                best = i;
            }
        }
        best as i64
    });
    let out: ArrayD<i64> = if keepdims {
        let mut s = shape.clone();
        s[axis] = 1;
        out.into_shape_with_order(IxDyn(&s))?
    } else {
        out
    };
    Ok(Value::Int(out).into())
}

/// `ArgMax`
pub fn argmax(ctx: &OpContext, inputs: Inputs) -> OpResult<OpOutput> {
    arg(ctx, inputs, true)
}

/// `ArgMin`
pub fn argmin(ctx: &OpContext, inputs: Inputs) -> OpResult<OpOutput> {
    arg(ctx, inputs, false)
}
