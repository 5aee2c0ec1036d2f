//! The [`Communicator`] trait: the collectives data-parallel training needs, on flat `f32`
//! buffers, plus the trivial single-process implementation and [`Forwarding`], for groups
//! that wrap another.

use crate::error::{DistError, DistResult};

/// Reduction of an all-reduce.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReduceOp {
    /// Element-wise sum.
    Sum,
    /// Element-wise mean over the ranks.
    Mean,
}

/// Collectives on flat f32 tensors that stay on the GPU (NCCL on CUDA devices): no host
/// copy on the way. Each rank passes its own tensor; the ranks of a group call the same
/// collectives in the same order, as with the host ones. A runtime whose devices only
/// all-reduce gets the gathers and scatters from its all-reduce (the provided methods).
pub trait DeviceCollectives: Send + Sync {
    /// Whether tensors on `device` can be moved here.
    fn works_on(&self, device: &burn::tensor::Device) -> bool;
    /// This rank in the group.
    fn rank(&self) -> usize;
    /// Ranks in the group.
    fn world_size(&self) -> usize;
    /// `t` reduced element-wise over the group by `op` (every rank's of the same length).
    fn all_reduce(
        &self,
        t: burn::tensor::Tensor<1>,
        op: ReduceOp,
    ) -> DistResult<burn::tensor::Tensor<1>>;
    /// Every rank's `t` (all of the same length) end to end, in rank order. Provided: one
    /// all-reduce of `t` at this rank's offset among zeros (the ranks' sum is each value
    /// exactly once, at the cost of `world` times a gather's traffic).
    fn all_gather(&self, t: burn::tensor::Tensor<1>) -> DistResult<burn::tensor::Tensor<1>> {
        let (rank, world, n) = (self.rank(), self.world_size(), t.dims()[0]);
        let device = t.device();
        let zeros = |len: usize| burn::tensor::Tensor::<1>::zeros([len], &device);
        let mut parts = Vec::with_capacity(3);
        if rank > 0 {
            parts.push(zeros(rank * n));
        }
        parts.push(t);
        if rank + 1 < world {
            parts.push(zeros((world - rank - 1) * n));
        }
        self.all_reduce(burn::tensor::Tensor::cat(parts, 0), ReduceOp::Sum)
    }
    /// Chunk `rank` of `t` reduced over the group by `op` (`t`'s length a multiple of the
    /// group's size): ZeRO's gradient sharding. Provided: the whole all-reduce, sliced.
    fn reduce_scatter(
        &self,
        t: burn::tensor::Tensor<1>,
        op: ReduceOp,
    ) -> DistResult<burn::tensor::Tensor<1>> {
        let (rank, world, n) = (self.rank(), self.world_size(), t.dims()[0]);
        check_reduce_scatter(rank, world, n, n / world)?;
        let chunk = n / world;
        Ok(self
            .all_reduce(t, op)?
            .slice(rank * chunk..(rank + 1) * chunk))
    }
}

/// Point-to-point messages of flat f32 tensors that stay on the GPU (NCCL's send and
/// receive on CUDA devices): pipeline parallelism's activations and their gradients. Each
/// send is matched, in order, by the peer's receive of the same length.
pub trait DeviceSends: Send + Sync {
    /// Whether tensors on `device` can be sent here.
    fn works_on(&self, device: &burn::tensor::Device) -> bool;
    /// Send `t` to rank `dest` of the group.
    fn send(&self, t: burn::tensor::Tensor<1>, dest: usize) -> DistResult<()>;
    /// The `len` values rank `src` sends, on `device`.
    fn recv(
        &self,
        len: usize,
        src: usize,
        device: &burn::tensor::Device,
    ) -> DistResult<burn::tensor::Tensor<1>>;
}

