//! `CumSum` and `CumProd` (with `exclusive` and `reverse`) and `Trilu`.

use ndarray::{ArrayD, Axis};

use super::{Inputs, OpContext, OpOutput};
use crate::error::OpResult;
use crate::op_bail;
use crate::value::{FloatValue, Value, norm_axis};

/// `CumSum`
pub fn cumsum(ctx: &OpContext, inputs: Inputs) -> OpResult<OpOutput> {
    cumulative(ctx, inputs, Cumulative::Sum)
}

/// `CumProd`
pub fn cumprod(ctx: &OpContext, inputs: Inputs) -> OpResult<OpOutput> {
    cumulative(ctx, inputs, Cumulative::Prod)
}

#[derive(Clone, Copy, PartialEq)]
enum Cumulative {
    Sum,
    Prod,
}

fn cumulative(ctx: &OpContext, mut inputs: Inputs, kind: Cumulative) -> OpResult<OpOutput> {
    let x = inputs.take(0, "x")?;
    let axis_list = inputs.take(1, "axis")?.int_list("axis")?;
    let [axis] = axis_list[..] else {
        op_bail!("axis must hold one value")
    };
    let axis = norm_axis(axis, x.rank())?;
    let exclusive = ctx.attrs.int("exclusive", 0)? != 0;
    let reverse = ctx.attrs.int("reverse", 0)? != 0;
    Ok(match x {
        Value::Int(mut a) => {
            for mut lane in a.lanes_mut(Axis(axis)) {
                let n = lane.len();
                let order: Vec<usize> = if reverse {
                    (0..n).rev().collect()
                } else {
                    (0..n).collect()
                };
                let (mut acc, combine): (i64, fn(i64, i64) -> i64) = match kind {
                    Cumulative::Sum => (0, i64::wrapping_add),
                    Cumulative::Prod => (1, i64::wrapping_mul),
                };
                for i in order {
                    let v = lane[i];
                    lane[i] = if exclusive { acc } else { combine(acc, v) };
                    acc = combine(acc, v);
                }
            }
            Value::Int(a)
        }
        other => {
            let x = other.into_float(ctx.device)?;
            let d = x.axis(axis as i64)?;
            let t = if reverse {
                x.tensor.clone().flip([d])
            } else {
                x.tensor.clone()
            };
            let c = match (kind, exclusive) {
                (Cumulative::Sum, false) => t.cumsum(d),
                (Cumulative::Sum, true) => t.clone().cumsum(d) - t,
                (Cumulative::Prod, false) => t.cumprod(d),
                // The exclusive product: the inclusive one shifted by one place (a leading
                // 1), not a division, which would fail on zeros.
                (Cumulative::Prod, true) => {
                    let n = t.dims()[d];
                    let head = t.clone().narrow(d, 0, 1).ones_like();
                    if n <= 1 {
                        head
                    } else {
                        let prefix = t.narrow(d, 0, n - 1).cumprod(d);
                        crate::value::PhysTensor::cat(vec![head, prefix], d)
                    }
                }
            };
            let c = if reverse { c.flip([d]) } else { c };
            Value::Float(FloatValue::new(c, x.rank))
        }
    }
    .into())
}

/// `Trilu`: keep the upper (`upper = 1`, default) or lower triangle of the last two axes,
/// shifted by `k`.
pub fn trilu(ctx: &OpContext, mut inputs: Inputs) -> OpResult<OpOutput> {
    let x = inputs.take(0, "input")?;
    let k = inputs
        .int_list(1, "k")?
        .and_then(|v| v.first().copied())
        .unwrap_or(0);
    let upper = ctx.attrs.int("upper", 1)? != 0;
    if x.rank() < 2 {
        op_bail!("Trilu needs rank >= 2, got {:?}", x.shape());
    }
    let keep = |i: usize, j: usize| {
        if upper {
            j as i64 - i as i64 >= k
        } else {
            j as i64 - i as i64 <= k
        }
    };
    fn mask<T: Copy + Default>(a: &mut ArrayD<T>, keep: impl Fn(usize, usize) -> bool) {
        let r = a.ndim();
        for (idx, v) in a.indexed_iter_mut() {
            if !keep(idx[r - 2], idx[r - 1]) {
                *v = T::default();
            }
        }
    }
    Ok(match x {
        Value::Str(_) => op_bail!("expected a numeric tensor, got strings"),
        Value::Sequence(_) => op_bail!("expected a tensor, got a sequence"),
        Value::Int(mut a) => {
            mask(&mut a, keep);
            Value::Int(a)
        }
        Value::Bool(mut a) => {
            mask(&mut a, keep);
            Value::Bool(a)
        }
        Value::Float(f) => {
            let t = if upper {
                f.tensor.triu(k)
            } else {
                f.tensor.tril(k)
            };
            Value::Float(FloatValue::new(t, f.rank))
        }
    }
    .into())
}
