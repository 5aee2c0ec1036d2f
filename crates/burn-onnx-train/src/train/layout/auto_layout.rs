//! `--auto`: the layout chosen for you, as DeepSpeed's autotuner chooses by short
//! experiments. Every way to lay a run out on its world (data x tensor x pipeline
//! parallel sizes, ZeRO stages 0 to 3 where there are replicas, and for a pipeline 1, 2
//! and 4 micro-batches per stage where the batch divides, and two model chunks per rank
//! (interleaved 1F1B) at the fewest) is fitted to that world
//! keeping the global batch ([`crate::train::process::elastic::fit_world`]), its memory planned
//! ([`plan_memory`]: a rank's peak from counted bytes and a probed working set), and its
//! speed measured by probe steps: the layout itself, run for [`SPEED_UPDATES`] updates in
//! a process of its own, its throughput over the last half. A layout that does not fit the
//! memory of a rank is tried again, as a user short of memory would: with activation
//! recomputation ([`RECOMPUTE_SEGMENTS`] segments), then also with the optimizer state on
//! disk, then (ZeRO-3) also with the parameters' chunks on disk; with tensor parallelism each of these (the base first) also with sequence
//! parallelism, before the next. The
//! layouts that fit are ranked by throughput; the others follow, with why.

use std::path::Path;
use std::sync::Arc;

use serde::Serialize;

use super::memory_plan::{plan_memory, probe_in_child};
use crate::error::Result;
use crate::train::config::TrainingConfig;
use crate::train::data::Dataset;
use crate::train::process::elastic::with_replicas;

/// Updates of a speed probe (the first half warms up).
pub const SPEED_UPDATES: usize = 4;

/// Segments of the recomputation tried for a layout without a pipeline that does not fit
/// (a pipeline recomputes one segment per stage).
pub const RECOMPUTE_SEGMENTS: usize = 4;

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
    /// Activation recomputation segments (0: none).
    pub recompute: usize,
    /// Sequence parallelism (`tensor_parallel_sequence`).
    pub sequence: bool,
    /// Adam's moments in a memory-mapped file (`offload_optimizer = "disk"`).
    pub offload: bool,
    /// ZeRO-3's parameter chunks in a memory-mapped file (`offload_params = "disk"`).
    pub params_on_disk: bool,
    /// Pipeline micro-batches per batch (0: no pipeline).
    pub micro_batches: usize,
    /// Model chunks per pipeline rank (virtual stages; 1: one stage each).
    pub chunks: usize,
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
        let mut flags = format!(
            "--dp {} --tp {} --pp {} --zero {} --batch-size {} --accumulation {}",
            self.dp, self.tp, self.pp, self.zero_stage, self.batch_size, self.accumulation
        );
        if self.micro_batches > 0 {
            flags += &format!(" --micro-batches {}", self.micro_batches);
        }
        if self.chunks > 1 {
            flags += &format!(" --virtual-stages {}", self.chunks);
        }
        if self.sequence {
            flags += " --sequence-parallel";
        }
        if self.recompute > 0 {
            flags += &format!(" --recompute {}", self.recompute);
        }
        if self.offload {
            flags += " --offload-optimizer disk";
        }
        if self.params_on_disk {
            flags += " --offload-params disk";
        }
        flags
    }

    /// The layout tried.
    pub fn layout(&self) -> Layout {
        Layout {
            dp: self.dp,
            tp: self.tp,
            pp: self.pp,
            zero: self.zero_stage,
            recompute: self.recompute,
            sequence: self.sequence,
            offload: self.offload,
            params_on_disk: self.params_on_disk,
            micro: self.micro_batches,
            chunks: self.chunks,
        }
    }
}

/// What `--auto` varies: data x tensor x pipeline parallel sizes, ZeRO stage,
/// recomputation segments, sequence parallelism, the optimizer state and ZeRO-3's
/// parameters on disk, and pipeline micro-batches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Layout {
    /// Data-parallel replicas.
    pub dp: usize,
    /// Tensor-parallel ranks per replica.
    pub tp: usize,
    /// Pipeline stages per replica.
    pub pp: usize,
    /// ZeRO stage (0-3).
    pub zero: usize,
    /// Activation-recomputation segments (0: off).
    pub recompute: usize,
    /// Sequence parallelism between the tensor-parallel blocks.
    pub sequence: bool,
    /// The optimizer state in a file on disk (`--offload-optimizer disk`).
    pub offload: bool,
    /// ZeRO-3's parameter chunks in a file on disk (`--offload-params disk`).
    pub params_on_disk: bool,
    /// Pipeline micro-batches per batch (0: no pipeline, or the configured rule).
    pub micro: usize,
    /// Model chunks per pipeline rank (`pipeline_virtual_stages`).
    pub chunks: usize,
}

