//! The integration tests of this crate, one module per feature, in one test binary (one
//! link of the crate and its dependencies instead of one per file). Run one module with
//! `cargo test --release --test integration -- MODULE::`.

mod device_buckets;
mod fp16_wire;
mod layout;
mod mpi;
mod threads;
mod zero_on_device;

/// The device `zero_on_device` runs on (the GPU where `tests/gpu.rs` of burn-onnx-train
/// includes it).
fn zero_device() -> burn::tensor::Device {
    burn::tensor::Device::flex()
}
