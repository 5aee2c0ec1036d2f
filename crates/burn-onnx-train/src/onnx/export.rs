//! Export (ORT training's last step): the original graph with the trained initializers,
//! as an inference ONNX file that onnxruntime or any other runtime loads.
//!
//! Only initializer data changes: nodes, opsets, metadata and non-float initializers are
//! written back with the values they were read with, and each trained value keeps its
//! initializer's data type. Attribute values equal to their default (`axis: 0`) stay on the
//! wire (see [`crate::onnx::proto_presence`]).
//!
//! A protobuf cannot exceed 2 GB, so when the initializers pass
//! [`ExportOptions::threshold_bytes`] (or when asked) their data goes to ONNX external
//! data: one file `<model file>.data` beside the model, every tensor of at least 1 KiB at a
//! 64-byte aligned offset (`location`, `offset`, `length`), the rest inline, as the `onnx`
//! package writes it. Initializers the source model kept in external files are carried over.

use std::collections::HashMap;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;

use burn_ort_dist::Communicator;
use ndarray::ArrayD;
use onnx_ir::{Message, ModelProto, TensorProto};

use crate::error::{OnnxError, Result};
use crate::graph::Graph;
use crate::graph::initializer_ties::restore_tied_copies;
use crate::model::OnnxModel;
use crate::onnx::proto_presence::restore_default_attribute_values;
use crate::util::atomic_file::write_atomic;
use crate::util::progress::progress;
use crate::value::host_tensor::{ExternalData, HostTensor, dtype, into_row_major_vec};

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
        ExportOptions {
            external_data: ExternalDataPolicy::Auto,
            threshold_bytes: 1_800_000_000,
        }
    }
}

/// Tensors smaller than this stay inline in external-data exports (the `onnx` package's
/// default `size_threshold`).
const EXTERNAL_MIN_BYTES: usize = 1024;
/// Alignment of tensors in the external data file (lets a reader map them directly).
const EXTERNAL_ALIGN: usize = 64;

/// Where a writer reads the trained parameters: this rank's own, gathered from ZeRO-3
/// chunks, or streamed from other ranks. Every other initializer keeps its source values.
pub trait ParamSource {
    /// Whether initializer `name` holds a trained parameter.
    fn holds(&self, name: &str) -> bool;
    /// Parameter `name`'s current values, whole. The writer asks for each held
    /// initializer in [`param_reads`]' order.
    fn values(&self, name: &str) -> Result<ArrayD<f32>>;
}

/// A model's parameters as this rank holds them (whole unless ZeRO-3 sharded them).
struct Local<'a>(&'a OnnxModel);

impl ParamSource for Local<'_> {
    fn holds(&self, name: &str) -> bool {
        self.0.param_index(name).is_some()
    }

    fn values(&self, name: &str) -> Result<ArrayD<f32>> {
        let field = || format!("parameter '{name}'");
        let value = self
            .0
            .param_by_name(name)
            .ok_or_else(|| OnnxError::field(field(), "missing"))?;
        value.to_array().map_err(|e| OnnxError::field(field(), e.0))
    }
}

/// A ZeRO-3 model's parameters, each gathered whole from the chunks of its sharding group.
struct Gathered<'a> {
    model: &'a OnnxModel,
    group: &'a dyn Communicator,
}

impl ParamSource for Gathered<'_> {
    fn holds(&self, name: &str) -> bool {
        self.model.param_index(name).is_some()
    }

    fn values(&self, name: &str) -> Result<ArrayD<f32>> {
        self.model
            .whole_param(self.model.require_param(name)?, self.group)
    }
}

/// Puts one initializer's data inline: trained values for the parameters, the source's bytes
/// for initializers it kept in external files, the original's values for a tied copy.
struct Filler<'a> {
    /// Which initializers are trained, and their values. Asked for
    /// [`Self::param_read`]'s names only, in the order the initializers are filled.
    params: &'a dyn ParamSource,
    source: Option<ExternalData>,
    /// Tied copies written back as initializers: copy -> (original, transposed).
    tied: HashMap<String, (String, bool)>,
    /// The protos of the originals of tied copies (read when they are not parameters).
    originals: HashMap<String, TensorProto>,
}

impl<'a> Filler<'a> {
    /// `graph`'s protobuf to export (tied copies back as initializers, attribute values
    /// as the source wrote them) and the filler of its initializers.
    fn prepare(graph: &Graph, params: &'a dyn ParamSource) -> (ModelProto, Self) {
        let dir = graph.source.as_deref().map(|s| {
            s.parent()
                .filter(|p| !p.as_os_str().is_empty())
                .unwrap_or(Path::new("."))
                .to_path_buf()
        });
        let mut proto = graph.model.clone();
        restore_default_attribute_values(&mut proto);
        let (tied, originals) = match proto.graph.as_mut() {
            Some(g) => {
                let tied = restore_tied_copies(g, &graph.ties);
                let originals = g
                    .initializer
                    .iter()
                    .filter(|t| tied.values().any(|(o, _)| *o == t.name))
                    .map(|t| (t.name.clone(), t.clone()))
                    .collect();
                (tied, originals)
            }
            None => Default::default(),
        };
        let filler = Filler {
            params,
            source: dir.as_deref().map(ExternalData::new),
            tied,
            originals,
        };
        (proto, filler)
    }

