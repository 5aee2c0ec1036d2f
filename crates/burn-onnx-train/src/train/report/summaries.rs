//! What a run writes to TensorBoard (rank 0): per update the loss, learning rate, global
//! gradient norm and throughput; every `display_loss_steps` the per-tensor weight and
//! gradient norms selected by `norm_weights` (ORT's norm summaries); per evaluation the
//! metrics and the histograms of `histogram_weights`.

use burn::module::ParamId;

use crate::error::{OnnxError, Result};
use crate::model::{OnnxModel, ParamRole};
use crate::train::config::{CheckpointConfig, LoggingConfig};
use crate::train::evaluate::EvalMetrics;
use crate::train::report::tensorboard::EventWriter;

/// What a rank writes to TensorBoard.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SummaryRole {
    /// Nothing (the other ranks, or `log_dir = ""`).
    Silent,
    /// The run's scalars, and the weight summaries of the parameters this rank holds
    /// (world rank 0).
    Run,
    /// Only the weight summaries (norms, histograms) of the parameters this rank holds:
    /// the first replica's rank of a later pipeline stage, in an event file of its own
    /// in the same directory (TensorBoard merges them).
    StageWeights,
}

/// The run's TensorBoard writer; every method is a no-op when logging is off.
pub struct Summaries {
    writer: Option<EventWriter>,
    scalars: bool,
    histogram_weights: Vec<String>,
    norm_weights: Vec<String>,
}

impl Summaries {
    /// Open `logging`'s log directory (by default under `checkpoint`'s output directory)
    /// for `role`.
    pub fn open(
        logging: &LoggingConfig,
        checkpoint: &CheckpointConfig,
        role: SummaryRole,
    ) -> Result<Self> {
        let writer = if role == SummaryRole::Silent {
            None
        } else {
            logging
                .resolved_log_dir(&checkpoint.output_dir)
                .map(|d| EventWriter::create(&d))
                .transpose()?
        };
        Ok(Summaries {
            writer,
            scalars: role == SummaryRole::Run,
            histogram_weights: logging.histogram_weights.clone(),
            norm_weights: logging.norm_weights.clone(),
        })
    }

    /// Scalars of one optimizer update.
    pub fn update(
        &mut self,
        step: usize,
        loss: f64,
        lr: f64,
        grad_norm: f32,
        loss_scale: Option<f64>,
        rate: f64,
        unit: &str,
    ) -> Result<()> {
        let Some(w) = self.writer.as_mut().filter(|_| self.scalars) else {
            return Ok(());
        };
        let step = step as i64;
        w.add_scalar("train/loss", loss as f32, step)?;
        w.add_scalar("train/learning_rate", lr as f32, step)?;
        w.add_scalar("train/grad_norm", grad_norm, step)?;
        if let Some(s) = loss_scale {
            w.add_scalar("train/loss_scale", s as f32, step)?;
        }
        w.add_scalar(&format!("train/{unit}_per_sec"), rate as f32, step)
    }

    /// Should [`Summaries::norms`] run at this update?
    pub fn wants_norms(&self) -> bool {
        self.writer.is_some() && !self.norm_weights.is_empty()
    }

    /// L2 norms of the selected weights and of their (synchronised, unclipped) gradients,
    /// `grad_norms` by parameter id as the update strategy measured them.
    pub fn norms(
        &mut self,
        model: &OnnxModel,
        grad_norms: &[(ParamId, f32)],
        step: usize,
    ) -> Result<()> {
        let Some(w) = self.writer.as_mut() else {
            return Ok(());
        };
        let all = self.norm_weights.iter().any(|n| n == "*");
        for (info, p) in model.param_infos().iter().zip(model.params()) {
            let selected = if all {
                info.role == ParamRole::Trainable
            } else {
                self.norm_weights.contains(&info.name)
            };
            if !selected {
                continue;
            }
            let norm = burn_ort_dist::host_values(p.val().square().sum().sqrt())
                .map_err(|e| OnnxError::field("tensorboard", format!("{}: {e}", info.name)))?;
            w.add_scalar(&format!("norms/weight/{}", info.name), norm[0], step as i64)?;
            if let Some((_, g)) = grad_norms.iter().find(|(id, _)| *id == p.id) {
                w.add_scalar(&format!("norms/gradient/{}", info.name), *g, step as i64)?;
            }
        }
        Ok(())
    }

    /// An evaluation's metrics and the weight histograms.
    pub fn eval(&mut self, m: &EvalMetrics, model: &OnnxModel) -> Result<()> {
        let Some(w) = self.writer.as_mut() else {
            return Ok(());
        };
        let step = m.step as i64;
        if self.scalars {
            w.add_scalar("eval/loss", m.loss as f32, step)?;
            if let Some(p) = m.perplexity {
                w.add_scalar("eval/perplexity", p as f32, step)?;
            }
            if let Some(a) = m.accuracy {
                w.add_scalar("eval/accuracy", a as f32, step)?;
            }
        }
        for name in &self.histogram_weights {
            // The names were checked against the whole model; a pipeline stage writes the
            // ones it holds.
            let Some(v) = model.param_by_name(name) else {
                continue;
            };
            let a = v.to_array().map_err(|e| OnnxError::field(name, e.0))?;
            w.add_histogram(
                &format!("weights/{name}"),
                a.as_slice().unwrap_or(&[]),
                step,
            )?;
        }
        w.flush()
    }

    /// Write what is buffered.
    pub fn flush(&mut self) -> Result<()> {
        self.writer.as_mut().map_or(Ok(()), EventWriter::flush)
    }
}
