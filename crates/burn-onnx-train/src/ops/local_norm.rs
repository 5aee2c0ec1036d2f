//! Normalisations over a local window or one axis: `LpNormalization`, `LRN` (local
//! response normalisation across channels) and `MeanVarianceNormalization`. All are
//! compositions of differentiable Burn ops.

use super::{Inputs, OpContext, OpOutput};
use crate::error::OpResult;
use crate::op_bail;
use crate::value::{FloatValue, MAX_RANK, Value, norm_axis};

/// `LpNormalization` (`axis`, `p` 1 or 2): `x / ||x||_p` along the axis.
pub fn lp_normalization(ctx: &OpContext, mut inputs: Inputs) -> OpResult<OpOutput> {
    let x = inputs.float(0, "input", ctx.device)?;
    let d = x.axis(ctx.attrs.int("axis", -1)?)?;
    let norm = match ctx.attrs.int("p", 2)? {
        1 => x.tensor.clone().abs().sum_dim(d),
        2 => x.tensor.clone().square().sum_dim(d).sqrt(),
        p => op_bail!("attribute `p` must be 1 or 2, got {p}"),
    };
    // A zero norm leaves the zero vector as it is (onnxruntime's result), not NaN.
    let safe = norm.clone().mask_fill(norm.equal_elem(0.0), 1.0);
    Ok(Value::Float(FloatValue::new(x.tensor / safe, x.rank)).into())
}

/// `LRN` (`size`, `alpha`, `beta`, `bias`) on `[N, C, ...]`:
/// `x / (bias + alpha / size * sum of x^2 over the channel window)^beta`.
pub fn lrn(ctx: &OpContext, mut inputs: Inputs) -> OpResult<OpOutput> {
    let x = inputs.float(0, "X", ctx.device)?;
    if x.rank < 3 {
        op_bail!("input must be [N, C, D1, ...], got {:?}", x.shape());
    }
    let size = ctx.attrs.int("size", 0)?;
    if size < 1 {
        op_bail!("attribute `size` must be positive, got {size}");
    }
    let size = size as usize;
    let alpha = f64::from(ctx.attrs.float("alpha", 1e-4)?);
    let beta = f64::from(ctx.attrs.float("beta", 0.75)?);
    let bias = f64::from(ctx.attrs.float("bias", 1.0)?);
    let c_axis = MAX_RANK - x.rank + 1;
    let channels = x.shape()[1];
    let (before, after) = ((size - 1) / 2, size.div_ceil(2) - 1);
    let sq = x.tensor.clone().square();
    let windows = (0..channels)
        .map(|c| {
            let lo = c.saturating_sub(before);
            let hi = (c + after + 1).min(channels);
            sq.clone().narrow(c_axis, lo, hi - lo).sum_dim(c_axis)
        })
        .collect();
    let sum = crate::value::PhysTensor::cat(windows, c_axis);
    let denom = sum
        .mul_scalar(alpha / size as f64)
        .add_scalar(bias)
        .powf_scalar(beta);
    Ok(Value::Float(FloatValue::new(x.tensor / denom, x.rank)).into())
}

/// `MeanVarianceNormalization` (`axes`, default [0, 2, 3]): `(x - mean) / sqrt(var)`
/// with the population variance (and onnxruntime's epsilon of 1e-9 under the root).
pub fn mean_variance_normalization(ctx: &OpContext, mut inputs: Inputs) -> OpResult<OpOutput> {
    let x = inputs.float(0, "X", ctx.device)?;
    let axes = ctx.attrs.ints("axes")?.unwrap_or_else(|| vec![0, 2, 3]);
    let axes: Vec<usize> = axes
        .iter()
        .map(|&a| Ok(norm_axis(a, x.rank)? + MAX_RANK - x.rank))
        .collect::<OpResult<_>>()?;
    let n: usize = axes.iter().map(|&a| x.tensor.dims()[a]).product();
    let mean_of = |t: crate::value::PhysTensor| {
        axes.iter()
            .fold(t, |t, &a| t.sum_dim(a))
            .div_scalar(n as f64)
    };
    let centered = x.tensor.clone() - mean_of(x.tensor.clone());
    let var = mean_of(centered.clone().square());
    Ok(Value::Float(FloatValue::new(
        centered / var.add_scalar(1e-9).sqrt(),
        x.rank,
    ))
    .into())
}
