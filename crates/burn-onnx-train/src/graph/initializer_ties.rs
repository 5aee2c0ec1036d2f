//! Parameter ties the exporter broke or made, undone when a file is loaded.
//!
//! An ONNX file has no notion of a parameter, and exporters rewrite what they were given:
//! - **Folded copies of one parameter.** TorchScript folds the transposed copy of a tied
//!   embedding (GPT-2's and T5's `lm_head`) into a second initializer. Trained as it is,
//!   the copy drifts apart from the embedding. An initializer that equals an earlier one
//!   exactly, directly or transposed (2-D), and is not filled with one constant value, is
//!   a duplicate: it is removed and read through an `Identity` or `Transpose` node of the
//!   earlier one, so both readers train one tensor (`tie_duplicates = false` only reports
//!   it). Export writes the copy back as an initializer of its own holding the trained
//!   values, so the exported file keeps the source's structure.
//! - **Merged constants.** TorchScript merges initializers of equal value, so a fresh
//!   model's norm weights (all ones), biases (all zeros) and batch-norm running statistics
//!   become one tensor read by many nodes, directly or through `Identity` nodes. Those
//!   were separate parameters (or buffers) in the framework: every further node that reads
//!   such a constant-filled initializer gets its own copy (`<name>__<k>`), so each trains,
//!   or updates its running statistics, on its own. With this rewrite, nodes also read
//!   initializers directly instead of through `Identity` nodes (dropped when unused), so
//!   a batch-norm node's running statistics are known as its state.
//!
//! Scalars and one-element tensors are left alone (they are constants by the default
//! rule). [`TieOptions`] turns each rewrite off; `inspect` prints the decisions.

use std::collections::{HashMap, HashSet};

use onnx_ir::{AttributeProto, AttributeType, GraphProto, NodeProto};

use crate::graph::initializer::Initializer;

/// Which rewrites to apply (both on by default).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TieOptions {
    /// Train initializers that duplicate another (directly or transposed) as one parameter
    /// (off: detected duplicates are only reported).
    pub tie_duplicates: bool,
    /// Give every reader of a shared constant-filled initializer its own copy.
    pub untie_constant_fills: bool,
}

impl Default for TieOptions {
    fn default() -> Self {
        TieOptions {
            tie_duplicates: true,
            untie_constant_fills: true,
        }
    }
}

/// One decision, for `inspect`.
#[derive(Debug, Clone, PartialEq)]
pub enum TieDecision {
    /// `copy` equals `original` (transposed when `transposed`); with `tied`, it is read
    /// from `original` and trains as it, else it stays a parameter of its own.
    Duplicate {
        /// The later initializer.
        copy: String,
        /// The earlier one it equals.
        original: String,
        /// Equal through a 2-D transpose.
        transposed: bool,
        /// Whether the copy now reads the original.
        tied: bool,
    },
    /// The constant-filled `original` was shared by several nodes; `copies` are the new
    /// initializers, one per further reading node.
    Untied {
        /// The shared initializer (kept by its first reader).
        original: String,
        /// The new initializers.
        copies: Vec<String>,
    },
}

impl std::fmt::Display for TieDecision {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TieDecision::Duplicate {
                copy,
                original,
                transposed,
                tied,
            } => write!(
                f,
                "{}: '{copy}' equals '{original}'{} {}",
                if *tied { "tied" } else { "duplicate" },
                if *transposed { " transposed" } else { "" },
                if *tied {
                    "and trains as it"
                } else {
                    "(tie_duplicate_initializers = true trains them as one)"
                }
            ),
            TieDecision::Untied { original, copies } => write!(
                f,
                "untied: constant-filled '{original}' was shared by {} nodes; each has its own copy ({})",
                copies.len() + 1,
                copies.join(", ")
            ),
        }
    }
}

