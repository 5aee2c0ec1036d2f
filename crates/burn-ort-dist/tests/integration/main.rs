//! The integration tests of this crate, one module per feature, in one test binary (one
//! link of the crate and its dependencies instead of one per file). Run one module with
//! `cargo test --release --test integration -- MODULE::`.

mod device_buckets;
mod fp16_wire;
mod layout;
mod mpi;
mod threads;
