//! Megatron's sequence parallelism on a tensor-parallel graph (after [`super::rewrite`]):
//! between the blocks each rank holds only its slice of the tokens, so the LayerNorms,
//! residual adds and dropouts there take 1/tp of the activation memory and work.
//!
//! The pass follows the token slices forward from every `g` (a row-parallel projection's
//! or a vocabulary-parallel lookup's all-reduce), which becomes a reduce-scatter along the
//! sequence axis. A node that reads a slice runs on slices when its op works token by token
//! (element-wise ops, normalisations and reductions over other axes, softmax, transposes,
//! reshapes, dropout, projections by a replicated weight smaller than the activation);
//! the values it reads whole get
//! a [`Transfer::Slice`] (a position table's rows) or, when they broadcast over the tokens,
//! Megatron's `f` so that their gradient (a LayerNorm's scale, a bias) is summed over the
//! ranks. Where a block reads slices, its `f` becomes an all-gather
//! ([`Transfer::IntoBlock`]); where only the block's first projections read them, the
//! projections gather them themselves, once for all the projections of one input (the
//! weights side by side in one product), and again in backward for the weights'
//! gradients (Megatron's way: no whole-sequence input is kept between the passes); any
//! other reader (an op that mixes tokens, a graph output)
//! gets the whole sequence back by [`Transfer::Gather`], so every graph runs, the part
//! between blocks on slices as far as its ops allow. The pass sweeps the graph twice: the
//! whole activations the first sweep sliced for a reader (the residual stream entering the
//! first block) are sliced where they are made in the second, so the token-wise nodes
//! before that reader (the first LayerNorm) run on slices too. `Shape` of a slice reports the whole
//! shape and Reshapes of slices take local sizes, so shape arithmetic stays the whole
//! model's.
//!
//! The sequence axis of a `[.., S, H]` output is the one before the last; a `[N, H]` one
//! (tokens flattened, as the TorchScript exporter's Gemms see them) is split on its rows
//! with a period of the sequence length `S` the other outputs or a `[batch, S]` token
//! input name (each sequence's positions are cut the same way), or in contiguous rows
//! when nothing names one.

use std::collections::{HashMap, HashSet};

use super::ops::{self, TRANSFER, Transfer};
use super::plan::{ELEMENTWISE, Known};
use super::rewrite::{local_reshape, new_node};
use crate::collective::axis_split::AxisSplit;
use crate::error::{OnnxError, Result};
use crate::graph::attributes::{ATTENTION_CORE, Attr, Attributes};
use crate::graph::{Graph, Node};
use crate::ops::sequence_marks::mark;
use crate::value::norm_axis;

/// How many of each transfer the pass placed (for the log, `inspect` and tests).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SequenceParallel {
    /// `g`s turned into reduce-scatters.
    pub scatters: usize,
    /// Block inputs all-gathered (those only projections read are gathered by each
    /// projection instead: `gathered_products`).
    pub into_blocks: usize,
    /// Block projections of gathered slices, the gathered input not kept for backward: one
    /// gather each, shared by the projections of one input (`shared_gathers`).
    pub gathered_products: usize,
    /// Projections that take another projection's gather of the same input (separate
    /// Q, K and V projections: one gather for the three).
    pub shared_gathers: usize,
    /// Slices gathered for a reader that needs whole sequences (graph outputs included).
    pub gathers: usize,
    /// Replicated values sliced.
    pub slices: usize,
    /// Nodes that run on slices.
    pub sliced_nodes: usize,
}

/// How a sliced node reads an input that is not a slice.
enum Edge {
    /// Broadcast over the tokens: Megatron's `f` (its gradient is summed over the ranks).
    Copy,
    /// Whole along the sequence axis: this rank's slice of it.
    Slice(AxisSplit),
}

/// What a node that reads slices does on them.
struct Local {
    /// The split of its outputs.
    out: AxisSplit,
    /// Its other inputs, by slot.
    edges: Vec<(usize, Edge)>,
    /// A Reshape's target entry that names the whole split axis: `(axis, whole size)`.
    reshape: Option<(usize, usize)>,
}

