//! `onnx-train launch`: run a command under `mpirun` and start it again when it fails, as
//! torchrun does for its workers. A failed rank ends the whole MPI job (the communicator
//! aborts it); the wrapper waits for mpirun, and if restarts remain, starts the same job
//! again, which resumes from the newest checkpoint (ZeRO state is resharded on load). A job
//! whose ranks stopped on a signal ([`super::preemption`]) is not restarted: the wrapper
//! ends with the same status; nor is one that failed before its first update
//! ([`crate::error::FAILED_BEFORE_FIRST_UPDATE`]: it would fail the same way).
//!
//! With `--min-np M` below `--np N` the job may shrink, as torchrun's `--nnodes M:N`: a
//! size that fails twice in a row is taken to have lost a rank for good (mpirun cannot
//! place its ranks, or one dies again), and the next attempt runs on one rank fewer, down
//! to M. The ranks are told through [`ELASTIC_ENV`] to fit the layout to the world they
//! find ([`fit_world`]): tensor and pipeline sizes kept, the data-parallel size what is
//! left, accumulation raised so that the global batch (and so the run's arithmetic, up to
//! the order of its sums) stays the same. A shrunk size that the layout cannot use fails
//! before its first update and the next smaller one is tried.

use std::ffi::OsString;
use std::path::Path;
use std::process::Command;

use burn_ort_dist::Topology;

use super::preemption::PREEMPTED_EXIT_CODE;
use crate::error::{FAILED_BEFORE_FIRST_UPDATE, OnnxError, Result};
use crate::train::config::TrainingConfig;

/// Set (to 1) for the ranks of a job that may shrink: a rank then fits its layout to the
/// world it finds ([`fit_world`]) instead of refusing a world of another size.
pub const ELASTIC_ENV: &str = "ONNX_TRAIN_ELASTIC";

/// Whether this process is a rank of a job that may shrink ([`ELASTIC_ENV`]).
pub fn elastic_world() -> bool {
    std::env::var_os(ELASTIC_ENV).is_some_and(|v| v == "1")
}

/// `c` fitted to a world of `world` processes: tensor and pipeline sizes kept, the
/// data-parallel size the rest ([`with_replicas`]). An error names the field when the
/// world cannot hold the layout.
pub fn fit_world(c: TrainingConfig, world: usize) -> Result<TrainingConfig> {
    let configured = c.parallel.topology();
    if configured.world_size() == world {
        return Ok(c);
    }
    let fitted = Topology::filling(world, configured.tp, configured.pp).map_err(|_| {
        OnnxError::field(
            "parallel.data_parallel_size",
            format!(
                "an elastic world of {world} process(es) cannot hold the layout: tensor x pipeline parallel sizes are {} per replica",
                configured.model_ranks()
            ),
        )
    })?;
    let c = with_replicas(c, fitted.dp)?;
    tracing::warn!(
        world,
        data_parallel_size = c.parallel.data_parallel_size,
        gradient_accumulation_steps = c.train.gradient_accumulation_steps,
        "elastic: the layout is fitted to the world found, the global batch kept"
    );
    Ok(c)
}

/// `c` with `dp` data-parallel replicas and the same global batch (`batch_size` x
/// replicas x accumulation) and number of updates: each replica's share of the global
/// batch is taken in micro-batches of `batch_size` (accumulating more or fewer of them) when
/// they divide it, else in one micro-batch of the share. An error names the field when
/// `dp` does not divide the global batch.
pub fn with_replicas(mut c: TrainingConfig, dp: usize) -> Result<TrainingConfig> {
    let (batch, was, accumulation) = (
        c.data.batch_size,
        c.parallel.data_parallel_size,
        c.train.gradient_accumulation_steps,
    );
    let global = batch * was * accumulation;
    if dp == 0 || !global.is_multiple_of(dp) {
        return Err(OnnxError::field(
            "parallel.data_parallel_size",
            format!(
                "{dp} replica(s) do not divide the global batch of {global} samples ({batch} per micro-batch x {was} replica(s) x {accumulation} accumulation step(s))"
            ),
        ));
    }
    let share = global / dp;
    let updates = c.train.num_updates();
    let (batch, accumulation) = if share.is_multiple_of(batch) {
        (batch, share / batch)
    } else {
        (share, 1)
    };
    c.parallel.data_parallel_size = dp;
    c.data.batch_size = batch;
    c.train.gradient_accumulation_steps = accumulation;
    // `num_train_steps` counts a rank's micro-steps: the same updates at the new accumulation.
    c.train.num_train_steps = updates * accumulation;
    Ok(c)
}

/// How to run the job.
#[derive(Debug, Clone)]
pub struct ElasticJob {
    /// The `mpirun` program.
    pub mpirun: OsString,
    /// Ranks (`mpirun -np`).
    pub ranks: usize,
    /// Extra arguments for `mpirun` (hosts, binding, ...).
    pub mpirun_args: Vec<OsString>,
    /// The program each rank runs and its arguments.
    pub command: Vec<OsString>,
    /// Restarts after a failure.
    pub max_restarts: usize,
    /// The fewest ranks the job may shrink to (`ranks`: it does not shrink).
    pub min_ranks: usize,
}

