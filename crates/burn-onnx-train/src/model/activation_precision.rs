//! Activations in the products' precision. Under autocast a product reads low-precision
//! operands and writes f32 (`kernels::cube_matmul`), and the ops between products run in
//! f32, so a value that only products read was written in f32 and cast down again, and
//! its gradient came back in f32 and was cast down again:
//!
//! - the MLP's `[rows, 4 x width]` hidden activation: the first product's output, kept in
//!   f32 for the GELU's backward, the GELU's output written in f32 and cast for the second
//!   product, 16 bytes an element where PyTorch's autocast keeps 2;
//! - a layer norm's output read by products only (GPT-2's `ln_1`, `ln_2`, `ln_f`): written
//!   in f32 and cast for each product (PyTorch's autocast does the same);
//! - the attention core's output (`onnx::fusion::fuse_attention_core`), its heads merged
//!   by a transpose and a reshape for the output projection: written in f32, cast while
//!   merged, its gradient cast down again for the core's backward.
//!
//! Nodes whose output may be written in the autocast precision are marked
//! [`LOW_PRECISION_RESULT`]: a MatMul whose one reader is a biased tanh `Gelu`
//! (`onnx::fusion::fuse_gelu_bias`) whose every reader is a MatMul ([`mlp_products`]), a
//! `LayerNormalization` whose every reader is a MatMul ([`product_norms`]), and an
//! attention core whose output only MatMuls read, through `Transpose` and `Reshape`
//! ([`product_attention`]). On a CubeCL device under autocast the product then writes its
//! result in that precision, the GELU kernels read and write it computing in f32, the
//! norm's kernel and the attention core's last product write it from their f32
//! arithmetic, and the next product reads it with no cast. Backward, each gradient comes
//! back in its value's precision (the product's backward writes each operand's gradient in
//! the operand's own, `kernels::cube_matmul`); the GELU's bias gradient is summed with f32
//! accumulators, rounded to the autocast precision (as PyTorch's autocast rounds a bias
//! gradient) and handed to the f32 bias in f32; the norm's kernels read the gradient in
//! its precision and give f32 gradients. The plan marks the model on CubeCL devices
//! (`train::layout::parallel_plan`: not under pipeline parallelism, whose cut may fall
//! between the marked nodes, and the norms not under tensor parallelism, whose collective
//! sits between a norm and its products).

use std::collections::HashMap;

use super::OnnxModel;
use crate::graph::Graph;
use crate::graph::attributes::{ATTENTION_CORE, LOW_PRECISION_RESULT};

impl OnnxModel {
    /// This model with every MatMul that feeds a biased tanh `Gelu` alone, whose output
    /// only MatMuls read, marked to write its result in the autocast precision (see the
    /// module doc), and how many were marked.
    pub fn with_low_precision_mlp(self) -> (OnnxModel, usize) {
        let marked = mlp_products(self.graph());
        self.with_mark(&marked, LOW_PRECISION_RESULT)
    }

    /// This model with every `LayerNormalization` whose output only MatMuls read marked to
    /// write it in the autocast precision (see the module doc), and how many were marked.
    pub fn with_low_precision_norms(self) -> (OnnxModel, usize) {
        let marked = product_norms(self.graph());
        self.with_mark(&marked, LOW_PRECISION_RESULT)
    }

    /// This model with every attention core whose output only MatMuls read (through
    /// `Transpose` and `Reshape`) marked to write it in the autocast precision (see the
    /// module doc), and how many were marked.
    pub fn with_low_precision_attention(self) -> (OnnxModel, usize) {
        let marked = product_attention(self.graph());
        self.with_mark(&marked, LOW_PRECISION_RESULT)
    }
}

/// Who reads and who writes each value of a graph.
struct Readers<'g> {
    graph: &'g Graph,
    readers: HashMap<&'g str, Vec<usize>>,
    producer: HashMap<&'g str, usize>,
}

