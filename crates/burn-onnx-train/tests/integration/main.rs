//! The integration tests of this crate, one module per feature, in one test binary (one
//! link of the crate and its dependencies instead of one per file). Run one module with
//! `cargo test --release --test integration -- MODULE::`. The GPU tests are their own
//! binary (`tests/gpu.rs`, `--test gpu`): `tools/gpu/pack.sh` ships it alone to a GPU
//! machine.

mod common;

mod cli;
mod config_reference;
mod conv_kernel;
mod data;
mod data_parallel;
mod documents;
mod dynamo_gpt2;
mod export;
mod external_data;
mod finite_difference;
mod fp16_gradients;
mod fused_optimizer;
mod gpt2_builder;
mod graph_loss;
mod import_cycles;
mod inference;
mod initializer_ties;
mod kernels;
#[cfg(feature = "learner")]
mod learner;
mod library_dependencies;
mod matmul_kernel;
mod mpi;
mod node_suite;
mod offload;
mod ops;
mod optimizers;
mod optimizers_vs_pytorch;
mod overlap;
mod pipeline;
mod pool_kernel;
mod precision;
mod quantization;
mod random_ops;
mod recompute;
mod runner;
mod runner_features;
mod schedule;
mod squeezenet_gradients;
mod tensor_parallel;
mod tensorboard;
mod tokenize;
mod training;
mod zero;