/// Apply the rewrites to a graph and its decoded initializers (kept in the same order as
/// the graph's; new copies follow their original).
pub fn apply(
    graph: &mut GraphProto,
    initializers: &mut Vec<(String, Initializer)>,
    options: TieOptions,
) -> Vec<TieDecision> {
    let mut decisions = Vec::new();
    if options.untie_constant_fills {
        decisions.extend(untie_constant_fills(graph, initializers));
    }
    decisions.extend(tie_duplicates(graph, initializers, options.tie_duplicates));
    decisions
}

/// The single value a float tensor of more than one element is filled with, if any.
fn constant_fill(t: &Initializer) -> Option<f32> {
    let a = t.floats()?;
    let mut it = a.iter();
    let first = *it.next()?;
    let fill = (a.len() > 1 && it.all(|v| v.to_bits() == first.to_bits())).then_some(first);
    t.release();
    fill
}

/// The initializer each `Identity` output stands for (chains followed).
fn identity_aliases(graph: &GraphProto, is_init: impl Fn(&str) -> bool) -> HashMap<String, String> {
    let mut alias: HashMap<String, String> = HashMap::new();
    for n in graph.node.iter().filter(|n| n.op_type == "Identity") {
        let (Some(i), Some(o)) = (n.input.first(), n.output.first()) else {
            continue;
        };
        let root = alias
            .get(i)
            .cloned()
            .or_else(|| is_init(i).then(|| i.clone()));
        if let Some(root) = root {
            alias.insert(o.clone(), root);
        }
    }
    alias
}

fn untie_constant_fills(
    graph: &mut GraphProto,
    initializers: &mut Vec<(String, Initializer)>,
) -> Vec<TieDecision> {
    let index: HashMap<String, usize> = initializers
        .iter()
        .enumerate()
        .map(|(i, (n, _))| (n.clone(), i))
        .collect();
    let filled: HashSet<&str> = initializers
        .iter()
        .filter(|(_, t)| constant_fill(t).is_some())
        .map(|(n, _)| n.as_str())
        .collect();
    let filled = |name: &str| filled.contains(name);
    let alias = identity_aliases(graph, |n| index.contains_key(n));
    // Every node reads an initializer directly, not through `Identity` nodes (so batch-norm
    // state and gradients are traced to the initializer itself); the reading nodes of each
    // constant-filled initializer are collected in graph order.
    let mut readers: HashMap<String, Vec<usize>> = HashMap::new();
    for (k, n) in graph.node.iter_mut().enumerate() {
        if n.op_type == "Identity" {
            continue;
        }
        for input in n.input.iter_mut() {
            if let Some(root) = alias.get(input.as_str()) {
                *input = root.clone();
            }
            if index.contains_key(input.as_str()) && filled(input) {
                let list = readers.entry(input.clone()).or_default();
                if list.last() != Some(&k) {
                    list.push(k);
                }
            }
        }
    }
    let mut decisions = Vec::new();
    let mut new_inits: Vec<(usize, String)> = Vec::new();
    let mut roots: Vec<_> = readers.into_iter().filter(|(_, r)| r.len() > 1).collect();
    roots.sort_by_key(|(root, _)| index[root]);
    for (root, nodes) in roots {
        let mut copies = Vec::new();
        for (k, &node) in nodes.iter().enumerate().skip(1) {
            let copy = fresh_name(graph, &format!("{root}__{k}"));
            for input in graph.node[node].input.iter_mut().filter(|i| **i == root) {
                *input = copy.clone();
            }
            new_inits.push((index[&root], copy.clone()));
            copies.push(copy);
        }
        decisions.push(TieDecision::Untied {
            original: root,
            copies,
        });
    }
    // Proto initializers: each copy is its original under the new name.
    for (i, copy) in &new_inits {
        let name = &initializers[*i].0;
        if let Some(proto) = graph.initializer.iter().find(|t| &t.name == name) {
            let mut proto = proto.clone();
            proto.name = copy.clone();
            graph.initializer.push(proto);
        }
    }
    // Loaded initializers: copies right after their original.
    for (i, copy) in new_inits.into_iter().rev() {
        let t = initializers[i].1.clone();
        initializers.insert(i + 1, (copy, t));
    }
    drop_dead_identities(graph);
    decisions
}

