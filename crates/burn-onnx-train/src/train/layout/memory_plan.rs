//! The memory a run will need, per rank, before it starts (`onnx-train plan`): parameters,
//! gradients and optimizer state counted from the rank's part of the model (its
//! tensor-parallel split and pipeline stage, ZeRO's shards, moments on disk), and the
//! working set of a micro-step (the autodiff tape, gradients as backward makes them, the
//! update's temporaries, what the allocator keeps between updates) measured by a probe:
//! the layout itself with at most two data-parallel replicas (its ranks as threads, at its
//! ZeRO stage: the collectives' buffers are per replica whatever their count) and at most
//! two micro-steps of gradient accumulation (the gradients kept between them) runs
//! [`PROBE_UPDATES`] real updates as `onnx-train train` in a fresh process, once with one
//! sample per micro-step and once with the configured micro-batch (two samples when that
//! is one); its peak resident set (`perf.json`) above this process's own footprint, less
//! the parameters, gradients and optimizer state it reports, is the working set: a line
//! through the two points gives any micro-batch. A pipeline's working set is shared among
//! its ranks by the bytes of the values each stage's nodes make (a shape probe) times the
//! micro-batches its rank holds in flight through it, at the worst point of the rank's
//! schedule (1F1B: `pp - k` on rank `k`; GPipe: all; with virtual stages the interleaved
//! schedule's warm-up holds more). A rank's peak is its
//! parameters, gradients, optimizer state and working set; a process adds its own
//! footprint from before the model was loaded.
//!
//! The probe runs on the configured device, so on a GPU the resident set is the host's
//! and the plan is for the host's memory only; the resident sets come from Linux's `/proc`.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use burn::tensor::Device;
use burn_ort_dist::Topology;
use serde::Serialize;

use super::memory_counts::{RankMemory, rank_memory};
use crate::collective::{CollectiveGroup, Collectives};
use crate::error::{OnnxError, Result};
use crate::model::OnnxModel;
use crate::parallel::pipeline::Partition;
use crate::parallel::pipeline::schedule::{Shape, peak_in_flight};
use crate::parallel::tensor_parallel::TensorParallel;
use crate::train::config::{OffloadTarget, OptimizerKind, ParallelConfig, TrainingConfig};
use crate::train::data::Dataset;
use crate::train::report::perf::proc_status_bytes;
use crate::value::Value;

/// The plan of a layout.
#[derive(Debug, Clone, Serialize)]
pub struct MemoryPlan {
    /// Data-parallel replicas, tensor-parallel ranks, pipeline stages.
    pub dp: usize,
    /// Tensor-parallel ranks.
    pub tp: usize,
    /// Pipeline stages.
    pub pp: usize,
    /// Samples per micro-step on a rank (a pipeline's micro-batch).
    pub micro_batch: usize,
    /// The probe: working set of the whole (tp part of the) model for `b` samples is
    /// `probe_fixed_bytes + b * probe_per_sample_bytes`.
    pub probe_fixed_bytes: u64,
    /// See `probe_fixed_bytes`.
    pub probe_per_sample_bytes: u64,
    /// This process's resident set before the model was loaded (runtime, data maps).
    pub process_base_bytes: u64,
    /// One entry per tensor-parallel rank and stage.
    pub ranks: Vec<RankMemory>,
}

impl MemoryPlan {
    /// The largest rank peak plus the process base: what one MPI rank needs.
    pub fn per_process_bytes(&self) -> u64 {
        self.process_base_bytes + self.ranks.iter().map(|r| r.peak_bytes).max().unwrap_or(0)
    }

    /// What one process running every rank as threads needs.
    pub fn threads_process_bytes(&self) -> u64 {
        self.process_base_bytes
            + self.dp as u64 * self.ranks.iter().map(|r| r.peak_bytes).sum::<u64>()
    }
}

/// Updates each probe takes: the first allocates the optimizer state, the next ones show
/// what the allocator keeps between updates.
pub const PROBE_UPDATES: usize = 3;

