//! `onnx-train init`: a commented starter config for an ONNX model, filled from its graph.

use std::path::{Path, PathBuf};

use burn::tensor::Device;

use crate::error::OnnxError;
use crate::frontend::starter_config::starter_config;
use crate::model::OnnxModel;
use crate::util::atomic_file::write_atomic;

/// `onnx-train init`'s arguments.
#[derive(clap::Args)]
pub struct InitArgs {
    /// The ONNX file.
    model: PathBuf,
    /// The config file to write.
    #[arg(long, default_value = "run.toml")]
    output: PathBuf,
    /// Replace the config file if it exists.
    #[arg(long)]
    force: bool,
}

/// `onnx-train init`: see [`init`].
pub fn run(args: InitArgs) -> Result<(), OnnxError> {
    init(&args.model, &args.output, args.force)
}

/// `onnx-train init`: the starter config for `model` written to `output` (never over an
/// existing file unless `force`).
fn init(model: &Path, output: &Path, force: bool) -> Result<(), OnnxError> {
    if output.exists() && !force {
        return Err(OnnxError::field(
            "--output",
            format!("{} exists (--force replaces it)", output.display()),
        ));
    }
    let loaded = OnnxModel::load(model, &Device::flex())?;
    write_atomic(output, starter_config(&loaded, model).as_bytes())?;
    println!(
        "wrote {} for {}: check its [model] and [data] sections, then\n  onnx-train train --config {} --check",
        output.display(),
        model.display(),
        output.display()
    );
    Ok(())
}
