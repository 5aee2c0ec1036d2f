//! What a group's collectives move per second, as nccl-tests reports it (`ort-dist-check
//! --bandwidth`): for each collective and size, the time of one operation (the slowest
//! rank's mean over the timed repetitions), the algorithm bandwidth (bytes / time) and the
//! bus bandwidth (the algorithm bandwidth times the share of the data each link carries in
//! a ring: `2 (n - 1) / n` for an all-reduce, `(n - 1) / n` for an all-gather or a
//! reduce-scatter, 1 for a broadcast), which compares with the link's own speed whatever
//! the rank count. Sizes are nccl-tests' too: an all-gather's whole output, a
//! reduce-scatter's whole input.

use std::time::Instant;

use burn::tensor::{Device, Tensor, TensorData};

use crate::comm::communicator::{Communicator, DeviceCollectives, ReduceOp};
use crate::error::{DistError, DistResult};

/// A collective whose bandwidth is measured.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Collective {
    /// `all_reduce` (sum).
    AllReduce,
    /// `all_gather`.
    AllGather,
    /// `reduce_scatter` (sum).
    ReduceScatter,
    /// `broadcast` from rank 0.
    Broadcast,
    /// The mean of a buffer on the device ([`DeviceCollectives`]: NCCL on a GPU's memory).
    DeviceAllReduce,
}

impl Collective {
    /// The host collectives, in the order they are measured.
    pub const HOST: [Collective; 4] = [
        Collective::AllReduce,
        Collective::AllGather,
        Collective::ReduceScatter,
        Collective::Broadcast,
    ];

    /// The name nccl-tests prints.
    pub fn name(self) -> &'static str {
        match self {
            Collective::AllReduce => "all_reduce",
            Collective::AllGather => "all_gather",
            Collective::ReduceScatter => "reduce_scatter",
            Collective::Broadcast => "broadcast",
            Collective::DeviceAllReduce => "all_reduce (device)",
        }
    }

    /// The share of the data each link of a ring carries, over `ranks` ranks.
    pub fn bus_factor(self, ranks: usize) -> f64 {
        let n = ranks.max(1) as f64;
        match self {
            Collective::AllReduce | Collective::DeviceAllReduce => 2.0 * (n - 1.0) / n,
            Collective::AllGather | Collective::ReduceScatter => (n - 1.0) / n,
            Collective::Broadcast => 1.0,
        }
    }
}

/// One collective at one size.
#[derive(Debug, Clone, PartialEq)]
pub struct BandwidthRow {
    /// Which collective.
    pub collective: Collective,
    /// Bytes of f32 values (an all-gather's output, a reduce-scatter's input).
    pub bytes: usize,
    /// Seconds per operation: the slowest rank's mean.
    pub seconds: f64,
    /// Ranks in the group.
    pub ranks: usize,
}

impl BandwidthRow {
    /// Bytes per second through the operation, in GB/s.
    pub fn alg_bw(&self) -> f64 {
        self.bytes as f64 / self.seconds / 1e9
    }

    /// [`Self::alg_bw`] times the collective's [`Collective::bus_factor`], in GB/s.
    pub fn bus_bw(&self) -> f64 {
        self.alg_bw() * self.collective.bus_factor(self.ranks)
    }
}

/// Sizes from `min` to `max` bytes, doubling, each a whole number of f32 values for every
/// one of `ranks` ranks (so an all-gather's output and a reduce-scatter's input divide).
pub fn sizes(min: usize, max: usize, ranks: usize) -> Vec<usize> {
    let unit = 4 * ranks.max(1);
    let mut out = Vec::new();
    let mut size = min.max(1);
    while size <= max {
        let rounded = size.div_ceil(unit) * unit;
        if out.last() != Some(&rounded) {
            out.push(rounded);
        }
        size *= 2;
    }
    out
}