/// Collective operations among the ranks of one group.
pub trait Communicator: Send + Sync {
    /// This process's rank in the group.
    fn rank(&self) -> usize;
    /// Number of ranks in the group.
    fn world_size(&self) -> usize;
    /// Reduce `buf` element-wise across ranks; every rank receives the result.
    fn all_reduce(&self, buf: &mut [f32], op: ReduceOp) -> DistResult<()>;
    /// Copy `buf` of rank `root` into `buf` of every rank.
    fn broadcast(&self, buf: &mut [f32], root: usize) -> DistResult<()>;
    /// Concatenate every rank's `send` (all the same length) into `recv`, in rank order.
    fn all_gather(&self, send: &[f32], recv: &mut [f32]) -> DistResult<()>;
    /// Reduce `send` across ranks and leave chunk `rank` of the result in `recv`
    /// (`send.len()` must be `recv.len() * world_size`): ZeRO-2's gradient sharding. Every
    /// rank ends with only its chunk, unlike an all-reduce.
    fn reduce_scatter(&self, send: &[f32], recv: &mut [f32], op: ReduceOp) -> DistResult<()>;
    /// Wait until every rank arrives.
    fn barrier(&self) -> DistResult<()>;
    /// Send `buf` to rank `dest` (pipeline stages pass activations this way).
    fn send(&self, buf: &[f32], dest: usize) -> DistResult<()>;
    /// Receive exactly `buf.len()` values sent by rank `src`.
    fn recv(&self, buf: &mut [f32], src: usize) -> DistResult<()>;
    /// Collective: split into sub-groups (`MPI_Comm_split`). Ranks passing the same `color`
    /// form a group, ranked by `(key, old rank)`; this is how data-, tensor- and
    /// pipeline-parallel groups are carved out of the world.
    fn split(&self, color: usize, key: usize) -> DistResult<Box<dyn Communicator>>;
    /// This rank failed: end the group so no peer waits for it (MPI: `MPI_Abort`, which
    /// terminates every rank with `code`; threads: peers fail at their next collective).
    fn abort(&self, code: i32) {
        let _ = code;
    }
    /// The group's collectives on device tensors, when it has them (NCCL).
    fn device_collectives(&self) -> Option<&dyn DeviceCollectives> {
        None
    }
    /// The group's point-to-point messages of device tensors, when it has them (NCCL).
    fn device_sends(&self) -> Option<&dyn DeviceSends> {
        None
    }
}

/// A group that wraps another and changes some of its collectives (counts them, carries
/// them in f16, serves gathers prefetched ahead): implement [`Forwarding::inner`] and the
/// methods that differ; every other one goes to the wrapped group, and the wrapper is a
/// [`Communicator`]. A wrapper moves device tensors through the host
/// ([`Forwarding::device_collectives`] is `None`) unless it says otherwise.
pub trait Forwarding: Send + Sync {
    /// The wrapped group.
    fn inner(&self) -> &dyn Communicator;
    /// See [`Communicator::rank`].
    fn rank(&self) -> usize {
        self.inner().rank()
    }
    /// See [`Communicator::world_size`].
    fn world_size(&self) -> usize {
        self.inner().world_size()
    }
    /// See [`Communicator::all_reduce`].
    fn all_reduce(&self, buf: &mut [f32], op: ReduceOp) -> DistResult<()> {
        self.inner().all_reduce(buf, op)
    }
    /// See [`Communicator::broadcast`].
    fn broadcast(&self, buf: &mut [f32], root: usize) -> DistResult<()> {
        self.inner().broadcast(buf, root)
    }
    /// See [`Communicator::all_gather`].
    fn all_gather(&self, send: &[f32], recv: &mut [f32]) -> DistResult<()> {
        self.inner().all_gather(send, recv)
    }
    /// See [`Communicator::reduce_scatter`].
    fn reduce_scatter(&self, send: &[f32], recv: &mut [f32], op: ReduceOp) -> DistResult<()> {
        self.inner().reduce_scatter(send, recv, op)
    }
    /// See [`Communicator::barrier`].
    fn barrier(&self) -> DistResult<()> {
        self.inner().barrier()
    }
    /// See [`Communicator::send`].
    fn send(&self, buf: &[f32], dest: usize) -> DistResult<()> {
        self.inner().send(buf, dest)
    }
    /// See [`Communicator::recv`].
    fn recv(&self, buf: &mut [f32], src: usize) -> DistResult<()> {
        self.inner().recv(buf, src)
    }
    /// See [`Communicator::split`].
    fn split(&self, color: usize, key: usize) -> DistResult<Box<dyn Communicator>> {
        self.inner().split(color, key)
    }
    /// See [`Communicator::abort`].
    fn abort(&self, code: i32) {
        self.inner().abort(code)
    }
    /// See [`Communicator::device_collectives`].
    fn device_collectives(&self) -> Option<&dyn DeviceCollectives> {
        None
    }
    /// See [`Communicator::device_sends`].
    fn device_sends(&self) -> Option<&dyn DeviceSends> {
        None
    }
}

