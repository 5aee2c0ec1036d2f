//! A tensor's values read to the host as f32, with a device that failed on the way (an
//! allocation it could not make, a kernel that did not run) reported as an error instead
//! of Burn's panic, so the caller can end the run naming what it was reading.

use burn::tensor::Tensor;

/// The values of `t` as f32 on the host (any float dtype converted); the error is the
/// device's report.
pub fn host_values<const D: usize>(t: Tensor<D>) -> Result<Vec<f32>, String> {
    t.try_into_data()
        .map_err(|e| format!("the device could not produce it: {e:?}"))?
        .convert::<f32>()
        .try_into_vec::<f32>()
        .map_err(|e| format!("{e:?}"))
}