/// The tensor-parallel `graph` with sequence parallelism over `tp` ranks. `known` holds
/// the whole model's shapes (the names the tensor-parallel rewrite added are looked up
/// by the value they stand for).
pub fn rewrite(graph: &Graph, known: &Known, tp: usize) -> Result<(Graph, SequenceParallel)> {
    let seq = sequence_length(graph, known, tp)?;
    // The first sweep finds the whole activations the slices meet (the residual stream
    // entering the first block); the second slices them where they are made, so that
    // the token-wise nodes before that meeting (the first LayerNorm) run on slices too,
    // as Megatron scatters the embedding's output into the sequence-parallel region.
    let met = Pass::new(graph, known, tp, seq, HashMap::new()).sweep().met;
    let Pass { nodes, count, .. } = Pass::new(graph, known, tp, seq, met).sweep();
    let mut last_use = HashMap::new();
    for (i, n) in nodes.iter().enumerate() {
        for input in n.inputs.iter().filter(|i| !i.is_empty()) {
            last_use.insert(input.clone(), i);
        }
    }
    Ok((
        Graph {
            nodes,
            last_use,
            ..graph.clone()
        },
        count,
    ))
}

/// The value of the whole model a name of the tensor-parallel graph stands for.
fn original(name: &str) -> &str {
    ["::tp_copy", "::tp_partial", "::tp_sum"]
        .iter()
        .find_map(|s| name.strip_suffix(s))
        .unwrap_or(name)
}

fn is_reduce(node: &Node) -> bool {
    node.op_type == "TensorParallelReduce"
}

/// The sequence length the `g` outputs of rank 3 or more name (the axis before the last),
/// or else a `[batch, seq]` integer graph input, if any; an error when they disagree or it
/// does not divide over `tp`.
fn sequence_length(graph: &Graph, known: &Known, tp: usize) -> Result<Option<usize>> {
    let mut seq: Option<(usize, &str)> = None;
    for node in graph.nodes.iter().filter(|n| is_reduce(n)) {
        let name = original(&node.outputs[0]);
        let Some(shape) = known.shape(name).filter(|s| s.len() >= 3) else {
            continue;
        };
        let s = shape[shape.len() - 2];
        match seq {
            Some((t, other)) if t != s => {
                return Err(OnnxError::field(
                    "tensor_parallel_sequence",
                    format!(
                        "the block outputs name two sequence lengths: {t} ({other}) and {s} ({name})"
                    ),
                ));
            }
            _ => seq = Some((s, name)),
        }
    }
    if seq.is_none() {
        // Only flattened `[N, H]` outputs: the sequence is the last axis of a `[batch, seq]`
        // token input (the TorchScript exporter's GPT-2 feeds its Gemms so).
        seq = graph
            .inputs
            .iter()
            .filter(|i| !known.is_float(&i.name))
            .find_map(|i| {
                let shape = known.shape(&i.name).filter(|s| s.len() == 2)?;
                Some((shape[1], i.name.as_str()))
            });
    }
    match seq {
        Some((s, name)) if s % tp != 0 => Err(OnnxError::field(
            "tensor_parallel_sequence",
            format!(
                "the sequence length {s} (of {name}) does not divide over {tp} tensor-parallel ranks"
            ),
        )),
        other => Ok(other.map(|(s, _)| s)),
    }
}

struct Pass<'a> {
    known: &'a Known<'a>,
    graph: &'a Graph,
    tp: usize,
    /// The sequence length, when a `g` output of rank 3 or more or a token input names it.
    seq: Option<usize>,
    /// The slices: values each rank holds its tokens of.
    split: HashMap<String, AxisSplit>,
    /// Block inputs only projections read: the slices their projections gather.
    fused: HashMap<String, (String, AxisSplit)>,
    /// Block inputs several projections read, and those projections (in order): one
    /// product of the gathered slices for all of them, placed at the first.
    groups: HashMap<String, Vec<Node>>,
    /// Block inputs whose group's product is placed.
    gathered: HashSet<String>,
    nodes: Vec<Node>,
    /// Transfer nodes already placed (by output name).
    emitted: HashSet<String>,
    /// Whole activations sliced where they are made (the first sweep's `met`).
    entries: HashMap<String, AxisSplit>,
    /// Node outputs sliced for a reader (by the split read): what the next sweep enters.
    met: HashMap<String, AxisSplit>,
    /// Those sliced so far: whole value -> its slice, which later nodes read instead.
    entered: HashMap<String, String>,
    count: SequenceParallel,
}

