//! The training runner and its parts: config, data, schedules, optimizers, checkpoints,
//! throughput.

pub mod checkpoint;
pub mod config;
pub mod data;
pub mod evaluate;
pub mod layout;
pub mod optimizer;
pub mod passes;
pub mod precision;
pub mod preflight;
pub mod process;
pub mod report;
pub mod schedule;
mod trainer;
mod update_graph;

pub use config::TrainingConfig;
pub use process::device::DeviceSpec;
pub use process::runner::{RunSummary, TrainingRunner};

// -- old module paths (kept for one release; docs/changelog.md) --
#[cfg(feature = "cli")]
#[doc(hidden)]
pub use crate::frontend::flags;
#[doc(hidden)]
pub use crate::frontend::starter_config;
#[doc(hidden)]
pub use checkpoint::{
    index as checkpoint_index, manifest as checkpoint_manifest, params as checkpoint_params,
    tp_resume, zero3_shards,
};
#[doc(hidden)]
pub use config::deepspeed;
#[doc(hidden)]
pub use data::{documents, sampler, token_shards};
#[doc(hidden)]
pub use layout::{auto_layout, memory_counts, memory_plan, parallel_plan};
#[doc(hidden)]
pub use passes::{pipelined, ready_grads, segmented, step};
#[doc(hidden)]
pub use process::{device, elastic, launch, preemption, runner};
#[doc(hidden)]
pub use report::{metrics_log, overview, perf, summaries};
// -- end of old module paths --