    /// The parameter whose values fill initializer `name`: its own, or a tied copy's
    /// original (`None`: the initializer is not trained).
    fn param_read<'n>(&'n self, name: &'n str) -> Option<&'n str> {
        let source = self.tied.get(name).map_or(name, |(o, _)| o.as_str());
        self.params.holds(source).then_some(source)
    }

    /// The current values of initializer `name`: trained, or as the source holds them.
    fn values(&self, name: &str) -> Result<ArrayD<f32>> {
        if self.params.holds(name) {
            return self.params.values(name);
        }
        let proto = self
            .originals
            .get(name)
            .ok_or_else(|| OnnxError::field(format!("tensor '{name}'"), "missing"))?;
        match HostTensor::from_proto(proto, self.source.as_ref())? {
            HostTensor::Float(a) => Ok(a),
            other => Err(OnnxError::field(
                format!("tensor '{name}'"),
                format!("a tied weight must be float, got {}", other.kind()),
            )),
        }
    }

    fn fill(&self, init: &mut TensorProto) -> Result<()> {
        if let Some((original, transposed)) = self.tied.get(&init.name) {
            let values = self.values(original)?;
            let values = if *transposed {
                values.reversed_axes()
            } else {
                values
            };
            return HostTensor::write_float_into(&into_row_major_vec(values), init);
        }
        if self.params.holds(&init.name) {
            let values = self.params.values(&init.name)?;
            return HostTensor::write_float_into(&into_row_major_vec(values), init);
        }
        if init.data_location.value() == 1 {
            let ext = self.source.as_ref().ok_or_else(|| {
                OnnxError::field(
                    format!("tensor '{}'", init.name),
                    "external data, but the model was not loaded from a file",
                )
            })?;
            let bytes = ext.bytes(init)?.as_ref().to_vec();
            init.raw_data = bytes.into();
            init.external_data.clear();
            init.data_location = Default::default();
        }
        Ok(())
    }

    /// The bytes `init` will hold once filled (to choose inline or external before filling).
    fn size(&self, init: &TensorProto) -> usize {
        let elements = || {
            init.dims
                .iter()
                .map(|&d| d.max(0) as usize)
                .product::<usize>()
        };
        if self.params.holds(&init.name) || self.tied.contains_key(&init.name) {
            elements() * dtype::width(init.data_type)
        } else {
            init.external_data
                .iter()
                .find(|e| e.key == "length")
                .and_then(|e| e.value.parse().ok())
                .unwrap_or(init.raw_data.len())
        }
    }
}

/// The initializers of `proto`'s graph, in order.
fn initializers_mut(proto: &mut ModelProto) -> impl Iterator<Item = &mut TensorProto> {
    proto
        .graph
        .as_mut()
        .into_iter()
        .flat_map(|g| g.initializer.iter_mut())
}

/// Serialise the model with its current parameter values, all data inline.
pub fn export_bytes(model: &OnnxModel) -> Result<Vec<u8>> {
    let local = Local(model);
    let (mut proto, filler) = Filler::prepare(model.graph(), &local);
    for init in initializers_mut(&mut proto) {
        filler.fill(init)?;
    }
    proto
        .write_to_bytes()
        .map_err(|e| OnnxError::field("export", e.to_string()))
}

/// Write the model with its current parameter values to `path` (default options).
pub fn export_onnx(model: &OnnxModel, path: impl AsRef<Path>) -> Result<()> {
    export_onnx_with(model, path, ExportOptions::default())
}

/// Write the model with its current parameter values to `path`, atomically; external data,
/// when used, goes to `<path>.data` (written and renamed into place first). With external
/// data the weights are serialised one tensor at a time, so the export holds little more
/// than the model.
pub fn export_onnx_with(
    model: &OnnxModel,
    path: impl AsRef<Path>,
    options: ExportOptions,
) -> Result<()> {
    export_onnx_from(model.graph(), &Local(model), path.as_ref(), options)
}

/// Export a ZeRO-3 model without ever holding it whole: every rank of its sharding `group`
/// calls this (a collective), each parameter is gathered where the writer reaches it and
/// dropped once written, and the rank given a `path` (one of them) writes the file, as
/// [`export_onnx_with`] does; the others only take part in the gathers. The caller knows
/// whether the model is sharded (a model that is not needs no gathers: write it with
/// [`export_onnx_with`]).
pub fn export_onnx_gathered(
    model: &OnnxModel,
    group: &dyn Communicator,
    path: Option<&Path>,
    options: ExportOptions,
) -> Result<()> {
    let params = Gathered { model, group };
    if let Some(path) = path {
        return export_onnx_from(model.graph(), &params, path, options);
    }
    for name in param_reads(model.graph(), &params) {
        params.values(&name)?;
    }
    Ok(())
}

