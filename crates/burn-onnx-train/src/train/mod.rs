//! The training runner and its parts: config, data, schedules, optimizers, checkpoints,
//! throughput.

pub mod auto_layout;
pub mod checkpoint;
pub mod checkpoint_index;
pub mod checkpoint_manifest;
pub mod checkpoint_params;
pub mod config;
pub mod data;
pub mod deepspeed;
pub mod device;
pub mod documents;
pub mod elastic;
pub mod evaluate;
#[cfg(feature = "cli")]
pub mod flags;
pub mod launch;
pub mod memory_counts;
pub mod memory_plan;
pub mod metrics_log;
pub mod optimizer;
pub mod overview;
pub mod parallel_plan;
pub mod passes;
pub mod perf;
pub mod pipelined;
pub mod precision;
pub mod preemption;
pub mod preflight;
pub mod ready_grads;
mod report;
mod resume;
pub mod runner;
pub mod sampler;
pub mod schedule;
pub mod segmented;
pub mod starter_config;
pub mod step;
pub mod summaries;
pub mod token_shards;
pub mod tp_resume;
mod trainer;
pub mod zero3_shards;

pub use config::TrainingConfig;
pub use device::DeviceSpec;
pub use runner::{RunSummary, TrainingRunner};
