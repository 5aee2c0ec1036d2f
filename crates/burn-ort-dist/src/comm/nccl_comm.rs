//! NCCL communicator through cudarc (feature `cuda`): one GPU per rank, ranks from MPI
//! (ORT's `use_nccl`: NCCL carries the gradients, MPI only starts the group, splits it and
//! aborts it).
//!
//! cudarc loads `libcuda` and `libnccl` at run time (`dynamic-loading`), so this compiles
//! on machines without the CUDA toolkit; [`NcclCommunicator::init`] checks that both
//! libraries are present before touching them. Rank 0 creates the NCCL unique id and
//! broadcasts it over MPI, which is what makes the group span nodes. The [`Communicator`]
//! collectives copy the host buffer to the rank's GPU, run the NCCL collective on the
//! rank's stream, and copy the result back; tensors that live on the GPU (Burn's CUDA
//! backend: gradient buckets, the model's tensor-parallel and ZeRO-3 collectives) are
//! moved where they are ([`DeviceCollectives`]): NCCL reads and writes the CubeCL buffers
//! through their device addresses, after the kernels that wrote them finish.
//! Both sides retain the device's primary CUDA context, so the address is valid for both.
//! A group of one ([`NcclCommunicator::single`]) needs no MPI: its id never travels.
//! With the MPI group's `collective_timeout`, a rank waits for an NCCL operation by polling
//! an event recorded after it rather than blocking in the stream: past the limit the wait
//! is a timeout naming the operation, its bytes and the group (NCCL cannot say which ranks
//! never arrived), and the failing rank ends the job through MPI instead of hanging.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use burn::backend::{
    BackendTensor, DispatchAutodiffContext, DispatchDevice, DispatchTensor, DispatchTensorKind,
};
use burn::tensor::{Device, Tensor};
use burn_cubecl::tensor::CubeTensor;
use cubecl::cuda::CudaRuntime;
use cubecl_runtime::runtime::Runtime;
use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::{
    CudaContext, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DeviceSlice, SyncOnDrop,
};
use cudarc::nccl::result::{NcclError, NcclStatus};
use cudarc::nccl::{Comm, Id, ReduceOp as NcclOp};

use crate::comm::communicator::{
    Communicator, DeviceCollectives, DeviceSends, ReduceOp, check_reduce_scatter,
};
use crate::comm::mpi_comm::MpiCommunicator;
use crate::comm::stall::{OpInfo, Stall};
use crate::error::{DistError, DistResult};

/// One rank of an NCCL group.
pub struct NcclCommunicator {
    /// The MPI group this NCCL group was built over: sub-groups split from it. `None` for
    /// a group of one started without MPI.
    mpi: Option<MpiCommunicator>,
    device: usize,
    comm: Mutex<Comm>,
    stream: Arc<CudaStream>,
    rank: usize,
    size: usize,
}

// SAFETY: the NCCL communicator is only used while holding `comm`'s mutex, so calls are
// serialised; NCCL communicators may be used from any thread as long as calls on one
// communicator do not overlap, and cudarc binds the CUDA context to the calling thread
// before every copy.
unsafe impl Send for NcclCommunicator {}
// SAFETY: see above.
unsafe impl Sync for NcclCommunicator {}

impl NcclCommunicator {
    /// Build the NCCL group over the ranks of `mpi`; `device` is this rank's GPU ordinal
    /// (usually the node-local rank, `OMPI_COMM_WORLD_LOCAL_RANK`).
    pub fn init(mpi: MpiCommunicator, device: usize) -> DistResult<Self> {
        Self::build(Some(mpi), device)
    }

    /// A group of one on GPU `device`, without MPI: a single-GPU run, or a check that the
    /// NCCL library works on this machine (`tools/gpu/check.sh`).
    pub fn single(device: usize) -> DistResult<Self> {
        Self::build(None, device)
    }

    fn build(mpi: Option<MpiCommunicator>, device: usize) -> DistResult<Self> {
        let (rank, size) = mpi.as_ref().map_or((0, 1), |m| (m.rank(), m.world_size()));
        let fail = |m: String| DistError::Invalid { rank, message: m };
        crate::check_cuda_device(device).map_err(|why| fail(format!("cuda:{device}: {why}")))?;
        // SAFETY: this only tries to load the shared library.
        if !unsafe { cudarc::nccl::sys::is_culib_present() } {
            return Err(fail(
                "no NCCL on this machine (libnccl.so could not be loaded)".into(),
            ));
        }
        let ctx =
            CudaContext::new(device).map_err(|e| fail(format!("CUDA device {device}: {e:?}")))?;
        let stream = ctx.default_stream();
        let id = if rank == 0 {
            Id::new().map_err(|e| fail(format!("ncclGetUniqueId: {e:?}")))?
        } else {
            Id::uninit([0; 128])
        };
        // Bytes are exact in f32, so the id can travel through the f32 broadcast.
        let mut wire: Vec<f32> = id.internal().iter().map(|&c| c as u8 as f32).collect();
        if let Some(mpi) = &mpi {
            mpi.broadcast(&mut wire, 0)?;
        }
        let mut internal = [0 as std::ffi::c_char; 128];
        for (dst, src) in internal.iter_mut().zip(&wire) {
            *dst = *src as u8 as std::ffi::c_char;
        }
        let comm = Comm::from_rank(stream.clone(), rank, size, Id::uninit(internal))
            .map_err(|e| fail(format!("ncclCommInitRank: {e:?}")))?;
        Ok(NcclCommunicator {
            mpi,
            device,
            comm: Mutex::new(comm),
            stream,
            rank,
            size,
        })
    }

