//! ONNX files in and out: [`loader`] decodes a file into a checked [`crate::Graph`] (with
//! its functions inlined and its patterns fused), [`export`] writes a trained model back as
//! an inference `.onnx`.

pub mod export;
pub mod functions;
pub mod fusion;
pub mod loader;
pub mod proto_presence;
