//! Node attributes, decoded from `AttributeProto` with typed getters that name the
//! attribute in their errors.

use std::collections::HashMap;
use std::sync::Arc;

use onnx_ir::{AttributeProto, AttributeType};

use crate::error::{OnnxError, OpError, OpResult, Result};
use crate::graph::Body;
use crate::value::host_tensor::HostTensor;

/// The reserved attribute under which a node that owns subgraphs lists the outer-scope
/// values its subgraphs read ([`Attributes::captured`]): they are appended to the node's
/// inputs, in this order, so liveness, trainability and graph partitioning see them.
pub const CAPTURED: &str = "__captured";

/// One decoded attribute value.
#[derive(Debug, Clone, PartialEq)]
pub enum Attr {
    /// `f`
    Float(f32),
    /// `i`
    Int(i64),
    /// `s`
    String(String),
    /// `t`
    Tensor(HostTensor),
    /// `t` of strings (`LabelEncoder`'s `keys_tensor`).
    StringTensor(ndarray::ArrayD<String>),
    /// `floats`
    Floats(Vec<f32>),
    /// `ints`
    Ints(Vec<i64>),
    /// `strings`
    Strings(Vec<String>),
    /// `g`: a subgraph (If branches, Loop and Scan bodies), decoded and checked at load.
    Graph(Arc<Body>),
}

/// All attributes of one node.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Attributes(HashMap<String, Attr>);

impl Attributes {
    /// Decode a node's attribute list. Graph-valued attributes (control flow) are refused
    /// here: they need the enclosing scope, and `Graph::build` decodes them.
    pub fn from_protos(protos: &[AttributeProto], node: &str) -> Result<Self> {
        let mut map = HashMap::new();
        for a in protos {
            let field = || format!("node `{node}` attribute `{}`", a.name);
            let value = match a.type_.enum_value() {
                Ok(AttributeType::FLOAT) => Attr::Float(a.f),
                Ok(AttributeType::INT) => Attr::Int(a.i),
                Ok(AttributeType::STRING) => {
                    Attr::String(String::from_utf8_lossy(&a.s).into_owned())
                }
                Ok(AttributeType::TENSOR)
                    if a.t.data_type == crate::value::host_tensor::dtype::STRING =>
                {
                    let dims: Vec<usize> = a.t.dims.iter().map(|&d| d.max(0) as usize).collect();
                    let values =
                        a.t.string_data
                            .iter()
                            .map(|s| String::from_utf8_lossy(s).into_owned())
                            .collect();
                    Attr::StringTensor(
                        ndarray::ArrayD::from_shape_vec(ndarray::IxDyn(&dims), values)
                            .map_err(|e| OnnxError::field(field(), e.to_string()))?,
                    )
                }
                Ok(AttributeType::TENSOR) => Attr::Tensor(HostTensor::from_proto(&a.t, None)?),
                Ok(AttributeType::FLOATS) => Attr::Floats(a.floats.clone()),
                Ok(AttributeType::INTS) => Attr::Ints(a.ints.clone()),
                Ok(AttributeType::STRINGS) => Attr::Strings(
                    a.strings
                        .iter()
                        .map(|s| String::from_utf8_lossy(s).into_owned())
                        .collect(),
                ),
                Ok(other) => {
                    return Err(OnnxError::field(
                        field(),
                        format!("attribute type {other:?} is not supported"),
                    ));
                }
                Err(code) => {
                    return Err(OnnxError::field(
                        field(),
                        format!("unknown attribute type {code}"),
                    ));
                }
            };
            map.insert(a.name.clone(), value);
        }
        Ok(Attributes(map))
    }

    /// Is the attribute present?
    pub fn has(&self, name: &str) -> bool {
        self.0.contains_key(name)
    }

    fn wrong(name: &str, want: &str, got: &Attr) -> OpError {
        OpError(format!(
            "attribute `{name}` should be {want}, found {got:?}"
        ))
    }

    /// Integer attribute with a default.
    pub fn int(&self, name: &str, default: i64) -> OpResult<i64> {
        match self.0.get(name) {
            None => Ok(default),
            Some(Attr::Int(v)) => Ok(*v),
            Some(other) => Err(Self::wrong(name, "an int", other)),
        }
    }

    /// Float attribute with a default.
    pub fn float(&self, name: &str, default: f32) -> OpResult<f32> {
        match self.0.get(name) {
            None => Ok(default),
            Some(Attr::Float(v)) => Ok(*v),
            Some(Attr::Int(v)) => Ok(*v as f32),
            Some(other) => Err(Self::wrong(name, "a float", other)),
        }
    }