impl<'a> Pass<'a> {
    fn new(
        graph: &'a Graph,
        known: &'a Known<'a>,
        tp: usize,
        seq: Option<usize>,
        entries: HashMap<String, AxisSplit>,
    ) -> Self {
        Pass {
            known,
            graph,
            tp,
            seq,
            split: HashMap::new(),
            fused: HashMap::new(),
            groups: HashMap::new(),
            gathered: HashSet::new(),
            nodes: Vec::with_capacity(graph.nodes.len() * 5 / 4),
            emitted: HashSet::new(),
            entries,
            entered: HashMap::new(),
            met: HashMap::new(),
            count: SequenceParallel::default(),
        }
    }

    /// Place every node of the graph, in order, then gather the sliced graph outputs.
    fn sweep(mut self) -> Self {
        let graph = self.graph;
        for node in &graph.nodes {
            self.node(node.clone());
            self.enter(&node.outputs);
        }
        self.gather_outputs();
        self
    }

    fn shape(&self, name: &str) -> Option<Vec<usize>> {
        self.known.shape(original(self.whole_of(name)))
    }

    fn is_float(&self, name: &str) -> bool {
        self.known.is_float(original(self.whole_of(name)))
    }

    /// The whole value an entry's slice stands for (any other name: itself).
    fn whole_of<'n>(&'n self, name: &'n str) -> &'n str {
        self.entered
            .iter()
            .find_map(|(whole, slice)| (slice == name).then_some(whole.as_str()))
            .unwrap_or(name)
    }

    /// Slice each entry among `outputs` that was made whole (one made of slices already
    /// is one); the nodes after read the slice.
    fn enter(&mut self, outputs: &[String]) {
        for out in outputs {
            let Some(&s) = self.entries.get(out) else {
                continue;
            };
            if self.split.contains_key(out) {
                continue;
            }
            let slice = self.transfer(out, Transfer::Slice, Some(s));
            self.split.insert(slice.clone(), s);
            self.entered.insert(out.clone(), slice);
        }
    }

    /// The split of a `g` output: the sequence axis, when it divides.
    fn seed_split(&self, out: &str) -> Option<AxisSplit> {
        let shape = self.shape(out)?;
        let split = match shape.len() {
            0 | 1 => return None,
            2 => AxisSplit::new(
                0,
                self.seq.filter(|s| shape[0] % s == 0).unwrap_or(shape[0]),
            ),
            r => AxisSplit::new(r - 2, shape[r - 2]),
        };
        (shape[split.axis] % split.period == 0 && split.period % self.tp == 0).then_some(split)
    }

