//! # burn-onnx-train
//!
//! Load any ONNX model as a trainable [Burn](https://burn.dev) module, train it, export it.
//!
//! * [`Graph`] decodes and checks an `.onnx` file (unsupported ops and malformed files are
//!   load-time errors that name the node or field).
//! * [`OnnxModel`] is a Burn `Module`: float initializers are `Param`s keyed by their ONNX
//!   names, trained where a framework would have made them parameters ([`trainability`]),
//!   and `forward` interprets the graph with Burn tensor ops, so autodiff yields gradients
//!   for every weight, embedding tables included.
//! * [`loss`] attaches a loss to the outputs; [`export`] writes the trained inference model.
//!
//! ```no_run
//! use burn::tensor::Device;
//! use burn_onnx_train::{Mode, OnnxModel, model::float_input};
//!
//! let device = Device::flex().autodiff();
//! let model = OnnxModel::load("mlp.onnx", &device)?;
//! let x = float_input(vec![0.0; 784], &[1, 784], &device)?;
//! let out = model.forward(vec![("input".into(), x)], Mode::Eval)?;
//! # Ok::<(), burn_onnx_train::OnnxError>(())
//! ```

#[cfg(feature = "cli")]
pub mod allocator;
pub mod atomic_file;
pub mod builders;
pub mod collective;
pub mod error;
pub mod export;
pub mod functions;
pub mod fusion;
pub mod graph;
pub mod host_tensor;
pub mod initializer;
pub mod initializer_ties;
pub mod kernels;
#[cfg(feature = "learner")]
pub mod learner;
pub mod loader;
pub mod loss;
pub mod model;
pub mod npy;
pub mod ops;
pub mod pipeline;
pub mod progress;
pub mod proto_presence;
pub mod seeds;
pub mod tensor_parallel;
pub mod tensorboard;
#[cfg(feature = "tokenize")]
pub mod tokenize;
pub mod train;
pub mod trainability;
pub mod unary_op;
pub mod value;

pub use error::{OnnxError, Result};
pub use graph::Graph;
pub use model::{ConstantInfo, ForwardOutput, Mode, OnnxModel, ParamInfo, ParamRole};
pub use value::{FloatValue, Value};
