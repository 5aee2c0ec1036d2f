//! # burn-ort-dist
//!
//! Distributed training pieces for `burn-onnx-train` and for any Burn module:
//! communicators (the [`Communicator`] trait and its implementations) and gradient
//! synchronisation between the backward pass and the optimizer step.
//!
//! ## Why a wrapper around the step, not a backend decorator
//! Burn 0.22 picks backends at run time through a closed `Dispatch` enum; a third-party
//! `Backend` decorator cannot be plugged into it without forking Burn, and Burn's own
//! collective ops exist only for CUDA/NCCL inside one process. So synchronisation happens
//! where PyTorch DDP hooks it too: on the gradients, after `backward()` and before the
//! optimizer, on every backend.

#![warn(missing_docs)]

// The layers, bottom to top: storage (off-device state and record formats), comm
// (communicators, topology, launch), grads (gradient averaging), update (DDP and ZeRO
// update strategies). `tools/import_cycles.py` checks that none imports one above it.
pub mod comm;
pub mod error;
pub mod grads;
pub mod storage;
pub mod update;

pub use comm::collective_check::check_collectives;
pub use comm::communicator::{
    Communicator, DeviceCollectives, DeviceSends, Forwarding, LocalCommunicator, ReduceOp,
};
#[cfg(feature = "cuda")]
pub use comm::cuda_probe::check_cuda_device;
#[cfg(feature = "cuda")]
pub use comm::device_group::DeviceGroup;
pub use comm::launch::{launched_by_mpi, local_rank, run_threads};
#[cfg(feature = "mpi")]
pub use comm::mpi_comm::MpiCommunicator;
#[cfg(feature = "cuda")]
pub use comm::nccl_comm::NcclCommunicator;
pub use comm::threads::ThreadCommunicator;
pub use comm::through_host::ThroughHost;
pub use comm::topology::{Groups, Topology};
pub use error::{DistError, DistResult};
pub use grads::data_parallel::{DataParallel, DistributedOptimizer};
pub use grads::grad_sync::{
    DEFAULT_BUCKET_BYTES, FlatGrad, Reduction, adasum_pair, adasum_tree, all_reduce_gradients,
    put_flat, reduce_gradients, take_flat,
};
pub use grads::overlap::{OverlappedSync, SyncTimes};
#[cfg(feature = "mpi")]
pub use mpi;
pub use storage::host_values::{
    collective_host_values, count_host_round_trip, count_host_round_trip_from,
    host_round_trips_so_far, host_values,
};
pub use storage::record::{
    MomentSlices, MomentState, RecordTensor, decode_moments, encode_moments, regroup_records,
    write_moments,
};
pub use update::grad_norm::{GradNorm, clip_grad_norm};
pub use update::replica_optimizer::ReplicaOptimizer;
pub use update::strategy::{
    MemoryUse, ModelParallel, Replicated, ScaledUpdate, StateContent, StateFile, UpdateReport,
    UpdateStrategy,
};
pub use update::zero::Zero;

// -- old module paths (kept for one release; docs/changelog.md) --
#[cfg(feature = "cuda")]
#[doc(hidden)]
pub use comm::cuda_probe;
#[cfg(feature = "mpi")]
#[doc(hidden)]
pub use comm::mpi_comm;
#[cfg(feature = "cuda")]
#[doc(hidden)]
pub use comm::nccl_comm;
#[doc(hidden)]
pub use comm::{
    collective_check, communicator, fp16_wire, launch, stall, threads, through_host, topology,
};
#[doc(hidden)]
pub use grads::{buckets, data_parallel, device_buckets, grad_sync, overlap};
#[doc(hidden)]
pub use storage::{disk_vectors, mapped, param_swap, record, record_safetensors};
#[doc(hidden)]
pub use update::{replica_optimizer, strategy, zero};
// -- end of old module paths --
