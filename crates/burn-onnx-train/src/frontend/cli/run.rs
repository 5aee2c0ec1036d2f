//! `onnx-train run`: the model's forward pass on `.npy` inputs, its outputs written as
//! `.npy` files (a sequence as a directory of them).

use std::path::{Path, PathBuf};

use burn::tensor::Device;

use crate::error::OnnxError;
use crate::model::{Mode, OnnxModel};
use crate::train::data::npy::{read_npy_value, write_npy_as};
use crate::value::Value;

/// `onnx-train run`'s arguments.
#[derive(clap::Args)]
pub struct RunArgs {
    /// The ONNX file.
    model: PathBuf,
    /// An input as NAME=FILE.npy (repeat for each graph input).
    #[arg(long = "input", value_name = "NAME=FILE.npy")]
    inputs: Vec<String>,
    /// Where to write the outputs.
    #[arg(long, value_name = "DIR")]
    output_dir: PathBuf,
    /// Where to run it: cpu, wgpu[:N] (--features wgpu), cuda[:N] (--features cuda).
    #[arg(long, value_name = "D", default_value = "cpu")]
    device: crate::train::DeviceSpec,
}

/// `onnx-train run`: every graph output written under `--output-dir`.
pub fn run(args: RunArgs) -> Result<(), OnnxError> {
    let RunArgs {
        model: path,
        inputs,
        output_dir,
        device,
    } = args;
    let device = device.device(0)?;
    let model = OnnxModel::load(&path, &device)?;
    let mut feeds = Vec::new();
    for spec in inputs {
        let (name, file) = spec.split_once('=').ok_or_else(|| {
            OnnxError::field("--input", format!("expected NAME=FILE.npy, got '{spec}'"))
        })?;
        feeds.push((
            name.to_string(),
            read_input(name, Path::new(file), &device)?,
        ));
    }
    let out = model.forward(feeds, Mode::Eval)?;
    std::fs::create_dir_all(&output_dir).map_err(|e| OnnxError::io(&output_dir, e))?;
    for ((name, value), info) in out.outputs.iter().zip(&model.graph().outputs) {
        write_output(&output_dir, name, value, info.elem_type)?;
    }
    Ok(())
}

/// A `--input` value: a `.npy` tensor, or a directory of them (a sequence, its tensors in
/// file-name order).
fn read_input(name: &str, path: &Path, device: &Device) -> Result<Value, OnnxError> {
    let tensor = |file: &Path| {
        read_npy_value(file, device)
            .map_err(|e| OnnxError::field(format!("--input {name}"), e.to_string()))
    };
    if !path.is_dir() {
        return tensor(path);
    }
    let mut files: Vec<PathBuf> = std::fs::read_dir(path)
        .map_err(|e| OnnxError::io(path, e))?
        .map(|e| e.map(|e| e.path()).map_err(|e| OnnxError::io(path, e)))
        .collect::<Result<_, _>>()?;
    files.retain(|f| f.extension().is_some_and(|x| x == "npy"));
    files.sort();
    Ok(Value::Sequence(
        files.iter().map(|f| tensor(f)).collect::<Result<_, _>>()?,
    ))
}

/// Graph output `name` in `dir`: `<name>.npy` for a tensor, the directory `<name>` of
/// `00000.npy`, `00001.npy`, ... for a sequence.
fn write_output(dir: &Path, name: &str, value: &Value, elem_type: i32) -> Result<(), OnnxError> {
    let Value::Sequence(items) = value else {
        let file = dir.join(format!("{}.npy", sanitize(name)));
        write_npy_as(&file, value, elem_type)?;
        println!("{name}: {:?} -> {}", value.shape(), file.display());
        return Ok(());
    };
    let seq = dir.join(sanitize(name));
    std::fs::create_dir_all(&seq).map_err(|e| OnnxError::io(&seq, e))?;
    for (k, item) in items.iter().enumerate() {
        write_npy_as(seq.join(format!("{k:05}.npy")), item, elem_type)?;
    }
    println!(
        "{name}: a sequence of {} tensor(s) -> {}/",
        items.len(),
        seq.display()
    );
    Ok(())
}

/// Output names may contain `/` or `:`; keep file names flat.
fn sanitize(name: &str) -> String {
    name.chars()
        .map(|c| {
            if c.is_alphanumeric() || "._-".contains(c) {
                c
            } else {
                '_'
            }
        })
        .collect()
}
