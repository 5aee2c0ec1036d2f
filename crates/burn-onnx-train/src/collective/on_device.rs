//! The model's collectives on device tensors, where the group moves them itself
//! (`burn_ort_dist::DeviceCollectives`: NCCL on CUDA devices, through MPI's NCCL
//! communicator or the CUDA runtime's for thread ranks): no host round trip, no copy of
//! the values through host memory. An op asks [`on_device`] first and takes its host path
//! ([`super::HostCopy`]) when the group has no transport for the tensor's device.

use burn::backend::Cube;
use burn::backend::ops::FloatTensorOps;
use burn::backend::tensor::FloatTensor;
use burn::backend::{
    BackendTensor, DType, DispatchAutodiffContext, DispatchTensor, DispatchTensorKind, Shape,
    TensorMetadata,
};
use burn::tensor::Tensor;
use burn_ort_dist::{DeviceCollectives, DistResult};

use super::CollectiveGroup;

/// `x` moved by `collective` through `group`'s device collectives, the result of `shape`;
/// `Err(x)` when the group has none for `x`'s device, or `x` is not f32. A failed
/// collective panics (`what` names it), as on the host path.
pub(super) fn on_device(
    x: FloatTensor<Cube>,
    group: &CollectiveGroup,
    what: &str,
    collective: impl FnOnce(&dyn DeviceCollectives, Tensor<1>) -> DistResult<Tensor<1>>,
    shape: Vec<usize>,
) -> Result<FloatTensor<Cube>, FloatTensor<Cube>> {
    // The device collectives move f32 values (gradients, activations: the products write
    // f32 even under autocast).
    let Some(moves) = group
        .0
        .device_collectives()
        .filter(|_| x.dtype == DType::F32)
    else {
        return Err(x);
    };
    let n = x.shape().num_elements();
    let flat = Tensor::<1>::from_dispatch(DispatchTensor {
        kind: DispatchTensorKind::Cube(BackendTensor::Float(Cube::float_reshape(
            x,
            Shape::new([n]),
        ))),
        autodiff: DispatchAutodiffContext::Disabled,
    });
    if !moves.works_on(&flat.device()) {
        let DispatchTensorKind::Cube(BackendTensor::Float(x)) = flat.into_dispatch().kind else {
            unreachable!("made from a CubeCL float tensor above")
        };
        return Err(x);
    }
    let moved = collective(moves, flat).unwrap_or_else(|e| panic!("{what} failed: {e}"));
    let DispatchTensorKind::Cube(BackendTensor::Float(y)) = moved.into_dispatch().kind else {
        panic!("{what}: the group's device collective returned a tensor of another backend")
    };
    Ok(Cube::float_reshape(y, Shape::from(shape)))
}
