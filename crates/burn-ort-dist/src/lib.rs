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

pub mod buckets;
pub mod collective_check;
pub mod communicator;
#[cfg(feature = "cuda")]
pub mod cuda_probe;
pub mod data_parallel;
pub mod device_buckets;
pub mod disk_vectors;
pub mod error;
pub mod fp16_wire;
pub mod grad_sync;
pub mod launch;
pub mod mapped;
#[cfg(feature = "mpi")]
pub mod mpi_comm;
#[cfg(feature = "mpi")]
mod mpi_ffi;
#[cfg(feature = "mpi")]
mod mpi_watch;
#[cfg(feature = "cuda")]
pub mod nccl_comm;
pub mod overlap;
pub mod param_swap;
pub mod record;
pub mod record_safetensors;
pub mod replica_optimizer;
pub mod stall;
pub mod strategy;
pub mod threads;
pub mod topology;
pub mod zero;

pub use collective_check::check_collectives;
pub use communicator::{Communicator, DeviceReduce, Forwarding, LocalCommunicator, ReduceOp};
#[cfg(feature = "cuda")]
pub use cuda_probe::check_cuda_device;
pub use data_parallel::{DataParallel, DistributedOptimizer};
pub use error::{DistError, DistResult};
pub use grad_sync::{
    DEFAULT_BUCKET_BYTES, FlatGrad, Reduction, adasum_pair, adasum_tree, all_reduce_gradients,
    put_flat, reduce_gradients, take_flat,
};
pub use launch::{launched_by_mpi, run_threads};
#[cfg(feature = "mpi")]
pub use mpi;
#[cfg(feature = "mpi")]
pub use mpi_comm::MpiCommunicator;
#[cfg(feature = "cuda")]
pub use nccl_comm::NcclCommunicator;
pub use overlap::{OverlappedSync, SyncTimes};
pub use record::{
    MomentSlices, MomentState, RecordTensor, decode_moments, encode_moments, regroup_records,
    write_moments,
};
pub use replica_optimizer::ReplicaOptimizer;
pub use strategy::{
    MemoryUse, ModelParallel, Replicated, StateContent, StateFile, UpdateReport, UpdateStrategy,
    clip_grad_norm,
};
pub use threads::ThreadCommunicator;
pub use topology::{Groups, Topology};
pub use zero::Zero;
