//! `--auto`: the layout chosen for you, as DeepSpeed's autotuner chooses by short
//! experiments. Every way to lay a run out on its world (data x tensor x pipeline
//! parallel sizes, and ZeRO stages 0 to 3 where there are replicas) is fitted to that world
//! keeping the global batch ([`super::elastic::fit_world`]), its memory planned
//! ([`plan_memory`]: a rank's peak from counted bytes and a probed working set), and its
//! speed measured by probe steps: the layout itself, run for [`SPEED_UPDATES`] updates in
//! a process of its own, its throughput over the last half. The layouts that fit the
//! memory of a rank are ranked by that throughput; the others follow, with why.

use std::path::Path;
use std::sync::Arc;

use serde::Serialize;

use super::config::TrainingConfig;
use super::data::Dataset;
use super::elastic::with_replicas;
use super::memory_plan::{plan_memory, probe_in_child};
use crate::error::Result;

/// Updates of a speed probe (the first half warms up).
pub const SPEED_UPDATES: usize = 4;

/// One layout tried.
#[derive(Debug, Clone, Serialize)]
pub struct Trial {
    /// Data-parallel replicas.
    pub dp: usize,
    /// Tensor-parallel ranks.
    pub tp: usize,
    /// Pipeline stages.
    pub pp: usize,
    /// ZeRO stage.
    pub zero_stage: usize,
    /// Samples per micro-batch and gradient accumulation that keep the global batch.
    pub batch_size: usize,
    /// See `batch_size`.
    pub accumulation: usize,
    /// What one process running the layout's ranks needs at its peak (the plan).
    pub predicted_peak_bytes: Option<u64>,
    /// What one rank needs at its peak (an MPI process).
    pub per_rank_bytes: Option<u64>,
    /// Throughput of the speed probe (the run's unit per second).
    pub throughput_per_sec: Option<f64>,
    /// Whether it fits the memory of a rank (always, without a limit).
    pub fits: bool,
    /// Why it cannot run, when it cannot.
    pub refused: Option<String>,
}

impl Trial {
    /// The flags that run this layout.
    pub fn flags(&self) -> String {
        format!(
            "--dp {} --tp {} --pp {} --zero {} --batch-size {} --accumulation {}",
            self.dp, self.tp, self.pp, self.zero_stage, self.batch_size, self.accumulation
        )
    }
}

/// `n`'s divisors, ascending.
fn divisors(n: usize) -> Vec<usize> {
    (1..=n).filter(|d| n.is_multiple_of(*d)).collect()
}

/// Every layout of `world` processes: tensor and pipeline sizes dividing it, the rest
/// data-parallel, at every ZeRO stage when there are replicas.
pub fn layouts(world: usize) -> Vec<(usize, usize, usize, usize)> {
    let mut out = Vec::new();
    for tp in divisors(world) {
        for pp in divisors(world / tp) {
            let dp = world / (tp * pp);
            let stages = if dp > 1 { 0..=3 } else { 0..=0 };
            out.extend(stages.map(|zero| (dp, tp, pp, zero)));
        }
    }
    out
}

/// `c` laid out as `(dp, tp, pp, zero)` on `world` processes, the global batch of its
/// configured layout kept ([`with_replicas`]), checked as a run would check it.
pub fn configure(
    c: &TrainingConfig,
    world: usize,
    (dp, tp, pp, zero): (usize, usize, usize, usize),
) -> Result<TrainingConfig> {
    let mut t = with_replicas(c.clone(), dp)?;
    t.parallel.horizontal_parallel_size = tp;
    t.parallel.pipeline_parallel_size = pp;
    t.parallel.zero_stage = zero;
    t.validate(world)?;
    Ok(t)
}