/// A name no value of the graph has yet, starting from `base`.
fn fresh_name(graph: &GraphProto, base: &str) -> String {
    let taken = |n: &str| {
        graph.initializer.iter().any(|t| t.name == n)
            || graph.input.iter().any(|i| i.name == n)
            || graph.node.iter().any(|x| x.output.iter().any(|o| o == n))
    };
    let mut name = base.to_string();
    let mut k = 0;
    while taken(&name) {
        k += 1;
        name = format!("{base}_{k}");
    }
    name
}

/// Whether a node of `graph`, or of a subgraph (If/Loop/Scan bodies) at any depth, reads
/// `name`.
fn read_anywhere(graph: &GraphProto, name: &str) -> bool {
    graph.node.iter().any(|n| {
        n.input.iter().any(|i| i == name)
            || n.attribute.iter().any(|a| {
                a.g.as_ref().is_some_and(|g| read_anywhere(g, name))
                    || a.graphs.iter().any(|g| read_anywhere(g, name))
            })
    })
}

/// Remove `Identity` nodes whose output nothing reads any more (after untying).
fn drop_dead_identities(graph: &mut GraphProto) {
    loop {
        let read =
            |name: &str| read_anywhere(graph, name) || graph.output.iter().any(|o| o.name == name);
        let dead = graph
            .node
            .iter()
            .position(|n| n.op_type == "Identity" && n.output.first().is_some_and(|o| !read(o)));
        match dead {
            Some(i) => {
                graph.node.remove(i);
            }
            None => return,
        }
    }
}

/// A cheap key equal for a tensor and any permutation of its elements (a transpose): the
/// element count and two wrapping sums over the elements' bits, which do not depend on the
/// order of the elements (floating-point sums do, in their last bits).
fn fingerprint(a: &ndarray::ArrayViewD<f32>) -> (usize, u64, u64) {
    let (s, m) = a.iter().fold((0u64, 0u64), |(s, m), v| {
        let bits = u64::from(v.to_bits());
        let mixed = bits.wrapping_mul(0x9e37_79b9_7f4a_7c15).rotate_left(29);
        (s.wrapping_add(bits), m.wrapping_add(mixed))
    });
    (a.len(), s, m)
}

/// Find initializers equal to an earlier one (directly or transposed); with `tie`, read
/// each from the earlier one.
fn tie_duplicates(
    graph: &mut GraphProto,
    initializers: &mut Vec<(String, Initializer)>,
    tie: bool,
) -> Vec<TieDecision> {
    let mut seen: HashMap<(usize, u64, u64), Vec<usize>> = HashMap::new();
    let mut ties: Vec<(usize, usize, bool)> = Vec::new();
    for (i, (_, t)) in initializers.iter().enumerate() {
        let Some(a) = t.floats() else { continue };
        if a.len() < 2 || constant_fill(t).is_some() {
            continue;
        }
        let key = fingerprint(&a);
        let earlier = seen.entry(key).or_default();
        let found = earlier.iter().find_map(|&j| {
            let other = &initializers[j].1;
            let b = other.floats()?;
            let found = if b.shape() == a.shape() && b == a {
                Some((j, false))
            } else if a.ndim() == 2 && b.ndim() == 2 && b.t() == a {
                Some((j, true))
            } else {
                None
            };
            other.release();
            found
        });
        t.release();
        match found {
            Some((j, transposed)) => ties.push((i, j, transposed)),
            None => earlier.push(i),
        }
    }
    let mut decisions = Vec::new();
    let mut tie_nodes = Vec::new();
    for &(copy, original, transposed) in &ties {
        let (copy, original) = (
            initializers[copy].0.clone(),
            initializers[original].0.clone(),
        );
        tie_nodes.push(tie_node(&original, &copy, transposed));
        decisions.push(TieDecision::Duplicate {
            copy,
            original,
            transposed,
            tied: tie,
        });
    }
    if !tie {
        return decisions;
    }
    let removed: Vec<String> = ties
        .iter()
        .map(|&(c, _, _)| initializers[c].0.clone())
        .collect();
    initializers.retain(|(n, _)| !removed.contains(n));
    graph.initializer.retain(|t| !removed.contains(&t.name));
    // A graph input that shares the removed initializer's name (IR < 4 lists initializers
    // as inputs too) is no longer an input either.
    graph.input.retain(|i| !removed.contains(&i.name));
    // Each tie node goes right before the first node that reads its copy, so a pipeline
    // stage that reads the copy holds the original (shared across stages) instead of
    // receiving the copy from the first stage every micro-batch.
    let mut placed: Vec<(usize, NodeProto)> = tie_nodes
        .into_iter()
        .map(|t| {
            let copy = &t.output[0];
            let at = graph.node.iter().position(|n| reads(n, copy)).unwrap_or(0);
            (at, t)
        })
        .collect();
    placed.sort_by_key(|(at, _)| std::cmp::Reverse(*at));
    for (at, t) in placed {
        graph.node.insert(at, t);
    }
    decisions
}

