//! Pipeline parallelism on any ONNX graph: the graph is cut into stages along its execution
//! order ([`partition`]), each rank of a pipeline group runs one stage ([`OnnxModel::into_stage`](crate::OnnxModel::into_stage)),
//! activations and their gradients cross the cuts as messages ([`wire`]), and a schedule
//! ([`schedule`]: GPipe or 1F1B) orders the micro-batches' passes. The training passes
//! that run a stage are `crate::train::pipelined`.

pub mod partition;
pub mod schedule;
pub mod wire;

pub use partition::{Partition, SharedParam, Stage};
pub use schedule::{Pass, PipelineSchedule};
