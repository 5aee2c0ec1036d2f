//! Thread ranks whose collectives run on their GPUs: the runtime's own, for ranks that are
//! threads of one process with a GPU each (`--dp 8 --device cuda` without mpirun), where
//! the thread communicator would carry every tensor through host memory.
//!
//! cubecl-cuda runs NCCL itself (`ComputeClient::all_reduce`, Burn's `DistributedOps`):
//! one communicator per device of a group, made from a unique id shared inside the
//! process, and a communication stream of its own. The ordering is the runtime's, with
//! events, not device syncs: the all-reduce waits on an event recorded on the compute
//! stream after the kernels that wrote the bucket, and the compute stream waits on the
//! communication stream before any kernel reads the result (`CollectiveTensor::resolve`).
//! So backward's kernels queue on while a bucket is averaged, and no host thread waits for
//! either. This answers the stream question of issue 49 for thread ranks. MPI ranks cannot
//! use it: cubecl mints the NCCL id inside the process and never hands it out, and an id
//! has to travel between processes; they keep [`super::nccl_comm::NcclCommunicator`].
//!
//! The group's [`Communicator::device_collectives`] take device tensors: the data-parallel
//! gradient buckets, and the collectives inside the model's passes (tensor parallelism's
//! all-reduces, ZeRO-3's parameter gathers and gradient scatters). The runtime only
//! all-reduces, so its gathers and scatters are all-reduces ([`DeviceCollectives`]'
//! provided methods; ZeRO's update on the device takes them too). Point-to-point messages
//! (pipeline sends) are the thread communicator's: the tensor handed over and copied to
//! the receiver's GPU. Collectives on host buffers go to the thread communicator it
//! wraps.

use std::sync::Arc;

use burn::backend::distributed::{DistributedOps, ReduceOperation};
use burn::backend::{BackendTensor, DeviceId, DispatchDevice, DispatchTensor, DispatchTensorKind};
use burn::tensor::{Device, Tensor};
use burn_cubecl::CubeBackend;

use crate::comm::communicator::{
    Communicator, DeviceCollectives, DeviceSends, Forwarding, ReduceOp,
};
use crate::error::{DistError, DistResult};

/// A group of thread ranks whose devices average gradient buckets among themselves.
pub struct DeviceGroup {
    inner: Arc<dyn Communicator>,
    /// This rank's device (the sub-groups of a split are made over it).
    device: Device,
    reduce: RuntimeReduce,
}

/// The mean over the group's devices by the runtime's all-reduce.
struct RuntimeReduce {
    rank: usize,
    /// Every rank's device, in rank order.
    members: Vec<DeviceId>,
}

impl DeviceGroup {
    /// `comm` with its gradient buckets averaged on the devices, when every rank's `device`
    /// is a GPU whose runtime moves data between devices itself (CUDA with NCCL) and no
    /// two ranks share one; `comm` as it is otherwise (the host path). Collective: every
    /// rank of `comm` calls it.
    pub fn over(comm: Arc<dyn Communicator>, device: &Device) -> DistResult<Arc<dyn Communicator>> {
        let mine = match transport_device(device) {
            Some(id) => [1.0, f32::from(id.type_id), f32::from(id.index_id)],
            None => [0.0; 3],
        };
        let mut all = vec![0.0; 3 * comm.world_size()];
        comm.all_gather(&mine, &mut all)?;
        let members: Option<Vec<DeviceId>> = all
            .chunks(3)
            .map(|m| {
                (m[0] == 1.0).then(|| DeviceId {
                    type_id: m[1] as u16,
                    index_id: m[2] as u16,
                })
            })
            .collect();
        let distinct = |m: &[DeviceId]| (1..m.len()).all(|i| !m[..i].contains(&m[i]));
        match members {
            Some(members) if distinct(&members) => Ok(Arc::new(DeviceGroup {
                reduce: RuntimeReduce {
                    rank: comm.rank(),
                    members,
                },
                inner: comm,
                device: device.clone(),
            })),
            _ => Ok(comm),
        }
    }

    /// The devices of the group's ranks, in rank order.
    pub fn devices(&self) -> &[DeviceId] {
        &self.reduce.members
    }
}

/// The runtime's id of `device` when it runs CubeCL kernels on a runtime that moves data
/// between its devices itself.
fn transport_device(device: &Device) -> Option<DeviceId> {
    match device.clone().inner().as_dispatch() {
        DispatchDevice::Cube(cube) => cube.client().has_device_transport().then(|| cube.to_id()),
        _ => None,
    }
}

impl Forwarding for DeviceGroup {
    fn inner(&self) -> &dyn Communicator {
        self.inner.as_ref()
    }

    fn split(&self, color: usize, key: usize) -> DistResult<Box<dyn Communicator>> {
        let sub: Arc<dyn Communicator> = Arc::from(self.inner.split(color, key)?);
        let sub = DeviceGroup::over(sub, &self.device)?;
        Ok(Box::new(Shared(sub)))
    }

    fn device_collectives(&self) -> Option<&dyn DeviceCollectives> {
        Some(&self.reduce)
    }

    fn device_sends(&self) -> Option<&dyn DeviceSends> {
        self.inner.device_sends()
    }
}

/// A shared group handed out as a box (what [`Communicator::split`] returns).
struct Shared(Arc<dyn Communicator>);

impl Forwarding for Shared {
    fn inner(&self) -> &dyn Communicator {
        self.0.as_ref()
    }

    fn device_collectives(&self) -> Option<&dyn DeviceCollectives> {
        self.0.device_collectives()
    }

    fn device_sends(&self) -> Option<&dyn DeviceSends> {
        self.0.device_sends()
    }
}

impl DeviceCollectives for RuntimeReduce {
    fn works_on(&self, device: &Device) -> bool {
        transport_device(device).is_some_and(|id| self.members.get(self.rank) == Some(&id))
    }

    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.members.len()
    }

    fn all_reduce(&self, bucket: Tensor<1>, op: ReduceOp) -> DistResult<Tensor<1>> {
        let op = match op {
            ReduceOp::Sum => ReduceOperation::Sum,
            ReduceOp::Mean => ReduceOperation::Mean,
        };
        let DispatchTensor { kind, autodiff } = bucket.into_dispatch();
        let DispatchTensorKind::Cube(BackendTensor::Float(t)) = kind else {
            return Err(DistError::Invalid {
                rank: self.rank,
                message: "the devices' all-reduce takes tensors of a CubeCL device".into(),
            });
        };
        // Queued on the communication stream behind the kernels that wrote `t`; the
        // compute stream waits for it before the next kernel (no host wait either way).
        let reduced =
            <CubeBackend as DistributedOps<CubeBackend>>::all_reduce(t, op, self.members.clone())
                .resolve();
        Ok(Tensor::from_dispatch(DispatchTensor {
            kind: DispatchTensorKind::Cube(BackendTensor::Float(reduced)),
            autodiff,
        }))
    }
}
