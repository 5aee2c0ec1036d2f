//! The head of a graph output: the MatMul (or Gemm without `transA`) producing it, which no
//! node reads, and the table it multiplies by (a 2-D weight, read directly or through a
//! two-axis Transpose that nothing else reads). The tensor-parallel vocabulary split and the
//! padded head (`crate::model::padded_head`) both start from it.

use super::Graph;
use super::attributes::Attr;

/// A head and its table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Head {
    /// The MatMul or Gemm node.
    pub node: usize,
    /// The Transpose node between the table and the head, if the table is read transposed.
    pub transpose: Option<usize>,
    /// The table's name.
    pub table: String,
    /// The table's axis that becomes the output's last (the vocabulary's).
    pub vocab_axis: usize,
}

/// The head producing graph output `output`, whose table is a value `is_table` accepts.
pub fn head_of(graph: &Graph, output: &str, is_table: impl Fn(&str) -> bool) -> Option<Head> {
    let readers = |v: &str| {
        graph
            .nodes
            .iter()
            .filter(|n| n.inputs.iter().any(|i| i == v))
            .count()
    };
    if !graph.outputs.iter().any(|o| o.name == output) || readers(output) > 0 {
        return None;
    }
    let node = graph
        .nodes
        .iter()
        .position(|n| n.outputs.first().map(String::as_str) == Some(output))?;
    let head = &graph.nodes[node];
    let trans_b = match head.op_type.as_str() {
        "MatMul" => false,
        "Gemm" if head.attrs.int("transA", 0).ok()? == 0 => head.attrs.int("transB", 0).ok()? != 0,
        _ => return None,
    };
    let w = head.inputs.get(1)?;
    if is_table(w) {
        return Some(Head {
            node,
            transpose: None,
            table: w.clone(),
            vocab_axis: if trans_b { 0 } else { 1 },
        });
    }
    let t = graph
        .nodes
        .iter()
        .position(|n| n.outputs.first() == Some(w) && n.op_type == "Transpose")?;
    let tn = &graph.nodes[t];
    let swaps = match tn.attrs.get("perm") {
        Some(Attr::Ints(p)) => p == &[1, 0],
        None => true,
        _ => false,
    };
    (swaps && is_table(&tn.inputs[0]) && readers(w) == 1).then(|| Head {
        node,
        transpose: Some(t),
        table: tn.inputs[0].clone(),
        vocab_axis: if trans_b { 1 } else { 0 },
    })
}
