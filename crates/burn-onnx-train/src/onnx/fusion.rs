//! Graph passes that replace a known subgraph by one op with a fused kernel, run on every
//! loaded graph. Each pass matches the exporters' forms by structure and by the constants'
//! values (operands of Add and Mul in either order), and only where every intermediate
//! value is read by the pattern alone (not by another node, not a graph output), so the
//! graph computes the same function.
//!
//! - GELU, tanh form (`0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`: HF's `gelu_new`,
//!   as PyTorch's TorchScript and dynamo exporters and our builder write it, 8 nodes) ->
//!   `Gelu(approximate = "tanh")`.
//! - Conv followed by Relu (the Conv's output read by the Relu alone) -> the Conv marked
//!   with [`FUSED_ACTIVATION`] = `"Relu"`: `kernels::conv2d` applies the ReLU to each image's
//!   output while it is in cache and masks the gradient in its backward, instead of a pass
//!   of its own over the activations each way. The mark is internal: export writes the
//!   original graph.

use std::collections::HashMap;

use crate::graph::attributes::{Attr, Attributes, FUSED_ACTIVATION};
use crate::graph::{Graph, Node};
use crate::ops;
use crate::value::host_tensor::HostTensor;

/// The value of a one-element float constant or initializer.
fn scalar(graph: &Graph, name: &str) -> Option<f32> {
    let one = |a: ndarray::ArrayViewD<f32>| (a.len() == 1).then(|| a.iter().next().copied())?;
    match graph.constants.get(name) {
        Some(HostTensor::Float(a)) => one(a.view()),
        Some(_) => None,
        None => one(graph
            .initializers
            .iter()
            .find(|(n, _)| n == name)?
            .1
            .floats()?),
    }
}

fn near(v: Option<f32>, want: f32) -> bool {
    v.is_some_and(|v| (v - want).abs() <= 1e-6 * want.abs())
}

struct View<'a> {
    graph: &'a Graph,
    /// Value -> index of the node producing it.
    producer: HashMap<&'a str, usize>,
    /// Value -> number of reads by nodes (a graph output counts as a read).
    readers: HashMap<&'a str, usize>,
}

impl<'a> View<'a> {
    fn new(graph: &'a Graph) -> Self {
        let mut producer = HashMap::new();
        let mut readers: HashMap<&str, usize> = HashMap::new();
        for (i, n) in graph.nodes.iter().enumerate() {
            for o in &n.outputs {
                producer.insert(o.as_str(), i);
            }
            for input in &n.inputs {
                *readers.entry(input.as_str()).or_default() += 1;
            }
        }
        for o in &graph.outputs {
            *readers.entry(o.name.as_str()).or_default() += 1;
        }
        View {
            graph,
            producer,
            readers,
        }
    }

    /// The node producing `value` if it has type `op` and `value` is read once.
    fn sole(&self, value: &str, op: &str) -> Option<usize> {
        let i = *self.producer.get(value)?;
        (self.graph.nodes[i].op_type == op && self.readers.get(value) == Some(&1)).then_some(i)
    }

