//! Loading an ONNX file into a [`Graph`]: decoded and checked, nodes in execution order with
//! their attributes and implementations, initializers under their original names.
//!
//! Everything that can be checked before running is checked here, so that a bad file fails
//! at load time with the file, node or field named: protobuf decoding, unsupported ops,
//! dangling edges (the graph must be topologically sorted, as the ONNX spec requires),
//! malformed initializers. Calls of model-local functions are expanded first,
//! `Constant` nodes are evaluated once here, control-flow subgraphs (`If` branches, `Loop`
//! and `Scan` bodies) are decoded and checked recursively into [`Body`]s whose outer reads
//! become trailing inputs of their node, known subgraphs become fused ops
//! ([`crate::onnx::fusion`]), and quantization nodes are told their zero point's element type
//! where the file states it ([`ops::annotate_zero_point_types`]).

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use burn::tensor::Device;
use onnx_ir::{
    AttributeProto, AttributeType, GraphProto, Message, ModelProto, NodeProto, TypeProto,
    ValueInfoProto,
};

use crate::error::{OnnxError, Result};
use crate::graph::attributes::{Attr, Attributes, CAPTURED};
use crate::graph::initializer::Initializer;
use crate::graph::initializer_ties::TieOptions;
use crate::graph::{Body, Dim, Graph, Node, TensorInfo, ValueKind, last_uses};
use crate::model::OnnxModel;
use crate::onnx::functions::inline_functions;
use crate::ops;
use crate::util::progress::progress;
use crate::value::host_tensor::{ExternalData, HostTensor};

/// Decode and check `protos` (a graph's nodes, local functions expanded) into executable
/// nodes and folded constants. `defined` holds every name visible so far (for a subgraph,
/// the enclosing scopes' names too) and grows with the nodes' outputs. Subgraph attributes
/// are decoded recursively; the outer names they read become trailing inputs of their node.
/// `scope` prefixes generated node names inside subgraphs (empty for the main graph).
fn build_nodes(
    model: &ModelProto,
    protos: &[NodeProto],
    defined: &mut HashSet<String>,
    scope: &str,
) -> Result<(Vec<Node>, HashMap<String, HostTensor>)> {
    let mut nodes = Vec::with_capacity(protos.len());
    let mut constants = HashMap::new();
    for (index, n) in protos.iter().enumerate() {
        let name = if !n.name.is_empty() {
            n.name.clone()
        } else if scope.is_empty() {
            format!("{}#{index}", n.op_type)
        } else {
            format!("{scope}/{}#{index}", n.op_type)
        };
        let constant = n.op_type == "Constant" && (n.domain.is_empty() || n.domain == "ai.onnx");
        if !constant && ops::lookup_in(&n.domain, &n.op_type).is_none() {
            return Err(OnnxError::UnsupportedOp {
                node: name,
                op_type: n.op_type.clone(),
                domain: if n.domain.is_empty() {
                    "ai.onnx".into()
                } else {
                    n.domain.clone()
                },
                supported: ops::supported().join(", "),
            });
        }
        for input in n.input.iter().filter(|i| !i.is_empty()) {
            if !defined.contains(input) {
                return Err(OnnxError::Node {
                    node: name,
                    op_type: n.op_type.clone(),
                    message: format!(
                        "input '{input}' is not a graph input, an initializer or the output of an earlier node \
                         (is the graph topologically sorted?)"
                    ),
                });
            }
        }
        let is_graph = |a: &&AttributeProto| a.type_.enum_value() == Ok(AttributeType::GRAPH);
        let has_graphs = n.attribute.iter().any(|a| is_graph(&a));
        let mut attrs = if has_graphs {
            let plain: Vec<AttributeProto> = n
                .attribute
                .iter()
                .filter(|a| !is_graph(a))
                .cloned()
                .collect();
            Attributes::from_protos(&plain, &name)?
        } else {
            Attributes::from_protos(&n.attribute, &name)?
        };
        let mut inputs = n.input.clone();
        if has_graphs {
            let mut captured: Vec<String> = Vec::new();
            for a in n.attribute.iter().filter(is_graph) {
                let body = build_body(model, &a.g, defined, format!("{name}.{}", a.name))?;
                for c in &body.captured {
                    if !captured.contains(c) {
                        captured.push(c.clone());
                    }
                }
                attrs.set(&a.name, Attr::Graph(Arc::new(body)));
            }
            inputs.extend(captured.iter().cloned());
            attrs.set(CAPTURED, Attr::Strings(captured));
        }
        defined.extend(n.output.iter().filter(|o| !o.is_empty()).cloned());
        if n.op_type == "Constant" {
            let out = n.output.first().ok_or_else(|| OnnxError::Node {
                node: name.clone(),
                op_type: "Constant".into(),
                message: "has no output".into(),
            })?;
            constants.insert(out.clone(), constant_value(&attrs, &name)?);
            continue;
        }
        let op = ops::lookup_in(&n.domain, &n.op_type).expect("checked above");
        nodes.push(Node {
            name,
            op_type: n.op_type.clone(),
            inputs,
            outputs: n.output.clone(),
            attrs,
            op,
        });
    }
    Ok((nodes, constants))
}

