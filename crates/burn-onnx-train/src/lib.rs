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

#![warn(missing_docs)]

// The layers, bottom to top; a module imports only from its own layer and the ones below
// it (`tools/import_cycles.py` checks this):
//   util, error        -> small shared pieces
//   value, collective, graph, kernels, ops -> the values, the graph and its ops with their
//                         kernels and the collectives inside the model
//   model              -> `OnnxModel`, its loss and the cuts the parallel layers ask of it
//   onnx               -> decoding a file into a graph, exporting a model back to a file
//   parallel           -> pipeline stages, tensor and sequence parallelism
//   train              -> the training loop and its parts (config, data, passes, checkpoint,
//                         report, process, layout)
//   frontend           -> the CLI's flags and `init`, builders, the tokenizer, the Learner
pub mod collective;
pub mod error;
pub mod frontend;
pub mod graph;
pub mod kernels;
pub mod model;
pub mod onnx;
pub mod ops;
pub mod parallel;
pub mod train;
pub mod util;
pub mod value;

pub use error::{OnnxError, Result};
pub use graph::Graph;
pub use model::{ConstantInfo, ForwardOutput, Mode, OnnxModel, ParamInfo, ParamRole};
pub use value::{FloatValue, Value};

// -- old module paths (kept for one release; docs/changelog.md) --
#[doc(hidden)]
pub use frontend::builders;
#[cfg(feature = "learner")]
#[doc(hidden)]
pub use frontend::learner;
#[cfg(feature = "tokenize")]
#[doc(hidden)]
pub use frontend::tokenize;
#[doc(hidden)]
pub use graph::{initializer, initializer_ties};
#[doc(hidden)]
pub use model::{loss, trainability};
#[doc(hidden)]
pub use onnx::{export, functions, fusion, loader, proto_presence};
#[doc(hidden)]
pub use parallel::{pipeline, tensor_parallel};
#[doc(hidden)]
pub use train::data::npy;
#[doc(hidden)]
pub use train::report::tensorboard;
#[cfg(feature = "cli")]
#[doc(hidden)]
pub use util::allocator;
#[doc(hidden)]
pub use util::{atomic_file, progress, seeds};
#[doc(hidden)]
pub use value::{host_tensor, unary_op};
// -- end of old module paths --
