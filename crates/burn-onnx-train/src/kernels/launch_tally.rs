//! Kernel launches counted as this process issues them, by kernel: cubecl's launch
//! observer, installed once for the life of the process on the first GPU run and read as
//! snapshots, so a run reports launches per update (`perf.json`) on any CubeCL device,
//! lavapipe included, without a profiler.

use std::collections::HashMap;

use burn::tensor::Device;

use super::runs_cubecl;

/// Every launch the process issued so far, by kernel name (cubecl's type name of the
/// kernel, generics included).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LaunchCounts {
    /// All launches.
    pub total: u64,
    /// Launches per kernel name.
    pub by_kernel: HashMap<&'static str, u64>,
}

impl LaunchCounts {
    /// The launches issued between `earlier` and `self`.
    pub fn since(&self, earlier: &LaunchCounts) -> LaunchCounts {
        let by_kernel = self
            .by_kernel
            .iter()
            .map(|(&name, &n)| (name, n - earlier.by_kernel.get(name).copied().unwrap_or(0)))
            .filter(|&(_, n)| n > 0)
            .collect();
        LaunchCounts {
            total: self.total - earlier.total,
            by_kernel,
        }
    }

    /// Count `other`'s launches in too.
    pub fn add(&mut self, other: &LaunchCounts) {
        self.total += other.total;
        for (&name, &n) in &other.by_kernel {
            *self.by_kernel.entry(name).or_default() += n;
        }
    }
}

/// The launches this process issued so far, when `device` runs CubeCL kernels (the first
/// call starts the count); `None` on the CPU.
pub fn launches_so_far(device: &Device) -> Option<LaunchCounts> {
    if !runs_cubecl(device) {
        return None;
    }
    #[cfg(any(feature = "wgpu", feature = "cuda"))]
    return Some(observed::launches_so_far());
    #[cfg(not(any(feature = "wgpu", feature = "cuda")))]
    None
}

/// `name` without its module paths (`matmul_kernel<f32, ...>`, not
/// `cubecl_matmul::...::matmul_kernel<...>`), as cubecl's profiling log prints it.
pub fn short_kernel_name(name: &str) -> String {
    #[cfg(any(feature = "wgpu", feature = "cuda"))]
    return cubecl::config::type_name_format(name, cubecl::config::TypeNameFormatLevel::Balanced);
    #[cfg(not(any(feature = "wgpu", feature = "cuda")))]
    name.to_string()
}

#[cfg(any(feature = "wgpu", feature = "cuda"))]
mod observed {
    use std::collections::HashMap;
    use std::sync::{Arc, Mutex, OnceLock};

    use cubecl::logging::{LaunchObservation, LaunchObserver};

    use super::LaunchCounts;

    /// The observer: a count per kernel name.
    #[derive(Default)]
    struct LaunchTally {
        by_kernel: Mutex<HashMap<&'static str, u64>>,
    }

    impl LaunchObserver for LaunchTally {
        fn launched(&self, kernel: &'static str) {
            let mut by_kernel = self.by_kernel.lock().unwrap_or_else(|e| e.into_inner());
            *by_kernel.entry(kernel).or_default() += 1;
        }
    }

    /// The process's tally; installed by the first call. cubecl has one observer slot per
    /// process, so the tally stays installed (its guard is never dropped) and every run of
    /// the process reads differences of it.
    fn tally() -> &'static LaunchTally {
        static TALLY: OnceLock<Arc<LaunchTally>> = OnceLock::new();
        TALLY.get_or_init(|| {
            let tally = Arc::new(LaunchTally::default());
            std::mem::forget(LaunchObservation::new(tally.clone()));
            tally
        })
    }

    /// Start counting (idempotent) and return the launches so far.
    pub fn launches_so_far() -> LaunchCounts {
        let tally = tally();
        let by_kernel = tally
            .by_kernel
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        LaunchCounts {
            total: by_kernel.values().sum(),
            by_kernel,
        }
    }
}