/// Decode and check the subgraph `g` of a node; `outer` holds the names visible where the
/// node stands.
fn build_body(
    model: &ModelProto,
    g: &GraphProto,
    outer: &HashSet<String>,
    name: String,
) -> Result<Body> {
    let field = |what: String| format!("subgraph '{name}' {what}");
    let mut constants = HashMap::new();
    for t in &g.initializer {
        if t.name.is_empty() {
            return Err(OnnxError::field(field("initializer".into()), "has no name"));
        }
        constants.insert(t.name.clone(), HostTensor::from_proto(t, None)?);
    }
    let inputs: Vec<TensorInfo> = g
        .input
        .iter()
        .filter(|vi| !constants.contains_key(&vi.name))
        .map(tensor_info)
        .collect();
    let mut defined = outer.clone();
    defined.extend(constants.keys().cloned());
    defined.extend(inputs.iter().map(|i| i.name.clone()));
    let flat = inline_functions(model, &g.node)?;
    let (nodes, folded) = build_nodes(model, &flat, &mut defined, &name)?;
    constants.extend(folded);
    // Names the body defines itself; everything else it reads comes from outside.
    let mut local: HashSet<&str> = constants.keys().map(String::as_str).collect();
    local.extend(inputs.iter().map(|i| i.name.as_str()));
    let mut captured: Vec<String> = Vec::new();
    for n in &nodes {
        for input in n.inputs.iter().filter(|i| !i.is_empty()) {
            if !local.contains(input.as_str()) && !captured.contains(input) {
                captured.push(input.clone());
            }
        }
        local.extend(n.outputs.iter().map(String::as_str));
    }
    let outputs: Vec<TensorInfo> = g.output.iter().map(tensor_info).collect();
    for o in &outputs {
        if !defined.contains(&o.name) {
            return Err(OnnxError::field(
                field(format!("output '{}'", o.name)),
                "is not produced by any node",
            ));
        }
        if !local.contains(o.name.as_str()) && !captured.contains(&o.name) {
            captured.push(o.name.clone());
        }
    }
    let last_use = last_uses(&nodes);
    Ok(Body {
        name,
        inputs,
        outputs,
        nodes,
        constants,
        captured,
        last_use,
    })
}

fn tensor_info(vi: &ValueInfoProto) -> TensorInfo {
    let mut ty: &TypeProto = &vi.type_;
    let optional = ty.has_optional_type();
    if optional {
        ty = &ty.optional_type().elem_type;
    }
    let kind = if ty.has_sequence_type() {
        ty = &ty.sequence_type().elem_type;
        ValueKind::Sequence
    } else {
        ValueKind::Tensor
    };
    let tt = ty.tensor_type();
    let dims = tt
        .shape
        .dim
        .iter()
        .map(|d| {
            if d.has_dim_value() && d.dim_value() >= 0 {
                Dim::Fixed(d.dim_value() as usize)
            } else {
                Dim::Symbolic(d.dim_param().to_string())
            }
        })
        .collect();
    TensorInfo {
        name: vi.name.clone(),
        elem_type: tt.elem_type,
        dims,
        kind,
        optional,
    }
}