impl<'g> Readers<'g> {
    fn of(graph: &'g Graph) -> Self {
        let mut readers: HashMap<&str, Vec<usize>> = HashMap::new();
        let mut producer = HashMap::new();
        for (i, n) in graph.nodes.iter().enumerate() {
            for input in &n.inputs {
                readers.entry(input.as_str()).or_default().push(i);
            }
            for output in &n.outputs {
                producer.insert(output.as_str(), i);
            }
        }
        Readers {
            graph,
            readers,
            producer,
        }
    }

    fn is_output(&self, v: &str) -> bool {
        self.graph.outputs.iter().any(|o| o.name == v)
    }

    /// Whether `v` is read, by MatMul nodes only, and is no graph output.
    fn only_products(&self, v: &str) -> bool {
        !self.is_output(v)
            && self.readers.get(v).is_some_and(|r| {
                !r.is_empty() && r.iter().all(|&k| self.graph.nodes[k].op_type == "MatMul")
            })
    }

    /// Whether `v` is read, by MatMul nodes only or by `Transpose` and `Reshape` nodes whose
    /// outputs are so read, and is no graph output.
    fn only_products_through_views(&self, v: &str) -> bool {
        !self.is_output(v)
            && self.readers.get(v).is_some_and(|r| {
                !r.is_empty()
                    && r.iter().all(|&k| {
                        let n = &self.graph.nodes[k];
                        match n.op_type.as_str() {
                            "MatMul" => true,
                            "Transpose" | "Reshape" => {
                                n.inputs[0] == v
                                    && n.outputs.len() == 1
                                    && self.only_products_through_views(&n.outputs[0])
                            }
                            _ => false,
                        }
                    })
            })
    }

    /// Whether node `node` alone reads `v`, and `v` is no graph output.
    fn read_only_by(&self, v: &str, node: usize) -> bool {
        !self.is_output(v) && self.readers.get(v).is_some_and(|r| r == &[node])
    }
}

/// The MatMul nodes of `graph` whose output only a biased tanh `Gelu` reads, that `Gelu`'s
/// output read by MatMul nodes only (and neither a graph output).
fn mlp_products(graph: &Graph) -> Vec<usize> {
    let view = Readers::of(graph);
    graph
        .nodes
        .iter()
        .enumerate()
        .filter(|(_, n)| n.op_type == "Gelu" && n.inputs.len() == 2 && n.outputs.len() == 1)
        .filter(|(_, n)| n.attrs.string("approximate", "none").ok().as_deref() == Some("tanh"))
        .filter(|(_, n)| view.only_products(&n.outputs[0]))
        .filter_map(|(g, n)| {
            let x = n.inputs[0].as_str();
            let p = *view.producer.get(x)?;
            (graph.nodes[p].op_type == "MatMul" && view.read_only_by(x, g)).then_some(p)
        })
        .collect()
}

/// The attention cores of `graph` whose output MatMul nodes only read, through `Transpose`
/// and `Reshape`.
fn product_attention(graph: &Graph) -> Vec<usize> {
    let view = Readers::of(graph);
    graph
        .nodes
        .iter()
        .enumerate()
        .filter(|(_, n)| n.attrs.has(ATTENTION_CORE) && n.outputs.len() == 1)
        .filter(|(_, n)| view.only_products_through_views(&n.outputs[0]))
        .map(|(i, _)| i)
        .collect()
}

/// The `LayerNormalization` nodes of `graph` with one output, read by MatMul nodes only.
fn product_norms(graph: &Graph) -> Vec<usize> {
    let view = Readers::of(graph);
    graph
        .nodes
        .iter()
        .enumerate()
        .filter(|(_, n)| n.op_type == "LayerNormalization")
        .filter(|(_, n)| n.outputs.iter().filter(|o| !o.is_empty()).count() == 1)
        .filter(|(_, n)| view.only_products(&n.outputs[0]))
        .map(|(i, _)| i)
        .collect()
}
