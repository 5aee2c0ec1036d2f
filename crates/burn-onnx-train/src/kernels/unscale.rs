//! Loss-scale unscaling with the inf/NaN check in the same pass. On CubeCL devices each
//! gradient is read once by a kernel that writes `g * factor` and raises a flag on the
//! device when a value is not finite; the flag, shared by all the gradients of an update,
//! is read back once. Elsewhere: `mul_scalar` and `is_finite`, the reference.

use burn::tensor::{Device, Tensor};

/// Whether any gradient seen so far held inf or NaN: a device-side flag on CubeCL
/// devices, a host boolean otherwise.
pub struct NonFiniteFlag {
    #[cfg(any(feature = "wgpu", feature = "cuda"))]
    device_flag: Option<Tensor<1>>,
    host_flag: bool,
}

impl NonFiniteFlag {
    /// A lowered flag for gradients on `device`.
    pub fn new(device: &Device) -> Self {
        #[cfg(not(any(feature = "wgpu", feature = "cuda")))]
        let _ = device;
        NonFiniteFlag {
            #[cfg(any(feature = "wgpu", feature = "cuda"))]
            device_flag: super::runs_cubecl(device)
                .then(|| Tensor::zeros([1], &device.clone().inner())),
            host_flag: false,
        }
    }

    /// Whether a non-finite value was seen (one read-back on CubeCL devices; the error is
    /// the report of a device that could not compute the flag).
    pub fn raised(self) -> Result<bool, String> {
        #[cfg(any(feature = "wgpu", feature = "cuda"))]
        if let Some(flag) = self.device_flag {
            return Ok(burn_ort_dist::host_values(flag)?[0] != 0.0);
        }
        Ok(self.host_flag)
    }
}

/// `grad * factor`, raising `flag` if `grad` holds inf or NaN.
pub fn unscale_and_check<const D: usize>(
    grad: Tensor<D>,
    factor: f32,
    flag: &mut NonFiniteFlag,
) -> Tensor<D> {
    #[cfg(any(feature = "wgpu", feature = "cuda"))]
    if let Some(device_flag) = &flag.device_flag {
        return fused::unscale_into_flag(grad, factor, device_flag);
    }
    unscale_and_check_reference(grad, factor, &mut flag.host_flag)
}

/// The plain Burn composition of [`unscale_and_check`].
pub fn unscale_and_check_reference<const D: usize>(
    grad: Tensor<D>,
    factor: f32,
    non_finite: &mut bool,
) -> Tensor<D> {
    let g = if factor == 1.0 {
        grad
    } else {
        grad.mul_scalar(factor)
    };
    if !*non_finite && !g.clone().is_finite().all().into_scalar::<bool>() {
        *non_finite = true;
    }
    g
}

#[cfg(any(feature = "wgpu", feature = "cuda"))]
mod fused {
    use burn::backend::tensor::FloatTensor;
    use burn::backend::{Backend, Cube, backend_extension};
    use burn::tensor::Tensor;

    use crate::kernels::cube;

    /// The fused unscale as a backend extension (gradients carry no autodiff graph).
    #[backend_extension(Cube)]
    pub trait UnscaleOps: Backend {
        /// `grad * factor`; writes 1 into `flag` `[1]` when `grad` holds inf or NaN.
        fn unscale_into_flag(
            grad: FloatTensor<Self>,
            flag: FloatTensor<Self>,
            factor: f32,
        ) -> FloatTensor<Self>;
    }

    impl UnscaleOps for Cube {
        fn unscale_into_flag(
            grad: FloatTensor<Self>,
            flag: FloatTensor<Self>,
            factor: f32,
        ) -> FloatTensor<Self> {
            cube::unscale(grad, flag, factor)
        }
    }

    pub fn unscale_into_flag<const D: usize>(
        grad: Tensor<D>,
        factor: f32,
        flag: &Tensor<1>,
    ) -> Tensor<D> {
        let out = <burn::backend::Dispatch as UnscaleOps>::unscale_into_flag(
            grad.into_dispatch(),
            flag.clone().into_dispatch(),
            factor,
        );
        Tensor::from_dispatch(out)
    }
}
