//! Gradient averaging between the backward pass and the optimizer step: buckets (host and
//! device), the all-reduce itself, its overlap with the backward pass, and DDP's wrapper.

pub mod buckets;
pub mod data_parallel;
pub mod device_buckets;
pub mod grad_sync;
pub mod overlap;
