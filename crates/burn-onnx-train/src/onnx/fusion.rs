//! Graph passes that replace a known subgraph by one op with a fused kernel, run on every
//! loaded graph. Each pass matches the exporters' forms by structure and by the constants'
//! values (operands of Add and Mul in either order), and only where every intermediate
//! value is read by the pattern alone (not by another node, not a graph output), so the
//! graph computes the same function.
//!
//! - GELU, tanh form (`0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`: HF's `gelu_new`,
//!   as PyTorch's TorchScript and dynamo exporters and our builder write it, 8 nodes) ->
//!   `Gelu(approximate = "tanh")`; then the `Add` of a 1-D initializer before it (the bias
//!   of the product feeding it, the sum read by the `Gelu` alone) -> that `Gelu` with
//!   inputs `[x, bias]`: on CubeCL devices the bias is added inside the GELU's kernels.
//! - Conv followed by Relu (the Conv's output read by the Relu alone) -> the Conv marked
//!   with [`FUSED_ACTIVATION`] = `"Relu"`: `kernels::conv2d` applies the ReLU to each image's
//!   output while it is in cache and masks the gradient in its backward, instead of a pass
//!   of its own over the activations each way. The mark is internal: export writes the
//!   original graph.
//! - The scaling, masking and additive bias of attention scores folded into the Softmax
//!   that reads them (`Softmax(Add(Where(mask, Mul(s, c), fill), bias))`, the Mul or Div
//!   by a scalar constant, the Where with a scalar constant branch and the Add each
//!   optional, not all absent; TorchScript's GPT-2 adds its mask, dynamo's selects it):
//!   the Softmax node takes `s`, the mask and the bias and is marked with
//!   [`MASKED_SOFTMAX`] (the constant,
//!   whether it divides, the fill, the mask's polarity), so a CubeCL
//!   device runs one kernel each way over the scores instead of five. Opset 13 and later
//!   only (one axis). The scalars are read at load: constants by the trainability rule.
//! - The two products around an attention softmax (`MatMul(Softmax(MatMul(q, kt)), v)`,
//!   the Softmax masked or not, the scores and probabilities read by the pattern alone)
//!   folded into the Softmax node, marked [`ATTENTION_CORE`], with inputs `[q, kt, v,
//!   mask, bias]`: on CubeCL devices one op that keeps no `[batch, heads, seq, seq]`
//!   tensor for its backward (`kernels::attention_core`). Runs after the masked softmax's
//!   fusion.

use std::collections::{HashMap, HashSet};