    fn err(&self, what: &str, e: impl std::fmt::Debug) -> DistError {
        DistError::Peer {
            rank: self.rank,
            message: format!("{what}: {e:?}"),
        }
    }

    /// One NCCL call on this group's communicator (calls are serialised), its error
    /// named `what`.
    fn nccl<T, E: std::fmt::Debug>(
        &self,
        what: &str,
        f: impl FnOnce(&Comm) -> Result<T, E>,
    ) -> DistResult<()> {
        let c = self
            .comm
            .lock()
            .map_err(|_| self.err("NCCL lock", "poisoned"))?;
        f(&c).map(|_| ()).map_err(|e| self.err(what, e))
    }

    /// A copy of `host` on this rank's GPU, on the group's stream.
    fn to_device(&self, host: &[f32]) -> DistResult<CudaSlice<f32>> {
        self.stream
            .clone_htod(host)
            .map_err(|e| self.err("host to device", e))
    }

    /// `dev` copied back into `host` once the stream's work (the collective `op`) is done.
    fn to_host(&self, op: &str, dev: &CudaSlice<f32>, host: &mut [f32]) -> DistResult<()> {
        // A copy to pageable memory blocks until the stream reaches it: wait first, with
        // the timeout.
        self.finish(op, 4 * host.len())?;
        self.stream
            .memcpy_dtoh(dev, host)
            .map_err(|e| self.err("device to host", e))?;
        self.stream
            .synchronize()
            .map_err(|e| self.err("synchronize", e))
    }

    /// Wait until the stream has done its work (the NCCL operation `op` of `bytes`): with
    /// the MPI group's timeout by polling an event (see the module doc), else blocking.
    fn finish(&self, op: &str, bytes: usize) -> DistResult<()> {
        let Some(mpi) = self.mpi.as_ref().filter(|m| m.timeout().is_some()) else {
            return self
                .stream
                .synchronize()
                .map_err(|e| self.err("synchronize", e));
        };
        let limit = mpi.timeout().unwrap_or_default();
        let done = self
            .stream
            .record_event(None)
            .map_err(|e| self.err("record an event", e))?;
        let started = Instant::now();
        let mut pause = Duration::from_micros(20);
        while !done.is_complete() {
            if started.elapsed() > limit {
                let op = format!("{op} (NCCL: which ranks never arrived is not known)");
                let stall = Stall {
                    info: OpInfo {
                        op: &op,
                        bytes,
                        group: mpi.world_ranks(),
                    },
                    waited: started.elapsed(),
                    absent: Vec::new(),
                    elsewhere: Vec::new(),
                };
                return Err(stall.into_error(mpi.world_ranks()[self.rank]));
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(1));
        }
        Ok(())
    }
}

fn nccl_op(op: ReduceOp) -> NcclOp {
    if op == ReduceOp::Mean {
        NcclOp::Avg
    } else {
        NcclOp::Sum
    }
}

