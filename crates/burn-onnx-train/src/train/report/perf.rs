//! Throughput measurement, reported like ORT's perf output: items (tokens or images) per
//! second over the last half of the run, once warm-up effects are gone, written as JSON.

use std::path::Path;
use std::time::Duration;

use serde::Serialize;

use burn::tensor::Device;
use burn_ort_dist::{Communicator, MemoryUse, SyncTimes};

use crate::error::{OnnxError, Result};
use crate::kernels::launch_tally::{LaunchCounts, launches_so_far, short_kernel_name};
use crate::train::config::TrainingConfig;
use crate::util::atomic_file::write_atomic;

/// Per-update timings.
pub struct PerfMeter {
    unit: &'static str,
    steps: Vec<(usize, Duration)>,
    sync: Vec<Duration>,
    waited: Vec<Duration>,
    overlapped: Vec<SyncTimes>,
    prefetched: Vec<SyncTimes>,
    device: Vec<DeviceWork>,
    /// Updates replayed from a recorded one.
    pub replayed: usize,
}

/// What one update asked of a GPU: the kernels this process launched, and the memory the
/// device's pools held at its end. Empty on the CPU.
#[derive(Debug, Clone, Default)]
pub struct DeviceWork {
    /// Kernel launches during the update.
    pub launches: Option<LaunchCounts>,
    /// Bytes the device's memory pools reserved at the end of the update.
    pub reserved_bytes: Option<u64>,
    /// Bytes in use in them at the end of the update (parameters, optimizer state,
    /// anything kept across updates).
    pub in_use_bytes: Option<u64>,
    /// Collectives that carried the device's values through host memory during the
    /// update (`burn_ort_dist::host_round_trips_so_far`).
    pub host_round_trips: Option<u64>,
}

/// Measures one update's [`DeviceWork`] on `device`: [`DeviceMeter::start`] before it,
/// [`DeviceMeter::finish`] after.
pub struct DeviceMeter {
    device: Device,
    launches_before: Option<LaunchCounts>,
    round_trips_before: u64,
}

impl DeviceMeter {
    /// Start measuring an update on `device`.
    pub fn start(device: &Device) -> Self {
        DeviceMeter {
            device: device.clone(),
            launches_before: launches_so_far(device),
            round_trips_before: burn_ort_dist::host_round_trips_so_far(),
        }
    }

    /// The update's launches, its collectives' host round trips and the device's memory
    /// now.
    pub fn finish(self) -> DeviceWork {
        let launches = launches_so_far(&self.device)
            .zip(self.launches_before)
            .map(|(now, before)| now.since(&before));
        let on_device = launches.is_some();
        let usage = on_device.then(|| self.device.memory_pool_usage()).flatten();
        DeviceWork {
            launches,
            reserved_bytes: usage.as_ref().map(|u| u.bytes_reserved),
            in_use_bytes: usage.as_ref().map(|u| u.bytes_in_use),
            host_round_trips: on_device
                .then(|| burn_ort_dist::host_round_trips_so_far() - self.round_trips_before),
        }
    }
}

/// One kernel's launches per update.
#[derive(Debug, Clone, Serialize)]
pub struct KernelLaunches {
    /// The kernel (cubecl's name for it, without module paths).
    pub kernel: String,
    /// Mean launches per measured update.
    pub per_update: f64,
}