/// The speed probe of `c`: its throughput over the last half of [`SPEED_UPDATES`] updates,
/// run as `exe train` in a process of its own.
fn probe_speed(c: &TrainingConfig, exe: &Path) -> Result<f64> {
    let out = std::env::temp_dir().join(format!("onnx-train-auto-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&out);
    let mut p = c.clone();
    p.train.num_train_steps = SPEED_UPDATES * p.train.gradient_accumulation_steps;
    p.train.num_train_epochs = 0;
    p.eval.evaluation_period = 0;
    p.checkpoint.output_dir = out.join("run");
    p.checkpoint.checkpoint_period = 0;
    p.checkpoint.checkpoint_to_load_path = None;
    p.logging.log_dir = Some(std::path::PathBuf::new());
    let report = probe_in_child(p, &out, exe);
    let _ = std::fs::remove_dir_all(&out);
    Ok(report?["throughput_per_sec"].as_f64().unwrap_or(0.0))
}

/// Try every layout of `c` on `world` processes (see the module doc); `limit` is the
/// memory of a rank (an MPI process) when there is one. Ranked: the fitting layouts,
/// fastest first, then the others.
pub fn rank_layouts(
    c: &TrainingConfig,
    world: usize,
    limit: Option<u64>,
    train: &Arc<dyn Dataset>,
    exe: &Path,
) -> Vec<Trial> {
    let mut trials: Vec<Trial> = layouts(world)
        .into_iter()
        .map(|layout| {
            let (dp, tp, pp, zero_stage) = layout;
            let mut trial = Trial {
                dp,
                tp,
                pp,
                zero_stage,
                batch_size: 0,
                accumulation: 0,
                predicted_peak_bytes: None,
                per_rank_bytes: None,
                throughput_per_sec: None,
                fits: false,
                refused: None,
            };
            let measured = configure(c, world, layout).and_then(|t| {
                trial.batch_size = t.data.batch_size;
                trial.accumulation = t.train.gradient_accumulation_steps;
                let plan = plan_memory(&t, train, exe)?;
                Ok((plan, probe_speed(&t, exe)?))
            });
            match measured {
                Ok((plan, speed)) => {
                    trial.predicted_peak_bytes = Some(plan.threads_process_bytes());
                    trial.per_rank_bytes = Some(plan.per_process_bytes());
                    trial.throughput_per_sec = Some(speed);
                    trial.fits = limit.is_none_or(|l| plan.per_process_bytes() <= l);
                }
                Err(e) => trial.refused = Some(e.to_string()),
            }
            trial
        })
        .collect();
    trials.sort_by(|a, b| {
        b.fits.cmp(&a.fits).then(
            b.throughput_per_sec
                .unwrap_or(0.0)
                .total_cmp(&a.throughput_per_sec.unwrap_or(0.0)),
        )
    });
    trials
}

/// The ranking as a table, the chosen layout first.
pub fn table(trials: &[Trial]) -> String {
    let mib = |b: Option<u64>| b.map_or("-".into(), |b| format!("{:.0} MiB", b as f64 / 1048576.0));
    let mut s = format!(
        "{:>3} {:>3} {:>3} {:>4} {:>5} {:>5} {:>14} {:>14} {:>12}  {}\n",
        "dp",
        "tp",
        "pp",
        "zero",
        "batch",
        "accum",
        "per rank",
        "all as threads",
        "throughput/s",
        "note"
    );
    for (i, t) in trials.iter().enumerate() {
        let note = match (&t.refused, t.fits, i) {
            (Some(why), ..) => format!("cannot run: {why}"),
            (None, false, _) => "does not fit".into(),
            (None, true, 0) => "chosen".into(),
            _ => String::new(),
        };
        s += &format!(
            "{:>3} {:>3} {:>3} {:>4} {:>5} {:>5} {:>14} {:>14} {:>12}  {note}\n",
            t.dp,
            t.tp,
            t.pp,
            t.zero_stage,
            t.batch_size,
            t.accumulation,
            mib(t.per_rank_bytes),
            mib(t.predicted_peak_bytes),
            t.throughput_per_sec
                .map_or("-".into(), |x| format!("{x:.1}")),
        );
    }
    s
}