impl Communicator for NcclCommunicator {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.size
    }

    fn all_reduce(&self, buf: &mut [f32], op: ReduceOp) -> DistResult<()> {
        let mut dev = self.to_device(buf)?;
        self.nccl("ncclAllReduce", |c| {
            c.all_reduce_in_place(&mut dev, &nccl_op(op))
        })?;
        self.to_host("ncclAllReduce", &dev, buf)
    }

    fn reduce_scatter(&self, send: &[f32], recv: &mut [f32], op: ReduceOp) -> DistResult<()> {
        check_reduce_scatter(self.rank, self.size, send.len(), recv.len())?;
        let src = self.to_device(send)?;
        let mut dst = self
            .stream
            .alloc_zeros::<f32>(recv.len())
            .map_err(|e| self.err("device alloc", e))?;
        self.nccl("ncclReduceScatter", |c| {
            c.reduce_scatter(&src, &mut dst, &nccl_op(op))
        })?;
        self.to_host("ncclReduceScatter", &dst, recv)
    }

    fn broadcast(&self, buf: &mut [f32], root: usize) -> DistResult<()> {
        let mut dev = self.to_device(buf)?;
        self.nccl("ncclBroadcast", |c| {
            c.broadcast_in_place(&mut dev, root as i32)
        })?;
        self.to_host("ncclBroadcast", &dev, buf)
    }

    fn all_gather(&self, send: &[f32], recv: &mut [f32]) -> DistResult<()> {
        if recv.len() != send.len() * self.size {
            return Err(DistError::Invalid {
                rank: self.rank,
                message: format!(
                    "all_gather receive buffer of {} for {} x {}",
                    recv.len(),
                    self.size,
                    send.len()
                ),
            });
        }
        let src = self.to_device(send)?;
        let mut dst = self.to_device(recv)?;
        self.nccl("ncclAllGather", |c| c.all_gather(&src, &mut dst))?;
        self.to_host("ncclAllGather", &dst, recv)
    }

    fn barrier(&self) -> DistResult<()> {
        let mut one = [0.0f32];
        Communicator::all_reduce(self, &mut one, ReduceOp::Sum)
    }

    fn send(&self, buf: &[f32], dest: usize) -> DistResult<()> {
        let dev = self.to_device(buf)?;
        self.nccl("ncclSend", |c| c.send(&dev, dest as i32))?;
        self.finish(&format!("ncclSend to rank {dest}"), 4 * buf.len())
    }

    fn recv(&self, buf: &mut [f32], src: usize) -> DistResult<()> {
        let mut dev = self.to_device(buf)?;
        self.nccl("ncclRecv", |c| c.recv(&mut dev, src as i32))?;
        self.to_host(&format!("ncclRecv from rank {src}"), &dev, buf)
    }

    fn split(&self, color: usize, key: usize) -> DistResult<Box<dyn Communicator>> {
        // cudarc 0.19 does not expose ncclCommSplit: split the MPI group and build a new
        // NCCL group over each colour (every rank of this group takes part, as in MPI).
        let mpi = match &self.mpi {
            Some(mpi) => Some(mpi.split_mpi(color, key)?),
            None => None,
        };
        Ok(Box::new(NcclCommunicator::build(mpi, self.device)?))
    }

    fn abort(&self, code: i32) {
        if let Some(mpi) = &self.mpi {
            mpi.abort(code);
        }
    }

    fn device_collectives(&self) -> Option<&dyn DeviceCollectives> {
        Some(self)
    }

    fn device_sends(&self) -> Option<&dyn DeviceSends> {
        Some(self)
    }
}

/// A buffer of Burn's CUDA backend, as cudarc's NCCL calls take it.
struct Borrowed {
    ptr: CUdeviceptr,
    len: usize,
    stream: Arc<CudaStream>,
}

impl DeviceSlice<f32> for Borrowed {
    fn len(&self) -> usize {
        self.len
    }
    fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }
}

impl DevicePtr<f32> for Borrowed {
    fn device_ptr<'a>(&'a self, _stream: &'a CudaStream) -> (CUdeviceptr, SyncOnDrop<'a>) {
        // See `device_ptr_mut`.
        (self.ptr, SyncOnDrop::Sync(None))
    }
}

impl DevicePtrMut<f32> for Borrowed {
    fn device_ptr_mut<'a>(&'a mut self, _stream: &'a CudaStream) -> (CUdeviceptr, SyncOnDrop<'a>) {
        // The caller finished every write before (a device sync) and synchronises NCCL's
        // stream after, so there is no event to record.
        (self.ptr, SyncOnDrop::Sync(None))
    }
}

impl NcclCommunicator {
    /// `t`'s CubeCL tensor, contiguous, with whether it was tracked by autodiff and its
    /// device.
    fn cube_tensor(
        &self,
        t: Tensor<1>,
    ) -> DistResult<(CubeTensor, DispatchAutodiffContext, Device)> {
        let device = t.device();
        let DispatchTensor { kind, autodiff } = t.into_dispatch();
        let DispatchTensorKind::Cube(BackendTensor::Float(t)) = kind else {
            return Err(DistError::Invalid {
                rank: self.rank,
                message: "NCCL moves tensors of Burn's CUDA backend only".into(),
            });
        };
        if t.dtype != burn::backend::DType::F32 {
            return Err(DistError::Invalid {
                rank: self.rank,
                message: format!("NCCL moves f32 tensors here, not {:?}", t.dtype),
            });
        }
        Ok((burn_cubecl::kernel::into_contiguous(t), autodiff, device))
    }

    /// An uninitialised f32 tensor of `len` values beside `like`, NCCL's output.
    fn empty_like(like: &CubeTensor, len: usize) -> CubeTensor {
        burn_cubecl::ops::numeric::empty_device_contiguous_dtype(
            like.client.clone(),
            like.device.clone(),
            burn::backend::Shape::new([len]),
            burn::backend::DType::F32,
        )
    }

