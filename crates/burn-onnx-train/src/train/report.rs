//! Where a run reports after each update and evaluation: the run summary it returns, the
//! throughput meter, TensorBoard, the progress bar and the log.

use serde::Serialize;

use super::config::TrainingConfig;
use super::evaluate::EvalMetrics;
use super::metrics_log::MetricsLog;
use super::parallel_plan::ParallelPlan;
use super::perf::{PerfMeter, PerfReport};
use super::summaries::Summaries;
use crate::error::Result;
use crate::model::OnnxModel;
use crate::progress::{Bar, updates};

/// What a finished run reports.
#[derive(Debug, Clone, Serialize)]
pub struct RunSummary {
    /// Update step the run started from (non-zero after a resume).
    pub start_step: usize,
    /// `(update step, mean loss of that update)` for every update this run performed.
    pub losses: Vec<(usize, f64)>,
    /// Evaluations.
    pub evals: Vec<EvalMetrics>,
    /// Exported model (rank 0).
    pub exported: Option<std::path::PathBuf>,
    /// Throughput report (rank 0).
    pub perf: Option<PerfReport>,
}

/// The loop's reporters: throughput meter, run summary, TensorBoard, progress bar, log.
pub(super) struct Reporter {
    pub perf: PerfMeter,
    pub summary: RunSummary,
    pub tb: Summaries,
    pub bar: Bar,
    /// `metrics.jsonl` (world rank 0).
    metrics: Option<MetricsLog>,
    unit: &'static str,
    root: bool,
}

/// One update's figures, as the reporters show them.
pub(super) struct UpdateReport {
    pub step: usize,
    pub loss: f64,
    pub lr: f64,
    pub grad_norm: f32,
    pub loss_scale: Option<f64>,
    /// A logged step (every `display_loss_steps` updates, and the last).
    pub display: bool,
}

impl Reporter {
    /// The reporters of world rank `rank` for updates `start_step..total`, counting `unit`s.
    pub fn open(
        c: &TrainingConfig,
        place: &ParallelPlan,
        rank: usize,
        unit: &'static str,
        (start_step, total): (usize, usize),
    ) -> Result<Self> {
        let root = rank == 0;
        Ok(Reporter {
            perf: PerfMeter::new(unit),
            summary: RunSummary {
                start_step,
                losses: Vec::new(),
                evals: Vec::new(),
                exported: None,
                perf: None,
            },
            tb: Summaries::open(c, place.summary_role(rank))?,
            bar: updates(c.logging.progress && root, total, start_step),
            metrics: root
                .then(|| MetricsLog::open(&c.checkpoint.output_dir, start_step))
                .transpose()?,
            unit,
            root,
        })
    }

    /// After an update: summary, progress bar, TensorBoard, and the log line when `display`.
    pub fn update(&mut self, u: &UpdateReport) -> Result<()> {
        let (rate, unit) = (self.perf.recent_rate(), self.unit);
        let (step, loss, lr, grad_norm) = (u.step, u.loss, u.lr, u.grad_norm);
        self.summary.losses.push((step, loss));
        self.bar.set_position(step as u64);
        self.bar
            .set_message(format!("loss {loss:.4} | {rate:.0} {unit}/s"));
        self.tb
            .update(step, loss, lr, grad_norm, u.loss_scale, rate, unit)?;
        if let Some(m) = self.metrics.as_mut().filter(|_| u.display) {
            m.update(step, loss, lr, grad_norm, u.loss_scale, (rate, unit))?;
        }
        if self.root && u.display {
            self.bar
                .suspend(|| tracing::info!(step, loss, lr, grad_norm, rate, unit, "train"));
        }
        Ok(())
    }

    /// After an evaluation.
    pub fn eval(&mut self, m: EvalMetrics, model: &OnnxModel) -> Result<()> {
        if self.root {
            self.bar.suspend(|| {
                tracing::info!(
                    step = m.step,
                    loss = m.loss,
                    perplexity = m.perplexity,
                    accuracy = m.accuracy,
                    "eval"
                )
            });
        }
        self.tb.eval(&m, model)?;
        if let Some(log) = self.metrics.as_mut() {
            log.eval(&m)?;
        }
        self.summary.evals.push(m);
        Ok(())
    }

    /// A line in the log (rank 0), above the progress bar.
    pub fn log(&self, line: impl FnOnce()) {
        if self.root {
            self.bar.suspend(line);
        }
    }
}