    /// Place `node` (of the tensor-parallel graph, in order), rewritten for the slices it
    /// reads, with the transfers it needs before it.
    fn node(&mut self, mut node: Node) {
        for input in node.inputs.iter_mut() {
            if let Some(slice) = self.entered.get(input) {
                input.clone_from(slice);
            }
        }
        if is_reduce(&node) {
            if let Some(s) = self.seed_split(&node.outputs[0]) {
                self.transfer_node(&mut node, Transfer::Scatter, s);
                self.split.insert(node.outputs[0].clone(), s);
                self.count.scatters += 1;
            }
            self.nodes.push(node);
            return;
        }
        if let Some((slice, s)) = node.inputs.first().and_then(|i| self.fused.get(i)).cloned() {
            let input = node.inputs[0].clone();
            if let Some(readers) = self.groups.remove(&input) {
                self.gathered_product(&readers, slice, s);
                self.gathered.insert(input);
            } else if !self.gathered.contains(&input) {
                self.gathered_product(std::slice::from_ref(&node), slice, s);
            }
            self.add_bias(&node);
            return;
        }
        let sliced: Vec<usize> = (0..node.inputs.len())
            .filter(|&k| self.split.contains_key(&node.inputs[k]))
            .collect();
        if sliced.is_empty() {
            self.nodes.push(node);
            return;
        }
        if node.op_type == "TensorParallelCopy" {
            let s = self.split[&node.inputs[0]];
            if let Some(readers) = self.projections(&node.outputs[0]) {
                if self.shareable(&readers) {
                    self.groups.insert(node.outputs[0].clone(), readers);
                }
                self.fused
                    .insert(node.outputs[0].clone(), (node.inputs[0].clone(), s));
                return;
            }
            self.transfer_node(&mut node, Transfer::IntoBlock, s);
            self.count.into_blocks += 1;
            self.nodes.push(node);
            return;
        }
        if node.op_type == "Shape" {
            mark(&mut node.attrs, self.split[&node.inputs[0]], self.tp);
            node.op = ops::sequence_shape;
            self.nodes.push(node);
            return;
        }
        match self.local(&node) {
            Some(local) => self.place_local(node, local),
            None => {
                for k in sliced {
                    let input = node.inputs[k].clone();
                    node.inputs[k] = self.transfer(&input, Transfer::Gather, None);
                }
                self.nodes.push(node);
            }
        }
    }

    /// The readers of the block input `name`, when every one is a projection of it by a
    /// 2-D weight (MatMul, or Gemm with `alpha` 1, no `transA` and a bias at `beta` 1).
    fn projections(&self, name: &str) -> Option<Vec<Node>> {
        let readers: Vec<&Node> = self
            .graph
            .nodes
            .iter()
            .filter(|n| n.inputs.iter().any(|i| i == name))
            .collect();
        let projection = |n: &Node| {
            let reads_a_only = n.inputs.iter().skip(1).all(|i| i != name);
            let weight_2d = self.shape(&n.inputs[1]).is_some_and(|s| s.len() == 2);
            let gemm_ok = || {
                let (alpha, beta) = (
                    n.attrs.float("alpha", 1.0).unwrap_or(0.0),
                    n.attrs.float("beta", 1.0).unwrap_or(0.0),
                );
                n.attrs.int("transA", 0).unwrap_or(1) == 0 && alpha == 1.0 && beta == 1.0
            };
            n.inputs[0] == name
                && reads_a_only
                && weight_2d
                && match n.op_type.as_str() {
                    "MatMul" => true,
                    "Gemm" => gemm_ok(),
                    _ => false,
                }
        };
        let only = !readers.is_empty()
            && readers.iter().all(|n| projection(n))
            && !self.graph.outputs.iter().any(|o| o.name == name);
        only.then(|| readers.into_iter().cloned().collect())
    }

    /// Whether the projections `readers` can share one gather: more than one, the same
    /// `transB`, and every weight known where the first of them runs (an initializer, or
    /// made by an earlier node).
    fn shareable(&self, readers: &[Node]) -> bool {
        let trans = |n: &Node| n.attrs.int("transB", 0).unwrap_or(-1);
        let Some(first) = readers.first() else {
            return false;
        };
        let at = self
            .graph
            .nodes
            .iter()
            .position(|n| n.outputs == first.outputs);
        let made_later = |w: &String| {
            self.graph
                .nodes
                .iter()
                .enumerate()
                .any(|(i, n)| at.is_none_or(|at| i >= at) && n.outputs.iter().any(|o| o == w))
        };
        readers.len() > 1
            && readers.iter().all(|n| trans(n) == trans(first))
            && readers.iter().all(|n| !made_later(&n.inputs[1]))
    }

    /// What a projection's product is called: its output, or with a Gemm's bias the value
    /// the bias is then added to.
    fn product_name(node: &Node) -> String {
        match Self::bias(node) {
            Some(_) => format!("{}::sp_product", node.outputs[0]),
            None => node.outputs[0].clone(),
        }
    }

    fn bias(node: &Node) -> Option<String> {
        (node.op_type == "Gemm")
            .then(|| node.inputs.get(2).cloned())
            .flatten()
            .filter(|c| !c.is_empty())
    }

