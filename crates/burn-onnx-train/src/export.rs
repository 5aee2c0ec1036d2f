//! Export (ORT training's last step): the original graph with the trained initializers,
//! as an inference ONNX file that onnxruntime or any other runtime loads.
//!
//! Only initializer data changes: nodes, opsets, metadata and non-float initializers are
//! written back with the values they were read with, and each trained value keeps its
//! initializer's data type. Attribute values equal to their default (`axis: 0`) stay on the
//! wire (see [`crate::proto_presence`]).
//!
//! A protobuf cannot exceed 2 GB, so when the initializers pass
//! [`ExportOptions::threshold_bytes`] (or when asked) their data goes to ONNX external
//! data: one file `<model file>.data` beside the model, every tensor of at least 1 KiB at a
//! 64-byte aligned offset (`location`, `offset`, `length`), the rest inline, as the `onnx`
//! package writes it. Initializers the source model kept in external files are carried over.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;

use onnx_ir::{Message, ModelProto};

use crate::atomic_file::write_atomic;
use crate::error::{OnnxError, Result};
use crate::host_tensor::{ExternalData, HostTensor};
use crate::model::OnnxModel;
use crate::progress::progress;
use crate::proto_presence::restore_default_attribute_values;

/// Where the initializers' data goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ExternalDataPolicy {
    /// Inline, unless the initializers hold more than the threshold.
    #[default]
    Auto,
    /// Always in an external data file.
    Always,
}

/// How to export.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExportOptions {
    /// External data or not.
    pub external_data: ExternalDataPolicy,
    /// With `Auto`: initializer bytes above which the data goes external (default: 1.8 GB,
    /// below protobuf's 2 GB limit with room for the graph).
    pub threshold_bytes: usize,
}

impl Default for ExportOptions {
    fn default() -> Self {
        ExportOptions { external_data: ExternalDataPolicy::Auto, threshold_bytes: 1_800_000_000 }
    }
}

/// Tensors smaller than this stay inline in external-data exports (the `onnx` package's
/// default `size_threshold`).
const EXTERNAL_MIN_BYTES: usize = 1024;
/// Alignment of tensors in the external data file (lets a reader map them directly).
const EXTERNAL_ALIGN: usize = 64;

/// The model's protobuf with every initializer's data inline: trained values for the
/// parameters, the source's bytes for everything else (read from its external files).
fn inline_proto(model: &OnnxModel) -> Result<ModelProto> {
    let mut proto = model.graph().model.clone();
    let source_dir = model.graph().source.as_deref().map(|s| s.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new(".")).to_path_buf());
    let external = source_dir.as_deref().map(ExternalData::new);
    let graph = proto.graph.as_mut().ok_or_else(|| OnnxError::field("model.graph", "missing"))?;
    for init in graph.initializer.iter_mut() {
        match model.param_index(&init.name) {
            Some(i) => {
                let value = model.param_value(i).ok_or_else(|| OnnxError::field(format!("parameter '{}'", init.name), "missing"))?;
                let values = value.to_array().map_err(|e| OnnxError::field(format!("parameter '{}'", init.name), e.0))?;
                let flat: Vec<f32> = values.iter().copied().collect();
                HostTensor::write_float_into(&flat, init)?;
            }
            None if init.data_location.value() == 1 => {
                let ext = external.as_ref().ok_or_else(|| OnnxError::field(format!("tensor '{}'", init.name), "external data, but the model was not loaded from a file"))?;
                let bytes = ext.bytes(init)?.as_ref().to_vec();
                init.raw_data = bytes.into();
                init.external_data.clear();
                init.data_location = Default::default();
            }
            None => {}
        }
    }
    restore_default_attribute_values(&mut proto);
    Ok(proto)
}

/// Serialise the model with its current parameter values, all data inline.
pub fn export_bytes(model: &OnnxModel) -> Result<Vec<u8>> {
    inline_proto(model)?.write_to_bytes().map_err(|e| OnnxError::field("export", e.to_string()))
}

/// Write the model with its current parameter values to `path` (default options).
pub fn export_onnx(model: &OnnxModel, path: impl AsRef<Path>) -> Result<()> {
    export_onnx_with(model, path, ExportOptions::default())
}

/// Write the model with its current parameter values to `path`, atomically; external data,
/// when used, goes to `<path>.data` (written and renamed into place first).
pub fn export_onnx_with(model: &OnnxModel, path: impl AsRef<Path>, options: ExportOptions) -> Result<()> {
    write_model(inline_proto(model)?, path.as_ref(), options)
}

/// Write `proto` (initializer data inline) to `path`, moving the data to `<path>.data`
/// when `options` say so (see the module docs).
pub fn write_model(mut proto: ModelProto, path: &Path, options: ExportOptions) -> Result<()> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(|e| OnnxError::io(dir, e))?;
    }
    let graph = proto.graph.as_mut().ok_or_else(|| OnnxError::field("model.graph", "missing"))?;
    let total: usize = graph.initializer.iter().map(|i| i.raw_data.len()).sum();
    let external = match options.external_data {
        ExternalDataPolicy::Always => true,
        ExternalDataPolicy::Auto => total > options.threshold_bytes,
    };
    if external {
        let name = path.file_name().ok_or_else(|| OnnxError::field(path.display().to_string(), "not a file path"))?;
        let location = format!("{}.data", name.to_string_lossy());
        let data_path = path.with_file_name(&location);
        let tmp = path.with_file_name(format!(".{location}.tmp-{}", std::process::id()));
        let bar = progress(total as u64, "export");
        let written = (|| -> std::io::Result<()> {
            let mut out = BufWriter::with_capacity(1 << 20, File::create(&tmp)?);
            let mut offset = 0usize;
            for init in graph.initializer.iter_mut().filter(|i| i.raw_data.len() >= EXTERNAL_MIN_BYTES) {
                let pad = offset.next_multiple_of(EXTERNAL_ALIGN) - offset;
                out.write_all(&[0u8; EXTERNAL_ALIGN][..pad])?;
                offset += pad;
                let len = init.raw_data.len();
                out.write_all(&init.raw_data)?;
                bar.inc(len as u64);
                for (k, v) in [("location", location.clone()), ("offset", offset.to_string()), ("length", len.to_string())] {
                    init.external_data.push(Default::default());
                    let e = init.external_data.last_mut().expect("just pushed");
                    e.key = k.into();
                    e.value = v;
                }
                init.data_location = protobuf_external();
                init.raw_data = Default::default();
                offset += len;
            }
            out.into_inner().map_err(|e| e.into_error())?.sync_all()?;
            std::fs::rename(&tmp, &data_path)
        })();
        bar.finish_and_clear();
        if let Err(e) = written {
            let _ = std::fs::remove_file(&tmp);
            return Err(OnnxError::io(&data_path, e));
        }
    }
    let bytes = proto.write_to_bytes().map_err(|e| OnnxError::field("export", e.to_string()))?;
    write_atomic(path, &bytes)
}

/// `TensorProto.DataLocation.EXTERNAL`.
fn protobuf_external<E: protobuf::Enum>() -> protobuf::EnumOrUnknown<E> {
    protobuf::EnumOrUnknown::from_i32(1)
}