fn constant_value(attrs: &Attributes, node: &str) -> Result<HostTensor> {
    use ndarray::{ArrayD, IxDyn};
    let bad = |m: &str| OnnxError::Node {
        node: node.to_string(),
        op_type: "Constant".into(),
        message: m.to_string(),
    };
    let one = |v: Vec<f32>, shape: &[usize]| {
        ArrayD::from_shape_vec(IxDyn(shape), v).map(HostTensor::Float)
    };
    let onei =
        |v: Vec<i64>, shape: &[usize]| ArrayD::from_shape_vec(IxDyn(shape), v).map(HostTensor::Int);
    let out = match (
        attrs.get("value"),
        attrs.get("value_float"),
        attrs.get("value_floats"),
        attrs.get("value_int"),
        attrs.get("value_ints"),
    ) {
        (Some(Attr::Tensor(t)), ..) => Ok(t.clone()),
        (_, Some(Attr::Float(f)), ..) => one(vec![*f], &[]),
        (_, _, Some(Attr::Floats(v)), ..) => one(v.clone(), &[v.len()]),
        (_, _, _, Some(Attr::Int(i)), _) => onei(vec![*i], &[]),
        (.., Some(Attr::Ints(v))) => onei(v.clone(), &[v.len()]),
        _ => {
            return Err(bad(
                "needs one of the attributes value, value_float(s), value_int(s)",
            ));
        }
    };
    out.map_err(|e| bad(&e.to_string()))
}

/// A mapped model file as the owner of the bytes the protobuf decoder slices.
struct MappedFile(Arc<memmap2::Mmap>);

impl AsRef<[u8]> for MappedFile {
    fn as_ref(&self) -> &[u8] {
        &self.0
    }
}

impl OnnxModel {
    /// Load an ONNX file onto `device` (use an autodiff device to train): [`Graph::load`],
    /// then [`OnnxModel::from_graph`].
    pub fn load(path: impl AsRef<Path>, device: &Device) -> Result<Self> {
        Self::from_graph(Graph::load(path)?, device)
    }
}

impl Graph {
    /// Load and check an ONNX file.
    ///
    /// The file is memory-mapped and decoded in place: big float32 initializers stay in the
    /// mapping (and in mapped external data files) and are read there
    /// ([`crate::graph::initializer::Initializer`]); the others are decoded straight from it. Each
    /// initializer's pages leave the resident set once read, so loading costs the small
    /// tensors' memory, not the model's.
    pub fn load(path: impl AsRef<Path>) -> Result<Self> {
        Self::load_with(path, TieOptions::default())
    }

    /// [`Graph::load`] with a choice of the initializer-tie rewrites
    /// ([`crate::graph::initializer_ties`]).
    pub fn load_with(path: impl AsRef<Path>, ties: TieOptions) -> Result<Self> {
        let path = path.as_ref();
        let file = std::fs::File::open(path).map_err(|e| OnnxError::io(path, e))?;
        // SAFETY: a read-only map; the file changing under a running load is outside what a
        // loader can defend against, as for every mmap-based loader.
        let map =
            Arc::new(unsafe { memmap2::Mmap::map(&file) }.map_err(|e| OnnxError::io(path, e))?);
        // Read ahead: the decoder walks the file front to back once.
        let _ = map.advise(memmap2::Advice::Sequential);
        let bytes = bytes::Bytes::from_owner(MappedFile(map.clone()));
        let model = ModelProto::parse_from_tokio_bytes(&bytes);
        Self::decoded(model, Some(path), Some(&map), ties)
    }

    /// Decode and check ONNX bytes; `source` names the file in errors and resolves
    /// external data.
    pub fn from_bytes(bytes: &[u8], source: Option<&Path>) -> Result<Self> {
        Self::decoded(
            ModelProto::parse_from_bytes(bytes),
            source,
            None,
            TieOptions::default(),
        )
    }

    fn decoded(
        model: protobuf::Result<ModelProto>,
        source: Option<&Path>,
        mapped: Option<&Arc<memmap2::Mmap>>,
        ties: TieOptions,
    ) -> Result<Self> {
        let label = source.map_or_else(|| PathBuf::from("<memory>"), Path::to_path_buf);
        let model = model.map_err(|e| OnnxError::Decode {
            path: label.clone(),
            what: "ONNX model",
            message: e.to_string(),
        })?;
        Self::build(model, source, mapped, ties).map_err(|e| match e {
            OnnxError::Field { field, message } => OnnxError::Decode {
                path: label,
                what: "ONNX model",
                message: format!("{field}: {message}"),
            },
            other => other,
        })
    }

