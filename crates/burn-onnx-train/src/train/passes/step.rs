//! One forward pass with the configured loss: the piece the training micro-step and the
//! evaluation step share.

use burn::tensor::{Device, Tensor};

use crate::collective::vocab::ShardedLogits;
use crate::error::{OnnxError, Result};
use crate::model::loss::{
    IGNORE_INDEX, LogitValues, Logits, LossKind, cross_entropy, lm_cross_entropy, mse,
    token_cross_entropy,
};
use crate::model::{ForwardOutput, Mode, OnnxModel};
use crate::train::config::TrainingConfig;
use crate::train::data::{Batch, Target};
use crate::train::precision::Precision;
use crate::value::host_tensor::HostTensor;
use crate::value::{FloatValue, PhysTensor, Value};

/// What the forward and backward passes read from a run's config: the graph's feeds and
/// loss, the compute precision, the accumulation and the seed. The plan builds it once
/// ([`PassSettings::of`]) and each [`Passes`](super::Passes) holds its copy.
#[derive(Debug, Clone, PartialEq)]
pub struct PassSettings {
    /// Graph input fed with the batch (`model.input_name`).
    pub input_name: String,
    /// Graph output the loss reads (`model.output_name`).
    pub output_name: String,
    /// The loss (`model.loss`).
    pub loss: LossKind,
    /// With the graph's own loss, the input fed with the targets (`model.label_name`,
    /// default `labels`).
    pub label_name: String,
    /// The graph input fed with the attention mask (`model.attention_mask_name`): the
    /// documents' padding mask, ones for windows.
    pub attention_mask_name: Option<String>,
    /// Compute precision of the big products (`precision.dtype`).
    pub precision: Precision,
    /// Micro-steps per update (`train.gradient_accumulation_steps`).
    pub accumulation: usize,
    /// The run's seed (`train.seed`): dropout masks derive from it.
    pub seed: u64,
}

impl PassSettings {
    /// The settings `c` gives the passes.
    pub fn of(c: &TrainingConfig) -> Self {
        PassSettings {
            input_name: c.model.input_name.clone(),
            output_name: c.model.output_name.clone(),
            loss: c.model.loss,
            label_name: c
                .model
                .label_name
                .clone()
                .unwrap_or_else(|| "labels".into()),
            attention_mask_name: c.model.attention_mask_name.clone(),
            precision: c.precision.dtype,
            accumulation: c.train.gradient_accumulation_steps,
            seed: c.train.seed,
        }
    }
}

/// Loss of one batch, with what else the step needs.
pub struct StepOutput {
    /// Scalar loss (`[1]`), differentiable when the model is on an autodiff device.
    pub loss: Tensor<1>,
    /// Batch-norm state updates from a training-mode forward.
    pub state_updates: Vec<(usize, PhysTensor)>,
    /// Correct top-1 predictions (classification only).
    pub correct: Option<usize>,
}

/// Forward `batch` through `model` and apply the configured loss; `seed` drives the pass's
/// randomness (dropout).
pub fn forward_loss(
    model: &OnnxModel,
    batch: &Batch,
    config: &PassSettings,
    device: &Device,
    mode: Mode,
    seed: u64,
) -> Result<StepOutput> {
    let out = forward_outputs(model, batch, config, device, mode, seed)?;
    loss_of_outputs(out, batch, config, device, mode)
}

/// The model's outputs on `batch`'s feeds.
fn forward_outputs(
    model: &OnnxModel,
    batch: &Batch,
    config: &PassSettings,
    device: &Device,
    mode: Mode,
    seed: u64,
) -> Result<ForwardOutput> {
    model.forward_with(
        feeds(batch, config, device)?,
        mode,
        seed,
        config.precision.autocast(),
    )
}

