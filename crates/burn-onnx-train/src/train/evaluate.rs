//! Evaluation (ORT's `EvaluateStep`): the test set without gradients and with dropout off,
//! its batches split across the data-parallel replicas (or replicated on each), the sums
//! all-reduced over the world so every rank gets the same metrics (in a pipeline only the
//! last stage computes them).

use burn::module::Module;
use burn_ort_dist::{Communicator, ReduceOp};

use super::passes::Passes;
use serde::Serialize;

use super::config::EvalConfig;
use super::data::Dataset;
use crate::error::{OnnxError, Result};
use crate::model::OnnxModel;
use crate::model::loss::LossKind;

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

impl EvalMetrics {
    /// `loss 2.3456, perplexity 10.44` / `loss 0.3012, accuracy 91.20%`: the figures a log
    /// line or a run's end summary shows.
    pub fn brief(&self) -> String {
        let mut text = format!("loss {:.4}", self.loss);
        if let Some(p) = self.perplexity {
            text += &format!(", perplexity {p:.2}");
        }
        if let Some(a) = self.accuracy {
            text += &format!(", accuracy {:.2}%", 100.0 * a);
        }
        text
    }
}

/// How many evaluation batches the config asks for on a test set of `len` samples; an
/// error when the set cannot fill one.
pub fn eval_batches(eval: &EvalConfig, len: usize) -> Result<usize> {
    let n = len / eval.eval_batch_size;
    if n == 0 {
        return Err(OnnxError::field(
            "config.eval.eval_batch_size",
            format!(
                "the test set ({len} samples) cannot fill one batch of {}",
                eval.eval_batch_size
            ),
        ));
    }
    Ok(if eval.eval_batches == 0 {
        n
    } else {
        n.min(eval.eval_batches)
    })
}

/// Where a rank evaluates in the run's layout
/// ([`crate::train::layout::parallel_plan::ParallelPlan::eval_place`]).
pub struct EvalPlace {
    /// This rank's data-parallel replica.
    pub replica: usize,
    /// The data-parallel replicas.
    pub replicas: usize,
    /// Whether this rank counts its losses: of the tensor-parallel ranks of a replica,
    /// which compute the same losses together, only the first does.
    pub reports: bool,
    /// Whether the replicas run every round together (ZeRO-3: the forward pass gathers
    /// the parameters, a collective of the replicas).
    pub lockstep: bool,
}

/// Mean loss (and perplexity or accuracy, by `loss_kind`) of `model` on `test` at update
/// `step`, as `eval` asks: this rank evaluates at `place`, runs `passes`, and `world` holds
/// every rank.
pub fn evaluate(
    eval: &EvalConfig,
    loss_kind: LossKind,
    world: &dyn Communicator,
    place: EvalPlace,
    passes: &dyn Passes,
    model: &OnnxModel,
    test: &dyn Dataset,
    step: usize,
) -> Result<EvalMetrics> {
    let EvalPlace {
        replica,
        replicas,
        reports,
        lockstep,
    } = place;
    let eval_model = model.valid();
    let batches = eval_batches(eval, test.len())?;
    let (first, stride) = if eval.eval_partitioned {
        (replica, replicas)
    } else {
        (0, 1)
    };
    // [loss sum, correct, samples]
    let mut sums = [0.0f32; 3];
    // In lockstep a replica left without a batch in the last round runs batch 0 uncounted.
    for round in 0..batches.div_ceil(stride) {
        let b = first + round * stride;
        if b >= batches && !lockstep {
            break;
        }
        let counted = b < batches;
        let b = if counted { b } else { 0 };
        let idx: Vec<usize> = (b * eval.eval_batch_size..(b + 1) * eval.eval_batch_size).collect();
        let batch = test.batch(&idx)?;
        if let Some((loss, correct)) = passes.eval(&eval_model, &batch)?
            && reports
            && counted
        {
            sums[0] += loss;
            sums[1] += correct as f32;
            sums[2] += idx.len() as f32;
        }
    }
    if world.world_size() > 1 {
        world.all_reduce(&mut sums, ReduceOp::Sum)?;
    }
    // Replicated evaluation: every replica summed every batch.
    let copies = if eval.eval_partitioned {
        1.0
    } else {
        replicas as f32
    };
    sums.iter_mut().for_each(|s| *s /= copies);
    let loss = f64::from(sums[0]) / batches as f64;
    Ok(EvalMetrics {
        step,
        loss,
        perplexity: (loss_kind == LossKind::LmCrossEntropy).then(|| loss.exp()),
        accuracy: (loss_kind == LossKind::CrossEntropy)
            .then(|| f64::from(sums[1]) / f64::from(sums[2])),
    })
}