    /// The block's projections `readers` of one gathered block input: one node gathering
    /// the `slice` (split `s`) itself and multiplying it by every reader's weight.
    fn gathered_product(&mut self, readers: &[Node], slice: String, s: AxisSplit) {
        let first = &readers[0];
        let mut attrs = Attributes::default();
        mark(&mut attrs, s, self.tp);
        attrs.set(
            "transB",
            Attr::Int(first.attrs.int("transB", 0).unwrap_or(0)),
        );
        let mut inputs = vec![slice];
        inputs.extend(readers.iter().map(|n| n.inputs[1].clone()));
        self.nodes.push(Node {
            name: first.name.clone(),
            op_type: "SequenceParallelMatMul".into(),
            inputs,
            outputs: readers.iter().map(Self::product_name).collect(),
            attrs,
            op: ops::sequence_product,
        });
        self.count.gathered_products += 1;
        self.count.shared_gathers += readers.len() - 1;
    }

    /// A Gemm projection's bias, added to its product.
    fn add_bias(&mut self, node: &Node) {
        if let Some(c) = Self::bias(node) {
            self.nodes.push(new_node(
                format!("{}::bias", node.name),
                "Add",
                vec![Self::product_name(node), c],
                vec![node.outputs[0].clone()],
                crate::ops::lookup("Add").expect("Add is an op"),
            ));
        }
    }

    /// Make `node` (one input, one output) the transfer `t` of split `s`.
    fn transfer_node(&self, node: &mut Node, t: Transfer, s: AxisSplit) {
        node.op_type = "SequenceParallel".into();
        node.op = ops::sequence;
        node.attrs = Attributes::default();
        node.attrs.set(TRANSFER, Attr::Int(t as i64));
        mark(&mut node.attrs, s, self.tp);
    }

    /// The name of `input` moved by `t` (a node placed before the current one, once per
    /// value and move). `split`: the split of a [`Transfer::Slice`].
    fn transfer(&mut self, input: &str, t: Transfer, split: Option<AxisSplit>) -> String {
        let (name, s) = match (t, split) {
            (Transfer::Slice, Some(s)) => (format!("{input}::sp_slice{}_{}", s.axis, s.period), s),
            _ => (format!("{input}::sp_gather"), self.split[input]),
        };
        if self.emitted.insert(name.clone()) {
            let mut node = new_node(
                name.clone(),
                "",
                vec![input.to_string()],
                vec![name.clone()],
                ops::sequence,
            );
            self.transfer_node(&mut node, t, s);
            self.nodes.push(node);
            match t {
                Transfer::Slice => self.count.slices += 1,
                _ => self.count.gathers += 1,
            }
        }
        name
    }

    /// Megatron's `f` on a replicated value a sliced node reads (once per value).
    fn copy(&mut self, input: &str) -> String {
        let name = format!("{input}::sp_copy");
        if self.emitted.insert(name.clone()) {
            self.nodes.push(new_node(
                name.clone(),
                "TensorParallelCopy",
                vec![input.to_string()],
                vec![name.clone()],
                ops::copy,
            ));
        }
        name
    }

    fn place_local(&mut self, mut node: Node, local: Local) {
        for (k, edge) in local.edges {
            let input = node.inputs[k].clone();
            node.inputs[k] = match edge {
                Edge::Copy => self.copy(&input),
                Edge::Slice(s) => {
                    if self.made(&input) {
                        self.met.insert(input.clone(), s);
                    }
                    self.transfer(&input, Transfer::Slice, Some(s))
                }
            };
        }
        if let Some((axis, full)) = local.reshape {
            local_reshape(&mut node, self.tp, axis, full);
        }
        if node.op_type == "Dropout" {
            mark(&mut node.attrs, local.out, self.tp);
        }
        let floats: Vec<String> = node
            .outputs
            .iter()
            .filter(|o| self.is_float(o))
            .cloned()
            .collect();
        for out in floats {
            self.split.insert(out, local.out);
        }
        self.count.sliced_nodes += 1;
        self.nodes.push(node);
    }