/// Micro-batches per stage tried for a pipeline: the bubble is `(p - 1) / (m + p - 1)` of
/// the time, so more micro-batches shrink it, and smaller ones compute less efficiently.
const MICRO_PER_STAGE: [usize; 3] = [1, 2, 4];

/// `n`'s divisors, ascending.
fn divisors(n: usize) -> Vec<usize> {
    (1..=n).filter(|d| n.is_multiple_of(*d)).collect()
}

/// Every layout of `world` processes: tensor and pipeline sizes dividing it, the rest
/// data-parallel, at every ZeRO stage when there are replicas (no recomputation, moments
/// in memory).
pub fn layouts(world: usize) -> Vec<Layout> {
    let mut out = Vec::new();
    for tp in divisors(world) {
        for pp in divisors(world / tp) {
            let dp = world / (tp * pp);
            let stages = if dp > 1 { 0..=3 } else { 0..=0 };
            out.extend(stages.map(|zero| Layout {
                dp,
                tp,
                pp,
                zero,
                recompute: 0,
                sequence: false,
                offload: false,
                params_on_disk: false,
                micro: 0,
                chunks: 1,
            }));
        }
    }
    out
}

/// The layouts a user short of memory would try after `base`, cheapest in time first:
/// recomputation, then that and the optimizer state on disk (the replicated moments, or
/// ZeRO's shards), then at ZeRO-3 also the parameters' chunks; with tensor parallelism sequence parallelism first, and each step
/// again with it before the next.
fn lighter(base: Layout) -> Vec<Layout> {
    // A pipeline recomputes stage by stage: one segment per stage.
    let segments = if base.pp > 1 {
        base.pp
    } else {
        RECOMPUTE_SEGMENTS
    };
    let recompute = Layout {
        recompute: segments,
        ..base
    };
    let moments = Layout {
        offload: true,
        ..recompute
    };
    let mut steps = vec![base, recompute, moments];
    if base.zero == 3 {
        steps.push(Layout {
            params_on_disk: true,
            ..moments
        });
    }
    let mut out = Vec::new();
    for (i, step) in steps.into_iter().enumerate() {
        if i > 0 {
            out.push(step);
        }
        if base.tp > 1 {
            out.push(Layout {
                sequence: true,
                ..step
            });
        }
    }
    out
}

/// `base` with each micro-batch count of [`MICRO_PER_STAGE`] that divides the batch `c`
/// gets laid out as `base` (`base` itself without a pipeline, or when none divides).
fn with_micro_batches(c: &TrainingConfig, world: usize, base: Layout) -> Vec<Layout> {
    let Some(batch) = (base.pp > 1)
        .then(|| configure(c, world, base).ok())
        .flatten()
        .map(|t| t.data.batch_size)
    else {
        return vec![base];
    };
    let counts: Vec<usize> = MICRO_PER_STAGE
        .iter()
        .map(|k| k * base.pp)
        .filter(|m| batch.is_multiple_of(*m))
        .collect();
    if counts.is_empty() {
        return vec![base];
    }
    // Interleaved 1F1B where the bubble is largest: two chunks per rank at the fewest
    // micro-batches.
    let interleaved = Layout {
        micro: counts[0],
        chunks: 2,
        ..base
    };
    counts
        .into_iter()
        .map(|micro| Layout { micro, ..base })
        .chain([interleaved])
        .collect()
}

/// `c` laid out as `layout` on `world` processes, the global batch of its configured
/// layout kept ([`with_replicas`]), checked as a run would check it.
pub fn configure(c: &TrainingConfig, world: usize, layout: Layout) -> Result<TrainingConfig> {
    let mut t = with_replicas(c.clone(), layout.dp)?;
    t.parallel.horizontal_parallel_size = layout.tp;
    t.parallel.pipeline_parallel_size = layout.pp;
    t.parallel.zero_stage = layout.zero;
    t.parallel.recompute_segments = layout.recompute;
    t.parallel.tensor_parallel_sequence = layout.sequence;
    if layout.micro > 0 {
        t.parallel.num_pipeline_micro_batches = layout.micro;
    }
    t.parallel.pipeline_virtual_stages = layout.chunks;
    if layout.offload {
        t.offload.offload_optimizer = crate::train::config::OffloadTarget::Disk;
    }
    if layout.params_on_disk {
        t.offload.offload_params = crate::train::config::ParamOffload::Disk;
    }
    t.validate(world)?;
    Ok(t)
}