use crate::graph::attributes::{
    ATTENTION_CORE, Attr, Attributes, FUSED_ACTIVATION, MASKED_SOFTMAX,
};
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

    /// For a two-input node: `(other operand, the constant's value, constant first)` when
    /// one operand is a scalar constant.
    fn scalar_operand(&self, i: usize) -> Option<(&'a str, f32, bool)> {
        let n = &self.graph.nodes[i];
        let [a, b] = &n.inputs[..] else { return None };
        if let Some(c) = scalar(self.graph, b) {
            Some((a.as_str(), c, false))
        } else {
            scalar(self.graph, a).map(|c| (b.as_str(), c, true))
        }
    }

    /// Scores scaled by a scalar constant: `(scores, constant, divided, the Mul or Div)`.
    fn scaled_at(&self, value: &'a str) -> Option<(&'a str, f32, bool, usize)> {
        let i = *self.producer.get(value)?;
        if self.readers.get(value) != Some(&1) {
            return None;
        }
        let (x, c, constant_first) = self.scalar_operand(i)?;
        match self.graph.nodes[i].op_type.as_str() {
            "Mul" => Some((x, c, false, i)),
            "Div" if !constant_first => Some((x, c, true, i)),
            _ => None,
        }
    }

    /// A Softmax `s` of scaled, masked and/or biased scores: `(inputs, the
    /// [`MASKED_SOFTMAX`] mark, nodes folded into it)`.
    fn masked_softmax_at(&self, s: usize) -> Option<(Vec<String>, Vec<f32>, Vec<usize>)> {
        let softmax = &self.graph.nodes[s];
        let mut scores = softmax.inputs.first()?.as_str();
        let mut folded = Vec::new();
        // An additive bias (Hugging Face's attention mask, ALiBi): the other operand of an
        // Add whose one operand is the masked or scaled scores.
        let mut bias = String::new();
        if let Some(add) = self.sole(scores, "Add") {
            let [a, b] = &self.graph.nodes[add].inputs[..] else {
                return None;
            };
            let chain = |v: &str| self.sole(v, "Where").is_some() || self.scaled_at(v).is_some();
            (scores, bias) = match (chain(a), chain(b)) {
                (true, _) => (a.as_str(), b.clone()),
                (false, true) => (b.as_str(), a.clone()),
                _ => return None,
            };
            folded.push(add);
        }
        let (mut mask, mut fill, mut keep_when) = (String::new(), 0.0, 1.0);
        if let Some(w) = self.sole(scores, "Where") {
            let [cond, a, b] = &self.graph.nodes[w].inputs[..] else {
                return None;
            };
            let (tensor, value, keep) = match (scalar(self.graph, a), scalar(self.graph, b)) {
                (None, Some(v)) => (a, v, 1.0),
                (Some(v), None) => (b, v, 0.0),
                _ => return None,
            };
            (scores, mask, fill, keep_when) = (tensor.as_str(), cond.clone(), value, keep);
            folded.push(w);
        }
        let (mut scale, mut divide) = (1.0, 0.0);
        if let Some((x, c, divided, i)) = self.scaled_at(scores) {
            (scores, scale, divide) = (x, c, if divided { 1.0 } else { 0.0 });
            folded.push(i);
        }
        if folded.is_empty() {
            return None;
        }
        Some((
            vec![scores.to_string(), mask, bias],
            vec![scale, divide, fill, keep_when],
            folded,
        ))
    }

    /// `value`, or the output of the Cast to f32 that alone reads it (Hugging Face casts
    /// the attention probabilities to the values' type, a no-op in an f32 graph), with
    /// that Cast.
    fn through_float_cast(&self, value: &'a str) -> Option<(Option<usize>, &'a str)> {
        let Some(r) = self.reader(value) else {
            return Some((None, value));
        };
        let n = &self.graph.nodes[r];
        if n.op_type != "Cast" {
            return Some((None, value));
        }
        (n.attrs.int("to", 0).ok()? == 1).then(|| (Some(r), n.outputs[0].as_str()))
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

/// The names of `graph`'s one-dimensional initializers (biases, norms' parameters).
fn one_d_initializers(graph: &Graph) -> HashSet<&str> {
    graph
        .initializers
        .iter()
        .filter(|(_, init)| init.shape().len() == 1)
        .map(|(name, _)| name.as_str())
        .collect()
}

/// `(x, bias)` of a two-input `add` node whose one input is in `one_d` and the other not.
fn biased(add: &Node, one_d: &HashSet<&str>) -> Option<(String, String)> {
    let [a, b] = &add.inputs[..] else {
        return None;
    };
    match (one_d.contains(a.as_str()), one_d.contains(b.as_str())) {
        (false, true) => Some((a.clone(), b.clone())),
        (true, false) => Some((b.clone(), a.clone())),
        _ => None,
    }
}

/// Fold into every tanh-form `Gelu` the `Add` before it of a 1-D initializer (the bias of
/// the product feeding it) when the `Gelu` alone reads the sum: the `Gelu` takes
/// `[x, bias]` (`kernels::gelu_tanh_biased`). Returns how many.
pub fn fuse_gelu_bias(graph: &mut Graph) -> usize {
    let one_d = one_d_initializers(graph);
    let found: Vec<(usize, usize, [String; 2])> = {
        let view = View::new(graph);
        graph
            .nodes
            .iter()
            .enumerate()
            .filter(|(_, n)| n.op_type == "Gelu" && n.inputs.len() == 1)
            .filter(|(_, n)| n.attrs.string("approximate", "none").ok().as_deref() == Some("tanh"))
            .filter_map(|(g, n)| {
                let add = view.sole(&n.inputs[0], "Add")?;
                let (x, bias) = biased(&graph.nodes[add], &one_d)?;
                Some((g, add, [x, bias]))
            })
            .collect()
    };
    let mut drop = vec![false; graph.nodes.len()];
    for (gelu, add, inputs) in &found {
        drop[*add] = true;
        graph.nodes[*gelu].inputs = inputs.to_vec();
    }
    remove_nodes(graph, &drop);
    found.len()
}

/// Fold into every `Add` of a residual the `Add` before it of a 1-D initializer (the bias
/// of the product feeding it) when that `Add` alone reads the sum: the `Add` takes `[x,
/// bias, residual]` (`kernels::add_bias_residual`). Returns how many.
pub fn fuse_bias_residual(graph: &mut Graph) -> usize {
    let one_d = one_d_initializers(graph);
    let found: Vec<(usize, usize, [String; 3])> = {
        let view = View::new(graph);
        let mut taken = HashSet::new();
        graph
            .nodes
            .iter()
            .enumerate()
            .filter(|(_, n)| n.op_type == "Add" && n.inputs.len() == 2)
            .filter_map(|(r, n)| {
                let of_input = |k: usize| {
                    let add = view.sole(&n.inputs[k], "Add")?;
                    let (x, bias) = biased(&graph.nodes[add], &one_d)?;
                    Some((add, [x, bias, n.inputs[1 - k].clone()]))
                };
                let (add, inputs) = of_input(0).or_else(|| of_input(1))?;
                // The other input must not be a one-dimensional bias itself.
                (!one_d.contains(inputs[2].as_str()) && taken.insert(add))
                    .then_some((r, add, inputs))
            })
            .collect()
    };
    let mut drop = vec![false; graph.nodes.len()];
    for (residual, add, inputs) in &found {
        drop[*add] = true;
        graph.nodes[*residual].inputs = inputs.to_vec();
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

/// Fold the scaling and masking of every Softmax's input into it (see the module's
/// comment); returns how many. Graphs before opset 13 (Softmax over flattened axes) are
/// left as they are.
pub fn fuse_masked_softmax(graph: &mut Graph) -> usize {
    if graph.opset < 13 {
        return 0;
    }
    let found: Vec<(usize, Vec<String>, Vec<f32>, Vec<usize>)> = {
        let view = View::new(graph);
        graph
            .nodes
            .iter()
            .enumerate()
            .filter(|(_, n)| n.op_type == "Softmax" && n.inputs.len() == 1)
            .filter_map(|(i, _)| {
                let (inputs, marks, folded) = view.masked_softmax_at(i)?;
                Some((i, inputs, marks, folded))
            })
            .collect()
    };
    let mut drop = vec![false; graph.nodes.len()];
    for (softmax, inputs, marks, folded) in &found {
        folded.iter().for_each(|&i| drop[i] = true);
        let node = &mut graph.nodes[*softmax];
        node.inputs = inputs.clone();
        node.attrs.set(MASKED_SOFTMAX, Attr::Floats(marks.clone()));
    }
    remove_nodes(graph, &drop);
    found.len()
}

/// Fold the two products around every attention softmax into it (see the module's
/// comment); returns how many.
pub fn fuse_attention_core(graph: &mut Graph) -> usize {
    if graph.opset < 13 {
        return 0;
    }
    // (scores product, softmax, a Cast to f32 between, context product)
    let found: Vec<(usize, usize, Option<usize>, usize)> = {
        let view = View::new(graph);
        graph
            .nodes
            .iter()
            .enumerate()
            .filter(|(_, n)| n.op_type == "Softmax" && !n.attrs.has(ATTENTION_CORE))
            .filter_map(|(s, n)| {
                let scores = view.sole(n.inputs.first()?, "MatMul")?;
                let (cast, probabilities) = view.through_float_cast(&n.outputs[0])?;
                let context = view.reader(probabilities)?;
                let c = &graph.nodes[context];
                (c.op_type == "MatMul"
                    && c.inputs.first().map(String::as_str) == Some(probabilities))
                .then_some((scores, s, cast, context))
            })
            .collect()
    };
    let mut drop = vec![false; graph.nodes.len()];
    for &(scores, s, cast, context) in &found {
        let [q, kt] = &graph.nodes[scores].inputs[..] else {
            continue;
        };
        let mut inputs = vec![
            q.clone(),
            kt.clone(),
            graph.nodes[context].inputs[1].clone(),
        ];
        inputs.extend(graph.nodes[s].inputs.iter().skip(1).cloned());
        let mut softmax = graph.nodes[s].clone();
        softmax.inputs = inputs;
        softmax.outputs = graph.nodes[context].outputs.clone();
        softmax.attrs.set(ATTENTION_CORE, Attr::Int(1));
        // In the second product's place: `v` may be computed after the softmax.
        graph.nodes[context] = softmax;
        drop[scores] = true;
        drop[s] = true;
        if let Some(c) = cast {
            drop[c] = true;
        }
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