    /// Graph outputs that are slices: the whole values, gathered after the last node.
    fn gather_outputs(&mut self) {
        for out in &self.graph.outputs {
            let Some(&s) = self.split.get(&out.name) else {
                continue;
            };
            let local = format!("{}::sp_local", out.name);
            for node in &mut self.nodes {
                for v in node.inputs.iter_mut().chain(node.outputs.iter_mut()) {
                    if *v == out.name {
                        v.clone_from(&local);
                    }
                }
            }
            let mut node = new_node(
                format!("{}::sp_gather", out.name),
                "",
                vec![local],
                vec![out.name.clone()],
                ops::sequence,
            );
            self.transfer_node(&mut node, Transfer::Gather, s);
            self.nodes.push(node);
            self.count.gathers += 1;
        }
    }

    /// How `node` runs on slices, or `None` when it needs whole sequences.
    fn local(&self, node: &Node) -> Option<Local> {
        let op = node.op_type.as_str();
        let x = &node.inputs[0];
        let used_outputs_float = node
            .outputs
            .iter()
            .filter(|o| !o.is_empty() && self.used(o))
            .all(|o| self.is_float(o));
        if !used_outputs_float {
            return None;
        }
        let out_shape = self.shape(&node.outputs[0])?;
        let out_rank = out_shape.len();
        let input_rank = |k: usize| {
            node.inputs
                .get(k)
                .and_then(|n| self.shape(n))
                .map(|s| s.len())
        };
        let plain = |out: AxisSplit| Local {
            out,
            edges: Vec::new(),
            reshape: None,
        };
        match op {
            _ if ELEMENTWISE.contains(&op) || op == "Dropout" => {
                if op == "Dropout" && node.outputs.get(1).is_some_and(|m| self.used(m)) {
                    return None;
                }
                self.broadcasting(node, &out_shape)
            }
            "LayerNormalization" | "RMSNormalization" => {
                let s = *self.split.get(x)?;
                let axis = norm_axis(node.attrs.int("axis", -1).ok()?, input_rank(0)?).ok()?;
                if s.axis >= axis || node.inputs[1..].iter().any(|n| self.split.contains_key(n)) {
                    return None;
                }
                let mut local = plain(s);
                local.edges = self.copies(node, 1);
                Some(local)
            }
            _ if op.starts_with("Reduce") => {
                let s = *self.split.get(x)?;
                let in_shape = self.shape(x)?;
                let keeps = node.attrs.int("keepdims", 1).ok()? == 1
                    && out_rank == in_shape.len()
                    && out_shape[s.axis] == in_shape[s.axis];
                keeps.then(|| plain(s))
            }
            // Attention's products read whole sequences of keys and values.
            "Softmax" if node.attrs.has(ATTENTION_CORE) => None,
            "Softmax" | "LogSoftmax" => {
                let s = *self.split.get(x)?;
                let default = if self.graph.opset >= 13 { -1 } else { 1 };
                let axis = norm_axis(node.attrs.int("axis", default).ok()?, input_rank(0)?).ok()?;
                let mixes = axis == s.axis || (self.graph.opset < 13 && s.axis > axis);
                (!mixes).then(|| plain(s))
            }
            "Transpose" => {
                let s = *self.split.get(x)?;
                let perm: Vec<usize> = match node.attrs.ints("perm").ok()? {
                    Some(p) => p.iter().map(|&a| a as usize).collect(),
                    None => (0..input_rank(0)?).rev().collect(),
                };
                Some(plain(s.on(perm.iter().position(|&a| a == s.axis)?)))
            }
            "Reshape" | "Flatten" | "Squeeze" | "Unsqueeze" => {
                let s = *self.split.get(x)?;
                if node.inputs[1..].iter().any(|n| self.split.contains_key(n)) {
                    return None;
                }
                let out = s.through_reshape(&self.shape(x)?, &out_shape, self.tp)?;
                let mut local = plain(out);
                if op == "Reshape" {
                    local.reshape = Some((out.axis, out_shape[out.axis]));
                }
                Some(local)
            }
            "MatMul" => {
                let s = *self.split.get(x)?;
                let (ra, w) = (input_rank(0)?, &node.inputs[1]);
                if s.axis + 1 >= ra
                    || self.split.contains_key(w)
                    || input_rank(1)? != 2
                    || !self.smaller(w, x)
                {
                    return None;
                }
                let mut local = plain(s.on(s.axis + out_rank - ra));
                local.edges = self.copies(node, 1);
                Some(local)
            }
            "Gemm" => {
                let s = *self.split.get(x)?;
                let bias = node.inputs.get(2).filter(|c| !c.is_empty());
                if s.axis != 0
                    || node.attrs.int("transA", 0).ok()? != 0
                    || self.split.contains_key(&node.inputs[1])
                    || !self.smaller(&node.inputs[1], x)
                    || bias.is_some_and(|c| self.split.contains_key(c))
                {
                    return None;
                }
                let mut local = plain(s);
                local.edges = self.copies(node, 1);
                if let Some(c) = bias {
                    let shape = self.shape(c)?;
                    if shape.len() == 2 && shape[0] != 1 {
                        local.edges.retain(|(k, _)| *k != 2);
                        local.edges.push((2, Edge::Slice(s)));
                    }
                }
                Some(local)
            }
            _ => None,
        }
    }

