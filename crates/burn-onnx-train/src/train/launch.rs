//! Start a training run on whatever the environment provides: one rank of an MPI job when
//! started by `mpirun` (feature `mpi`), one worker thread per rank of the configured topology
//! otherwise, or a plain single-process run. Thread runs restart after a failure (elastic
//! restart, like torchrun's `--max-restarts`): every rank stops, and the run starts again
//! from the newest checkpoint. MPI jobs restart through `onnx-train launch`.
//!
//! A rank that has the process to itself (an MPI rank, or a one-rank run) runs on a compute
//! pool of its own, on one of the pool's threads: each parallel op then starts on the
//! thread that runs the model instead of waking sleeping workers and blocking until they
//! finish (a futex round trip per op, ~10% of a small model's step). Thread ranks share the
//! process's global pool from their own threads: a pool the ranks ran on would deadlock
//! when its threads all hold ranks waiting for a collective.

use std::sync::Arc;
use std::time::Duration;

use burn_ort_dist::{Communicator, LocalCommunicator, run_threads};

use super::config::TrainingConfig;
use super::data::Dataset;
use super::device::local_rank;
use super::elastic::{elastic_world, fit_world};
use super::preemption::is_preemption;
use super::runner::{RunSummary, TrainingRunner};
use crate::error::{OnnxError, Result};

/// The communicator of this process when started by an MPI launcher: NCCL over the MPI
/// world when the run is on CUDA GPUs, MPI otherwise.
#[cfg(feature = "mpi")]
fn mpi_comm(config: &TrainingConfig) -> Result<Option<Arc<dyn Communicator>>> {
    if !burn_ort_dist::launched_by_mpi() {
        return Ok(None);
    }
    let mpi = burn_ort_dist::MpiCommunicator::init()?
        .with_timeout(config.parallel.collective_wait_limit(true));
    match config.parallel.device {
        #[cfg(feature = "cuda")]
        super::device::DeviceSpec::Cuda(index) => {
            let gpu = index.unwrap_or_else(|| local_rank(mpi.rank()));
            Ok(Some(Arc::new(burn_ort_dist::NcclCommunicator::init(
                mpi, gpu,
            )?)))
        }
        _ => Ok(Some(Arc::new(mpi))),
    }
}

#[cfg(not(feature = "mpi"))]
fn mpi_comm(_: &TrainingConfig) -> Result<Option<Arc<dyn Communicator>>> {
    if burn_ort_dist::launched_by_mpi() {
        return Err(OnnxError::field(
            "launch",
            "started by mpirun, but built without the `mpi` feature (rebuild with --features mpi)",
        ));
    }
    Ok(None)
}

fn run_rank(
    config: TrainingConfig,
    comm: Arc<dyn Communicator>,
    train: Arc<dyn Dataset>,
    test: Option<Arc<dyn Dataset>>,
) -> Result<RunSummary> {
    let result = config
        .parallel
        .device
        .device(local_rank(comm.rank()))
        .and_then(|device| TrainingRunner::new(config, comm.clone(), device.autodiff()))
        .and_then(|r| r.run(train, test));
    match &result {
        // Every rank stopped after the same update: nothing to abort (the front end
        // reports it).
        Err(e) if is_preemption(e) => {}
        Err(e) => {
            // Collective errors name their rank already.
            let prefix = format!("rank {}: ", comm.rank());
            let message = e.to_string();
            let prefix = if message.starts_with(&prefix) {
                ""
            } else {
                &prefix
            };
            eprintln!("{prefix}{message}");
            comm.abort(i32::from(e.training_exit_code()));
        }
        Ok(_) => {}
    }
    result
}

/// `work()` on one thread of a new compute pool (as many threads as the global pool:
/// `RAYON_NUM_THREADS` or one per core), or on this thread when the pool cannot start.
fn on_own_pool<R: Send>(work: impl FnOnce() -> R + Send) -> R {
    match rayon::ThreadPoolBuilder::new()
        .thread_name(|i| format!("compute-{i}"))
        .build()
    {
        Ok(pool) => pool.install(work),
        Err(e) => {
            tracing::warn!(error = %e, "no compute pool of its own; running on the global one");
            work()
        }
    }
}

/// Train as configured; returns rank 0's summary (other ranks' when this process is one
/// MPI rank).
pub fn launch(
    config: TrainingConfig,
    train: Arc<dyn Dataset>,
    test: Option<Arc<dyn Dataset>>,
) -> Result<RunSummary> {
    launch_elastic(config, train, test, 0)
}