/// What trying a layout found: the plan's peak of one process running all its ranks and
/// of one rank, and the probe's throughput.
#[derive(Debug, Clone, Copy)]
pub struct Measured {
    /// Peak bytes of one process running every rank as a thread.
    pub threads_process_bytes: u64,
    /// Peak bytes of one rank's process (a run under MPI).
    pub per_rank_bytes: u64,
    /// The probe run's throughput (tokens or samples a second).
    pub throughput_per_sec: f64,
}

/// Plan and time `t` (see the module doc).
pub fn measure(t: &TrainingConfig, train: &Arc<dyn Dataset>, exe: &Path) -> Result<Measured> {
    let plan = plan_memory(t, train, exe)?;
    Ok(Measured {
        threads_process_bytes: plan.threads_process_bytes(),
        per_rank_bytes: plan.per_process_bytes(),
        throughput_per_sec: probe_speed(t, exe)?,
    })
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

/// Try every layout of `c` on `world` processes (see the module doc), each measured by
/// `measure`; `limit` is the memory of a rank (an MPI process) when there is one. Ranked:
/// the fitting layouts, fastest first, then the others.
pub fn rank_layouts(
    c: &TrainingConfig,
    world: usize,
    limit: Option<u64>,
    measure: impl Fn(&TrainingConfig) -> Result<Measured>,
) -> Vec<Trial> {
    let try_one = |layout: Layout| -> Trial {
        let mut trial = Trial {
            dp: layout.dp,
            tp: layout.tp,
            pp: layout.pp,
            zero_stage: layout.zero,
            recompute: layout.recompute,
            sequence: layout.sequence,
            offload: layout.offload,
            params_on_disk: layout.params_on_disk,
            micro_batches: 0,
            chunks: layout.chunks,
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
            trial.micro_batches = if t.parallel.pipeline_parallel_size > 1 {
                t.micro_batches()
            } else {
                0
            };
            measure(&t)
        });
        match measured {
            Ok(m) => {
                trial.predicted_peak_bytes = Some(m.threads_process_bytes);
                trial.per_rank_bytes = Some(m.per_rank_bytes);
                trial.throughput_per_sec = Some(m.throughput_per_sec);
                trial.fits = limit.is_none_or(|l| m.per_rank_bytes <= l);
            }
            Err(e) => trial.refused = Some(e.to_string()),
        }
        trial
    };
    let mut trials = Vec::new();
    let bases = layouts(world)
        .into_iter()
        .flat_map(|base| with_micro_batches(c, world, base));
    for base in bases {
        let trial = try_one(base);
        let short_of_memory = trial.refused.is_none() && !trial.fits;
        trials.push(trial);
        if short_of_memory {
            for layout in lighter(base) {
                let trial = try_one(layout);
                let fits = trial.fits;
                trials.push(trial);
                if fits {
                    break;
                }
            }
        }
    }
    trials.sort_by(|a, b| {
        b.fits.cmp(&a.fits).then(
            b.throughput_per_sec
                .unwrap_or(0.0)
                .total_cmp(&a.throughput_per_sec.unwrap_or(0.0)),
        )
    });
    trials
}

/// The layout `--auto` runs: the first of the ranking, when it fits and can run.
pub fn chosen(trials: &[Trial]) -> Option<&Trial> {
    trials.first().filter(|t| t.fits && t.refused.is_none())
}

