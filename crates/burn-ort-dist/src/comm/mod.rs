//! Communicators and the world they span: the [`communicator::Communicator`] trait, threads,
//! MPI and NCCL implementations, the topology of groups, launching ranks, stall detection,
//! the fp16 wire format, the collectives' bandwidth, and device collectives carried through
//! the host where no device transport exists.

pub mod bandwidth;
pub mod collective_check;
pub mod communicator;
#[cfg(feature = "cuda")]
pub mod cuda_probe;
#[cfg(feature = "cuda")]
pub mod device_group;
pub mod fp16_wire;
pub mod launch;
#[cfg(feature = "mpi")]
pub mod mpi_comm;
#[cfg(feature = "mpi")]
pub(crate) mod mpi_ffi;
#[cfg(feature = "mpi")]
pub(crate) mod mpi_watch;
#[cfg(feature = "cuda")]
pub mod nccl_comm;
pub mod stall;
pub mod threads;
pub mod through_host;
pub mod topology;
