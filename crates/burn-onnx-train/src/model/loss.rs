//! Losses attached to graph outputs: classification cross-entropy, next-token language-model
//! cross-entropy and mean squared error. Each returns a scalar (shape `[1]`) tensor to call
//! `backward()` on, with PyTorch's reduction (`mean`) and `ignore_index` (-100) semantics.

use std::sync::Arc;

use burn::tensor::Tensor;
use ndarray::ArrayD;
use serde::{Deserialize, Serialize};

use crate::collective::vocab::ShardedLogits;
use crate::error::{OnnxError, Result};
use crate::kernels::{
    block_rows, cross_entropy_rows_within, head_cross_entropy_sum, head_cross_entropy_value,
};
use crate::model::HeadOperands;
use crate::value::FloatValue;
use crate::value::uploads::DeviceUploads;

/// Target value that contributes nothing to cross-entropy (PyTorch's default).
pub const IGNORE_INDEX: i64 = -100;

/// The loss functions a training run can attach to the model's output.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "cli", derive(clap::ValueEnum))]
#[cfg_attr(feature = "cli", value(rename_all = "snake_case"))]
#[serde(rename_all = "snake_case")]
pub enum LossKind {
    /// Cross-entropy of logits `[.., C]` against class ids `[..]`.
    CrossEntropy,
    /// Next-token cross-entropy: logits `[B, S, V]` at position t predict ids `[B, S]` at t+1.
    LmCrossEntropy,
    /// Mean squared error against a float target of the output's shape.
    Mse,
    /// The graph computes its own loss (ORT Training's way: a graph ending in
    /// `SoftmaxCrossEntropyLoss`, say): `output_name` is that scalar, and the batch's
    /// targets feed the graph input `label_name` (class ids, float targets, or for token
    /// shards the ids themselves, shifted inside the graph as Hugging Face models do).
    Graph,
}

fn loss_err(m: String) -> OnnxError {
    OnnxError::field("loss", m)
}

/// The logits a cross-entropy reads: the whole class axis, a tensor-parallel rank's
/// slice of the vocabulary (the head split along it), or rows wider than the classes (a
/// padded head, `crate::model::padded_head`).
#[derive(Debug, Clone)]
pub struct Logits {
    /// The values, class axis last.
    pub value: LogitValues,
    /// Which slice of the classes they hold, with the group holding the rest.
    pub sharded: Option<ShardedLogits>,
    /// The classes, when fewer than the last axis's columns: the loss reads these first
    /// columns of each row only.
    pub classes: Option<usize>,
    /// Where the targets and weights are uploaded: the model's copies
    /// ([`ForwardOutput::uploads`](crate::model::ForwardOutput::uploads)), so that weights
    /// equal to the last pass's are not uploaded again.
    pub uploads: Arc<DeviceUploads>,
}

/// Where a cross-entropy's logits come from.
#[derive(Debug, Clone)]
pub enum LogitValues {
    /// Written by the model.
    Written(FloatValue),
    /// Computed with the loss from the head's operands, a block of rows at a time, never
    /// whole (`crate::model::fused_head_loss`).
    Fused(HeadOperands),
}

impl LogitValues {
    /// The logits' shape, class axis last.
    pub fn shape(&self) -> Vec<usize> {
        match self {
            LogitValues::Written(v) => v.shape(),
            LogitValues::Fused(h) => {
                let mut shape = h.hidden.shape();
                if let (Some(last), Some(&columns)) = (shape.last_mut(), h.table.shape().last()) {
                    *last = columns;
                }
                shape
            }
        }
    }

    /// The logits the model wrote; `None` for a head left to the loss.
    pub fn written(&self) -> Option<&FloatValue> {
        match self {
            LogitValues::Written(v) => Some(v),
            LogitValues::Fused(_) => None,
        }
    }
}

impl From<FloatValue> for LogitValues {
    fn from(value: FloatValue) -> Self {
        LogitValues::Written(value)
    }
}

impl From<FloatValue> for Logits {
    fn from(value: FloatValue) -> Self {
        Logits {
            value: LogitValues::Written(value),
            sharded: None,
            classes: None,
            uploads: Arc::default(),
        }
    }
}

/// Mean cross-entropy with the class axis last; targets have the logits' leading shape.
pub fn cross_entropy(logits: impl Into<Logits>, targets: &ArrayD<i64>) -> Result<Tensor<1>> {
    let (sum, counted) = cross_entropy_sum(logits, targets)?;
    if counted == 0 {
        return Err(loss_err("every target is ignore_index".into()));
    }
    Ok(sum.div_scalar(counted as f32))
}

/// Cross-entropy summed over the positions with a label (`labels`: the logits' leading
/// shape, [`IGNORE_INDEX`] where none) and divided by `divisor`: the documents' loss,
/// whose divisor counts the labels of a whole update (see `train::data::Target::Tokens`).
pub fn token_cross_entropy(
    logits: impl Into<Logits>,
    labels: &ArrayD<i64>,
    divisor: f64,
) -> Result<Tensor<1>> {
    if divisor.is_nan() || divisor <= 0.0 {
        return Err(loss_err(format!(
            "the loss divisor {divisor} is not positive"
        )));
    }
    Ok(cross_entropy_sum(logits, labels)?.0.div_scalar(divisor))
}

