//! Where a run reports after each update and evaluation: the run summary it returns, the
//! throughput meter, TensorBoard, the progress bar and the log.

pub mod metrics_log;
pub mod overview;
pub mod perf;
pub mod summaries;
pub mod tensorboard;

use std::fmt;
use std::path::PathBuf;
use std::time::Instant;

use serde::Serialize;

use self::metrics_log::MetricsLog;
use self::perf::{PerfMeter, PerfReport};
use self::summaries::Summaries;
use super::config::{CheckpointConfig, LoggingConfig};
use super::evaluate::EvalMetrics;
use super::layout::parallel_plan::ParallelPlan;
use crate::error::Result;
use crate::model::OnnxModel;
use crate::util::progress::{Bar, updates};

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
    pub exported: Option<PathBuf>,
    /// Throughput report (rank 0).
    pub perf: Option<PerfReport>,
    /// The last checkpoint this run wrote.
    pub checkpoint: Option<PathBuf>,
    /// The run's output directory (`metrics.jsonl`, TensorBoard, `perf.json`).
    pub output_dir: PathBuf,
    /// Seconds from the first update to the end of the export.
    pub seconds: f64,
}

impl fmt::Display for RunSummary {
    /// The end of a run in a few lines: the loss from first to last update with the time
    /// and throughput, the last evaluation, the last checkpoint, the export, the metrics.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (Some(first), Some(last)) = (self.losses.first(), self.losses.last()) else {
            return write!(
                f,
                "nothing to train: the run in {} had finished (it resumed at its last update, {}); --resume never or another --output-dir starts anew",
                self.output_dir.display(),
                self.start_step
            );
        };
        let rate = self.perf.as_ref().map_or_else(String::new, |p| {
            format!(", {:.0} {}/s", p.throughput_per_sec, p.unit)
        });
        writeln!(
            f,
            "train loss {:.4} (update {}) -> {:.4} (update {}): {} updates in {:.1} s{rate}",
            first.1,
            first.0,
            last.1,
            last.0,
            self.losses.len(),
            self.seconds
        )?;
        if let Some(e) = self.evals.last() {
            writeln!(f, "eval {} (update {})", e.brief(), e.step)?;
        }
        if let Some(c) = &self.checkpoint {
            writeln!(f, "checkpoint {}", c.display())?;
        }
        if let Some(p) = &self.exported {
            writeln!(f, "exported {}", p.display())?;
        }
        write!(
            f,
            "metrics {}",
            self.output_dir.join("metrics.jsonl").display()
        )
    }
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
    /// The run's last update (the `N` of `step k/N`).
    total: usize,
    /// When the reporters opened (the run's first update follows).
    started: Instant,
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
    /// The reporters of world rank `rank` for updates `start_step..total`, counting `unit`s,
    /// as `logging` asks, into `checkpoint`'s output directory.
    pub fn open(
        logging: &LoggingConfig,
        checkpoint: &CheckpointConfig,
        plan: &ParallelPlan,
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
                checkpoint: None,
                output_dir: checkpoint.output_dir.clone(),
                seconds: 0.0,
            },
            tb: Summaries::open(logging, checkpoint, plan.summary_role(rank))?,
            bar: updates(logging.progress && root, total, start_step),
            metrics: root
                .then(|| MetricsLog::open(&checkpoint.output_dir, start_step))
                .transpose()?,
            unit,
            total,
            started: Instant::now(),
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
            let total = self.total;
            self.bar.suspend(|| {
                tracing::info!(
                    "train step {step}/{total}: loss {loss:.4}, lr {lr:.3e}, grad norm {grad_norm:.3}, {rate:.0} {unit}/s"
                )
            });
        }
        Ok(())
    }

    /// After an evaluation.
    pub fn eval(&mut self, m: EvalMetrics, model: &OnnxModel) -> Result<()> {
        if self.root {
            self.bar
                .suspend(|| tracing::info!("eval step {}/{}: {}", m.step, self.total, m.brief()));
        }
        self.tb.eval(&m, model)?;
        if let Some(log) = self.metrics.as_mut() {
            log.eval(&m)?;
        }
        self.summary.evals.push(m);
        Ok(())
    }

    /// The run's summary, its time taken now.
    pub fn finish(mut self) -> RunSummary {
        self.summary.seconds = self.started.elapsed().as_secs_f64();
        self.summary
    }

    /// A line in the log (rank 0), above the progress bar.
    pub fn log(&self, line: impl FnOnce()) {
        if self.root {
            self.bar.suspend(line);
        }
    }
}
