//! Pipeline parallelism on any ONNX graph: the graph is cut into stages along its execution
//! order ([`partition`]), each rank of a pipeline group runs one stage, or with virtual
//! stages several ([`OnnxModel::into_stages`](crate::OnnxModel::into_stages)),
//! activations and their gradients cross the cuts as tagged messages ([`wire`]), and a
//! schedule ([`schedule`]: GPipe, 1F1B or interleaved 1F1B) orders the micro-batches'
//! passes. The training passes that run a rank's stages are `crate::train::passes::pipelined`.

pub mod partition;
pub mod schedule;
pub mod wire;

pub use partition::{Partition, SharedParam, Stage};
pub use schedule::{Pass, PipelineSchedule};