/// Cross-entropy summed over the targets that are not [`IGNORE_INDEX`], and their count.
fn cross_entropy_sum(
    logits: impl Into<Logits>,
    targets: &ArrayD<i64>,
) -> Result<(Tensor<1>, usize)> {
    let Logits {
        value: logits,
        sharded,
        classes,
        uploads,
    } = logits.into();
    let shape = logits.shape();
    let Some((&width, lead)) = shape.split_last() else {
        return Err(loss_err("cross-entropy needs logits of rank >= 1".into()));
    };
    if lead != targets.shape() {
        return Err(loss_err(format!(
            "logits {shape:?} and targets {:?} disagree (targets must be logits' shape without the class axis)",
            targets.shape()
        )));
    }
    let columns = classes.unwrap_or(width);
    if columns == 0 || columns > width {
        return Err(loss_err(format!(
            "{columns} classes in logits {shape:?} (a padded head has at least as many columns as classes)"
        )));
    }
    let classes = sharded.as_ref().map_or(columns, |s| s.shard.vocab);
    let n: usize = lead.iter().product();
    let mut weight = Vec::with_capacity(n);
    for &t in targets.iter() {
        if t == IGNORE_INDEX {
            weight.push(0f32);
        } else if t < 0 || t as usize >= classes {
            return Err(loss_err(format!("target {t} is outside 0..{classes}")));
        } else {
            weight.push(1.0);
        }
    }
    let idx = target_rows(targets);
    let counted = weight.iter().filter(|w| **w > 0.0).count();
    let logits = match logits {
        LogitValues::Written(v) => v,
        LogitValues::Fused(head) if sharded.is_none() => {
            return Ok((
                fused_sum(head, (&idx, &weight), columns, &uploads)?,
                counted,
            ));
        }
        LogitValues::Fused(_) => {
            return Err(loss_err(
                "a head left to the loss cannot also be split across ranks".into(),
            ));
        }
    };
    let device = logits.tensor.device();
    let flat = logits
        .reshape(&[n, width])
        .map_err(|e| loss_err(e.0))?
        .into_rank::<2>()
        .map_err(|e| loss_err(e.0))?;
    let nll = match sharded {
        Some(s) => s.nll_rows(flat, &idx).map_err(|e| loss_err(e.0))?,
        None => cross_entropy_rows_within(flat, uploads.ints(&idx, &device), columns),
    };
    let nll = if counted == n {
        nll
    } else {
        nll * uploads.floats(&weight, &device)
    };
    Ok((nll.sum(), counted))
}

/// The weighted sum of the rows' cross-entropy over the product of a head's operands
/// (`kernels::head_cross_entropy_sum`, or `head_cross_entropy_value` where the pass takes
/// no gradient): `idx` and `weight` per row, `classes` columns read.
fn fused_sum(
    head: HeadOperands,
    (idx, weight): (&[i64], &[f32]),
    classes: usize,
    uploads: &DeviceUploads,
) -> Result<Tensor<1>> {
    let n = idx.len();
    let width = head.table.shape()[0];
    let hidden = head
        .hidden
        .reshape(&[n, width])
        .map_err(|e| loss_err(e.0))?;
    let device = hidden.tensor.device();
    let columns = head.table.shape()[1];
    let by_blocks = match head.gradients {
        true => head_cross_entropy_sum,
        false => head_cross_entropy_value,
    };
    Ok(by_blocks(
        hidden.tensor,
        head.table.tensor,
        uploads.ints(idx, &device),
        uploads.floats(weight, &device),
        classes,
        head.compute,
        block_rows(columns, head.compute, &device),
    ))
}

/// Next-token cross-entropy: `cross_entropy(logits[:, :-1], ids[:, 1:])`, computed on the
/// whole logits with [`IGNORE_INDEX`] as the last position's target. Slicing the logits
/// first made a copy in forward (the slice is not contiguous) and, in backward, a
/// zero-padded copy of their gradient: two more tensors of `batch x seq x vocab` values
/// (1.6 GB each for GPT-2 at 8 x 1024 tokens).
pub fn lm_cross_entropy(logits: impl Into<Logits>, ids: &ArrayD<i64>) -> Result<Tensor<1>> {
    let logits = logits.into();
    let shape = logits.value.shape();
    let [b, s, _] = shape[..] else {
        return Err(loss_err(format!(
            "LM loss needs logits [batch, seq, vocab], got {shape:?}"
        )));
    };
    if ids.shape() != [b, s] || s < 2 {
        return Err(loss_err(format!(
            "LM loss needs ids [batch, seq >= 2] matching logits {shape:?}, got {:?}",
            ids.shape()
        )));
    }
    cross_entropy(logits, &next_token_targets(ids))
}

/// The targets of the next-token loss on token `ids` `[batch, seq]`: each position's next
/// id, [`IGNORE_INDEX`] at the last.
pub fn next_token_targets(ids: &ArrayD<i64>) -> ArrayD<i64> {
    let mut next = ArrayD::from_elem(ids.raw_dim(), IGNORE_INDEX);
    if let Some(&s) = ids.shape().get(1).filter(|&&s| s > 0) {
        next.slice_mut(ndarray::s![.., ..s - 1])
            .assign(&ids.slice(ndarray::s![.., 1..]));
    }
    next
}

/// The row indices a cross-entropy uploads for `targets` (in order; [`IGNORE_INDEX`] reads
/// row 0, weighted 0).
pub fn target_rows(targets: &ArrayD<i64>) -> Vec<i64> {
    targets
        .iter()
        .map(|&t| if t == IGNORE_INDEX { 0 } else { t })
        .collect()
}

/// Mean squared error.
pub fn mse(pred: FloatValue, target: FloatValue) -> Result<Tensor<1>> {
    if pred.shape() != target.shape() {
        return Err(loss_err(format!(
            "prediction {:?} and target {:?} differ in shape",
            pred.shape(),
            target.shape()
        )));
    }
    let n = pred.numel();
    let d = pred.tensor - target.tensor;
    Ok(d.square().reshape([n]).mean())
}
