//! Front ends over the training runner: the `onnx-train` command line (a module per
//! subcommand), its flags and `init`, the bundled model builders, the tokenizer and
//! burn-train's `Learner` adapter.

pub mod builders;
#[cfg(feature = "cli")]
pub mod cli;
#[cfg(feature = "cli")]
pub mod flags;
#[cfg(feature = "learner")]
pub mod learner;
pub mod starter_config;
#[cfg(feature = "tokenize")]
pub mod tokenize;