/// Data-parallel replicas in the probe run: two when the layout has several, else one.
fn probe_replicas(parallel: &ParallelConfig) -> usize {
    parallel.topology().dp.clamp(1, 2)
}

/// The probe run of `c`'s layout with `samples` samples per micro-step (see the module
/// doc): the peak resident set's rise over `base` less the parameters, gradients (twice
/// with accumulation: the sum kept between micro-steps) and optimizer state every rank
/// reported, i.e. the working set of all its ranks together.
fn probe_working_set(c: &TrainingConfig, samples: usize, base: u64, exe: &Path) -> Result<u64> {
    let out =
        std::env::temp_dir().join(format!("onnx-train-plan-{}-{samples}", std::process::id()));
    let _ = std::fs::remove_dir_all(&out);
    let mut p = c.clone();
    p.data.batch_size = samples * c.micro_batches();
    // Two replicas when there are several: what the gradient averaging and ZeRO's
    // collectives hold (whole-sized flat buffers, the communicator's copies) is then in
    // the probe too, per replica as it will be with more.
    p.parallel.data_parallel_size = probe_replicas(&c.parallel);
    // Accumulation too, two micro-steps when there are several: the gradients kept
    // between micro-steps change where the allocator puts the next step's tensors.
    let accumulation = c.train.gradient_accumulation_steps.clamp(1, 2);
    p.train.gradient_accumulation_steps = accumulation;
    p.train.num_train_steps = PROBE_UPDATES * accumulation;
    p.train.num_train_epochs = 0;
    p.eval.evaluation_period = 0;
    p.checkpoint.output_dir = out.join("run");
    p.checkpoint.checkpoint_period = 0;
    p.checkpoint.checkpoint_to_load_path = None;
    p.logging.log_dir = Some(PathBuf::new());
    let report = probe_in_child(p, &out, exe);
    let _ = std::fs::remove_dir_all(&out);
    let report = report?;
    let column = |k: &str| -> Vec<u64> {
        report[k]
            .as_array()
            .map(|a| a.iter().filter_map(|v| v.as_u64()).collect())
            .unwrap_or_default()
    };
    let counted: u64 = ["parameter_bytes", "gradient_bytes", "optimizer_state_bytes"]
        .iter()
        .map(|k| column(k).iter().sum::<u64>())
        .sum();
    // The accumulated gradients are counted with the rank's own memory (`rank_memory`).
    let accumulated: u64 = if accumulation > 1 {
        column("gradient_bytes").iter().sum()
    } else {
        0
    };
    let counted = counted + accumulated;
    let peak = column("peak_rss_bytes").first().copied().unwrap_or(0);
    Ok(peak.saturating_sub(base).saturating_sub(counted))
}

/// The probe run `p` as `exe train` in a process of its own (its config in `dir`): its
/// `perf.json`.
pub(crate) fn probe_in_child(
    p: TrainingConfig,
    dir: &Path,
    exe: &Path,
) -> Result<serde_json::Value> {
    std::fs::create_dir_all(dir).map_err(|e| OnnxError::io(dir, e))?;
    let config = dir.join("probe.toml");
    std::fs::write(&config, p.to_toml()?).map_err(|e| OnnxError::io(&config, e))?;
    let mut command = std::process::Command::new(exe);
    command
        .arg("train")
        .arg("--config")
        .arg(&config)
        .env("RUST_LOG", "warn");
    // A probe started by a rank of an MPI job (`train --auto` under mpirun) is a process of
    // its own, not another rank: it must not find the job's launcher in its environment.
    for (key, _) in std::env::vars_os() {
        let key = key.to_string_lossy();
        if ["OMPI_", "PMIX_", "PMI_", "ONNX_TRAIN_ELASTIC"]
            .iter()
            .any(|p| key.starts_with(p))
        {
            command.env_remove(key.as_ref());
        }
    }
    let run = command.output().map_err(|e| OnnxError::io(exe, e))?;
    if !run.status.success() {
        return Err(OnnxError::field(
            "plan",
            format!(
                "the probe run ({} train --config {}) failed: {}",
                exe.display(),
                config.display(),
                String::from_utf8_lossy(&run.stderr).trim()
            ),
        ));
    }
    let perf = p.checkpoint.output_dir.join("perf.json");
    let text = std::fs::read(&perf).map_err(|e| OnnxError::io(&perf, e))?;
    serde_json::from_slice(&text)
        .map_err(|e| OnnxError::field("plan", format!("{}: {e}", perf.display())))
}

