//! Where state lives off the device: device values read to the host, memory-mapped and
//! on-disk vectors, parameter swaps, and the record formats (safetensors) checkpoints are
//! written in.

pub mod disk_vectors;
pub mod host_values;
pub mod mapped;
pub mod param_swap;
pub mod record;
pub mod record_safetensors;
