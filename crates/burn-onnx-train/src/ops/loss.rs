//! `SoftmaxCrossEntropyLoss` and `NegativeLogLikelihoodLoss` (opsets 12 and 13).
//!
//! Scores or log-probabilities are `[N, C]` or `[N, C, d1, .., dk]`, the targets `[N]` or
//! `[N, d1, .., dk]` integer class indices. Each position contributes
//! `-log_prob[n, target, d..] * weight[target]` (weight 1 without the `weights` input);
//! positions whose target is `ignore_index` contribute 0 and leave the mean's denominator,
//! which is the sum of the weights of the remaining positions (their count without
//! weights), as in the ONNX spec and PyTorch.
//!
//! The targets are checked and turned into gather indices on the host; the float data
//! stays on the device, where the class of each position is picked with a differentiable
//! gather (its backward a scatter into the picked classes), so gradients reach the scores
//! (and the class weights, when they are trained).

use burn::tensor::activation;
use burn::tensor::{Bool, Int, Tensor, TensorData};
use ndarray::ArrayD;

use super::{Inputs, OpContext, OpOutput};
use crate::error::OpResult;
use crate::op_bail;
use crate::value::{FloatValue, Value, int_tensor_1d};

/// How the per-position losses are combined (`reduction` attribute).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Reduction {
    None,
    Sum,
    Mean,
}

impl Reduction {
    fn of(ctx: &OpContext) -> OpResult<Self> {
        Ok(match ctx.attrs.string("reduction", "mean")?.as_str() {
            "none" => Reduction::None,
            "sum" => Reduction::Sum,
            "mean" => Reduction::Mean,
            other => op_bail!("attribute `reduction` must be none, sum or mean, got {other:?}"),
        })
    }
}

/// The integer targets input, which must match `[N, d1, .., dk]` of an input `shape`.
fn targets(inputs: &mut Inputs, shape: &[usize]) -> OpResult<ArrayD<i64>> {
    let labels = match inputs.take(1, "target")? {
        Value::Int(a) => a,
        other => op_bail!(
            "target must be an integer tensor, got a {} tensor",
            other.kind()
        ),
    };
    let mut want = vec![shape[0]];
    want.extend_from_slice(&shape[2..]);
    if labels.shape() != want.as_slice() {
        op_bail!(
            "target has shape {:?}, expected {want:?} for an input of shape {shape:?}",
            labels.shape()
        );
    }
    Ok(labels)
}

/// The input's shape, which must be `[N, C, ..]`.
fn class_shape(x: &FloatValue, what: &str) -> OpResult<Vec<usize>> {
    let shape = x.shape();
    if shape.len() < 2 {
        op_bail!("{what} must have shape [N, C] or [N, C, d1, ..], got {shape:?}");
    }
    Ok(shape)
}

