//! The cuts the parallel layouts make of a model: [`pipeline`] stages (partition, schedule,
//! the wire between stages) and [`tensor_parallel`] (Megatron's column/row splits, sequence
//! parallelism, the vocabulary-parallel head). ZeRO-3's sharding of the parameters lives
//! with the model ([`crate::model`]) and in burn-ort-dist; [`crate::train::layout`] composes
//! them all into one plan.

pub mod pipeline;
pub mod tensor_parallel;
