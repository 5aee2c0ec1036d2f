//! Reductions: `ReduceMean`, `ReduceSum`, `ReduceMax`, `ReduceMin`, `ReduceL1`, `ReduceL2`,
//! `ReduceSumSquare`, `ReduceProd`, `ReduceLogSum`, `ReduceLogSumExp`, with axes given as
//! an attribute (older opsets) or as the second input (ReduceSum from opset 13, the others
//! from opset 18). A reduction over an empty set gives the operation's identity (0 for
//! sums, 1 for the product, -inf for max and the log-sums, +inf for min, NaN for the mean),
//! as NumPy and onnxruntime do.

use super::{Inputs, OpContext, OpOutput};
use crate::error::OpResult;
use crate::value::{FloatValue, Value, norm_axis};

#[derive(Clone, Copy)]
enum Reduce {
    Mean,
    Sum,
    Max,
    Min,
    /// sum(|x|)
    L1,
    /// sqrt(sum(x^2))
    L2,
    /// The product.
    Prod,
    /// log(sum(x))
    LogSum,
    /// sum(x^2)
    SumSquare,
    /// log(sum(exp(x))), computed stably around the maximum.
    LogSumExp,
}

fn reduce(
    ctx: &OpContext,
    mut inputs: Inputs,
    kind: Reduce,
    axes_input_from: i64,
) -> OpResult<OpOutput> {
    let x = inputs.float(0, "data", ctx.device)?;
    let axes = if ctx.opset >= axes_input_from {
        inputs.int_list(1, "axes")?
    } else {
        ctx.attrs.ints("axes")?
    };
    let keepdims = ctx.attrs.int("keepdims", 1)? != 0;
    let noop_empty = ctx.attrs.int("noop_with_empty_axes", 0)? != 0;
    let shape = x.shape();
    let mut axes: Vec<usize> = match axes {
        Some(a) if !a.is_empty() => a
            .iter()
            .map(|&ax| norm_axis(ax, shape.len()))
            .collect::<OpResult<_>>()?,
        _ if noop_empty => return Ok(Value::Float(x).into()),
        _ => (0..shape.len()).collect(),
    };
    axes.sort_unstable();
    axes.dedup();
    if axes.iter().any(|&a| shape[a] == 0) {
        return empty_reduction(ctx, kind, &shape, &axes, keepdims);
    }
    let rank = x.rank;
    let offset = crate::value::MAX_RANK - rank;
    let sum_over = |mut t: crate::value::PhysTensor| {
        for &a in &axes {
            t = t.sum_dim(a + offset);
        }
        t
    };
    let t = match kind {
        Reduce::Sum => sum_over(x.tensor),
        Reduce::SumSquare => sum_over(x.tensor.square()),
        Reduce::L1 => sum_over(x.tensor.abs()),
        Reduce::L2 => sum_over(x.tensor.square()).sqrt(),
        Reduce::LogSum => sum_over(x.tensor).log(),
        Reduce::Prod => {
            let mut t = x.tensor;
            for &a in &axes {
                t = t.prod_dim(a + offset);
            }
            t
        }
        Reduce::Mean => {
            let n: usize = axes.iter().map(|&a| shape[a]).product();
            sum_over(x.tensor).div_scalar(n as f64)
        }
        Reduce::Max | Reduce::Min | Reduce::LogSumExp => {
            let mut m = x.tensor.clone();
            for &a in &axes {
                m = if matches!(kind, Reduce::Min) {
                    m.min_dim(a + offset)
                } else {
                    m.max_dim(a + offset)
                };
            }
            if matches!(kind, Reduce::LogSumExp) {
                let m = m.detach();
                sum_over((x.tensor - m.clone()).exp()).log() + m
            } else {
                m
            }
        }
    };
    let kept = FloatValue::new(t, rank);
    let out = if keepdims {
        kept
    } else {
        kept.reshape(&reduced_shape(&shape, &axes, false))?
    };
    Ok(Value::Float(out).into())
}

fn reduced_shape(shape: &[usize], axes: &[usize], keepdims: bool) -> Vec<usize> {
    shape
        .iter()
        .enumerate()
        .filter_map(|(i, &d)| match (axes.contains(&i), keepdims) {
            (false, _) => Some(d),
            (true, true) => Some(1),
            (true, false) => None,
        })
        .collect()
}

/// A reduction over a zero-size axis: the identity of the operation, everywhere.
fn empty_reduction(
    ctx: &OpContext,
    kind: Reduce,
    shape: &[usize],
    axes: &[usize],
    keepdims: bool,
) -> OpResult<OpOutput> {
    let identity = match kind {
        Reduce::Sum | Reduce::SumSquare | Reduce::L1 | Reduce::L2 => 0.0,
        Reduce::Prod => 1.0,
        Reduce::Max | Reduce::LogSum | Reduce::LogSumExp => f32::NEG_INFINITY,
        Reduce::Min => f32::INFINITY,
        Reduce::Mean => f32::NAN,
    };
    let out = ndarray::ArrayD::from_elem(reduced_shape(shape, axes, keepdims), identity);
    Ok(Value::Float(FloatValue::from_array(&out, ctx.device)?).into())
}

/// `ReduceMean`
pub fn reduce_mean(ctx: &OpContext, inputs: Inputs) -> OpResult<OpOutput> {
    reduce(ctx, inputs, Reduce::Mean, 18)
}

/// `ReduceSum`
pub fn reduce_sum(ctx: &OpContext, inputs: Inputs) -> OpResult<OpOutput> {
    reduce(ctx, inputs, Reduce::Sum, 13)
}

/// `ReduceMax`
pub fn reduce_max(ctx: &OpContext, inputs: Inputs) -> OpResult<OpOutput> {
    reduce(ctx, inputs, Reduce::Max, 18)
}

/// `ReduceL2`
pub fn reduce_l2(ctx: &OpContext, inputs: Inputs) -> OpResult<OpOutput> {
    reduce(ctx, inputs, Reduce::L2, 18)
}

/// `ReduceSumSquare`
pub fn reduce_sum_square(ctx: &OpContext, inputs: Inputs) -> OpResult<OpOutput> {
    reduce(ctx, inputs, Reduce::SumSquare, 18)
}

/// `ReduceLogSumExp`
pub fn reduce_log_sum_exp(ctx: &OpContext, inputs: Inputs) -> OpResult<OpOutput> {
    reduce(ctx, inputs, Reduce::LogSumExp, 18)
}

/// `ReduceL1`
pub fn reduce_l1(ctx: &OpContext, inputs: Inputs) -> OpResult<OpOutput> {
    reduce(ctx, inputs, Reduce::L1, 18)
}

/// `ReduceProd`
pub fn reduce_prod(ctx: &OpContext, inputs: Inputs) -> OpResult<OpOutput> {
    reduce(ctx, inputs, Reduce::Prod, 18)
}

/// `ReduceLogSum`
pub fn reduce_log_sum(ctx: &OpContext, inputs: Inputs) -> OpResult<OpOutput> {
    reduce(ctx, inputs, Reduce::LogSum, 18)
}

/// `ReduceMin`
pub fn reduce_min(ctx: &OpContext, inputs: Inputs) -> OpResult<OpOutput> {
    reduce(ctx, inputs, Reduce::Min, 18)
}
