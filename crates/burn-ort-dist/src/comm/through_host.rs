//! [`ThroughHost`]: a group's [`DeviceCollectives`] and [`DeviceSends`] carried through host
//! memory by its own host collectives and messages, counting the calls. It is what code written against device tensors
//! runs on where no device transport exists (the CPU, wgpu): the tests of that code check
//! its results and that it took the device path, without a GPU; NCCL and the CUDA runtime
//! are the real implementations.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use burn::tensor::{Device, Tensor, TensorData};

use crate::comm::communicator::{
    Communicator, DeviceCollectives, DeviceSends, Forwarding, ReduceOp,
};
use crate::error::{DistError, DistResult};
use crate::storage::host_values::collective_host_values;

/// A group whose device collectives go through its host ones.
pub struct ThroughHost {
    inner: Arc<dyn Communicator>,
    /// Device collectives and messages served, by this group and the groups split from it.
    calls: Arc<AtomicUsize>,
}

impl ThroughHost {
    /// `inner` with device collectives through the host.
    pub fn over(inner: Arc<dyn Communicator>) -> Self {
        ThroughHost {
            inner,
            calls: Arc::new(AtomicUsize::new(0)),
        }
    }

    /// Device collectives and messages served so far, by this group and every group split
    /// from it.
    pub fn calls(&self) -> usize {
        self.calls.load(Ordering::Relaxed)
    }

    /// `t`'s values on the host, one call counted.
    fn values(&self, t: Tensor<1>) -> DistResult<Vec<f32>> {
        self.calls.fetch_add(1, Ordering::Relaxed);
        collective_host_values(t).map_err(|message| DistError::Invalid {
            rank: self.inner.rank(),
            message,
        })
    }
}

fn upload(values: Vec<f32>, device: &Device) -> Tensor<1> {
    let n = values.len();
    Tensor::from_data(TensorData::new(values, [n]), device)
}

impl DeviceCollectives for ThroughHost {
    fn works_on(&self, _device: &Device) -> bool {
        true
    }

    fn rank(&self) -> usize {
        self.inner.rank()
    }

    fn world_size(&self) -> usize {
        self.inner.world_size()
    }

    fn all_reduce(&self, t: Tensor<1>, op: ReduceOp) -> DistResult<Tensor<1>> {
        let device = t.device();
        let mut values = self.values(t)?;
        self.inner.all_reduce(&mut values, op)?;
        Ok(upload(values, &device))
    }

    fn all_gather(&self, t: Tensor<1>) -> DistResult<Tensor<1>> {
        let device = t.device();
        let values = self.values(t)?;
        let mut all = vec![0.0; values.len() * self.inner.world_size()];
        self.inner.all_gather(&values, &mut all)?;
        Ok(upload(all, &device))
    }

    fn reduce_scatter(&self, t: Tensor<1>, op: ReduceOp) -> DistResult<Tensor<1>> {
        let device = t.device();
        let values = self.values(t)?;
        let mut mine = vec![0.0; values.len() / self.inner.world_size().max(1)];
        self.inner.reduce_scatter(&values, &mut mine, op)?;
        Ok(upload(mine, &device))
    }
}

impl DeviceSends for ThroughHost {
    fn works_on(&self, _device: &Device) -> bool {
        true
    }

    fn send(&self, t: Tensor<1>, dest: usize) -> DistResult<()> {
        let values = self.values(t)?;
        self.inner.send(&values, dest)
    }

    fn recv(&self, len: usize, src: usize, device: &Device) -> DistResult<Tensor<1>> {
        self.calls.fetch_add(1, Ordering::Relaxed);
        let mut values = vec![0.0; len];
        self.inner.recv(&mut values, src)?;
        Ok(upload(values, device))
    }
}

impl Forwarding for ThroughHost {
    fn inner(&self) -> &dyn Communicator {
        self.inner.as_ref()
    }

    fn split(&self, color: usize, key: usize) -> DistResult<Box<dyn Communicator>> {
        // The sub-group moves device tensors the same way, counted with this one.
        Ok(Box::new(ThroughHost {
            inner: Arc::from(self.inner.split(color, key)?),
            calls: self.calls.clone(),
        }))
    }

    fn device_collectives(&self) -> Option<&dyn DeviceCollectives> {
        Some(self)
    }

    fn device_sends(&self) -> Option<&dyn DeviceSends> {
        Some(self)
    }
}