    /// `f` given `t`'s buffer as NCCL reads and writes it, once the kernels that wrote
    /// it are done (NCCL runs on its own stream).
    fn with_buffer<R>(
        &self,
        t: &CubeTensor,
        f: impl FnOnce(Borrowed) -> DistResult<R>,
    ) -> DistResult<R> {
        let len = burn::backend::TensorMetadata::shape(t).num_elements();
        let resource = t
            .client
            .get_resource::<<CudaRuntime as Runtime>::Server>(t.handle.clone())
            .map_err(|e| self.err("a tensor's device address", e))?;
        let out = f(Borrowed {
            ptr: resource.resource().ptr,
            len,
            stream: self.stream.clone(),
        });
        drop(resource);
        out
    }

    /// One NCCL collective `what` from `src` into `dst` (the same tensor: in place), on
    /// this group's stream after the device's kernels, waited for with the timeout.
    fn device_collective(
        &self,
        what: &str,
        device: &Device,
        (src, dst): (&CubeTensor, &CubeTensor),
        call: impl FnOnce(&Comm, &Borrowed, &mut Borrowed) -> Result<NcclStatus, NcclError>,
    ) -> DistResult<()> {
        device
            .sync()
            .map_err(|e| self.err("finishing the kernels before a collective", e))?;
        self.with_buffer(src, |send| {
            self.with_buffer(dst, |mut recv| {
                self.nccl(what, |c| call(c, &send, &mut recv))?;
                self.finish(what, 4 * recv.len)
            })
        })
    }

    fn back(t: CubeTensor, autodiff: DispatchAutodiffContext) -> Tensor<1> {
        Tensor::from_dispatch(DispatchTensor {
            kind: DispatchTensorKind::Cube(BackendTensor::Float(t)),
            autodiff,
        })
    }
}

impl DeviceCollectives for NcclCommunicator {
    fn works_on(&self, device: &Device) -> bool {
        matches!(
            device.clone().inner().as_dispatch(),
            DispatchDevice::Cube(_)
        )
    }

    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.size
    }

    fn all_reduce(&self, t: Tensor<1>, op: ReduceOp) -> DistResult<Tensor<1>> {
        let (t, autodiff, device) = self.cube_tensor(t)?;
        // In place: into a buffer no other tensor shares.
        let t = if t.can_mut() { t } else { t.copy() };
        let on = "ncclAllReduce on the device";
        self.device_collective(on, &device, (&t, &t), |c, _, buf| {
            c.all_reduce_in_place(buf, &nccl_op(op))
        })?;
        Ok(Self::back(t, autodiff))
    }

    fn all_gather(&self, t: Tensor<1>) -> DistResult<Tensor<1>> {
        let (t, autodiff, device) = self.cube_tensor(t)?;
        let n = burn::backend::TensorMetadata::shape(&t).num_elements();
        let all = Self::empty_like(&t, n * self.size);
        let on = "ncclAllGather on the device";
        self.device_collective(on, &device, (&t, &all), |c, src, dst| {
            c.all_gather(src, dst)
        })?;
        Ok(Self::back(all, autodiff))
    }

    fn reduce_scatter(&self, t: Tensor<1>, op: ReduceOp) -> DistResult<Tensor<1>> {
        let (t, autodiff, device) = self.cube_tensor(t)?;
        let n = burn::backend::TensorMetadata::shape(&t).num_elements();
        check_reduce_scatter(self.rank, self.size, n, n / self.size)?;
        let mine = Self::empty_like(&t, n / self.size);
        let on = "ncclReduceScatter on the device";
        self.device_collective(on, &device, (&t, &mine), |c, src, dst| {
            c.reduce_scatter(src, dst, &nccl_op(op))
        })?;
        Ok(Self::back(mine, autodiff))
    }
}

impl DeviceSends for NcclCommunicator {
    fn works_on(&self, device: &Device) -> bool {
        DeviceCollectives::works_on(self, device)
    }

    fn send(&self, t: Tensor<1>, dest: usize) -> DistResult<()> {
        let (t, _, device) = self.cube_tensor(t)?;
        let on = format!("ncclSend to rank {dest} on the device");
        self.device_collective(&on, &device, (&t, &t), |c, src, _| {
            c.send(src, dest as i32).map(|()| NcclStatus::Success)
        })
    }

    fn recv(&self, len: usize, src: usize, device: &Device) -> DistResult<Tensor<1>> {
        // A fresh buffer no other tensor shares, which NCCL fills.
        let (t, autodiff, device) = self.cube_tensor(Tensor::<1>::empty([len], device))?;
        let on = format!("ncclRecv from rank {src} on the device");
        self.device_collective(&on, &device, (&t, &t), |c, _, dst| c.recv(dst, src as i32))?;
        Ok(Self::back(t, autodiff))
    }
}
