//! Megatron's vocabulary parallelism on ONNX graphs: the token embedding and the LM head
//! split along the vocabulary, so neither the table nor the logits are ever whole on one
//! rank (on GPT-2 124M the two are one 38.6 M-parameter table, a third of the model).
//!
//! - **Embedding**: a `Gather` on axis 0 of a 2-D parameter whose indices are token ids
//!   (a graph input, through reshapes and casts at most). Each rank looks up the ids that
//!   fall in its rows, zeroes the others ([`super::ops::vocab_gather`]), and Megatron's `g`
//!   sums the ranks' rows. Position tables, indexed by computed positions, stay whole.
//! - **Head**: the MatMul/Gemm producing the loss's logits (a graph output nothing else
//!   reads), whose weight is a 2-D parameter, read directly or through a `Transpose` (a
//!   head tied to the embedding). Its input gets Megatron's `f`; its output is this rank's
//!   slice of the vocabulary, which the loss reads as such (a parallel cross-entropy, see
//!   [`crate::collective::vocab`]).
//!
//! The vocabulary need not divide by the rank count: it is padded with zero rows (columns)
//! up to a multiple, the padding lives on the last rank, and the loss never reads it.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use crate::collective::axis_split::AxisSplit;
pub use crate::collective::vocab::VocabShard;
use crate::graph::head::head_of;
use crate::graph::{Graph, Node};
use crate::model::{OnnxModel, ParamRole};

/// What the vocabulary split adds to a [`SplitPlan`](super::SplitPlan).
#[derive(Debug, Clone, Default)]
pub struct VocabPlan {
    /// Gather nodes looking up rows of a split table.
    pub embeddings: BTreeSet<usize>,
    /// The head node and its vocabulary size.
    pub head: Option<(usize, usize)>,
    /// The split tables (and a head's bias).
    pub params: BTreeMap<String, AxisSplit>,
}

impl VocabPlan {
    /// Rank `rank`'s slice of the head's logits (of `tp` ranks).
    pub fn shard(&self, graph: &Graph, rank: usize, tp: usize) -> Option<VocabShard> {
        let (node, vocab) = self.head?;
        let local = vocab.div_ceil(tp);
        let start = rank * local;
        Some(VocabShard {
            output: graph.nodes[node].outputs[0].clone(),
            vocab,
            start,
            valid: local.min(vocab - start),
        })
    }
}

/// The Megatron blocks a vocabulary split goes beside: what they split, and whether a
/// node is inside one.
pub struct Blocks<'a> {
    /// The parameters the blocks split.
    pub params: &'a BTreeMap<String, AxisSplit>,
    /// Whether node `i` is inside a block (reads a split value, or starts one).
    pub contains: &'a dyn Fn(usize) -> bool,
}

/// The vocabulary split of `model` over `tp` ranks, beside the Megatron `blocks`:
/// embeddings always, the head when `head_output` (the output a vocabulary cross-entropy
/// reads) is given.
pub fn plan(model: &OnnxModel, tp: usize, blocks: &Blocks, head_output: Option<&str>) -> VocabPlan {
    let graph = model.graph();
    let mut readers: HashMap<&str, Vec<usize>> = HashMap::new();
    for (i, n) in graph.nodes.iter().enumerate() {
        for input in &n.inputs {
            readers.entry(input.as_str()).or_default().push(i);
        }
    }
    let free = |name: &str| table(model, name).is_some() && !blocks.params.contains_key(name);
    let mut plan = VocabPlan::default();
    // The head: (node, transpose node, table, its vocabulary axis).
    let head = head_output
        .and_then(|out| head_of(graph, out, free))
        .filter(|h| !(blocks.contains)(h.node))
        .map(|h| (h.node, h.transpose, h.table, h.vocab_axis));
    let mut head_table = None;
    if let Some((i, t, w, axis)) = head {
        let vocab = model.param_infos()[model.param_index(&w).expect("a table")].shape[axis];
        let mut only = vec![i];
        only.extend(t);
        let embeddings = lookups(graph, &readers, &w);
        let readers_ok = readers[w.as_str()]
            .iter()
            .all(|r| only.contains(r) || (axis == 0 && embeddings.contains(r)));
        if let (true, Some(split)) = (readers_ok, padded(vocab, tp, axis)) {
            if let Some(bias) = head_bias(model, &graph.nodes[i], vocab, split) {
                plan.params.extend(bias);
                plan.params.insert(w.clone(), split);
                plan.head = Some((i, vocab));
                plan.embeddings.extend(embeddings);
                head_table = Some(w);
            }
        }
    }
    // Untied token embeddings.
    for node in graph.nodes.iter().filter(|n| n.op_type == "Gather") {
        let name = &node.inputs[0];
        if head_table.as_deref() == Some(name.as_str())
            || plan.params.contains_key(name)
            || !free(name)
        {
            continue;
        }
        let embeddings = lookups(graph, &readers, name);
        if embeddings.is_empty() || embeddings.len() != readers[name.as_str()].len() {
            continue;
        }
        let rows = model.param_infos()[model.param_index(name).expect("a table")].shape[0];
        if let Some(split) = padded(rows, tp, 0) {
            plan.params.insert(name.clone(), split);
            plan.embeddings.extend(embeddings);
        }
    }
    plan
}

