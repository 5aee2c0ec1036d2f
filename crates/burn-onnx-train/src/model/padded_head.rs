//! A head padded to an aligned vocabulary, inside the model only (nanoGPT's 50257 -> 50304,
//! Megatron's `make_vocab_size_divisible_by`). GPT-2's 50257 classes make every row of the
//! logits, and of the head's weight read as `[width, vocab]`, an odd number of values: no
//! vectorized load or store fits them, and CubeCL's matmul takes its scalar kernels for the
//! three largest products of the step (session 17's profile: 12.6 ms of 79 on an H200).
//!
//! The head (a MatMul or Gemm producing the loss's logits, its weight a 2-D parameter read
//! directly or through a Transpose) is marked [`PAD_COLUMNS`]: its op widens the weight with
//! zero columns for the product, so the logits have `padded` columns, and the loss reads
//! the first `classes` of each row (`kernels::cross_entropy_rows_within`), giving the others
//! a zero gradient. Nothing else changes: the parameter keeps its shape (checkpoints,
//! exports and the optimizer never see the padding), the padded part of the weight's
//! gradient is sliced off as a view, and the loss is the unpadded model's.

use std::sync::Arc;

use super::{OnnxModel, Spec};
use crate::graph::Graph;
use crate::graph::attributes::{Attr, PAD_COLUMNS};
use crate::graph::head::head_of;

/// The logits output of a model whose head is padded, and how many of its columns are
/// classes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PaddedHead {
    /// The graph output holding the padded logits.
    pub output: String,
    /// The head's columns in the source model: the classes.
    pub classes: usize,
    /// The columns of the padded logits.
    pub padded: usize,
}

impl OnnxModel {
    /// This model with the head producing graph output `output` padded to a multiple of
    /// `multiple` columns, when the head is one ([`head_columns`]) and its width is not a
    /// multiple already; the model unchanged otherwise.
    pub fn with_padded_head(mut self, output: &str, multiple: usize) -> OnnxModel {
        let Some((node, classes)) = head_columns(self.graph(), output, |name| {
            let i = self.param_index(name)?;
            match self.param_infos()[i].shape[..] {
                [rows, cols] => Some([rows, cols]),
                _ => None,
            }
        }) else {
            return self;
        };
        let padded = classes.next_multiple_of(multiple.max(1));
        if padded == classes {
            return self;
        }
        let mut graph = self.graph().clone();
        graph.nodes[node]
            .attrs
            .set(PAD_COLUMNS, Attr::Int(padded as i64));
        self.spec = Arc::new(Spec {
            graph: Arc::new(graph),
            padded_head: Some(PaddedHead {
                output: output.to_string(),
                classes,
                padded,
            }),
            ..(*self.spec).clone()
        });
        self
    }

    /// The padded head, if [`Self::with_padded_head`] padded one.
    pub fn padded_head(&self) -> Option<&PaddedHead> {
        self.spec.padded_head.as_ref()
    }
}

/// The node producing graph output `output` and its column count, when it is a head
/// ([`head_of`]) whose table is a 2-D parameter (`shape_of` gives its shape).
pub fn head_columns(
    graph: &Graph,
    output: &str,
    shape_of: impl Fn(&str) -> Option<[usize; 2]>,
) -> Option<(usize, usize)> {
    let head = head_of(graph, output, |name| shape_of(name).is_some())?;
    Some((head.node, shape_of(&head.table)?[head.vocab_axis]))
}