    /// For a two-input node: `(other operand, constant)` when one operand is a scalar
    /// constant equal to `want`.
    fn with_constant(&self, i: usize, want: f32) -> Option<&'a str> {
        let n = &self.graph.nodes[i];
        let [a, b] = &n.inputs[..] else { return None };
        if near(scalar(self.graph, b), want) {
            Some(a.as_str())
        } else if near(scalar(self.graph, a), want) {
            Some(b.as_str())
        } else {
            None
        }
    }

    /// The only node reading `value`.
    fn reader(&self, value: &str) -> Option<usize> {
        if self.readers.get(value) != Some(&1) || self.graph.outputs.iter().any(|o| o.name == value)
        {
            return None;
        }
        self.graph
            .nodes
            .iter()
            .position(|n| n.inputs.iter().any(|i| i == value))
    }

    /// A GELU around Tanh node `t`: `(x, nodes of the pattern, the final Mul)`.
    fn gelu_at(&self, t: usize) -> Option<(String, Vec<usize>, usize)> {
        const SQRT_2_OVER_PI: f32 = 0.797_884_6;
        const CUBIC: f32 = 0.044_715;
        let tanh = &self.graph.nodes[t];
        let scaled = self.sole(&tanh.inputs[0], "Mul")?;
        let inner = self.with_constant(scaled, SQRT_2_OVER_PI)?;
        let add = self.sole(inner, "Add")?;
        let [u, v] = &self.graph.nodes[add].inputs[..] else {
            return None;
        };
        // x + 0.044715 * Pow(x, 3), either order.
        let cubic_term = |x: &str, other: &str| -> Option<(usize, usize)> {
            let mul = self.sole(other, "Mul")?;
            let pow_out = self.with_constant(mul, CUBIC)?;
            let pow = self.sole(pow_out, "Pow")?;
            let p = &self.graph.nodes[pow].inputs;
            (p[0] == x && near(scalar(self.graph, &p[1]), 3.0)).then_some((mul, pow))
        };
        let (x, (mul, pow)) = match cubic_term(u, v) {
            Some(found) => (u.as_str(), found),
            None => (v.as_str(), cubic_term(v, u)?),
        };
        let plus_one = self.reader(&tanh.outputs[0])?;
        if self.graph.nodes[plus_one].op_type != "Add"
            || self.with_constant(plus_one, 1.0)? != tanh.outputs[0]
        {
            return None;
        }
        let last = self.reader(&self.graph.nodes[plus_one].outputs[0])?;
        let out = &self.graph.nodes[last];
        let [a, b] = &out.inputs[..] else { return None };
        if out.op_type != "Mul" {
            return None;
        }
        let half_value = if *a == self.graph.nodes[plus_one].outputs[0] {
            b
        } else {
            a
        };
        let half = self.sole(half_value, "Mul")?;
        if self.with_constant(half, 0.5)? != x {
            return None;
        }
        Some((
            x.to_string(),
            vec![pow, mul, add, scaled, t, plus_one, half],
            last,
        ))
    }
}

/// Replace every tanh-form GELU by one `Gelu` node; returns how many.
pub fn fuse_gelu(graph: &mut Graph) -> usize {
    let found: Vec<(String, Vec<usize>, usize)> = {
        let view = View::new(graph);
        graph
            .nodes
            .iter()
            .enumerate()
            .filter(|(_, n)| n.op_type == "Tanh")
            .filter_map(|(i, _)| view.gelu_at(i))
            .collect()
    };
    if found.is_empty() {
        return 0;
    }
    let mut drop = vec![false; graph.nodes.len()];
    for (x, pattern, last) in &found {
        pattern.iter().for_each(|&i| drop[i] = true);
        let node = &mut graph.nodes[*last];
        let mut attrs = Attributes::default();
        attrs.set("approximate", Attr::String("tanh".into()));
        *node = Node {
            name: node.name.clone(),
            op_type: "Gelu".into(),
            inputs: vec![x.clone()],
            outputs: node.outputs.clone(),
            attrs,
            op: ops::lookup("Gelu").expect("Gelu is an op"),
        };
    }
    remove_nodes(graph, &drop);
    found.len()
}

/// Fold every Relu whose input is a Conv's output read by nothing else into that Conv;
/// returns how many.
pub fn fuse_conv_relu(graph: &mut Graph) -> usize {
    let found: Vec<(usize, usize)> = {
        let view = View::new(graph);
        graph
            .nodes
            .iter()
            .enumerate()
            .filter(|(_, n)| n.op_type == "Relu" && n.inputs.len() == 1)
            .filter_map(|(r, n)| view.sole(&n.inputs[0], "Conv").map(|c| (c, r)))
            .collect()
    };
    let mut drop = vec![false; graph.nodes.len()];
    for &(conv, relu) in &found {
        drop[relu] = true;
        let outputs = graph.nodes[relu].outputs.clone();
        let node = &mut graph.nodes[conv];
        node.outputs = outputs;
        node.attrs
            .set(FUSED_ACTIVATION, Attr::String("Relu".into()));
    }
    remove_nodes(graph, &drop);
    found.len()
}

/// Remove the nodes marked in `drop` and recompute each value's last reader.
fn remove_nodes(graph: &mut Graph, drop: &[bool]) {
    let mut index = 0;
    graph.nodes.retain(|_| {
        index += 1;
        !drop[index - 1]
    });
    graph.last_use.clear();
    for (i, n) in graph.nodes.iter().enumerate() {
        for input in n.inputs.iter().filter(|i| !i.is_empty()) {
            graph.last_use.insert(input.clone(), i);
        }
    }
}