/// Time every host collective of `comm` at every size in `sizes` (bytes), `iters` times
/// after two untimed rounds. Collective: every rank calls it with the same arguments.
pub fn measure(
    comm: &dyn Communicator,
    sizes: &[usize],
    iters: usize,
) -> DistResult<Vec<BandwidthRow>> {
    let n = comm.world_size();
    let mut rows = Vec::new();
    for collective in Collective::HOST {
        for &bytes in sizes {
            let count = bytes / 4;
            let mut whole = vec![1.0f32; count];
            let mut part = vec![1.0f32; count / n];
            let mut once = || match collective {
                Collective::AllReduce => comm.all_reduce(&mut whole, ReduceOp::Sum),
                Collective::AllGather => comm.all_gather(&part, &mut whole),
                Collective::ReduceScatter => comm.reduce_scatter(&whole, &mut part, ReduceOp::Sum),
                Collective::Broadcast => comm.broadcast(&mut whole, 0),
                Collective::DeviceAllReduce => unreachable!("not a host collective"),
            };
            let seconds = timed(comm, iters, &mut once, || Ok(()))?;
            rows.push(BandwidthRow {
                collective,
                bytes,
                seconds,
                ranks: n,
            });
        }
    }
    Ok(rows)
}

/// Time the group's device all-reduce ([`Communicator::device_collectives`]) of f32 buffers on
/// `device` at every size in `sizes`, `iters` times after two untimed rounds, waiting for
/// the device at the end of each round. Collective.
pub fn measure_device(
    comm: &dyn Communicator,
    device: &Device,
    sizes: &[usize],
    iters: usize,
) -> DistResult<Vec<BandwidthRow>> {
    let reduce: &dyn DeviceCollectives = comm
        .device_collectives()
        .filter(|r| r.works_on(device))
        .ok_or_else(|| DistError::Invalid {
        rank: comm.rank(),
        message: format!("this group has no all-reduce on {device:?} (NCCL needs a CUDA device)"),
    })?;
    let mut rows = Vec::new();
    for &bytes in sizes {
        let count = bytes / 4;
        let buffer = Tensor::<1>::from_data(TensorData::new(vec![1.0f32; count], [count]), device);
        let mut once = || {
            reduce
                .all_reduce(buffer.clone(), ReduceOp::Mean)
                .map(|_| ())
        };
        let wait = || {
            device.sync().map_err(|e| DistError::Invalid {
                rank: comm.rank(),
                message: format!("waiting for {device:?}: {e:?}"),
            })
        };
        let seconds = timed(comm, iters, &mut once, wait)?;
        rows.push(BandwidthRow {
            collective: Collective::DeviceAllReduce,
            bytes,
            seconds,
            ranks: comm.world_size(),
        });
    }
    Ok(rows)
}

/// The slowest rank's mean seconds of `once()` over `iters` runs after two untimed ones;
/// `wait()` after each round (the device's queue), a barrier before the timed round.
fn timed(
    comm: &dyn Communicator,
    iters: usize,
    once: &mut dyn FnMut() -> DistResult<()>,
    wait: impl Fn() -> DistResult<()>,
) -> DistResult<f64> {
    for _ in 0..2 {
        once()?;
    }
    wait()?;
    comm.barrier()?;
    let start = Instant::now();
    for _ in 0..iters.max(1) {
        once()?;
    }
    wait()?;
    let mine = start.elapsed().as_secs_f64() / iters.max(1) as f64;
    let mut all = vec![0.0f32; comm.world_size()];
    comm.all_gather(&[mine as f32], &mut all)?;
    Ok(all.iter().fold(0.0f64, |m, &t| m.max(f64::from(t))))
}

/// The rows as nccl-tests prints them: size, count, collective, time, algbw, busbw.
pub fn table(rows: &[BandwidthRow]) -> String {
    let mut out = format!(
        "{:>12} {:>12} {:>20} {:>11} {:>12} {:>12}\n",
        "size (B)", "count (f32)", "collective", "time (us)", "algbw (GB/s)", "busbw (GB/s)"
    );
    for r in rows {
        out.push_str(&format!(
            "{:>12} {:>12} {:>20} {:>11.1} {:>12.2} {:>12.2}\n",
            r.bytes,
            r.bytes / 4,
            r.collective.name(),
            r.seconds * 1e6,
            r.alg_bw(),
            r.bus_bw()
        ));
    }
    out
}
