//! `Softmax` and `LogSoftmax` (opset 13 semantics: along one axis; before opset 13 the
//! input is flattened at `axis` into 2-D first, as the older spec says).

use burn::tensor::{FloatDType, TensorData, activation};
use ndarray::ArrayD;

use super::broadcast::{broadcast_shapes, float_binary};
use super::compare::where_floats;
use super::matmul::autocast_product;
use super::{Inputs, OpContext, OpOutput};
use crate::error::OpResult;
use crate::graph::attributes::{ATTENTION_CORE, LOW_PRECISION_RESULT, MASKED_SOFTMAX};
use crate::kernels::{self, masked_softmax_fused_here};
use crate::op_bail;
use crate::value::{FloatValue, PhysTensor, Value, norm_axis, padded};

fn along_axis(
    ctx: &OpContext,
    mut inputs: Inputs,
    f: fn(PhysTensor, usize) -> PhysTensor,
) -> OpResult<OpOutput> {
    let x = inputs.float(0, "input", ctx.device)?;
    let shape = x.shape();
    let default_axis = if ctx.opset >= 13 { -1 } else { 1 };
    let axis = norm_axis(ctx.attrs.int("axis", default_axis)?, shape.len())?;
    if ctx.opset >= 13 {
        let phys = x.axis(axis as i64)?;
        return Ok(Value::Float(FloatValue::new(f(x.tensor, phys), x.rank)).into());
    }
    let outer: usize = shape[..axis].iter().product();
    let inner: usize = shape[axis..].iter().product();
    let flat = x.reshape(&[outer, inner])?;
    let phys = flat.axis(1)?;
    let y = FloatValue::new(f(flat.tensor, phys), 2);
    Ok(Value::Float(y.reshape(&shape)?).into())
}

/// `Softmax`, with the scaling and masking of its input folded in where the graph had
/// them ([`MASKED_SOFTMAX`]), and with the products around it where the graph had those
/// ([`ATTENTION_CORE`]).
pub fn softmax(ctx: &OpContext, mut inputs: Inputs) -> OpResult<OpOutput> {
    if ctx.attrs.has(ATTENTION_CORE) {
        return attention_core(ctx, inputs);
    }
    match ctx.attrs.floats(MASKED_SOFTMAX)? {
        Some(mark) => {
            let x = inputs.float(0, "input", ctx.device)?;
            let (cond, bias) = mask_and_bias(ctx, &mut inputs, 1)?;
            Ok(Value::Float(masked_softmax(ctx, x, cond, bias, Mark::of(mark)?)?).into())
        }
        None => along_axis(ctx, inputs, crate::kernels::softmax),
    }
}

/// The mask and the bias of the scores: inputs `at` and `at + 1`, each optional.
fn mask_and_bias(
    ctx: &OpContext,
    inputs: &mut Inputs,
    at: usize,
) -> OpResult<(Option<ArrayD<bool>>, Option<FloatValue>)> {
    let cond = inputs.opt(at).map(Value::into_bool).transpose()?;
    let bias = inputs
        .opt(at + 1)
        .map(|b| b.into_float(ctx.device))
        .transpose()?;
    Ok((cond, bias))
}

/// A [`MASKED_SOFTMAX`] mark: `softmax(where(mask == keep_when, x * c (x / c when
/// divide), fill) + bias)`.
#[derive(Clone, Copy)]
struct Mark {
    c: f32,
    divide: bool,
    fill: f32,
    keep_when: bool,
}

impl Mark {
    /// Scores that are neither scaled nor masked.
    const UNMASKED: Mark = Mark {
        c: 1.0,
        divide: false,
        fill: 0.0,
        keep_when: true,
    };

    fn of(mark: &[f32]) -> OpResult<Self> {
        let &[c, divide, fill, keep_when] = mark else {
            op_bail!("malformed `{MASKED_SOFTMAX}` mark {mark:?}")
        };
        Ok(Mark {
            c,
            divide: divide == 1.0,
            fill,
            keep_when: keep_when == 1.0,
        })
    }

    /// The factor the scores are multiplied by.
    fn scale(self) -> f32 {
        if self.divide { 1.0 / self.c } else { self.c }
    }
}

/// The mask and the bias as the fused kernels read them, when they fit `scores` and the
/// bias needs no gradient. The mask's device form ([`keep_values`]) is made once a pass
/// and shared by every node reading an equal mask.
fn fused_masking(
    ctx: &OpContext,
    cond: Option<&ArrayD<bool>>,
    bias: Option<FloatValue>,
    scores: &[usize],
    mark: Mark,
    like: &PhysTensor,
) -> OpResult<Option<(PhysTensor, PhysTensor)>> {
    let fits = |s: &[usize]| broadcast_shapes(s, scores).is_ok_and(|b| b == scores);
    let fits = cond.is_none_or(|m| fits(m.shape()))
        && bias
            .as_ref()
            .is_none_or(|b| fits(&b.shape()) && !b.tensor.is_require_grad());
    if !fits {
        return Ok(None);
    }
    let keep = match cond {
        Some(cond) => {
            let form = if mark.keep_when {
                "keep where true"
            } else {
                "keep where false"
            };
            ctx.memo.device_form(cond, form, &like.device(), || {
                keep_values(cond, mark.keep_when, like)
            })?
        }
        None => ctx.memo.constant(1.0, &like.device()),
    };
    let bias = match bias {
        Some(b) => b.tensor,
        None => ctx.memo.constant(0.0, &like.device()),
    };
    Ok(Some((keep, bias)))
}

