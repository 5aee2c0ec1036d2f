//! The decoded program the interpreter runs: [`Graph`] (nodes in execution order with
//! their attributes and implementations, initializers under their original names, graph
//! inputs and outputs), the [`Node`]s and control-flow [`Body`]s it is made of, their
//! [`attributes`], and the calling convention every op implements ([`op_api`]).
//!
//! These are the types at the bottom of the data path: ops read them, the loader
//! (`crate::onnx::loader`) builds them from an ONNX file, the model runs them.

use std::collections::HashMap;
use std::path::PathBuf;

use onnx_ir::ModelProto;

use crate::graph::initializer::Initializer;
use crate::graph::initializer_ties::TieDecision;
use crate::value::host_tensor::HostTensor;

pub mod attributes;
pub mod head;
pub mod initializer;
pub mod initializer_ties;
pub mod op_api;

use attributes::Attributes;

use op_api::OpFn;

/// A dimension of a declared graph input or output.
#[derive(Debug, Clone, PartialEq)]
pub enum Dim {
    /// A fixed size.
    Fixed(usize),
    /// A named (dynamic) size such as `batch`.
    Symbolic(String),
}

/// Declared dims as `inspect` and the starter config print them: `[batch, seq, 1024]`
/// (`?` for an unnamed dynamic one).
pub fn dims_text(dims: &[Dim]) -> String {
    let parts: Vec<String> = dims
        .iter()
        .map(|d| match d {
            Dim::Fixed(n) => n.to_string(),
            Dim::Symbolic(s) if s.is_empty() => "?".into(),
            Dim::Symbolic(s) => s.clone(),
        })
        .collect();
    format!("[{}]", parts.join(", "))
}

/// What a declared graph value holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ValueKind {
    /// A tensor.
    #[default]
    Tensor,
    /// A sequence of tensors (`elem_type` and `dims` are its tensors').
    Sequence,
}

/// A declared graph input or output.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct TensorInfo {
    /// Name.
    pub name: String,
    /// ONNX element type code (see [`crate::value::host_tensor::dtype`]).
    pub elem_type: i32,
    /// Declared dims; empty if the file declares none.
    pub dims: Vec<Dim>,
    /// A tensor or a sequence of them.
    pub kind: ValueKind,
    /// Declared optional: the value may be absent (the empty optional).
    pub optional: bool,
}

/// One executable node.
#[derive(Debug, Clone)]
pub struct Node {
    /// Node name, or `<op_type>#<index>` when the file gives none.
    pub name: String,
    /// ONNX op type.
    pub op_type: String,
    /// Input edge names (empty string: omitted optional input).
    pub inputs: Vec<String>,
    /// Output edge names.
    pub outputs: Vec<String>,
    /// Decoded attributes.
    pub attrs: Attributes,
    /// The implementation.
    pub op: OpFn,
}

/// A subgraph: the branch of an `If`, the body of a `Loop` or `Scan`, decoded and checked
/// like the main graph. Its nodes may read outer-scope values (values computed earlier in
/// the enclosing graph, its inputs and initializers): those are listed in `captured`, and
/// the owning node reads them as extra inputs ([`crate::graph::attributes::CAPTURED`]).
#[derive(Clone)]
pub struct Body {
    /// `<owning node>.<attribute>`, for errors.
    pub name: String,
    /// Formal inputs, bound by the owning op on every run.
    pub inputs: Vec<TensorInfo>,
    /// Formal outputs.
    pub outputs: Vec<TensorInfo>,
    /// Nodes to execute, in order.
    pub nodes: Vec<Node>,
    /// The body's own initializers and folded `Constant` nodes.
    pub constants: HashMap<String, HostTensor>,
    /// Outer-scope names the body (or a subgraph nested in it) reads, in first-use order.
    pub captured: Vec<String>,
    /// For every edge read in the body, the index of the last body node that reads it.
    pub last_use: HashMap<String, usize>,
}

impl std::fmt::Debug for Body {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Body")
            .field("name", &self.name)
            .field("inputs", &self.inputs.len())
            .field("outputs", &self.outputs.len())
            .field("nodes", &self.nodes.len())
            .field("captured", &self.captured)
            .finish()
    }
}

impl PartialEq for Body {
    fn eq(&self, other: &Self) -> bool {
        self.name == other.name
            && self.inputs == other.inputs
            && self.outputs == other.outputs
            && self.captured == other.captured
            && self.nodes.len() == other.nodes.len()
            && self.nodes.iter().zip(&other.nodes).all(|(a, b)| {
                a.name == b.name
                    && a.op_type == b.op_type
                    && a.inputs == b.inputs
                    && a.outputs == b.outputs
                    && a.attrs == b.attrs
            })
    }
}

/// For every edge read by `nodes`, the index of the last node reading it.
pub fn last_uses(nodes: &[Node]) -> HashMap<String, usize> {
    let mut last_use = HashMap::new();
    for (i, n) in nodes.iter().enumerate() {
        for input in n.inputs.iter().filter(|i| !i.is_empty()) {
            last_use.insert(input.clone(), i);
        }
    }
    last_use
}

/// A decoded, checked ONNX model.
#[derive(Clone)]
pub struct Graph {
    /// The file it came from, if any.
    pub source: Option<PathBuf>,
    /// The original protobuf (kept for export).
    pub model: ModelProto,
    /// `ai.onnx` opset version.
    pub opset: i64,
    /// Nodes to execute, in order (`Constant` nodes are folded into `constants`).
    pub nodes: Vec<Node>,
    /// Graph inputs the caller must feed (initializers excluded).
    pub inputs: Vec<TensorInfo>,
    /// Graph outputs.
    pub outputs: Vec<TensorInfo>,
    /// Initializers, in file order, under their original names (moved into the parameters
    /// and constants by `OnnxModel::from_graph`); big float ones read in place from the
    /// file ([`Initializer`]).
    pub initializers: Vec<(String, Initializer)>,
    /// Outputs of `Constant` nodes.
    pub constants: HashMap<String, HostTensor>,
    /// For every edge, the index of the last node that reads it.
    pub last_use: HashMap<String, usize>,
    /// The initializer-tie rewrites applied at load ([`crate::graph::initializer_ties`]).
    pub ties: Vec<TieDecision>,
    /// Index of the first node in the whole model's order (non-zero for a pipeline stage's
    /// part of a graph): random streams are keyed by it, so a stage draws what the whole
    /// graph would.
    pub node_offset: usize,
}

impl std::fmt::Debug for Graph {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Graph")
            .field("source", &self.source)
            .field("opset", &self.opset)
            .field("nodes", &self.nodes.len())
            .field("inputs", &self.inputs)
            .field("outputs", &self.outputs)
            .field("initializers", &self.initializers.len())
            .finish()
    }
}

impl Graph {
    /// Count of each op type, `Constant` nodes included.
    pub fn op_counts(&self) -> Vec<(String, usize)> {
        let mut counts: HashMap<String, usize> = HashMap::new();
        if let Some(g) = self.model.graph.as_ref() {
            for n in &g.node {
                *counts.entry(n.op_type.clone()).or_default() += 1;
            }
        }
        let mut v: Vec<_> = counts.into_iter().collect();
        v.sort();
        v
    }
}
