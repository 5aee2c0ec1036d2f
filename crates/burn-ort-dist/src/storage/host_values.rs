//! A tensor's values read to the host as f32, with a device that failed on the way (an
//! allocation it could not make, a kernel that did not run) reported as an error instead
//! of Burn's panic, so the caller can end the run naming what it was reading.
//!
//! Reads that carry a GPU's values through host memory for a collective
//! ([`collective_host_values`], [`count_host_round_trip`]) are counted for the whole
//! process ([`host_round_trips_so_far`]): `perf.json` reports them per update, so a run
//! shows which of its collectives still leave the device (none, where the group moves
//! device tensors itself).

use std::sync::atomic::{AtomicU64, Ordering};

use burn::tensor::{Device, Tensor};

/// The values of `t` as f32 on the host (any float dtype converted); the error is the
/// device's report.
pub fn host_values<const D: usize>(t: Tensor<D>) -> Result<Vec<f32>, String> {
    t.try_into_data()
        .map_err(|e| format!("the device could not produce it: {e:?}"))?
        .convert::<f32>()
        .try_into_vec::<f32>()
        .map_err(|e| format!("{e:?}"))
}

/// [`host_values`] of a tensor a collective is about to carry through host memory: counted
/// as a host round trip when `t` is not on the CPU.
pub fn collective_host_values<const D: usize>(t: Tensor<D>) -> Result<Vec<f32>, String> {
    count_host_round_trip_from(&t.device());
    host_values(t)
}

static HOST_ROUND_TRIPS: AtomicU64 = AtomicU64::new(0);

/// Count one collective's values read from `device` to the host (nothing on the CPU).
pub fn count_host_round_trip_from(device: &Device) {
    let on_cpu = matches!(
        device.clone().inner().as_dispatch(),
        burn::backend::DispatchDevice::Flex(_)
    );
    if !on_cpu {
        count_host_round_trip();
    }
}

/// Count one collective's values read from a GPU to the host.
pub fn count_host_round_trip() {
    HOST_ROUND_TRIPS.fetch_add(1, Ordering::Relaxed);
}

/// The collectives' reads of device values to the host this process made so far (every
/// rank of the process together).
pub fn host_round_trips_so_far() -> u64 {
    HOST_ROUND_TRIPS.load(Ordering::Relaxed)
}
