//! Builders of ONNX models from a config.

pub mod gpt2;