/// [`forward_loss`] with the output the loss reads (the logits), for callers that report
/// predictions (`learner.rs`; its models never leave their head to the loss).
pub fn forward_loss_and_output(
    model: &OnnxModel,
    batch: &Batch,
    config: &PassSettings,
    device: &Device,
    mode: Mode,
    seed: u64,
) -> Result<(StepOutput, PhysTensor)> {
    let out = forward_outputs(model, batch, config, device, mode, seed)?;
    let Some(Value::Float(logits)) = out.get(&config.output_name) else {
        return Err(OnnxError::field(
            "config.model.output_name",
            format!(
                "'{}' is not a float output of the graph",
                config.output_name
            ),
        ));
    };
    let logits = logits.tensor.clone();
    Ok((loss_of_outputs(out, batch, config, device, mode)?, logits))
}

/// The graph inputs a batch feeds: the input, and with `loss = "graph"` the targets.
fn feeds(batch: &Batch, config: &PassSettings, device: &Device) -> Result<Vec<(String, Value)>> {
    let value =
        |h: &HostTensor| Value::from_host(h, device).map_err(|e| OnnxError::field("batch", e.0));
    let mut feeds = vec![(config.input_name.clone(), value(&batch.input)?)];
    if config.loss == LossKind::Graph {
        let labels = match &batch.target {
            Target::NextToken => value(&batch.input)?,
            Target::Classes(c) => Value::Int(c.clone()),
            Target::Values(v) => value(&HostTensor::Float(v.clone()))?,
            // Hugging Face graphs shift the labels themselves: the label of position t
            // is the id it holds, which position t - 1 predicts.
            Target::Tokens { labels, .. } => {
                let mut unshifted = ndarray::ArrayD::from_elem(labels.raw_dim(), IGNORE_INDEX);
                let l = labels.shape()[1];
                unshifted
                    .slice_mut(ndarray::s![.., 1..])
                    .assign(&labels.slice(ndarray::s![.., ..l - 1]));
                Value::Int(unshifted)
            }
        };
        feeds.push((config.label_name.clone(), labels));
    }
    if let Some(name) = &config.attention_mask_name {
        let mask = match &batch.target {
            Target::Tokens { mask, .. } => mask.clone(),
            _ => ndarray::ArrayD::from_elem(batch.input.shape(), 1i64),
        };
        feeds.push((name.clone(), Value::Int(mask)));
    }
    Ok(feeds)
}

/// The configured loss of a forward pass's outputs against `batch`'s targets (the last
/// pipeline stage calls this on its outputs).
pub fn loss_of_outputs(
    out: ForwardOutput,
    batch: &Batch,
    config: &PassSettings,
    device: &Device,
    mode: Mode,
) -> Result<StepOutput> {
    // The logits: written by the model, or left to the loss with the head's operands.
    let values = match out.fused_head.clone() {
        Some(head) if head.output == config.output_name => LogitValues::Fused(head),
        _ => match out.get(&config.output_name).cloned() {
            Some(Value::Float(pred)) => LogitValues::Written(pred),
            _ => {
                return Err(OnnxError::field(
                    "config.model.output_name",
                    format!(
                        "'{}' is not a float output of the model",
                        config.output_name
                    ),
                ));
            }
        },
    };
    let pred = || match &values {
        LogitValues::Written(pred) => Ok(pred.clone()),
        LogitValues::Fused(_) => Err(OnnxError::field(
            "config.model.loss",
            format!(
                "the head writing '{}' was left to a cross-entropy, not to {:?}",
                config.output_name, config.loss
            ),
        )),
    };
    let sharded = out
        .sharded_logits
        .clone()
        .filter(|s| s.shard.output == config.output_name);
    if sharded.is_some()
        && !matches!(
            config.loss,
            LossKind::CrossEntropy | LossKind::LmCrossEntropy
        )
    {
        return Err(OnnxError::field(
            "config.model.loss",
            format!(
                "'{}' holds one tensor-parallel rank's slice of the vocabulary; only the cross-entropy losses read it",
                config.output_name
            ),
        ));
    }
    let classes = out
        .padded_logits
        .as_ref()
        .filter(|h| h.output == config.output_name)
        .map(|h| h.classes);
    let logits = || Logits {
        value: values.clone(),
        sharded: sharded.clone(),
        classes,
        uploads: out.uploads.clone(),
    };
    let (loss, correct) = match (config.loss, &batch.target, &batch.input) {
        (LossKind::Graph, _, _) => {
            let pred = pred()?;
            if pred.numel() != 1 {
                return Err(OnnxError::field(
                    "config.model.output_name",
                    format!(
                        "with loss = \"graph\", '{}' must be the scalar loss, got shape {:?}",
                        config.output_name,
                        pred.shape()
                    ),
                ));
            }
            (pred.tensor.reshape([1]), None)
        }
        (LossKind::LmCrossEntropy, Target::NextToken, HostTensor::Int(ids)) => {
            (lm_cross_entropy(logits(), ids)?, None)
        }
        (
            LossKind::LmCrossEntropy,
            Target::Tokens {
                labels, divisor, ..
            },
            _,
        ) => (token_cross_entropy(logits(), labels, *divisor)?, None),
        (LossKind::CrossEntropy, Target::Classes(labels), _) => {
            let correct = if mode == Mode::Eval {
                Some(count_correct(&pred()?, labels, sharded.as_ref(), classes)?)
            } else {
                None
            };
            (cross_entropy(logits(), labels)?, correct)
        }
        (LossKind::Mse, Target::Values(t), _) => {
            let t = FloatValue::from_array(t, device)
                .map_err(|e| OnnxError::field("batch targets", e.0))?;
            (mse(pred()?, t)?, None)
        }
        (kind, _, _) => {
            return Err(OnnxError::field(
                "config.model.loss",
                format!("loss {kind:?} does not fit this data set's targets"),
            ));
        }
    };
    Ok(StepOutput {
        loss,
        state_updates: out.state_updates,
        correct,
    })
}