/// The loss of log-probabilities `log_prob` (shape `[N, C, ..]`) against `labels`, with the
/// node's `reduction` and `ignore_index` and optional per-class `weights` (`[C]`).
fn nll(
    ctx: &OpContext,
    log_prob: FloatValue,
    labels: &ArrayD<i64>,
    weights: Option<FloatValue>,
) -> OpResult<FloatValue> {
    let reduction = Reduction::of(ctx)?;
    let ignore = if ctx.attrs.has("ignore_index") {
        Some(ctx.attrs.int("ignore_index", 0)?)
    } else {
        None
    };
    let shape = log_prob.shape();
    let (n, c) = (shape[0], shape[1]);
    let d: usize = shape[2..].iter().product();
    if let Some(w) = &weights
        && w.shape() != [c]
    {
        op_bail!(
            "weights have shape {:?}, expected [{c}] (one per class)",
            w.shape()
        );
    }

    // Gather indices per position (0 for ignored ones, masked out below).
    let mut idx = Vec::with_capacity(labels.len());
    let mut ignored = Vec::with_capacity(labels.len());
    for (pos, &t) in labels.iter().enumerate() {
        if Some(t) == ignore {
            idx.push(0);
            ignored.push(true);
        } else if (0..c as i64).contains(&t) {
            idx.push(t);
            ignored.push(false);
        } else {
            op_bail!(
                "target {t} (element {pos} of the target tensor) is not a class index in \
                 0..{c}{}",
                ignore.map_or(String::new(), |i| format!(" nor ignore_index {i}"))
            );
        }
    }
    let kept = ignored.iter().filter(|i| !**i).count();
    let mask: Option<Tensor<2, Bool>> = ignored
        .iter()
        .any(|i| *i)
        .then(|| Tensor::from_data(TensorData::new(ignored, vec![n, d]), ctx.device));

    let x = log_prob.reshape(&[n, c, d])?.into_rank::<3>()?;
    let gather_idx: Tensor<3, Int> =
        Tensor::from_data(TensorData::new(idx.clone(), vec![n, 1, d]), ctx.device);
    let mut picked = x.gather(1, gather_idx).reshape([n, d]);
    // Ignored positions read class 0, which may hold anything (-inf): zero them, not scale.
    if let Some(m) = &mask {
        picked = picked.mask_fill(m.clone(), 0.0);
    }
    let mut loss = picked.neg();
    let position_weights = match weights {
        Some(w) => {
            let w = w
                .into_rank::<1>()?
                .select(0, int_tensor_1d(idx, ctx.device));
            let w = w.reshape([n, d]);
            let w = match &mask {
                Some(m) => w.mask_fill(m.clone(), 0.0),
                None => w,
            };
            loss = loss * w.clone();
            Some(w)
        }
        None => None,
    };
    let total = |t: Tensor<1>| -> OpResult<FloatValue> { FloatValue::from_rank(t)?.reshape(&[]) };
    match reduction {
        Reduction::None => {
            let out = FloatValue::from_rank(loss)?;
            out.reshape(labels.shape())
        }
        Reduction::Sum => total(loss.sum()),
        // 0 / 0 (every position ignored) is NaN, as in PyTorch and the ONNX reference.
        Reduction::Mean => match position_weights {
            Some(w) => total(loss.sum() / w.sum()),
            None => total(loss.sum().div_scalar(kept as f64)),
        },
    }
}

/// `SoftmaxCrossEntropyLoss(scores, labels, weights?)` (`reduction`, `ignore_index`): the
/// negative log-likelihood of the log-softmax of the scores along axis 1, and that
/// log-softmax as the optional second output `log_prob`.
pub fn softmax_cross_entropy_loss(ctx: &OpContext, mut inputs: Inputs) -> OpResult<OpOutput> {
    let scores = inputs.float(0, "scores", ctx.device)?;
    let shape = class_shape(&scores, "scores")?;
    let labels = targets(&mut inputs, &shape)?;
    let weights = inputs
        .opt(2)
        .map(|v| v.into_float(ctx.device))
        .transpose()?;
    let (n, c) = (shape[0], shape[1]);
    let d: usize = shape[2..].iter().product();
    let x = scores.reshape(&[n, c, d])?.into_rank::<3>()?;
    let log_prob = FloatValue::from_rank(activation::log_softmax(x, 1))?.reshape(&shape)?;
    let loss = nll(ctx, log_prob.clone(), &labels, weights)?;
    let mut values = vec![Value::Float(loss)];
    if ctx.num_outputs > 1 {
        values.push(Value::Float(log_prob));
    }
    Ok(values.into())
}

/// `NegativeLogLikelihoodLoss(input, target, weight?)` (`reduction`, `ignore_index`): the
/// input holds log-probabilities; each position's loss is
/// `-input[n, target, d..] * weight[target]`.
pub fn negative_log_likelihood_loss(ctx: &OpContext, mut inputs: Inputs) -> OpResult<OpOutput> {
    let x = inputs.float(0, "input", ctx.device)?;
    let shape = class_shape(&x, "input")?;
    let labels = targets(&mut inputs, &shape)?;
    let weights = inputs
        .opt(2)
        .map(|v| v.into_float(ctx.device))
        .transpose()?;
    Ok(Value::Float(nll(ctx, x, &labels, weights)?).into())
}
