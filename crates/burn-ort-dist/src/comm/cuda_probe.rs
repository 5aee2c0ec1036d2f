//! Whether a CUDA GPU can be used here (feature `cuda`), asked before Burn's CUDA backend
//! first touches the driver: its runtime panics when `libcuda` is missing or the ordinal
//! does not exist, and a run should instead end with one line that says so.

use cudarc::driver::{CudaContext, result};

/// `Ok` when the CUDA driver library loads and GPU `index` exists; else why not.
pub fn check_cuda_device(index: usize) -> Result<(), String> {
    // SAFETY: this only tries to load the shared library.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err("no CUDA driver on this machine (libcuda.so could not be loaded)".into());
    }
    result::init().map_err(|e| format!("the CUDA driver did not start: {e:?}"))?;
    let count = CudaContext::device_count().map_err(|e| format!("counting CUDA GPUs: {e:?}"))?;
    if index >= count as usize {
        return Err(format!(
            "CUDA GPU {index} does not exist: this machine has {count}"
        ));
    }
    Ok(())
}
