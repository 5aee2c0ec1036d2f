//! The loss's logits in the products' precision. Under autocast a product writes f32
//! (`kernels::cube_matmul`), which for the head means a `[rows, vocabulary]` f32 tensor
//! kept for the loss's backward, an f32 gradient of the same size, and a cast of that
//! gradient to the low precision the head's backward products read: at GPT-2's 50304
//! columns and 16 x 1024 tokens, 3.3 GB written by the head, 3.3 GB of gradient and 4.9 GB
//! more moved by the cast.
//!
//! A head whose output only the loss reads (a MatMul producing a graph output no node
//! reads, `OnnxModel::matmul_head`) is marked [`LOW_PRECISION_RESULT`]: on a CubeCL device
//! under autocast its product writes the logits in the autocast precision from its f32
//! accumulators (as PyTorch's autocast rounds every product), the cross-entropy reads them
//! so and computes in f32 (`kernels::cross_entropy_rows_within`), and writes their gradient
//! in their precision, which the head's backward products read with no cast. Every dtype
//! along the way is the logits' own, so no gradient of one precision meets another. The
//! loss attaches the mark when it is a cross-entropy on the whole vocabulary
//! (`train::layout::parallel_plan`); the model's outputs keep f32 everywhere else.

use super::OnnxModel;
use crate::graph::attributes::LOW_PRECISION_RESULT;

impl OnnxModel {
    /// This model with the MatMul head producing graph output `output` marked to write its
    /// logits in the autocast precision (see the module doc), and whether it was one.
    pub fn with_low_precision_logits(self, output: &str) -> (OnnxModel, bool) {
        self.with_head_mark(output, LOW_PRECISION_RESULT)
    }

    /// Whether graph output `output` comes from a head whose logits autocast writes in
    /// the low precision once marked (a MatMul; a Gemm adds its bias in f32).
    pub fn has_low_precision_head(&self, output: &str) -> bool {
        self.matmul_head(output).is_some()
    }
}
