//! Pipeline parallelism on any ONNX graph: the graph is cut into stages along its execution
//! order ([`partition`]), each rank of a pipeline group runs one stage ([`OnnxModel::into_stage`](crate::OnnxModel::into_stage)),
//! activations and their gradients cross the cuts as messages ([`wire`]), and a schedule
//! ([`schedule`]: GPipe or 1F1B) orders the micro-batches' passes ([`executor`]).

pub mod executor;
pub mod partition;
pub mod pipelined;
pub mod schedule;
pub mod wire;

pub use executor::{StageExec, StageResult};
pub use partition::{Partition, SharedParam, Stage};
pub use pipelined::Pipelined;
pub use schedule::{Pass, PipelineSchedule};
