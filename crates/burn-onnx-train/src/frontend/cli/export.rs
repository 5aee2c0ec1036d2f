//! `onnx-train export`: the model a checkpoint holds written as an ONNX file (or its weights
//! as safetensors).

use std::path::PathBuf;

use burn::tensor::Device;

use crate::error::OnnxError;
use crate::graph::Graph;
use crate::model::OnnxModel;
use crate::onnx::export::{ExportOptions, ExternalDataPolicy, export_onnx_with};
use crate::train::TrainingConfig;
use crate::train::checkpoint::manifest::check_files;
use crate::train::checkpoint::params::{from_other_model, read_params};
use crate::train::checkpoint::{find_checkpoint, read_state, weights_file_bytes};
use crate::util::atomic_file::write_atomic;

/// `onnx-train export`'s arguments.
#[derive(clap::Args)]
pub struct ExportArgs {
    /// The checkpoint: its directory (`ckpt-NNNNNNNNN`), a directory of checkpoints, or a
    /// run's output directory (the newest checkpoint in either); without it, `--model`
    /// is written as it is (e.g. to move its weights into external data).
    #[arg(long)]
    checkpoint: Option<PathBuf>,
    /// The ONNX file to write.
    #[arg(long)]
    output: PathBuf,
    /// The model the checkpoint was trained from (default: the `model_path` of the run
    /// that wrote it).
    #[arg(long)]
    model: Option<PathBuf>,
    /// Put the weights in ONNX external data (`<output>.data`) even below the 1.8 GB at
    /// which it happens anyway (protobuf's 2 GB limit).
    #[arg(long)]
    external_data: bool,
    /// Write the weights alone as one safetensors file (ONNX initializer names, logical
    /// shapes, f32, `format: pt` metadata as Hugging Face's loaders expect) instead of
    /// an ONNX file; a pipelined or tensor-parallel checkpoint's parts are merged.
    #[arg(long, conflicts_with = "external_data")]
    safetensors: bool,
}

/// `onnx-train export`: the ONNX (or safetensors) file written to `--output`.
pub fn run(args: ExportArgs) -> Result<(), OnnxError> {
    let ExportArgs {
        checkpoint,
        output,
        model,
        external_data,
        safetensors,
    } = args;
    let checkpoint = checkpoint.as_deref().map(find_checkpoint).transpose()?;
    // A damaged checkpoint is refused before anything is read from it.
    if let Some(c) = &checkpoint {
        check_files(c)?;
    }
    // The run that wrote the checkpoint says which model file and which initializer ties
    // its parameters follow.
    let run = checkpoint
        .as_ref()
        .map(|c| TrainingConfig::from_toml(&read_state(c)?.config_toml, c))
        .transpose()?;
    let model_path = match (model, &run) {
        (Some(m), _) => m,
        (None, Some(r)) => r.model.model_path.clone(),
        (None, None) => {
            return Err(OnnxError::field(
                "export",
                "needs --checkpoint, --model, or both",
            ));
        }
    };
    let ties = run
        .as_ref()
        .map(|c| c.model.tie_options())
        .unwrap_or_default();
    let mut model = OnnxModel::from_graph(Graph::load_with(&model_path, ties)?, &Device::flex())?;
    if let (Some(c), Some(run)) = (&checkpoint, &run) {
        model = read_params(c, model, None)
            .map_err(|e| from_other_model(e, c, &run.model.model_path, &model_path))?;
    }
    if safetensors {
        write_atomic(&output, &weights_file_bytes(&model)?)?;
    } else {
        let external_data = if external_data {
            ExternalDataPolicy::Always
        } else {
            ExternalDataPolicy::Auto
        };
        export_onnx_with(
            &model,
            &output,
            ExportOptions {
                external_data,
                ..Default::default()
            },
        )?;
    }
    let from = checkpoint.map_or_else(String::new, |c| format!(", checkpoint {}", c.display()));
    println!(
        "exported {} (model {}{from})",
        output.display(),
        model_path.display()
    );
    Ok(())
}
