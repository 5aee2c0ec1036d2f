//! Preemption: a scheduler's SIGTERM, SLURM's warning signal (SIGUSR1, `--signal`) or
//! Ctrl-C (SIGINT) asks the run to stop. Every rank agrees at the next update boundary (an
//! all-reduce of the flag after each update, so ranks that saw the signal at different
//! moments stop after the same update), writes a checkpoint and ends with
//! [`OnnxError::Preempted`]; `onnx-train` then exits with status [`PREEMPTED_EXIT_CODE`].
//! A second signal ends the process at once (status 128 + signal): checkpoints are written
//! to a temporary directory and renamed into place, so the newest complete one stays
//! loadable.

use std::sync::Once;
use std::sync::atomic::{AtomicI32, Ordering};

use burn_ort_dist::{Communicator, ReduceOp};

use crate::error::{OnnxError, Result};

/// Exit status of a preempted run (`EX_TEMPFAIL`: try again later).
pub const PREEMPTED_EXIT_CODE: u8 = 75;

/// The first stop signal received by this process (0: none).
static REQUESTED: AtomicI32 = AtomicI32::new(0);

extern "C" fn on_signal(signal: libc::c_int) {
    if REQUESTED.swap(signal, Ordering::SeqCst) != 0 {
        // SAFETY: `_exit` is async-signal-safe.
        unsafe { libc::_exit(128 + signal) };
    }
}

/// Install the handlers of SIGTERM, SIGINT and SIGUSR1 (once per process).
pub fn install() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        for signal in [libc::SIGTERM, libc::SIGINT, libc::SIGUSR1] {
            // SAFETY: the handler only touches an atomic and calls `_exit`.
            unsafe { libc::signal(signal, on_signal as *const () as libc::sighandler_t) };
        }
    });
}

fn name(signal: i32) -> &'static str {
    match signal {
        libc::SIGTERM => "SIGTERM",
        libc::SIGINT => "SIGINT",
        libc::SIGUSR1 => "SIGUSR1",
        _ => "a signal",
    }
}

/// The stop signal any rank of `world` has received, agreed by all (a collective: every
/// rank calls it after the same update).
pub fn agreed_stop(world: &dyn Communicator) -> Result<Option<&'static str>> {
    let signal = REQUESTED.load(Ordering::SeqCst);
    // (ranks that received one, sum of their signals): the name when they agree.
    let mut sums = [f32::from(signal != 0), signal as f32];
    world.all_reduce(&mut sums, ReduceOp::Sum)?;
    Ok((sums[0] > 0.0).then(|| name((sums[1] / sums[0]).round() as i32)))
}

/// Whether `e` is a preemption (not a failure: no rank aborts the job, no restart).
pub fn is_preemption(e: &OnnxError) -> bool {
    matches!(e, OnnxError::Preempted { .. })
}