    /// Check a decoded model.
    pub fn from_proto(model: ModelProto, source: Option<&Path>) -> Result<Self> {
        Self::build(model, source, None, TieOptions::default())
    }

    /// [`Graph::from_proto`]; `mapped` is the file mapping the proto's data points into.
    fn build(
        mut model: ModelProto,
        source: Option<&Path>,
        mapped: Option<&Arc<memmap2::Mmap>>,
        ties: TieOptions,
    ) -> Result<Self> {
        let Some(g) = model.graph.as_ref() else {
            return Err(OnnxError::field(
                "model.graph",
                "missing (empty or truncated file?)",
            ));
        };
        // A graph of other domains' ops alone (ORT Training's optimizer graphs) may declare
        // no ai.onnx opset; the default domain's op semantics then never come up.
        let default_domain = |d: &str| d.is_empty() || d == "ai.onnx";
        let opset = match model
            .opset_import
            .iter()
            .find(|o| default_domain(&o.domain))
        {
            Some(o) => o.version,
            None if !g.node.iter().any(|n| default_domain(&n.domain)) => 0,
            None => {
                return Err(OnnxError::field(
                    "model.opset_import",
                    "no ai.onnx opset declared",
                ));
            }
        };
        let external = source.map(|s| {
            ExternalData::new(
                s.parent()
                    .filter(|p| !p.as_os_str().is_empty())
                    .unwrap_or(Path::new(".")),
            )
        });

        let mut initializers = Vec::with_capacity(g.initializer.len());
        let mut defined: HashSet<String> = HashSet::new();
        let bytes_of = |t: &onnx_ir::TensorProto| {
            let external = t
                .external_data
                .iter()
                .find(|e| e.key == "length")
                .and_then(|e| e.value.parse::<u64>().ok());
            external.unwrap_or(t.raw_data.len() as u64)
        };
        let bar = progress(g.initializer.iter().map(bytes_of).sum(), "load");
        for t in &g.initializer {
            bar.inc(bytes_of(t));
            if t.name.is_empty() {
                return Err(OnnxError::field(
                    "graph.initializer",
                    "an initializer has no name",
                ));
            }
            if !defined.insert(t.name.clone()) {
                return Err(OnnxError::field(
                    format!("initializer '{}'", t.name),
                    "defined twice",
                ));
            }
            initializers.push((
                t.name.clone(),
                Initializer::load(t, mapped, external.as_ref())?,
            ));
        }
        bar.finish_and_clear();
        let ties = match model.graph.as_mut() {
            Some(g) => crate::graph::initializer_ties::apply(g, &mut initializers, ties),
            None => Vec::new(),
        };
        let mut defined: HashSet<String> = initializers.iter().map(|(n, _)| n.clone()).collect();
        let Some(g) = model.graph.as_ref() else {
            unreachable!("checked above")
        };
        let inputs: Vec<TensorInfo> = g
            .input
            .iter()
            .filter(|vi| !defined.contains(&vi.name))
            .map(tensor_info)
            .collect();
        defined.extend(inputs.iter().map(|i| i.name.clone()));

        let flat = inline_functions(&model, &g.node)?;
        let (nodes, constants) = build_nodes(&model, &flat, &mut defined, "")?;
        let last_use = last_uses(&nodes);
        let outputs: Vec<TensorInfo> = g.output.iter().map(tensor_info).collect();
        for o in &outputs {
            if !defined.contains(&o.name) {
                return Err(OnnxError::field(
                    format!("graph output '{}'", o.name),
                    "is not produced by any node",
                ));
            }
        }
        let mut graph = Graph {
            source: source.map(Path::to_path_buf),
            model,
            opset,
            nodes,
            inputs,
            outputs,
            initializers,
            constants,
            last_use,
            node_offset: 0,
            ties,
        };
        ops::annotate_zero_point_types(&mut graph);
        crate::onnx::fusion::fuse_gelu(&mut graph);
        crate::onnx::fusion::fuse_gelu_bias(&mut graph);
        crate::onnx::fusion::fuse_bias_residual(&mut graph);
        crate::onnx::fusion::fuse_conv_relu(&mut graph);
        crate::onnx::fusion::fuse_masked_softmax(&mut graph);
        crate::onnx::fusion::fuse_attention_core(&mut graph);
        Ok(graph)
    }
}