    /// An element-wise node: its slices must agree (after broadcasting); a replicated
    /// input broadcast over the sequence axis is read through `f`, one whole along it is
    /// sliced.
    fn broadcasting(&self, node: &Node, out_shape: &[usize]) -> Option<Local> {
        let out_rank = out_shape.len();
        let mut target: Option<AxisSplit> = None;
        for input in node.inputs.iter().filter(|n| !n.is_empty()) {
            if let Some(s) = self.split.get(input) {
                let here = s.on(s.axis + out_rank - self.shape(input)?.len());
                if target.is_some_and(|t| t != here) {
                    return None;
                }
                target = Some(here);
            }
        }
        let target = target?;
        let mut edges = Vec::new();
        for (k, input) in node.inputs.iter().enumerate() {
            if input.is_empty() || self.split.contains_key(input) {
                continue;
            }
            let shape = self.shape(input)?;
            let lift = out_rank - shape.len();
            let broadcast = target.axis < lift || shape[target.axis - lift] == 1;
            let float = self.is_float(input);
            if broadcast {
                if float && !self.known.is_constant(original(input)) {
                    edges.push((k, Edge::Copy));
                }
            } else if shape[target.axis - lift] == out_shape[target.axis] && float {
                edges.push((k, Edge::Slice(target.on(target.axis - lift))));
            } else {
                return None;
            }
        }
        Some(Local {
            out: target,
            edges,
            reshape: None,
        })
    }

    /// `f` on the float inputs of `node` from slot `from` on (a normalisation's scale and
    /// bias, a projection's weight and bias: replicated, read by every token).
    fn copies(&self, node: &Node, from: usize) -> Vec<(usize, Edge)> {
        (from..node.inputs.len())
            .filter(|&k| {
                let n = &node.inputs[k];
                !n.is_empty() && self.is_float(n) && !self.known.is_constant(original(n))
            })
            .map(|k| (k, Edge::Copy))
            .collect()
    }

    /// Whether the weight `w` has fewer elements than the whole activation `x`: a
    /// projection by a replicated weight runs on slices only then, as its weight's
    /// gradient is all-reduced (an LM head's vocabulary-wide table is cheaper to read
    /// whole sequences with).
    fn smaller(&self, w: &str, x: &str) -> bool {
        let numel = |n: &str| self.shape(n).map(|s| s.iter().product::<usize>());
        matches!((numel(w), numel(x)), (Some(a), Some(b)) if a < b)
    }

    /// Whether a value is read by a node or is a graph output.
    /// Whether a node of the graph makes `name` (an activation, not an initializer or a
    /// graph input).
    fn made(&self, name: &str) -> bool {
        self.graph
            .nodes
            .iter()
            .any(|n| n.outputs.iter().any(|o| o == name))
    }

    fn used(&self, name: &str) -> bool {
        self.graph.last_use.contains_key(name) || self.graph.outputs.iter().any(|o| o.name == name)
    }
}
