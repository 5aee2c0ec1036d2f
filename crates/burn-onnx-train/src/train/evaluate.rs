//! Evaluation (ORT's `EvaluateStep`): the test set without gradients and with dropout off,
//! its batches split across the data-parallel ranks (or replicated on each), the sums
//! all-reduced so every rank gets the same metrics.

use burn::module::Module;
use burn_ort_dist::{Communicator, ReduceOp};
use serde::Serialize;

use super::config::TrainingConfig;
use super::data::Dataset;
use super::step::{forward_loss, scalar};
use crate::error::{OnnxError, Result};
use crate::loss::LossKind;
use crate::model::{Mode, OnnxModel};

/// Evaluation result.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct EvalMetrics {
    /// Update step at which it ran.
    pub step: usize,
    /// Mean loss over the evaluated batches.
    pub loss: f64,
    /// `exp(loss)` for language models.
    pub perplexity: Option<f64>,
    /// Top-1 accuracy for classifiers.
    pub accuracy: Option<f64>,
}

/// How many evaluation batches the config asks for on a test set of `len` samples; an
/// error when the set cannot fill one.
pub fn eval_batches(c: &TrainingConfig, len: usize) -> Result<usize> {
    let n = len / c.eval_batch_size;
    if n == 0 {
        return Err(OnnxError::field("config.eval_batch_size", format!("the test set ({len} samples) cannot fill one batch of {}", c.eval_batch_size)));
    }
    Ok(if c.eval_batches == 0 { n } else { n.min(c.eval_batches) })
}

/// Mean loss (and perplexity or accuracy) of `model` on `test` at update `step`.
pub fn evaluate(c: &TrainingConfig, comm: &dyn Communicator, model: &OnnxModel, test: &dyn Dataset, step: usize) -> Result<EvalMetrics> {
    let eval_model = model.valid();
    let device = eval_model.device();
    let batches = eval_batches(c, test.len())?;
    let (rank, world) = if c.eval_partitioned { (comm.rank(), comm.world_size()) } else { (0, 1) };
    // [loss sum, correct, samples]
    let mut sums = [0.0f32; 3];
    for b in (rank..batches).step_by(world) {
        let idx: Vec<usize> = (b * c.eval_batch_size..(b + 1) * c.eval_batch_size).collect();
        let batch = test.batch(&idx)?;
        let out = forward_loss(&eval_model, &batch, c, &device, Mode::Eval, 0)?;
        sums[0] += scalar(out.loss);
        sums[1] += out.correct.unwrap_or(0) as f32;
        sums[2] += idx.len() as f32;
    }
    if world > 1 {
        comm.all_reduce(&mut sums, ReduceOp::Sum)?;
    }
    let loss = f64::from(sums[0]) / batches as f64;
    Ok(EvalMetrics {
        step,
        loss,
        perplexity: (c.loss == LossKind::LmCrossEntropy).then(|| loss.exp()),
        accuracy: (c.loss == LossKind::CrossEntropy).then(|| f64::from(sums[1]) / f64::from(sums[2])),
    })
}