/// The ranking as a table, the chosen layout first.
pub fn table(trials: &[Trial]) -> String {
    let mib = |b: Option<u64>| b.map_or("-".into(), |b| format!("{:.0} MiB", b as f64 / 1048576.0));
    let mut s = format!(
        "{:>3} {:>3} {:>3} {:>4} {:>5} {:>5} {:>5} {:>2} {:>5} {:>3} {:>7} {:>14} {:>14} {:>12}  {}\n",
        "dp",
        "tp",
        "pp",
        "zero",
        "batch",
        "accum",
        "micro",
        "v",
        "recmp",
        "seq",
        "offload",
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
            "{:>3} {:>3} {:>3} {:>4} {:>5} {:>5} {:>5} {:>2} {:>5} {:>3} {:>7} {:>14} {:>14} {:>12}  {note}\n",
            t.dp,
            t.tp,
            t.pp,
            t.zero_stage,
            t.batch_size,
            t.accumulation,
            if t.micro_batches > 0 {
                t.micro_batches.to_string()
            } else {
                "-".into()
            },
            t.chunks,
            t.recompute,
            if t.sequence { "on" } else { "-" },
            match (t.offload, t.params_on_disk) {
                (_, true) => "all",
                (true, false) => "moments",
                (false, false) => "-",
            },
            mib(t.per_rank_bytes),
            mib(t.predicted_peak_bytes),
            t.throughput_per_sec
                .map_or("-".into(), |x| format!("{x:.1}")),
        );
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::train::config::{OffloadTarget, ParamOffload};

    /// A stand-in for the probes: 1000 bytes a rank, 800 with sequence parallelism, 600 with
    /// recomputation (450 with sequence parallelism too), 300 with the moments on disk too
    /// (250), half that with the parameters on disk too; speed 100 per replica, less 10
    /// for sequence parallelism, 20 for recomputation and 20 for each thing on disk.
    fn fake(t: &TrainingConfig) -> Result<Measured> {
        let recompute = t.parallel.recompute_segments > 0;
        let disk = t.offload.offload_optimizer == OffloadTarget::Disk;
        let sequence = t.parallel.tensor_parallel_sequence;
        let params = t.offload.offload_params == ParamOffload::Disk;
        let bytes = match (recompute, disk, sequence) {
            (false, _, false) => 1000,
            (false, _, true) => 800,
            (true, false, false) => 600,
            (true, false, true) => 450,
            (true, true, false) => 300,
            (true, true, true) => 250,
        } / if params { 2 } else { 1 };
        let speed = 100.0 * t.parallel.data_parallel_size as f64
            - 10.0 * f64::from(u8::from(sequence))
            - 20.0 * f64::from(u8::from(recompute))
            - 20.0 * f64::from(u8::from(disk))
            - 20.0 * f64::from(u8::from(params));
        Ok(Measured {
            threads_process_bytes: 2 * bytes,
            per_rank_bytes: bytes,
            throughput_per_sec: speed,
        })
    }

    fn config() -> TrainingConfig {
        let mut c = TrainingConfig::default();
        c.data.batch_size = 8;
        c.model.model_path = "model.onnx".into();
        c.data.train_data_dir = "data".into();
        c
    }

    #[test]
    fn every_layout_of_the_world_is_tried_and_the_fastest_comes_first() {
        let trials = rank_layouts(&config(), 2, None, fake);
        let got: Vec<Layout> = trials.iter().map(Trial::layout).collect();
        // dp 2 at 4 ZeRO stages, tp 2, and pp 2 with 2, 4 and 8 micro-batches of the 8,
        // and with 2 model chunks per rank at 2 micro-batches.
        assert_eq!(got.len(), 9, "{got:?}");
        assert!(trials.iter().all(|t| t.fits && t.refused.is_none()));
        // dp 2 (speed 200) before tp 2 and pp 2 (100); 4 samples a replica.
        assert_eq!((trials[0].dp, trials[0].batch_size), (2, 4));
        assert!(got.iter().all(|l| l.recompute == 0 && !l.offload));
        let mut micro: Vec<(usize, usize)> = trials
            .iter()
            .filter(|t| t.pp == 2)
            .map(|t| (t.micro_batches, t.chunks))
            .collect();
        micro.sort();
        assert_eq!(micro, [(2, 1), (2, 2), (4, 1), (8, 1)]);
        let interleaved = trials.iter().find(|t| t.chunks == 2).unwrap();
        assert!(
            interleaved
                .flags()
                .ends_with("--micro-batches 2 --virtual-stages 2"),
            "{}",
            interleaved.flags()
        );
        let pp = trials.iter().find(|t| t.micro_batches == 8).unwrap();
        assert!(
            pp.flags()
                .contains("--pp 2 --zero 0 --batch-size 8 --accumulation 1 --micro-batches 8"),
            "{}",
            pp.flags()
        );
        assert!(
            trials
                .iter()
                .filter(|t| t.pp == 1)
                .all(|t| t.micro_batches == 0)
        );
    }

    #[test]
    fn a_tensor_parallel_layout_short_of_memory_is_tried_with_sequence_parallelism_first() {
        // 900 bytes a rank: tp 2 fits with sequence parallelism (800); the others need
        // recomputation.
        let trials = rank_layouts(&config(), 2, Some(900), fake);
        let tp: Vec<&Trial> = trials.iter().filter(|t| t.tp == 2).collect();
        assert_eq!(tp.len(), 2, "the base, then sequence parallelism: {tp:?}");
        let fitting = tp.iter().find(|t| t.fits).unwrap();
        assert!(fitting.sequence && fitting.recompute == 0, "{fitting:?}");
        assert!(fitting.flags().ends_with("--sequence-parallel"));
        assert!(
            trials
                .iter()
                .filter(|t| t.tp == 1 && t.fits)
                .all(|t| !t.sequence && t.recompute > 0)
        );
    }

    #[test]
    fn a_layout_short_of_memory_is_tried_with_recomputation_then_moments_on_disk() {
        // 700 bytes a rank: every layout fits with recomputation, which is tried once each.
        let trials = rank_layouts(&config(), 2, Some(700), fake);
        let fitting: Vec<Layout> = trials
            .iter()
            .filter(|t| t.fits)
            .map(Trial::layout)
            .collect();
        assert_eq!(fitting.len(), 9, "{trials:?}");
        for l in &fitting {
            let segments = if l.pp > 1 { l.pp } else { RECOMPUTE_SEGMENTS };
            assert!(l.recompute == segments && !l.offload, "{l:?}");
        }
        assert_eq!(
            trials.iter().filter(|t| !t.fits).count(),
            10,
            "the bases and tp 2 with sequence parallelism, not fitting"
        );
        assert!(trials[0].fits && trials[0].flags().contains("--recompute 4"));

        // 400 bytes: only the optimizer state on disk fits: dp 2 at every ZeRO stage, tp 2
        // and pp 2 (its 3 micro-batch counts, and interleaved).
        let trials = rank_layouts(&config(), 2, Some(400), fake);
        let fitting: Vec<Layout> = trials
            .iter()
            .filter(|t| t.fits)
            .map(Trial::layout)
            .collect();
        assert_eq!(fitting.len(), 9, "{trials:?}");
        assert!(fitting.iter().all(|l| l.offload));
        assert!(
            trials[0]
                .flags()
                .ends_with("--recompute 4 --offload-optimizer disk")
        );
        assert_eq!(trials[0].dp, 2);
    }

    #[test]
    fn sequence_parallelism_stays_on_as_recomputation_joins_it() {
        // 500 bytes: tp 2 fits with sequence parallelism and recomputation (450), tried
        // after each alone (800, 600); the layouts without tensor parallelism need the
        // moments on disk (300).
        let trials = rank_layouts(&config(), 2, Some(500), fake);
        let tp: Vec<Layout> = trials
            .iter()
            .filter(|t| t.tp == 2)
            .map(Trial::layout)
            .collect();
        let mut tried: Vec<(bool, usize, bool)> = tp
            .iter()
            .map(|l| (l.sequence, l.recompute, l.offload))
            .collect();
        tried.sort();
        let r = RECOMPUTE_SEGMENTS;
        let want = [
            (false, 0, false),
            (false, r, false),
            (true, 0, false),
            (true, r, false),
        ];
        assert_eq!(tried, want, "{trials:?}");
        let fitting = trials.iter().find(|t| t.tp == 2 && t.fits).unwrap();
        assert!(fitting.sequence && fitting.recompute > 0 && !fitting.offload);
        assert!(
            trials
                .iter()
                .filter(|t| t.tp == 1 && t.fits)
                .all(|t| t.offload && !t.sequence)
        );
    }

    #[test]
    fn a_zero_3_layout_short_of_memory_puts_its_parameters_on_disk_last() {
        // 200 bytes: nothing fits with the moments on disk alone (300, 250 with sequence
        // parallelism); ZeRO-3 then puts its parameters' chunks on disk too (150). No
        // other layout holds chunks to put there.
        let trials = rank_layouts(&config(), 2, Some(200), fake);
        let fitting: Vec<&Trial> = trials.iter().filter(|t| t.fits).collect();
        assert_eq!(fitting.len(), 1, "{trials:?}");
        let t = fitting[0];
        assert_eq!((t.dp, t.zero_stage), (2, 3));
        assert!(t.offload && t.params_on_disk && t.recompute == RECOMPUTE_SEGMENTS);
        assert!(
            t.flags()
                .ends_with("--recompute 4 --offload-optimizer disk --offload-params disk"),
            "{}",
            t.flags()
        );
        assert!(
            trials
                .iter()
                .all(|t| !t.params_on_disk || t.zero_stage == 3)
        );
        assert!(table(&trials).lines().nth(1).unwrap().contains(" all "));
    }
}