/// The throughput report written to `perf.json`.
#[derive(Debug, Clone, Serialize)]
pub struct PerfReport {
    /// `tokens` or `images`.
    pub unit: String,
    /// Items per second over the measured updates (all ranks together).
    pub throughput_per_sec: f64,
    /// Mean wall time per optimizer update, in milliseconds.
    pub avg_update_ms: f64,
    /// Of which the update strategy: gradient synchronisation across ranks (what backward
    /// did not average already), clipping and the optimizer step, in milliseconds.
    pub avg_sync_and_update_ms: f64,
    /// With `parallel.overlap`: time per update the communication thread spent averaging
    /// gradients during backward, in milliseconds (0 otherwise).
    pub avg_overlapped_sync_ms: f64,
    /// Of it, the time the update waited for it after backward ended: the part not
    /// hidden behind backward, in milliseconds.
    pub avg_exposed_sync_ms: f64,
    /// ZeRO-3 with `parallel.zero3_prefetch`: time per update the communication thread
    /// spent gathering parameters ahead of the passes, in milliseconds (0 otherwise).
    pub avg_prefetch_gather_ms: f64,
    /// Of it, the time the passes waited for a gather: the part not hidden behind the
    /// computation, in milliseconds.
    pub avg_prefetch_exposed_ms: f64,
    /// `1 - exposed / gather`: the fraction of the parameter gathers hidden behind the
    /// computation (absent without prefetched gathers).
    pub prefetch_hidden_fraction: Option<f64>,
    /// Updates measured (the last half).
    pub updates_measured: usize,
    /// Updates in the run.
    pub updates_total: usize,
    /// Micro-batch size per rank.
    pub batch_size: usize,
    /// Sequence length (token data).
    pub seq_len: usize,
    /// Gradient accumulation steps.
    pub gradient_accumulation_steps: usize,
    /// Ranks.
    pub world_size: usize,
    /// Threads of the compute pool (rayon) this rank ran on. Thread ranks (`--dp N` without
    /// mpirun) share one pool of this size; MPI ranks each have their own.
    pub threads: usize,
    /// ZeRO stage.
    pub zero_stage: usize,
    /// Pipeline ranks of a replica (`pipeline_parallel_size`).
    pub pipeline_stages: usize,
    /// Model chunks per pipeline rank (`pipeline_virtual_stages`).
    pub pipeline_virtual_stages: usize,
    /// Pipeline micro-batches per batch.
    pub pipeline_micro_batches: usize,
    /// Per rank, the fraction of the measured update time it spent blocked waiting for
    /// another pipeline stage (the bubble plus imbalance; 0 without a pipeline).
    pub pipeline_idle_fraction: Vec<f64>,
    /// Memory per rank, in rank order.
    #[serde(flatten)]
    pub memory: MemoryReport,
    /// On a GPU: the kernels this process launched per measured update (all its thread
    /// ranks together; collectives outside CubeCL, such as NCCL's, are not counted).
    pub kernel_launches_per_update: Option<f64>,
    /// The same by kernel, most launched first.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub kernel_launches_by_kernel: Vec<KernelLaunches>,
    /// On a GPU: the most bytes the device's memory pools reserved at the end of an
    /// update (what the device holds for this process, like PyTorch's
    /// `max_memory_reserved` sampled between updates).
    pub device_memory_reserved_bytes: Option<u64>,
    /// On a GPU: the most bytes in use at the end of an update (what the run keeps
    /// across updates: parameters, optimizer state, gradients held).
    pub device_memory_in_use_bytes: Option<u64>,
    /// On a GPU: collectives per measured update that carried the device's values through
    /// host memory (all this process's thread ranks together; 0 where every collective
    /// stays on the device, as NCCL's groups keep them).
    pub collective_host_round_trips_per_update: Option<f64>,
    /// Updates replayed from a recorded one (`train.cuda_graph`; 0 without it).
    pub replayed_updates: usize,
}

/// Bytes each rank holds, one value per rank in rank order.
#[derive(Debug, Clone, Default, Serialize)]
pub struct MemoryReport {
    /// Optimizer state (moments, velocities; Burn's record size when replicated).
    pub optimizer_state_bytes: Vec<u64>,
    /// Gradients held through the update.
    pub gradient_bytes: Vec<u64>,
    /// Parameters.
    pub parameter_bytes: Vec<u64>,
    /// Peak resident set of the rank's process (`VmHWM`; thread ranks share one process).
    pub peak_rss_bytes: Vec<u64>,
}