/// Refuse a launcher this trainer does not speak: torchrun (torchelastic) and
/// `torch.distributed.launch` start N processes with `WORLD_SIZE`, `RANK` and a TCP
/// rendezvous at `MASTER_ADDR`, and a plain `srun -n N` starts N tasks without PMI/PMIx;
/// each process would train alone, into the same output directory. MPI launchers
/// (mpirun, `srun --mpi=pmix`) are ours and pass.
fn refuse_foreign_launcher() -> Result<()> {
    if burn_ort_dist::launched_by_mpi() {
        return Ok(());
    }
    let var = |k: &str| std::env::var(k).ok();
    // An srun step of several tasks without MPI's process management (`--mpi=pmix`): its
    // tasks would each train alone too. (A batch script has SLURM_NTASKS but no step.)
    if let Some(tasks) = var("SLURM_STEP_NUM_TASKS").and_then(|n| n.parse::<usize>().ok())
        && tasks > 1
    {
        let task = var("SLURM_PROCID").unwrap_or_else(|| "?".into());
        return Err(OnnxError::field(
            "launch",
            format!(
                "started by srun as task {task} of {tasks} without MPI process management (no PMI/PMIx in the environment): every task would train alone into the same output directory. Use `srun --mpi=pmix -n {tasks} onnx-train train ...` (OpenMPI's PMIx), or one task with threads: `srun -n 1 onnx-train train --dp {tasks} ...`"
            ),
        ));
    }
    let Some(world) = var("WORLD_SIZE").and_then(|w| w.parse::<usize>().ok()) else {
        return Ok(());
    };
    if world <= 1 {
        return Ok(());
    }
    let launcher = if var("TORCHELASTIC_RUN_ID").is_some() {
        "torchrun (torchelastic)"
    } else {
        "a torch.distributed launcher"
    };
    let rank = var("RANK").unwrap_or_else(|| "?".into());
    Err(OnnxError::field(
        "launch",
        format!(
            "started by {launcher} (WORLD_SIZE={world}, RANK={rank}), whose rendezvous onnx-train does not join: every process would train alone into the same output directory. Start the ranks with MPI: `mpirun -np {world} onnx-train train ...` (Slurm: `srun --mpi=pmix -n {world} onnx-train train ...`), or as threads of one process: `onnx-train train --dp {world} ...`"
        ),
    ))
}

/// [`launch`], and when the run fails, start it again up to `max_restarts` times; each
/// attempt resumes from the newest checkpoint of the run (resharding ZeRO state as needed).
/// Under `mpirun` the processes of a failed job are gone: restarts belong to
/// `onnx-train launch`, and `max_restarts` > 0 is an error here.
pub fn launch_elastic(
    config: TrainingConfig,
    train: Arc<dyn Dataset>,
    test: Option<Arc<dyn Dataset>>,
    max_restarts: usize,
) -> Result<RunSummary> {
    refuse_foreign_launcher()?;
    if let Some(comm) = mpi_comm(&config)? {
        if max_restarts > 0 {
            return Err(OnnxError::field(
                "--max-restarts",
                "under mpirun a failed rank ends the job: restart it with `onnx-train launch --max-restarts K -- train ...`",
            ));
        }
        // A rank of a job that may shrink fits the layout to the world it finds.
        let config = if elastic_world() {
            fit_world(config, comm.world_size()).map_err(OnnxError::before_first_update)?
        } else {
            config
        };
        return on_own_pool(|| run_rank(config, comm, train, test));
    }
    let mut attempt = 0;
    loop {
        match launch_threads(config.clone(), train.clone(), test.clone()) {
            Err(e) if attempt < max_restarts && e.is_before_first_update() => {
                tracing::warn!(
                    "the run failed before its first update: not restarted (it would fail the same way)"
                );
                return Err(e);
            }
            Err(e) if attempt < max_restarts && !is_preemption(&e) => {
                attempt += 1;
                if config.checkpoint.checkpoint_period == 0 {
                    tracing::warn!("checkpoint_period is 0: the restart trains from the start");
                }
                tracing::warn!(error = %e, attempt, max_restarts, "the run failed; restarting from the newest checkpoint");
            }
            result => return result,
        }
    }
}

/// One attempt on this process: a thread per rank of the topology (data x tensor x
/// pipeline parallel sizes), or one plain run.
fn launch_threads(
    config: TrainingConfig,
    train: Arc<dyn Dataset>,
    test: Option<Arc<dyn Dataset>>,
) -> Result<RunSummary> {
    let world = config.parallel.data_parallel_size
        * config.parallel.horizontal_parallel_size
        * config.parallel.pipeline_parallel_size;
    if world <= 1 {
        return on_own_pool(|| run_rank(config, Arc::new(LocalCommunicator), train, test));
    }
    // Thread ranks wait without limit unless configured: a rank that fails, panics or
    // returns leaves the group and fails its peers at once, and one that has not arrived
    // is still working (writing a checkpoint of a big model, say).
    let timeout = config
        .parallel
        .collective_wait_limit(false)
        .unwrap_or(Duration::MAX);
    let results = run_threads(world, timeout, |comm| {
        run_rank(config.clone(), comm, train.clone(), test.clone())
    });
    let mut first_error = None;
    let mut root = None;
    for (rank, r) in results.into_iter().enumerate() {
        match r {
            Ok(s) if rank == 0 => root = Some(s),
            Ok(_) => {}
            Err(e) => {
                first_error.get_or_insert(e);
            }
        }
    }
    match (first_error, root) {
        (Some(e), _) => Err(e),
        (None, Some(s)) => Ok(s),
        (None, None) => Err(OnnxError::field("launch", "rank 0 produced no result")),
    }
}