impl<T: Forwarding> Communicator for T {
    fn rank(&self) -> usize {
        Forwarding::rank(self)
    }
    fn world_size(&self) -> usize {
        Forwarding::world_size(self)
    }
    fn all_reduce(&self, buf: &mut [f32], op: ReduceOp) -> DistResult<()> {
        Forwarding::all_reduce(self, buf, op)
    }
    fn broadcast(&self, buf: &mut [f32], root: usize) -> DistResult<()> {
        Forwarding::broadcast(self, buf, root)
    }
    fn all_gather(&self, send: &[f32], recv: &mut [f32]) -> DistResult<()> {
        Forwarding::all_gather(self, send, recv)
    }
    fn reduce_scatter(&self, send: &[f32], recv: &mut [f32], op: ReduceOp) -> DistResult<()> {
        Forwarding::reduce_scatter(self, send, recv, op)
    }
    fn barrier(&self) -> DistResult<()> {
        Forwarding::barrier(self)
    }
    fn send(&self, buf: &[f32], dest: usize) -> DistResult<()> {
        Forwarding::send(self, buf, dest)
    }
    fn recv(&self, buf: &mut [f32], src: usize) -> DistResult<()> {
        Forwarding::recv(self, buf, src)
    }
    fn split(&self, color: usize, key: usize) -> DistResult<Box<dyn Communicator>> {
        Forwarding::split(self, color, key)
    }
    fn abort(&self, code: i32) {
        Forwarding::abort(self, code)
    }
    fn device_collectives(&self) -> Option<&dyn DeviceCollectives> {
        Forwarding::device_collectives(self)
    }
    fn device_sends(&self) -> Option<&dyn DeviceSends> {
        Forwarding::device_sends(self)
    }
}

/// The error for a `reduce_scatter` whose buffers do not fit the group, if they do not.
pub fn check_reduce_scatter(rank: usize, world: usize, send: usize, recv: usize) -> DistResult<()> {
    if recv.checked_mul(world) == Some(send) {
        return Ok(());
    }
    Err(DistError::Invalid {
        rank,
        message: format!("reduce_scatter of {send} values into chunks of {recv} for {world} ranks"),
    })
}

/// Divide by the group size (the `Mean` of a sum), as every communicator does.
pub fn scale_mean(buf: &mut [f32], op: ReduceOp, world: usize) {
    if op == ReduceOp::Mean {
        let n = world as f32;
        buf.iter_mut().for_each(|x| *x /= n);
    }
}

/// The group of one process: every collective is the identity.
#[derive(Debug, Clone, Copy, Default)]
pub struct LocalCommunicator;

impl Communicator for LocalCommunicator {
    fn rank(&self) -> usize {
        0
    }

    fn world_size(&self) -> usize {
        1
    }

    fn all_reduce(&self, _buf: &mut [f32], _op: ReduceOp) -> DistResult<()> {
        Ok(())
    }

    fn broadcast(&self, _buf: &mut [f32], root: usize) -> DistResult<()> {
        if root != 0 {
            return Err(DistError::Invalid {
                rank: 0,
                message: format!("broadcast root {root} in a group of 1"),
            });
        }
        Ok(())
    }

    fn all_gather(&self, send: &[f32], recv: &mut [f32]) -> DistResult<()> {
        if recv.len() != send.len() {
            return Err(DistError::Invalid {
                rank: 0,
                message: format!(
                    "all_gather receive buffer of {} for 1 x {}",
                    recv.len(),
                    send.len()
                ),
            });
        }
        recv.copy_from_slice(send);
        Ok(())
    }

    fn reduce_scatter(&self, send: &[f32], recv: &mut [f32], _op: ReduceOp) -> DistResult<()> {
        check_reduce_scatter(0, 1, send.len(), recv.len())?;
        recv.copy_from_slice(send);
        Ok(())
    }

    fn barrier(&self) -> DistResult<()> {
        Ok(())
    }

    fn send(&self, _buf: &[f32], dest: usize) -> DistResult<()> {
        Err(DistError::Invalid {
            rank: 0,
            message: format!("send to rank {dest} in a group of 1"),
        })
    }

    fn recv(&self, _buf: &mut [f32], src: usize) -> DistResult<()> {
        Err(DistError::Invalid {
            rank: 0,
            message: format!("receive from rank {src} in a group of 1"),
        })
    }

    fn split(&self, _color: usize, _key: usize) -> DistResult<Box<dyn Communicator>> {
        Ok(Box::new(LocalCommunicator))
    }
}
