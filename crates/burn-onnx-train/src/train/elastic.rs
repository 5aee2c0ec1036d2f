//! `onnx-train launch`: run a command under `mpirun` and start it again when it fails, as
//! torchrun does for its workers. A failed rank ends the whole MPI job (the communicator
//! aborts it); the wrapper waits for mpirun, and if restarts remain, starts the same job
//! again, which resumes from the newest checkpoint (ZeRO state is resharded on load). A job
//! whose ranks stopped on a signal ([`super::preemption`]) is not restarted: the wrapper
//! ends with the same status; nor is one that failed before its first update
//! ([`crate::error::FAILED_BEFORE_FIRST_UPDATE`]: it would fail the same way).

use std::ffi::OsString;
use std::path::Path;
use std::process::Command;

use super::preemption::PREEMPTED_EXIT_CODE;
use crate::error::{FAILED_BEFORE_FIRST_UPDATE, OnnxError, Result};

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
        for attempt in 0..=self.max_restarts {
            let status = Command::new(&self.mpirun)
                .arg("-np")
                .arg(self.ranks.to_string())
                .args(&self.mpirun_args)
                .arg(program)
                .args(args)
                .status()
                .map_err(|e| OnnxError::io(Path::new(&self.mpirun), e))?;
            if status.success() {
                return Ok(attempt);
            }
            if status.code() == Some(i32::from(FAILED_BEFORE_FIRST_UPDATE)) {
                return Err(OnnxError::field(
                    "launch",
                    format!(
                        "the job failed before its first update ({status}): not restarted, it would fail the same way (see the ranks' errors above)"
                    ),
                ));
            }
            if status.code() == Some(i32::from(PREEMPTED_EXIT_CODE)) {
                // Preempted, not failed: the ranks wrote a checkpoint; no restart here.
                return Err(OnnxError::Preempted {
                    what: format!("the job stopped on a signal ({status})"),
                });
            }
            if attempt < self.max_restarts {
                tracing::warn!(%status, restart = attempt + 1, max_restarts = self.max_restarts, "the job failed; restarting it from the newest checkpoint");
            } else {
                return Err(OnnxError::field(
                    "launch",
                    format!(
                        "the job failed ({status}) and {} restart(s) are used up",
                        self.max_restarts
                    ),
                ));
            }
        }
        unreachable!("the loop returns on its last attempt")
    }
}