impl MemoryReport {
    /// Collect every rank's figures (a collective).
    pub fn gather(m: MemoryUse, comm: &dyn Communicator) -> Result<Self> {
        let mine = [
            m.optimizer_state_bytes as u64,
            m.gradient_bytes as u64,
            m.parameter_bytes as u64,
            peak_rss_bytes(),
        ];
        // Each value as two 24-bit halves, exact in f32 (values below 2^48).
        let send: Vec<f32> = mine
            .iter()
            .flat_map(|v| [(v >> 24) as f32, (v & 0xff_ffff) as f32])
            .collect();
        let mut all = vec![0.0f32; send.len() * comm.world_size()];
        comm.all_gather(&send, &mut all)?;
        let value = |rank: usize, k: usize| {
            ((all[rank * 8 + 2 * k] as u64) << 24) | all[rank * 8 + 2 * k + 1] as u64
        };
        let column = |k: usize| (0..comm.world_size()).map(|r| value(r, k)).collect();
        Ok(MemoryReport {
            optimizer_state_bytes: column(0),
            gradient_bytes: column(1),
            parameter_bytes: column(2),
            peak_rss_bytes: column(3),
        })
    }
}

/// This process's peak resident set size (Linux `VmHWM`; 0 where unavailable).
pub fn peak_rss_bytes() -> u64 {
    proc_status_bytes("VmHWM:").unwrap_or(0)
}

/// A figure of this process's `/proc/self/status` given in kB (`VmRSS:`, `VmHWM:`), in
/// bytes; `None` where unavailable.
pub fn proc_status_bytes(field: &str) -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let kb = status
        .lines()
        .find_map(|l| l.strip_prefix(field))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse::<u64>()
        .ok()?;
    Some(kb * 1024)
}

impl PerfMeter {
    /// A meter counting `unit`.
    pub fn new(unit: &'static str) -> Self {
        PerfMeter {
            unit,
            steps: Vec::new(),
            sync: Vec::new(),
            waited: Vec::new(),
            overlapped: Vec::new(),
            prefetched: Vec::new(),
            device: Vec::new(),
            replayed: 0,
        }
    }

    /// Record one update of `items` items that took `elapsed`, `sync` of it in the update
    /// strategy, `waited` blocked on other pipeline stages, the gradient averaging
    /// `overlapped` with backward, the ZeRO-3 gathers `prefetched` ahead of the passes, and
    /// what it asked of the `device`.
    pub fn record(
        &mut self,
        items: usize,
        elapsed: Duration,
        sync: Duration,
        waited: Duration,
        [overlapped, prefetched]: [SyncTimes; 2],
        device: DeviceWork,
    ) {
        self.steps.push((items, elapsed));
        self.sync.push(sync);
        self.waited.push(waited);
        self.overlapped.push(overlapped);
        self.prefetched.push(prefetched);
        self.device.push(device);
    }

    /// Every rank's idle fraction over its measured updates (a collective over `comm`).
    pub fn gather_idle(&self, comm: &dyn Communicator) -> Result<Vec<f64>> {
        let half = self.steps.len() / 2;
        let busy: f64 = self.steps[half..].iter().map(|s| s.1.as_secs_f64()).sum();
        let waited: f64 = self.waited[half..].iter().map(Duration::as_secs_f64).sum();
        let mine = [if busy > 0.0 {
            (waited / busy) as f32
        } else {
            0.0
        }];
        let mut all = vec![0.0f32; comm.world_size()];
        comm.all_gather(&mine, &mut all)?;
        Ok(all.into_iter().map(f64::from).collect())
    }

    fn rate(steps: &[(usize, Duration)]) -> f64 {
        let items: usize = steps.iter().map(|s| s.0).sum();
        let secs: f64 = steps.iter().map(|s| s.1.as_secs_f64()).sum();
        if secs > 0.0 { items as f64 / secs } else { 0.0 }
    }

    /// Rate over the last 10 updates (for the progress bar).
    pub fn recent_rate(&self) -> f64 {
        Self::rate(&self.steps[self.steps.len().saturating_sub(10)..])
    }

