//! What a timed-out collective reports (`collective_timeout`): the operation, its bytes,
//! the group, how long it waited, and which ranks never arrived; and the debug-level
//! trace of every completed operation (op, bytes, group, time).

use std::time::Duration;

use crate::error::DistError;

/// One operation of a group, for reports and traces.
#[derive(Debug, Clone, Copy)]
pub struct OpInfo<'a> {
    /// The operation (`all_reduce`, `recv from rank 2`, ...).
    pub op: &'a str,
    /// Bytes this rank contributes or expects.
    pub bytes: usize,
    /// The group's members as world ranks, in group-rank order.
    pub group: &'a [usize],
}

/// A wait that outlasted the timeout, and what is known of the ranks it waited for.
pub struct Stall<'a> {
    /// The operation that waited.
    pub info: OpInfo<'a>,
    /// How long it waited.
    pub waited: Duration,
    /// World ranks that never arrived at this operation.
    pub absent: Vec<usize>,
    /// World ranks that are waiting in another operation, with what they said it is.
    pub elsewhere: Vec<(usize, String)>,
}

impl Stall<'_> {
    /// The error that ends the rank (`rank`: its world rank).
    pub fn into_error(self, rank: usize) -> DistError {
        let OpInfo { op, bytes, group } = self.info;
        let mut message = format!(
            "{op} of {} in the group of world ranks {group:?}: no answer within {:.1} s",
            human_bytes(bytes),
            self.waited.as_secs_f64()
        );
        if !self.absent.is_empty() {
            message += &format!(
                "; never arrived: world rank(s) {:?} (stopped, dead, or busy outside communication)",
                self.absent
            );
        }
        for (r, what) in &self.elsewhere {
            message += &format!(
                "; world rank {r} waits in {what} instead (the ranks disagree on the order of operations)"
            );
        }
        DistError::Timeout { rank, message }
    }
}

/// Trace a completed operation at debug level.
pub fn trace_done(info: OpInfo<'_>, elapsed: Duration) {
    tracing::debug!(
        op = info.op,
        bytes = info.bytes,
        group = ?info.group,
        micros = elapsed.as_micros() as u64,
        "collective"
    );
}

/// `n` bytes for people: B, KiB, MiB or GiB with one decimal.
pub fn human_bytes(n: usize) -> String {
    const UNITS: [&str; 4] = ["B", "KiB", "MiB", "GiB"];
    let mut v = n as f64;
    let mut unit = 0;
    while v >= 1024.0 && unit + 1 < UNITS.len() {
        v /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{n} B")
    } else {
        format!("{v:.1} {}", UNITS[unit])
    }
}