/// Whether `node` reads `name`, itself or inside one of its subgraphs.
fn reads(node: &NodeProto, name: &str) -> bool {
    node.input.iter().any(|i| i == name)
        || node.attribute.iter().any(|a| {
            a.g.iter()
                .chain(&a.graphs)
                .any(|g| g.node.iter().any(|n| reads(n, name)))
        })
}

/// `Identity(original) -> copy`, or `Transpose(original, perm = [1, 0]) -> copy`.
fn tie_node(original: &str, copy: &str, transposed: bool) -> NodeProto {
    let attribute = if transposed {
        vec![AttributeProto {
            name: "perm".into(),
            type_: AttributeType::INTS.into(),
            ints: vec![1, 0],
            ..Default::default()
        }]
    } else {
        Vec::new()
    };
    NodeProto {
        name: format!("tie/{copy}"),
        op_type: if transposed { "Transpose" } else { "Identity" }.into(),
        input: vec![original.to_string()],
        output: vec![copy.to_string()],
        attribute,
        ..Default::default()
    }
}

/// The inverse of the tie rewrite, for export: every tied copy is an initializer again
/// (its tie node removed; after its original, and listed as a graph input where the
/// original is, as IR < 4 files do), so the exported file has the source's structure.
/// The copies' data is left empty: returns, per copy, the original it is filled from and
/// whether transposed.
pub fn restore_tied_copies(
    graph: &mut GraphProto,
    decisions: &[TieDecision],
) -> HashMap<String, (String, bool)> {
    let mut restored = HashMap::new();
    for d in decisions {
        let TieDecision::Duplicate {
            copy,
            original,
            transposed,
            tied: true,
        } = d
        else {
            continue;
        };
        let Some(at) = graph.initializer.iter().position(|t| &t.name == original) else {
            continue;
        };
        graph.node.retain(|n| n.output.first() != Some(copy));
        let mut proto = graph.initializer[at].clone();
        proto.name = copy.clone();
        if *transposed {
            proto.dims.reverse();
        }
        proto.raw_data = Default::default();
        proto.float_data.clear();
        proto.double_data.clear();
        proto.int32_data.clear();
        proto.external_data.clear();
        proto.data_location = Default::default();
        graph.initializer.insert(at + 1, proto);
        if let Some(i) = graph.input.iter().position(|v| &v.name == original) {
            let mut info = graph.input[i].clone();
            info.name = copy.clone();
            if *transposed {
                reverse_dims(&mut info);
            }
            graph.input.insert(i + 1, info);
        }
        restored.insert(copy.clone(), (original.clone(), *transposed));
    }
    restored
}

/// Reverse the shape of a tensor value info (a 2-D transpose).
fn reverse_dims(info: &mut onnx_ir::ValueInfoProto) {
    if let Some(ty) = info.type_.as_mut().filter(|t| t.has_tensor_type())
        && let Some(shape) = ty.mut_tensor_type().shape.as_mut()
    {
        shape.dim.reverse();
    }
}