    /// String attribute with a default.
    pub fn string(&self, name: &str, default: &str) -> OpResult<String> {
        match self.0.get(name) {
            None => Ok(default.to_string()),
            Some(Attr::String(v)) => Ok(v.clone()),
            Some(other) => Err(Self::wrong(name, "a string", other)),
        }
    }

    /// Optional list of ints.
    pub fn ints(&self, name: &str) -> OpResult<Option<Vec<i64>>> {
        match self.0.get(name) {
            None => Ok(None),
            Some(Attr::Ints(v)) => Ok(Some(v.clone())),
            Some(other) => Err(Self::wrong(name, "a list of ints", other)),
        }
    }

    /// Optional list of floats.
    pub fn floats(&self, name: &str) -> OpResult<Option<&[f32]>> {
        match self.0.get(name) {
            None => Ok(None),
            Some(Attr::Floats(v)) => Ok(Some(v)),
            Some(other) => Err(Self::wrong(name, "a list of floats", other)),
        }
    }

    /// Optional tensor attribute.
    pub fn tensor(&self, name: &str) -> OpResult<Option<&HostTensor>> {
        match self.0.get(name) {
            None => Ok(None),
            Some(Attr::Tensor(t)) => Ok(Some(t)),
            Some(other) => Err(Self::wrong(name, "a tensor", other)),
        }
    }

    /// A subgraph attribute (required).
    pub fn graph(&self, name: &str) -> OpResult<&Body> {
        match self.0.get(name) {
            None => Err(OpError(format!("missing graph attribute `{name}`"))),
            Some(Attr::Graph(g)) => Ok(g),
            Some(other) => Err(Self::wrong(name, "a graph", other)),
        }
    }

    /// Every subgraph attribute, in no particular order.
    pub fn graphs(&self) -> impl Iterator<Item = &Body> {
        self.0.values().filter_map(|a| match a {
            Attr::Graph(g) => Some(&**g),
            _ => None,
        })
    }

    /// The outer-scope values this node's subgraphs read: the node's trailing inputs
    /// (empty for a node without subgraphs).
    pub fn captured(&self) -> &[String] {
        match self.0.get(CAPTURED) {
            Some(Attr::Strings(v)) => v,
            _ => &[],
        }
    }

    /// The raw attribute value.
    pub fn get(&self, name: &str) -> Option<&Attr> {
        self.0.get(name)
    }

    /// Set an attribute (graph rewrites annotate nodes this way).
    pub fn set(&mut self, name: &str, value: Attr) {
        self.0.insert(name.to_string(), value);
    }
}

/// The attribute marking a Conv that applies the named activation to its output itself
/// (set by `crate::onnx::fusion::fuse_conv_relu`).
pub const FUSED_ACTIVATION: &str = "__fused_activation";

/// The attribute marking a Softmax that scales and masks its input itself: `[c, divide,
/// fill, keep_when]` for `softmax(where(mask == keep_when, x * c (x / c when divide is 1),
/// fill) + bias)`, the mask and the bias its optional second and third inputs (set by
/// `crate::onnx::fusion::fuse_masked_softmax`).
pub const MASKED_SOFTMAX: &str = "__masked_softmax";

/// The attribute marking a Softmax that also computes the two products around it:
/// `MatMul(Softmax(scores), v)` with `scores = MatMul(q, kt)` (scaled and masked as
/// [`MASKED_SOFTMAX`] says, when it is there), the inputs `[q, kt, v, mask, bias]`, the
/// output the second product's (set by `crate::onnx::fusion::fuse_attention_core`).
pub const ATTENTION_CORE: &str = "__attention_core";

/// The attribute marking a MatMul or Gemm whose product is widened to this many columns:
/// its right-hand side (and a Gemm's bias) padded with zero columns, so the output's rows
/// are aligned for vectorized kernels; the loss reading it knows how many columns are
/// classes (set by `crate::model::padded_head`).
pub const PAD_COLUMNS: &str = "__pad_columns";

/// The attribute marking a MatMul whose product, under autocast on a CubeCL device, is
/// written in the autocast precision instead of f32: the head whose logits only the loss
/// reads (set by `crate::model::head_precision`).
pub const LOW_PRECISION_RESULT: &str = "__low_precision_result";

/// The attribute marking a MatMul head whose product a training pass leaves to the loss:
/// the pass skips the node, and the cross-entropy computes the product with itself a block
/// of rows at a time, so the logits never exist whole (set by
/// `crate::model::fused_head_loss`). Evaluation runs the node as it is.
pub const FUSED_HEAD_LOSS: &str = "__fused_head_loss";
