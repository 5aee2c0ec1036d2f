//! The MLP's hidden activation in the products' precision. Under autocast a product
//! writes f32 (`kernels::cube_matmul`), so a transformer's MLP kept its `[rows, 4 x
//! width]` hidden activation (the first product's output, which the GELU's backward reads)
//! in f32, wrote the GELU's output in f32, cast it down for the second product, and cast
//! both their gradients down again for the products' backward: 16 bytes an element where
//! PyTorch's autocast keeps 2 (the product's result rounded to bf16, the GELU run on it).
//!
//! A product whose one reader is a biased tanh `Gelu` (`onnx::fusion::fuse_gelu_bias`)
//! whose every reader is a product is marked [`LOW_PRECISION_RESULT`]: on a CubeCL device
//! under autocast it writes its result in the autocast precision, the GELU reads it so,
//! computes in f32 and writes its output in it too, and the next product reads that with
//! no cast. Backward, each gradient comes back in its value's precision (the product's
//! backward writes each operand's gradient in the operand's own, `kernels::cube_matmul`),
//! and the bias's gradient is summed with f32 accumulators, rounded to the autocast
//! precision (as PyTorch's autocast rounds a bias gradient) and handed to the f32 bias in
//! f32. The plan marks
//! the model on CubeCL devices when no pipeline cut could fall between the marked nodes
//! (`train::layout::parallel_plan`).

use std::collections::HashMap;
use std::sync::Arc;

use super::{OnnxModel, Spec};
use crate::graph::Graph;
use crate::graph::attributes::{Attr, LOW_PRECISION_RESULT};

impl OnnxModel {
    /// This model with every MatMul that feeds a biased tanh `Gelu` alone, whose output
    /// only MatMuls read, marked to write its result in the autocast precision (see the
    /// module doc), and how many were marked.
    pub fn with_low_precision_mlp(mut self) -> (OnnxModel, usize) {
        let marked = mlp_products(self.graph());
        if marked.is_empty() {
            return (self, 0);
        }
        let mut graph = self.graph().clone();
        for &node in &marked {
            graph.nodes[node]
                .attrs
                .set(LOW_PRECISION_RESULT, Attr::Int(1));
        }
        self.spec = Arc::new(Spec {
            graph: Arc::new(graph),
            ..(*self.spec).clone()
        });
        (self, marked.len())
    }
}

/// The MatMul nodes of `graph` whose output only a biased tanh `Gelu` reads, that `Gelu`'s
/// output read by MatMul nodes only (and neither a graph output).
fn mlp_products(graph: &Graph) -> Vec<usize> {
    let mut readers: HashMap<&str, Vec<usize>> = HashMap::new();
    let mut producer: HashMap<&str, usize> = HashMap::new();
    for (i, n) in graph.nodes.iter().enumerate() {
        for input in &n.inputs {
            readers.entry(input.as_str()).or_default().push(i);
        }
        for output in &n.outputs {
            producer.insert(output.as_str(), i);
        }
    }
    let is_output = |v: &str| graph.outputs.iter().any(|o| o.name == v);
    let only_products = |v: &str| {
        !is_output(v)
            && readers.get(v).is_some_and(|r| {
                !r.is_empty() && r.iter().all(|&k| graph.nodes[k].op_type == "MatMul")
            })
    };
    graph
        .nodes
        .iter()
        .enumerate()
        .filter(|(_, n)| n.op_type == "Gelu" && n.inputs.len() == 2 && n.outputs.len() == 1)
        .filter(|(_, n)| n.attrs.string("approximate", "none").ok().as_deref() == Some("tanh"))
        .filter(|(_, n)| only_products(&n.outputs[0]))
        .filter_map(|(g, n)| {
            let x = n.inputs[0].as_str();
            let p = *producer.get(x)?;
            let sole_reader = readers.get(x).is_some_and(|r| r == &[g]);
            (graph.nodes[p].op_type == "MatMul" && sole_reader && !is_output(x)).then_some(p)
        })
        .collect()
}