/// The parameters a writer of `graph` reads from `params`, by name, in the order it reads
/// them (a tied copy reads its original once more): what ranks streaming values to the
/// writer send.
pub fn param_reads(graph: &Graph, params: &dyn ParamSource) -> Vec<String> {
    let (proto, filler) = Filler::prepare(graph, params);
    proto
        .graph
        .iter()
        .flat_map(|g| &g.initializer)
        .filter_map(|init| filler.param_read(&init.name).map(str::to_string))
        .collect()
}

/// Write `graph` to `path` as [`export_onnx_with`] does, the initializers `params` holds
/// with its values, read as the writer reaches each ([`param_reads`]' order): they can
/// be gathered or received one at a time, so no rank holds the trained model whole.
pub fn export_onnx_from(
    graph: &Graph,
    params: &dyn ParamSource,
    path: &Path,
    options: ExportOptions,
) -> Result<()> {
    let (proto, filler) = Filler::prepare(graph, params);
    write_with(proto, &filler, path, options)
}

/// Write `proto`, each initializer filled by `filler` as it is written.
fn write_with(
    proto: ModelProto,
    filler: &Filler,
    path: &Path,
    options: ExportOptions,
) -> Result<()> {
    let total = proto
        .graph
        .as_ref()
        .map_or(0, |g| g.initializer.iter().map(|i| filler.size(i)).sum());
    write_filled(proto, path, options, total, |init| filler.fill(init))
}

/// Write `proto` (initializer data inline) to `path`, moving the data to `<path>.data`
/// when `options` say so (see the module docs).
pub fn write_model(proto: ModelProto, path: &Path, options: ExportOptions) -> Result<()> {
    let total = proto
        .graph
        .as_ref()
        .map_or(0, |g| g.initializer.iter().map(|i| i.raw_data.len()).sum());
    write_filled(proto, path, options, total, |_| Ok(()))
}

/// The writer behind both: `fill` puts each initializer's data inline just before it is
/// written (or moved to the external file and dropped); `total` is the data's size.
fn write_filled(
    mut proto: ModelProto,
    path: &Path,
    options: ExportOptions,
    total: usize,
    fill: impl Fn(&mut TensorProto) -> Result<()>,
) -> Result<()> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(|e| OnnxError::io(dir, e))?;
    }
    let graph = proto
        .graph
        .as_mut()
        .ok_or_else(|| OnnxError::field("model.graph", "missing"))?;
    let external = match options.external_data {
        ExternalDataPolicy::Always => true,
        ExternalDataPolicy::Auto => total > options.threshold_bytes,
    };
    if !external {
        for init in graph.initializer.iter_mut() {
            fill(init)?;
        }
    } else {
        let name = path
            .file_name()
            .ok_or_else(|| OnnxError::field(path.display().to_string(), "not a file path"))?;
        let location = format!("{}.data", name.to_string_lossy());
        let data_path = path.with_file_name(&location);
        let tmp = path.with_file_name(format!(".{location}.tmp-{}", std::process::id()));
        let bar = progress(total as u64, "export");
        let written = (|| -> Result<()> {
            let io = |e| OnnxError::io(&tmp, e);
            let mut out = BufWriter::with_capacity(1 << 20, File::create(&tmp).map_err(io)?);
            let mut offset = 0usize;
            for init in graph.initializer.iter_mut() {
                fill(init)?;
                if init.raw_data.len() < EXTERNAL_MIN_BYTES {
                    continue;
                }
                let pad = offset.next_multiple_of(EXTERNAL_ALIGN) - offset;
                out.write_all(&[0u8; EXTERNAL_ALIGN][..pad]).map_err(io)?;
                offset += pad;
                let len = init.raw_data.len();
                out.write_all(&init.raw_data).map_err(io)?;
                bar.inc(len as u64);
                for (k, v) in [
                    ("location", location.clone()),
                    ("offset", offset.to_string()),
                    ("length", len.to_string()),
                ] {
                    init.external_data.push(Default::default());
                    let e = init.external_data.last_mut().expect("just pushed");
                    e.key = k.into();
                    e.value = v;
                }
                init.data_location = protobuf_external();
                init.raw_data = Default::default();
                offset += len;
            }
            out.into_inner()
                .map_err(|e| io(e.into_error()))?
                .sync_all()
                .map_err(io)?;
            std::fs::rename(&tmp, &data_path).map_err(|e| OnnxError::io(&data_path, e))
        })();
        bar.finish_and_clear();
        if written.is_err() {
            let _ = std::fs::remove_file(&tmp);
        }
        written?;
    }
    let bytes = proto
        .write_to_bytes()
        .map_err(|e| OnnxError::field("export", e.to_string()))?;
    write_atomic(path, &bytes)
}

/// `TensorProto.DataLocation.EXTERNAL`.
fn protobuf_external<E: protobuf::Enum>() -> protobuf::EnumOrUnknown<E> {
    protobuf::EnumOrUnknown::from_i32(1)
}
