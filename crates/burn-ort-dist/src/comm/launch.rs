//! Local launch: run `N` data-parallel workers as threads of this process, each with its
//! rank of a [`ThreadCommunicator`] group (what `--dp N` does without `mpirun`); and whether
//! an MPI launcher started this process and its rank among those of its node (read from
//! its environment, with or without the `mpi` feature).

use std::sync::Arc;
use std::time::Duration;

use crate::comm::communicator::Communicator;
use crate::comm::threads::ThreadCommunicator;

/// Was this process started by an MPI launcher (OpenMPI, MPICH, Slurm's PMI)?
pub fn launched_by_mpi() -> bool {
    ["OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"]
        .iter()
        .any(|v| std::env::var_os(v).is_some())
}

/// This process's index among the ranks of its node: the launcher's local rank
/// (OpenMPI, MPICH/Intel MPI, Slurm, or `LOCAL_RANK` as torchrun-style launchers set it),
/// else `rank` (thread ranks share one process).
pub fn local_rank(rank: usize) -> usize {
    [
        "OMPI_COMM_WORLD_LOCAL_RANK",
        "MPI_LOCALRANKID",
        "SLURM_LOCALID",
        "LOCAL_RANK",
    ]
    .iter()
    .find_map(|v| std::env::var(v).ok()?.parse().ok())
    .unwrap_or(rank)
}

/// Run `worker` on `world` threads, one rank each. Returns every rank's result in rank order.
/// A worker that fails or panics aborts the group, so the others fail at their next
/// collective instead of waiting; `timeout` bounds the wait for a silent rank.
pub fn run_threads<T, E, F>(world: usize, timeout: Duration, worker: F) -> Vec<Result<T, E>>
where
    T: Send,
    E: Send + From<String>,
    F: Fn(Arc<dyn Communicator>) -> Result<T, E> + Sync,
{
    let comms = ThreadCommunicator::group(world, timeout);
    std::thread::scope(|scope| {
        let handles: Vec<_> = comms
            .into_iter()
            .map(|comm| {
                let worker = &worker;
                std::thread::Builder::new()
                    .name(format!("rank-{}", comm.rank()))
                    .spawn_scoped(scope, move || {
                        let comm: Arc<dyn Communicator> = Arc::new(comm);
                        let result = worker(comm.clone());
                        if result.is_err() {
                            comm.abort(1);
                        }
                        result
                    })
                    .expect("spawning a worker thread")
            })
            .collect();
        handles
            .into_iter()
            .enumerate()
            .map(|(rank, h)| {
                h.join()
                    .unwrap_or_else(|_| Err(E::from(format!("rank {rank} panicked"))))
            })
            .collect()
    })
}