impl ElasticJob {
    /// Run until the job succeeds or the restarts are used up; returns the number of
    /// restarts it took.
    pub fn run(&self) -> Result<usize> {
        let Some((program, args)) = self.command.split_first() else {
            return Err(OnnxError::field(
                "launch",
                "no command to run (onnx-train launch --np N -- train --config run.toml)",
            ));
        };
        if self.min_ranks == 0 || self.min_ranks > self.ranks {
            return Err(OnnxError::field(
                "--min-np",
                format!(
                    "{} must be between 1 and --np ({})",
                    self.min_ranks, self.ranks
                ),
            ));
        }
        let elastic = self.min_ranks < self.ranks;
        let (mut ranks, mut restarts, mut failed_at_this_size) = (self.ranks, 0, false);
        loop {
            let mut mpirun = Command::new(&self.mpirun);
            mpirun.arg("-np").arg(ranks.to_string());
            if elastic {
                // Exported to every rank, on remote hosts too.
                mpirun.env(ELASTIC_ENV, "1").args(["-x", ELASTIC_ENV]);
            }
            let status = mpirun
                .args(&self.mpirun_args)
                .arg(program)
                .args(args)
                .status()
                .map_err(|e| OnnxError::io(Path::new(&self.mpirun), e))?;
            if status.success() {
                return Ok(restarts);
            }
            if status.code() == Some(i32::from(PREEMPTED_EXIT_CODE)) {
                // Preempted, not failed: the ranks wrote a checkpoint; no restart here.
                return Err(OnnxError::Preempted {
                    what: format!("the job stopped on a signal ({status})"),
                });
            }
            if status.code() == Some(i32::from(FAILED_BEFORE_FIRST_UPDATE)) {
                if ranks < self.ranks && ranks > self.min_ranks {
                    ranks -= 1;
                    tracing::warn!(%status, ranks, "the layout does not fit the shrunk world; trying one rank fewer");
                    continue;
                }
                return Err(OnnxError::field(
                    "launch",
                    format!(
                        "the job failed before its first update on {ranks} rank(s) ({status}): not restarted, it would fail the same way (see the ranks' errors above)"
                    ),
                ));
            }
            if restarts == self.max_restarts {
                return Err(OnnxError::field(
                    "launch",
                    format!(
                        "the job failed ({status}) and {} restart(s) are used up",
                        self.max_restarts
                    ),
                ));
            }
            restarts += 1;
            if failed_at_this_size && ranks > self.min_ranks {
                ranks -= 1;
                failed_at_this_size = false;
                tracing::warn!(%status, restart = restarts, max_restarts = self.max_restarts, ranks, "the job failed twice in a row at this size: a rank is lost; restarting on one rank fewer from the newest checkpoint");
            } else {
                failed_at_this_size = true;
                tracing::warn!(%status, restart = restarts, max_restarts = self.max_restarts, ranks, "the job failed; restarting it from the newest checkpoint");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout(dp: usize, tp: usize, pp: usize, accumulation: usize) -> TrainingConfig {
        let mut c = TrainingConfig::default();
        c.parallel.data_parallel_size = dp;
        c.parallel.horizontal_parallel_size = tp;
        c.parallel.pipeline_parallel_size = pp;
        c.train.gradient_accumulation_steps = accumulation;
        c.train.num_train_steps = 10 * accumulation;
        c
    }

    /// (dp, accumulation, micro-steps per rank) of `c` fitted to `world`.
    fn fitted(c: TrainingConfig, world: usize) -> Result<(usize, usize, usize)> {
        let f = fit_world(c, world)?;
        Ok((
            f.parallel.data_parallel_size,
            f.train.gradient_accumulation_steps,
            f.train.num_train_steps,
        ))
    }

    #[test]
    fn more_replicas_split_the_micro_batch_when_accumulation_cannot_shrink() {
        // 8 samples x 1 replica x 1 step -> 2 replicas of 4 samples, 4 of 2.
        let mut c = layout(1, 1, 1, 1);
        c.data.batch_size = 8;
        for (dp, batch) in [(2, 4), (4, 2), (8, 1)] {
            let f = with_replicas(c.clone(), dp).unwrap();
            assert_eq!(
                (
                    f.data.batch_size,
                    f.train.gradient_accumulation_steps,
                    f.train.num_train_steps
                ),
                (batch, 1, 10),
                "{dp} replicas"
            );
        }
        let err = with_replicas(c, 3).unwrap_err().to_string();
        assert!(
            err.contains("parallel.data_parallel_size") && err.contains("8 samples"),
            "{err}"
        );
    }

    #[test]
    fn a_smaller_world_keeps_the_global_batch_and_the_updates() {
        // 4 replicas x 1 step -> 2 x 2 and 1 x 4; 10 updates each time.
        assert_eq!(fitted(layout(4, 1, 1, 1), 2).unwrap(), (2, 2, 20));
        assert_eq!(fitted(layout(4, 1, 1, 1), 1).unwrap(), (1, 4, 40));
        // tp 2 x pp 2 per replica: 8 processes (2 replicas x 3 steps) -> 4 (1 x 6).
        assert_eq!(fitted(layout(2, 2, 2, 3), 4).unwrap(), (1, 6, 60));
        // The same world: unchanged.
        assert_eq!(fitted(layout(2, 1, 1, 2), 2).unwrap(), (2, 2, 20));
    }

    #[test]
    fn a_world_that_cannot_hold_the_layout_is_an_error_naming_the_field() {
        for (c, world) in [
            (layout(4, 1, 1, 1), 3), // 3 replicas do not divide 4 samples
            (layout(2, 2, 1, 1), 3), // 3 processes are no whole tp-2 replica
            (layout(1, 4, 1, 1), 2), // fewer processes than one replica needs
        ] {
            let err = fit_world(c, world).unwrap_err().to_string();
            assert!(err.contains("parallel.data_parallel_size"), "{err}");
        }
    }
}