/// `softmax(where(mask == keep_when, x * c or x / c, fill) + bias)` (opset 13 and
/// later): one kernel each way on CubeCL devices ([`kernels::masked_softmax`]) when the
/// mask and the bias fit the scores' shape and the bias needs no gradient, the graph's
/// own composition otherwise.
fn masked_softmax(
    ctx: &OpContext,
    x: FloatValue,
    cond: Option<ArrayD<bool>>,
    bias: Option<FloatValue>,
    mark: Mark,
) -> OpResult<FloatValue> {
    let (shape, rank) = (x.shape(), x.rank);
    let axis = norm_axis(ctx.attrs.int("axis", -1)?, rank)?;
    if axis + 1 == rank && masked_softmax_fused_here(&x.tensor) {
        let fused = fused_masking(ctx, cond.as_ref(), bias.clone(), &shape, mark, &x.tensor)?;
        if let Some((keep, bias)) = fused {
            let y = kernels::masked_softmax(x.tensor, keep, bias, mark.scale(), mark.fill);
            return Ok(FloatValue::new(y, rank));
        }
    }
    let scaled = match (mark.c, mark.divide) {
        (1.0, _) => x,
        (c, true) => FloatValue::new(x.tensor.div_scalar(c), rank),
        (c, false) => FloatValue::new(x.tensor.mul_scalar(c), rank),
    };
    let masked = match cond {
        Some(cond) => {
            let fill = FloatValue::new(ctx.memo.constant(mark.fill, &scaled.tensor.device()), 0);
            if mark.keep_when {
                where_floats(ctx, &cond, scaled, fill)?
            } else {
                where_floats(ctx, &cond, fill, scaled)?
            }
        }
        None => scaled,
    };
    let biased = match bias {
        Some(bias) => float_binary(masked, bias, |a, b| a + b)?,
        None => masked,
    };
    let phys = biased.axis(axis as i64)?;
    let y = crate::kernels::softmax(biased.tensor, phys);
    Ok(FloatValue::new(y, biased.rank))
}

/// `MatMul(Softmax(masked(MatMul(q, kt))), v)` folded into one node
/// (`onnx::fusion::fuse_attention_core`; inputs `[q, kt, v, mask, bias]`): on CubeCL
/// devices one op that keeps no scores or probabilities for its backward
/// ([`kernels::attention_core`]) when the three operands have the same batch dimensions
/// and the softmax runs over the last axis; the three ops otherwise.
fn attention_core(ctx: &OpContext, mut inputs: Inputs) -> OpResult<OpOutput> {
    let mark = match ctx.attrs.floats(MASKED_SOFTMAX)? {
        Some(mark) => Mark::of(mark)?,
        None => Mark::UNMASKED,
    };
    let q = inputs.float(0, "Q", ctx.device)?;
    let kt = inputs.float(1, "K^T", ctx.device)?;
    let v = inputs.float(2, "V", ctx.device)?;
    let (cond, bias) = mask_and_bias(ctx, &mut inputs, 3)?;
    let (sq, sk, sv) = (q.shape(), kt.shape(), v.shape());
    let r = sq.len();
    let batched = r >= 2
        && sk.len() == r
        && sv.len() == r
        && sq[..r - 2] == sk[..r - 2]
        && sq[..r - 2] == sv[..r - 2]
        && sq[r - 1] == sk[r - 2]
        && sk[r - 1] == sv[r - 2];
    if batched
        && norm_axis(ctx.attrs.int("axis", -1)?, r)? + 1 == r
        && masked_softmax_fused_here(&q.tensor)
        && kt.tensor.dtype() == q.tensor.dtype()
        && v.tensor.dtype() == q.tensor.dtype()
    {
        let mut scores = sq.clone();
        scores[r - 1] = sk[r - 1];
        let fused = fused_masking(ctx, cond.as_ref(), bias.clone(), &scores, mark, &q.tensor)?;
        if let Some((keep, bias)) = fused {
            let compute = ctx.autocast.unwrap_or(FloatDType::F32);
            // Marked where only products read the output (through views): written in the
            // products' precision, `crate::model::activation_precision`.
            let out = match ctx.attrs.int(LOW_PRECISION_RESULT, 0)? {
                0 => FloatDType::F32,
                _ => compute,
            };
            let (q, kt, v) = (q.tensor, kt.tensor, v.tensor);
            let (scale, fill) = (mark.scale(), mark.fill);
            let y = kernels::attention_core(
                q,
                kt,
                v,
                keep,
                bias,
                scale,
                fill,
                (compute, out),
                kernels::TRANSIENT_BYTES,
            );
            return Ok(Value::Float(FloatValue::new(y, r)).into());
        }
    }
    let scores = autocast_product(ctx, q, kt)?;
    let p = masked_softmax(ctx, scores, cond, bias, mark)?;
    Ok(Value::Float(autocast_product(ctx, p, v)?).into())
}

/// The mask as the fused kernel reads it: 1 where the score is kept, 0 where filled, at
/// the condition's own (padded) shape.
fn keep_values(cond: &ArrayD<bool>, keep_when: bool, like: &PhysTensor) -> OpResult<PhysTensor> {
    let values: Vec<f32> = cond
        .iter()
        .map(|&c| if c == keep_when { 1.0 } else { 0.0 })
        .collect();
    Ok(PhysTensor::from_data(
        TensorData::new(values, padded(cond.shape())?),
        &like.device(),
    ))
}

/// `LogSoftmax`
pub fn log_softmax(ctx: &OpContext, inputs: Inputs) -> OpResult<OpOutput> {
    along_axis(ctx, inputs, |t, d| activation::log_softmax(t, d))
}
