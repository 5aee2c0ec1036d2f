//! The graph of one tensor-parallel rank, from a [`SplitPlan`]: `f` on every value entering a
//! block or the vocabulary-parallel head, `g` after every row-parallel projection (a
//! Gemm's bias moves after it, so it is added once) and every vocabulary-parallel
//! embedding lookup, Reshape and Split nodes on the split axis adapted to local sizes.
//! Every rank gets the same graph; only the parameters differ (see
//! `OnnxModel::into_tensor_parallel`).

use std::collections::{HashMap, HashSet};

use super::ops;
use super::plan::SplitPlan;
use crate::error::{OnnxError, Result};
use crate::graph::attributes::{Attr, Attributes};
use crate::graph::{Graph, Node};

fn copied(name: &str) -> String {
    format!("{name}::tp_copy")
}

/// The rewritten graph (same inputs, outputs and constants).
pub fn rewrite(graph: &Graph, plan: &SplitPlan) -> Result<Graph> {
    let tp = plan.tp as i64;
    let mut nodes = Vec::with_capacity(graph.nodes.len() + plan.copies.len() + 2 * plan.ends.len());
    let mut emitted: HashSet<&str> = HashSet::new();
    for (i, node) in graph.nodes.iter().enumerate() {
        let mut node = node.clone();
        let head = plan.vocab.head.is_some_and(|(h, _)| h == i);
        let in_block = plan.region.contains(&i) || plan.starts.contains(&i) || head;
        if in_block {
            for input in node
                .inputs
                .iter_mut()
                .filter(|n| plan.copies.contains(n.as_str()))
            {
                if emitted.insert(plan.copies.get(input.as_str()).expect("a copied value")) {
                    nodes.push(new_node(
                        format!("{}::tp_copy", input),
                        "TensorParallelCopy",
                        vec![input.clone()],
                        vec![copied(input)],
                        ops::copy,
                    ));
                }
                *input = copied(input);
            }
        }
        if let Some(&(axis, full)) = plan.reshapes.get(&i) {
            local_reshape(&mut node, plan.tp, axis, full);
        }
        if plan.splits.contains(&i) {
            if let Some(Attr::Ints(sizes)) = node.attrs.get("split").cloned() {
                if sizes.iter().any(|s| s % tp != 0) {
                    return Err(OnnxError::Node {
                        node: node.name.clone(),
                        op_type: node.op_type.clone(),
                        message: format!(
                            "split sizes {sizes:?} are not multiples of {tp} tensor-parallel ranks"
                        ),
                    });
                }
                node.attrs
                    .set("split", Attr::Ints(sizes.iter().map(|s| s / tp).collect()));
            }
            node.attrs.set(ops::PARTS, Attr::Int(tp));
            node.op = ops::split;
        }
        let lookup = plan.vocab.embeddings.contains(&i);
        if lookup {
            let split = plan.vocab.params[&node.inputs[0]];
            let rows = split.period - split.pad;
            node.attrs.set(ops::FULL, Attr::Int(rows as i64));
            node.op = ops::vocab_gather;
        }
        if !plan.ends.contains(&i) && !lookup {
            nodes.push(node);
            continue;
        }
        let out = node.outputs[0].clone();
        let partial = format!("{out}::tp_partial");
        node.outputs[0] = partial.clone();
        let bias = (node.op_type == "Gemm")
            .then(|| node.inputs.get(2).cloned())
            .flatten()
            .filter(|c| !c.is_empty());
        if bias.is_some() {
            node.inputs.truncate(2);
        }
        let name = node.name.clone();
        nodes.push(node);
        match bias {
            None => nodes.push(new_node(
                format!("{name}::tp_reduce"),
                "TensorParallelReduce",
                vec![partial],
                vec![out],
                ops::reduce,
            )),
            Some(c) => {
                let summed = format!("{out}::tp_sum");
                nodes.push(new_node(
                    format!("{name}::tp_reduce"),
                    "TensorParallelReduce",
                    vec![partial],
                    vec![summed.clone()],
                    ops::reduce,
                ));
                let add = crate::ops::lookup("Add").expect("Add is an op");
                nodes.push(new_node(
                    format!("{name}::tp_bias"),
                    "Add",
                    vec![summed, c],
                    vec![out],
                    add,
                ));
            }
        }
    }
    let mut last_use = HashMap::new();
    for (i, n) in nodes.iter().enumerate() {
        for input in n.inputs.iter().filter(|i| !i.is_empty()) {
            last_use.insert(input.clone(), i);
        }
    }
    Ok(Graph {
        nodes,
        last_use,
        initializers: Vec::new(),
        ..graph.clone()
    })
}

/// Make the Reshape `node` take this rank's size where its target names `full`, the
/// whole size of output axis `axis` split over `parts` ranks ([`ops::reshape`]).
pub(crate) fn local_reshape(node: &mut Node, parts: usize, axis: usize, full: usize) {
    node.attrs.set(ops::PARTS, Attr::Int(parts as i64));
    node.attrs.set(ops::AXIS, Attr::Int(axis as i64));
    node.attrs.set(ops::FULL, Attr::Int(full as i64));
    node.op = ops::reshape;
}

/// A node the rewrite adds, without attributes.
pub(crate) fn new_node(
    name: String,
    op_type: &str,
    inputs: Vec<String>,
    outputs: Vec<String>,
    op: crate::ops::OpFn,
) -> Node {
    Node {
        name,
        op_type: op_type.into(),
        inputs,
        outputs,
        attrs: Attributes::default(),
        op,
    }
}