/// Rows whose top-1 class (over every rank's slice, for sharded logits) is the label.
fn count_correct(
    logits: &FloatValue,
    labels: &ndarray::ArrayD<i64>,
    sharded: Option<&ShardedLogits>,
    padded_to_classes: Option<usize>,
) -> Result<usize> {
    let a = logits
        .to_array()
        .map_err(|e| OnnxError::field("logits", e.0))?;
    let width = *a.shape().last().unwrap_or(&1);
    let a = match padded_to_classes {
        Some(c) if c < width => a
            .slice_axis(ndarray::Axis(a.ndim() - 1), (0..c).into())
            .to_owned(),
        _ => a,
    };
    let classes = *a.shape().last().unwrap_or(&1);
    let rows = a
        .as_standard_layout()
        .into_owned()
        .into_shape_with_order((labels.len(), classes))
        .map_err(|e| OnnxError::field("logits", e.to_string()))?;
    let best: Vec<usize> = match sharded {
        Some(s) => s
            .argmax_rows(&rows)
            .map_err(|e| OnnxError::field("logits", e.0))?,
        None => rows
            .outer_iter()
            .map(|row| {
                row.iter()
                    .enumerate()
                    .fold(
                        (0, f32::MIN),
                        |acc, (i, &v)| if v > acc.1 { (i, v) } else { acc },
                    )
                    .0
            })
            .collect(),
    };
    Ok(best
        .iter()
        .zip(labels.iter())
        .filter(|(b, l)| **b as i64 == **l)
        .count())
}

/// Read a scalar tensor. A device that failed on the way (an allocation it could not
/// make, a kernel that did not run) ends the run with [`device_failure`].
pub fn scalar(t: Tensor<1>) -> Result<f32> {
    let device = t.device();
    t.try_into_scalar::<f32>()
        .map_err(|e| device_failure(&device, &format!("{e:?}")))
}

/// The error of a device that could not run the step: the device, what it reported
/// (cubecl's error names the allocation that failed) and the memory its pools held.
pub fn device_failure(device: &Device, reported: &str) -> OnnxError {
    let held = device
        .memory_pool_usage()
        .map(|u| format!(" (its memory pools held {} MiB)", u.bytes_reserved >> 20))
        .unwrap_or_default();
    OnnxError::field(
        "device",
        format!("{device:?} could not run the training step{held}: {reported}"),
    )
}