/// A 2-D trained (or frozen) parameter.
fn table(model: &OnnxModel, name: &str) -> Option<usize> {
    let i = model.param_index(name)?;
    let info = &model.param_infos()[i];
    (info.shape.len() == 2 && matches!(info.role, ParamRole::Trainable | ParamRole::Frozen))
        .then_some(i)
}

/// The split of a vocabulary axis of `size` entries, padded to a multiple of `tp`; `None`
/// when the last rank would hold padding only.
fn padded(size: usize, tp: usize, axis: usize) -> Option<AxisSplit> {
    let local = size.div_ceil(tp);
    ((tp - 1) * local < size).then_some(AxisSplit {
        axis,
        period: local * tp,
        pad: local * tp - size,
    })
}

/// The split of a Gemm head's bias: none needed (absent, or one value broadcast), a
/// `[V]` or `[1, V]` parameter split like the vocabulary, or `None` when the bias cannot
/// follow (a constant of the vocabulary's width).
fn head_bias(
    model: &OnnxModel,
    node: &Node,
    vocab: usize,
    split: AxisSplit,
) -> Option<Vec<(String, AxisSplit)>> {
    let Some(c) = node.inputs.get(2).filter(|c| !c.is_empty()) else {
        return Some(Vec::new());
    };
    let shape = match model.param_index(c) {
        Some(i) => model.param_infos()[i].shape.clone(),
        None => {
            let whole = model
                .constant_infos()
                .iter()
                .find(|k| &k.name == c)
                .map(|k| k.shape.iter().product::<usize>());
            return (whole == Some(1)).then(Vec::new);
        }
    };
    match shape[..] {
        [v] if v == vocab => Some(vec![(c.clone(), split.on(0))]),
        [1, v] if v == vocab => Some(vec![(c.clone(), split.on(1))]),
        _ if shape.iter().product::<usize>() == 1 => Some(Vec::new()),
        _ => None,
    }
}

/// The Gather nodes that read `table` as an embedding: axis 0, indices that are token ids.
fn lookups(graph: &Graph, readers: &HashMap<&str, Vec<usize>>, table: &str) -> Vec<usize> {
    readers
        .get(table)
        .into_iter()
        .flatten()
        .copied()
        .filter(|&r| {
            let n = &graph.nodes[r];
            n.op_type == "Gather"
                && n.inputs[0] == table
                && n.attrs.int("axis", 0).ok() == Some(0)
                && n.inputs.get(1).is_some_and(|ids| token_ids(graph, ids))
        })
        .collect()
}

/// Whether `value` is a graph input's values, through reshapes and casts.
fn token_ids(graph: &Graph, value: &str) -> bool {
    const CARRY: &[&str] = &[
        "Reshape",
        "Unsqueeze",
        "Squeeze",
        "Flatten",
        "Cast",
        "Identity",
    ];
    let mut v = value;
    for _ in 0..graph.nodes.len() + 1 {
        if graph.inputs.iter().any(|i| i.name == v) {
            return true;
        }
        match graph
            .nodes
            .iter()
            .find(|n| n.outputs.iter().any(|o| o == v))
        {
            Some(n) if CARRY.contains(&n.op_type.as_str()) => v = &n.inputs[0],
            _ => return false,
        }
    }
    false
}
