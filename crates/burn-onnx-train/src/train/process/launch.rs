//! Start a training run on whatever the environment provides: one rank of an MPI job when
//! started by `mpirun` (feature `mpi`), one worker thread per rank of the configured topology
//! otherwise, or a plain single-process run. Thread runs restart after a failure (elastic
//! restart, like torchrun's `--max-restarts`): every rank stops, and the run starts again
//! from the newest checkpoint. MPI jobs restart through `onnx-train launch`. With a layout
//! chooser (`train --auto`, [`launch_auto`]) the layout is chosen for the world the job
//! has: under mpirun by rank 0, which tells the others.
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

use super::device::local_rank;
use super::elastic::{elastic_world, fit_world};
use super::preemption::is_preemption;
use super::runner::{RunSummary, TrainingRunner};
use crate::error::{OnnxError, Result};
use crate::train::config::{ParallelConfig, TrainingConfig};
use crate::train::data::Dataset;
use crate::train::layout::auto_layout::{Layout, configure};

/// The communicator of this process when started by an MPI launcher: NCCL over the MPI
/// world when the run is on CUDA GPUs, MPI otherwise.
#[cfg(feature = "mpi")]
fn mpi_comm(parallel: &ParallelConfig) -> Result<Option<Arc<dyn Communicator>>> {
    if !burn_ort_dist::launched_by_mpi() {
        return Ok(None);
    }
    let mpi =
        burn_ort_dist::MpiCommunicator::init()?.with_timeout(parallel.collective_wait_limit());
    match parallel.device {
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
fn mpi_comm(_: &ParallelConfig) -> Result<Option<Arc<dyn Communicator>>> {
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
        .map_err(OnnxError::before_first_update)
        .and_then(|device| {
            let group = device_collectives(comm.clone(), &device)?;
            TrainingRunner::new(config, group, device.autodiff())
        })
        .and_then(|r| r.run(train, test));
    match &result {
        // Every rank stopped after the same update: nothing to abort (the front end
        // reports it).
        Err(e) if is_preemption(e) => {}
        // An MPI rank says why it failed before it ends the job: its error never reaches
        // a front end. Thread ranks return theirs to the launcher, which reports one.
        Err(e) if burn_ort_dist::launched_by_mpi() => {
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
        _ => {}
    }
    result
}

/// Thread ranks on GPUs whose runtime moves data between them (CUDA with NCCL): `comm`
/// with the gradient buckets averaged by the devices themselves (`burn_ort_dist::DeviceGroup`);
/// every other group as it is (MPI ranks have their communicator's own NCCL already).
#[cfg(feature = "cuda")]
fn device_collectives(
    comm: Arc<dyn Communicator>,
    device: &burn::tensor::Device,
) -> Result<Arc<dyn Communicator>> {
    if comm.world_size() == 1 || burn_ort_dist::launched_by_mpi() {
        return Ok(comm);
    }
    let group = burn_ort_dist::DeviceGroup::over(comm, device)
        .map_err(|e| OnnxError::from(e).before_first_update())?;
    if group.rank() == 0 && group.device_collectives().is_some() {
        tracing::info!("collectives on the GPUs (NCCL through the CUDA runtime)");
    }
    Ok(group)
}

#[cfg(not(feature = "cuda"))]
fn device_collectives(
    comm: Arc<dyn Communicator>,
    _device: &burn::tensor::Device,
) -> Result<Arc<dyn Communicator>> {
    Ok(comm)
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
    launch_laid_out(config, train, test, max_restarts, None)
}

/// Chooses the layout of a run for a world of the given size (`train --auto`).
pub type ChooseLayout<'a> = &'a dyn Fn(&TrainingConfig, usize) -> Result<Layout>;

/// [`launch_elastic`] with the layout `choose` picks for the world the job has. Under
/// mpirun, rank 0 chooses (its probes run in processes of their own) while the others wait,
/// and every rank runs the layout it broadcast; thread ranks are laid out before they start.
pub fn launch_auto(
    config: TrainingConfig,
    train: Arc<dyn Dataset>,
    test: Option<Arc<dyn Dataset>>,
    max_restarts: usize,
    choose: ChooseLayout,
) -> Result<RunSummary> {
    launch_laid_out(config, train, test, max_restarts, Some(choose))
}

fn launch_laid_out(
    config: TrainingConfig,
    train: Arc<dyn Dataset>,
    test: Option<Arc<dyn Dataset>>,
    max_restarts: usize,
    choose: Option<ChooseLayout>,
) -> Result<RunSummary> {
    config.check().map_err(OnnxError::before_first_update)?;
    refuse_foreign_launcher()?;
    if let Some(comm) = mpi_comm(&config.parallel)? {
        if max_restarts > 0 {
            return Err(OnnxError::field(
                "--max-restarts",
                "under mpirun a failed rank ends the job: restart it with `onnx-train launch --max-restarts K -- train ...`",
            ));
        }
        // A rank of a job that may shrink fits the layout to the world it finds.
        let config = match choose {
            Some(choose) => agreed_layout(config, comm.as_ref(), choose)?,
            None if elastic_world() => {
                fit_world(config, comm.world_size()).map_err(OnnxError::before_first_update)?
            }
            None => config,
        };
        return on_own_pool(|| run_rank(config, comm, train, test));
    }
    let config = match choose {
        Some(choose) => {
            let world = config.parallel.topology().world_size();
            configure(&config, world, choose(&config, world)?)?
        }
        None => config,
    };
    let mut attempt = 0;
    loop {
        match launch_threads(config.clone(), train.clone(), test.clone(), &|comm| comm) {
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

/// `config` laid out as rank 0 of `comm` chooses with `choose`: it broadcasts the layout
/// (or that it found none) to every rank.
fn agreed_layout(
    config: TrainingConfig,
    comm: &dyn Communicator,
    choose: ChooseLayout,
) -> Result<TrainingConfig> {
    let world = comm.world_size();
    let mut chosen = None;
    let mut wire = [0f32; 11];
    if comm.rank() == 0 {
        let layout = choose(&config, world).map_err(OnnxError::before_first_update);
        if let Ok(l) = &layout {
            wire = [
                1.0,
                l.dp as f32,
                l.tp as f32,
                l.pp as f32,
                l.zero as f32,
                l.recompute as f32,
                f32::from(u8::from(l.offload)),
                l.micro as f32,
                f32::from(u8::from(l.sequence)),
                l.chunks as f32,
                f32::from(u8::from(l.params_on_disk)),
            ];
        }
        chosen = Some(layout);
    }
    comm.broadcast(&mut wire, 0)?;
    if let Some(Err(e)) = chosen {
        return Err(e);
    }
    if wire[0] != 1.0 {
        return Err(OnnxError::before_first_update(OnnxError::field(
            "--auto",
            "rank 0 found no layout to run (its log says why)",
        )));
    }
    let n = |k: usize| wire[k] as usize;
    let layout = Layout {
        dp: n(1),
        tp: n(2),
        pp: n(3),
        zero: n(4),
        recompute: n(5),
        offload: wire[6] == 1.0,
        micro: n(7),
        sequence: wire[8] == 1.0,
        chunks: n(9),
        params_on_disk: wire[10] == 1.0,
    };
    configure(&config, world, layout).map_err(OnnxError::before_first_update)
}

/// Makes a thread rank's group from its plain in-process communicator.
pub type GroupOf<'a> = &'a (dyn Fn(Arc<dyn Communicator>) -> Arc<dyn Communicator> + Sync);

/// [`launch`] on thread ranks (no elastic restart) whose groups `group_of` makes from the
/// plain in-process ones, as PyTorch takes a process group of the caller's: a wrapper that
/// counts, delays or carries collectives another way (the tests carry the device
/// collectives through host memory with `burn_ort_dist::ThroughHost`, so a run on the CPU
/// or wgpu takes the code paths NCCL takes on CUDA). Sub-groups are what the wrapper's
/// `split` makes. A one-rank topology runs plain.
pub fn launch_threads_over(
    config: TrainingConfig,
    train: Arc<dyn Dataset>,
    test: Option<Arc<dyn Dataset>>,
    group_of: GroupOf,
) -> Result<RunSummary> {
    config.check().map_err(OnnxError::before_first_update)?;
    launch_threads(config, train, test, group_of)
}

/// One attempt on this process: a thread per rank of the topology (data x tensor x
/// pipeline parallel sizes) over the groups `group_of` makes, or one plain run.
fn launch_threads(
    config: TrainingConfig,
    train: Arc<dyn Dataset>,
    test: Option<Arc<dyn Dataset>>,
    group_of: GroupOf,
) -> Result<RunSummary> {
    let world = config.parallel.topology().world_size();
    if world <= 1 {
        return on_own_pool(|| run_rank(config, Arc::new(LocalCommunicator), train, test));
    }
    // A rank that fails, panics or returns leaves the group and fails its peers at once;
    // the limit ends a job one of whose ranks is stuck for good (as under MPI).
    let timeout = config
        .parallel
        .collective_wait_limit()
        .unwrap_or(Duration::MAX);
    let results = run_threads(world, timeout, |comm| {
        run_rank(config.clone(), group_of(comm), train.clone(), test.clone())
    });
    first_failure(results)
}

/// Rank 0's summary when every rank succeeded, else the error that caused the failure:
/// the first (by rank) that is not a peer's report of another rank's failure.
fn first_failure(results: Vec<Result<RunSummary>>) -> Result<RunSummary> {
    let mut errors = Vec::new();
    let mut root = None;
    for (rank, r) in results.into_iter().enumerate() {
        match r {
            Ok(s) if rank == 0 => root = Some(s),
            Ok(_) => {}
            Err(e) => errors.push(e),
        }
    }
    let is_peer = |e: &OnnxError| {
        let inner = match e {
            OnnxError::BeforeFirstUpdate(inner) => inner.as_ref(),
            e => e,
        };
        matches!(
            inner,
            OnnxError::Distributed(burn_ort_dist::DistError::Peer { .. })
        )
    };
    let cause = errors.iter().position(|e| !is_peer(e)).unwrap_or(0);
    match (errors.into_iter().nth(cause), root) {
        (Some(e), _) => Err(e),
        (None, Some(s)) => Ok(s),
        (None, None) => Err(OnnxError::field("launch", "rank 0 produced no result")),
    }
}