/// The bytes of the float values each of a stage's nodes makes for one sample, as a
/// fraction of the whole graph's (`stages` of `model`).
fn stage_shares(
    model: &OnnxModel,
    partition: &Partition,
    input: (String, Value),
) -> Result<Vec<f64>> {
    let probe = model.probe(vec![input])?;
    let bytes_of = |node: usize| -> f64 {
        model.graph().nodes[node]
            .outputs
            .iter()
            .filter(|o| probe.floats.contains(*o))
            .filter_map(|o| probe.shapes.get(o))
            .map(|s| s.iter().product::<usize>() as f64 * 4.0)
            .sum()
    };
    let per_stage: Vec<f64> = partition
        .stages
        .iter()
        .map(|s| s.nodes.clone().map(bytes_of).sum())
        .collect();
    let total: f64 = per_stage.iter().sum::<f64>().max(1.0);
    Ok(per_stage.into_iter().map(|b| b / total).collect())
}

/// Plan `c`'s layout on `train`'s samples (see the module doc): the probe runs first,
/// then the model is loaded on the CPU to count each rank's part.
pub fn plan_memory(c: &TrainingConfig, train: &Arc<dyn Dataset>, exe: &Path) -> Result<MemoryPlan> {
    let Topology { dp, tp, pp } = c.parallel.topology();
    let (dp, tp, pp) = (dp.max(1), tp.max(1), pp.max(1));
    let micro_batch = (c.data.batch_size / c.micro_batches()).max(1);
    let process_base_bytes = proc_status_bytes("VmRSS:").unwrap_or(0);
    let (small, large) = (1, micro_batch.max(2));
    let at_large = probe_working_set(c, large, process_base_bytes, exe)?;
    let at_small = probe_working_set(c, small, process_base_bytes, exe)?;
    let per_sample = at_large.saturating_sub(at_small) / (large - small) as u64;
    let fixed = at_small.saturating_sub(per_sample);
    let working = (fixed + per_sample * micro_batch as u64) as f64
        / (tp * probe_replicas(&c.parallel)) as f64;

    let device = Device::flex();
    let model = c.model.load_for_training(&device)?;
    let sample = |n: usize| -> Result<Value> {
        let indices: Vec<usize> = (0..n).map(|i| i % train.len()).collect();
        Value::from_host(&train.batch(&indices)?.input, &device)
            .map_err(|e| OnnxError::field("batch", e.0))
    };
    let mut ranks = Vec::new();
    for tp_rank in 0..tp {
        let part = if tp > 1 {
            TensorParallel::apply(
                model.clone(),
                vec![(c.model.input_name.clone(), sample(2)?)],
                tp_rank,
                tp,
                &c.tensor_parallel_split(),
            )?
            .0
        } else {
            model.clone()
        };
        let per_rank: Vec<(Option<HashSet<String>>, f64)> = if pp == 1 {
            vec![(None, working)]
        } else {
            let partition = c.parallel.partition(&part)?;
            // The part's Megatron operators run in a group of one here (identities), so the
            // probe sees this rank's shapes.
            let probed = part.clone().with_collectives(Collectives {
                tensor_parallel: (tp > 1)
                    .then(|| CollectiveGroup(Arc::new(burn_ort_dist::LocalCommunicator))),
                sharding: None,
            });
            let shares = stage_shares(
                &probed,
                &partition,
                (c.model.input_name.clone(), sample(1)?),
            )?;
            let shape = Shape {
                ranks: pp,
                chunks: partition.chunks(),
                micro: c.micro_batches(),
            };
            let weights: Vec<f64> = (0..pp)
                .map(|rank| {
                    let passes = c.parallel.pipeline_schedule.passes(shape, rank);
                    let mine: Vec<f64> = partition
                        .stages_of(rank)
                        .iter()
                        .map(|s| shares[s.index])
                        .collect();
                    peak_in_flight(&passes, |chunk| mine[chunk])
                })
                .collect();
            let total: f64 = weights.iter().sum::<f64>().max(f64::MIN_POSITIVE);
            (0..pp)
                .zip(weights)
                .map(|(rank, w)| {
                    (
                        Some(partition.params_of(rank).into_iter().collect()),
                        working * w / total,
                    )
                })
                .collect()
        };
        for (pp_rank, (names, working)) in per_rank.into_iter().enumerate() {
            ranks.push(rank_memory(
                c,
                &part,
                names.as_ref(),
                dp,
                tp_rank,
                pp_rank,
                working as u64,
            ));
        }
    }
    Ok(MemoryPlan {
        dp,
        tp,
        pp,
        micro_batch,
        probe_fixed_bytes: fixed,
        probe_per_sample_bytes: per_sample,
        process_base_bytes,
        ranks,
    })
}