    /// The report over the last half of the updates.
    pub fn report(
        &self,
        c: &TrainingConfig,
        world_size: usize,
        memory: MemoryReport,
        idle: Vec<f64>,
    ) -> PerfReport {
        let half = self.steps.len() / 2;
        let measured = &self.steps[half..];
        let sync = &self.sync[half..];
        let mean_ms = |d: &mut dyn Iterator<Item = Duration>| {
            d.map(|d| d.as_secs_f64()).sum::<f64>() * 1000.0 / measured.len().max(1) as f64
        };
        let overlapped = &self.overlapped[half..];
        let prefetched = &self.prefetched[half..];
        let device = &self.device[half..];
        let launches = device
            .iter()
            .map(|d| d.launches.as_ref())
            .try_fold(None::<LaunchCounts>, |sum, l| {
                let mut sum = sum.unwrap_or_default();
                sum.add(l?);
                Some(Some(sum))
            })
            .flatten();
        let gather: f64 = prefetched.iter().map(|p| p.busy.as_secs_f64()).sum();
        let exposed: f64 = prefetched.iter().map(|p| p.exposed.as_secs_f64()).sum();
        PerfReport {
            unit: self.unit.to_string(),
            throughput_per_sec: Self::rate(measured),
            avg_update_ms: mean_ms(&mut measured.iter().map(|s| s.1)),
            avg_sync_and_update_ms: mean_ms(&mut sync.iter().copied()),
            avg_overlapped_sync_ms: mean_ms(&mut overlapped.iter().map(|o| o.busy)),
            avg_exposed_sync_ms: mean_ms(&mut overlapped.iter().map(|o| o.exposed)),
            avg_prefetch_gather_ms: mean_ms(&mut prefetched.iter().map(|o| o.busy)),
            avg_prefetch_exposed_ms: mean_ms(&mut prefetched.iter().map(|o| o.exposed)),
            prefetch_hidden_fraction: (gather > 0.0).then(|| (1.0 - exposed / gather).max(0.0)),
            updates_measured: measured.len(),
            updates_total: self.steps.len(),
            batch_size: c.data.batch_size,
            seq_len: c.data.seq_len,
            gradient_accumulation_steps: c.train.gradient_accumulation_steps,
            world_size,
            threads: rayon::current_num_threads(),
            zero_stage: c.parallel.zero_stage,
            pipeline_stages: c.parallel.pipeline_parallel_size,
            pipeline_virtual_stages: c.parallel.pipeline_virtual_stages,
            pipeline_micro_batches: c.micro_batches(),
            pipeline_idle_fraction: idle,
            memory,
            kernel_launches_per_update: launches
                .as_ref()
                .map(|l| l.total as f64 / measured.len().max(1) as f64),
            kernel_launches_by_kernel: launches
                .map(|l| by_kernel(l, measured.len()))
                .unwrap_or_default(),
            device_memory_reserved_bytes: device.iter().filter_map(|d| d.reserved_bytes).max(),
            device_memory_in_use_bytes: device.iter().filter_map(|d| d.in_use_bytes).max(),
            collective_host_round_trips_per_update: device
                .iter()
                .map(|d| d.host_round_trips)
                .sum::<Option<u64>>()
                .filter(|_| !device.is_empty())
                .map(|n| n as f64 / measured.len().max(1) as f64),
            replayed_updates: self.replayed,
        }
    }
}

/// The launches of `updates` updates by kernel, per update, most launched first (kernels
/// whose short names agree counted together).
fn by_kernel(launches: LaunchCounts, updates: usize) -> Vec<KernelLaunches> {
    let mut named = std::collections::BTreeMap::<String, u64>::new();
    for (name, n) in launches.by_kernel {
        *named.entry(short_kernel_name(name)).or_default() += n;
    }
    let mut rows: Vec<KernelLaunches> = named
        .into_iter()
        .map(|(kernel, n)| KernelLaunches {
            kernel,
            per_update: n as f64 / updates.max(1) as f64,
        })
        .collect();
    rows.sort_by(|a, b| b.per_update.total_cmp(&a.per_update));
    rows
}

impl PerfReport {
    /// Write as pretty JSON.
    pub fn write(&self, path: &Path) -> Result<()> {
        let json =
            serde_json::to_vec_pretty(self).map_err(|e| OnnxError::field("perf", e.to_string()))?;
        write_atomic(path, &json)
    }
}