fn mib(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / (1024.0 * 1024.0))
}

/// A memory figure as a user reads it: MiB below a GiB, GiB above.
pub fn human_bytes(bytes: u64) -> String {
    const GIB: f64 = 1024.0 * 1024.0 * 1024.0;
    if bytes as f64 >= GIB {
        format!("{:.2} GiB", bytes as f64 / GIB)
    } else {
        mib(bytes)
    }
}

/// What to change in `c` when its layout does not fit, lightest change first: each a flag
/// and what it saves (ZeRO's stages, recomputation, offload), then `--auto`.
pub fn lighter_layouts(c: &TrainingConfig) -> Vec<String> {
    let p = &c.parallel;
    let mut out = Vec::new();
    if p.data_parallel_size > 1 && p.zero_stage < 3 {
        out.push(format!(
            "--zero 3: parameters, gradients and optimizer state sharded over the {} data-parallel ranks",
            p.data_parallel_size
        ));
    }
    if p.recompute_segments == 0 {
        out.push("--recompute 2 (or more): one segment's activations held at a time".into());
    }
    if c.offload.offload_optimizer == OffloadTarget::None && c.optimizer.kind != OptimizerKind::Sgd
    {
        out.push(
            "--offload-optimizer disk: the optimizer's moments in a memory-mapped file".into(),
        );
    }
    if p.pipeline_parallel_size == 1 && p.horizontal_parallel_size == 1 {
        out.push("--pp N or --tp N: the model cut over N ranks".into());
    }
    out.push("--auto: every layout planned and timed, the fastest that fits run".into());
    out
}

impl std::fmt::Display for MemoryPlan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "layout: dp {} x tp {} x pp {}, {} sample(s) per micro-step",
            self.dp, self.tp, self.pp, self.micro_batch
        )?;
        writeln!(
            f,
            "probe ({PROBE_UPDATES} updates of the layout with at most 2 replicas): working set {} + {} per sample per micro-step (all its ranks)",
            mib(self.probe_fixed_bytes),
            mib(self.probe_per_sample_bytes)
        )?;
        writeln!(
            f,
            "{:>3} {:>5} {:>12} {:>12} {:>12} {:>12} {:>12} {:>12}",
            "tp", "stage", "parameters", "gradients", "optimizer", "on disk", "working set", "peak"
        )?;
        for r in &self.ranks {
            writeln!(
                f,
                "{:>3} {:>5} {:>12} {:>12} {:>12} {:>12} {:>12} {:>12}",
                r.tp_rank,
                r.stage,
                mib(r.parameter_bytes),
                mib(r.gradient_bytes),
                mib(r.optimizer_state_bytes),
                mib(r.on_disk_bytes),
                mib(r.working_set_bytes),
                mib(r.peak_bytes)
            )?;
        }
        writeln!(
            f,
            "a rank needs {} (the largest peak above and {} of the process itself); all {} ranks as threads of one process: {}",
            human_bytes(self.per_process_bytes()),
            human_bytes(self.process_base_bytes),
            self.dp * self.tp * self.pp,
            human_bytes(self.threads_process_bytes())
        )
    }
}
