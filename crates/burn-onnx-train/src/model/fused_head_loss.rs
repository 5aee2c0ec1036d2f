//! The head's product left to the loss, so the `[tokens, vocabulary]` logits never exist
//! whole (`kernels::head_cross_entropy_sum`, Liger-Kernel's fused linear cross-entropy). A
//! MatMul head whose output only the loss reads (`OnnxModel::matmul_head`) is marked
//! [`FUSED_HEAD_LOSS`]; a pass skips the node and hands the loss its operands
//! ([`HeadOperands`], in `ForwardOutput::fused_head`): the hidden rows and the table as
//! the product would read it (padded to the head's aligned columns,
//! `crate::model::padded_head`). An evaluation pass asks for the loss alone; a training
//! pass for its gradients too. Evaluating by blocks keeps the logits from setting the
//! pool's page size between updates as well.

use std::collections::HashMap;

use burn::tensor::{Device, FloatDType};

use super::OnnxModel;
use crate::error::{OnnxError, Result};
use crate::graph::attributes::FUSED_HEAD_LOSS;
use crate::ops::pad_columns;
use crate::value::{FloatValue, Value};

/// What a fused head loss reads in place of the logits of graph output `output`.
#[derive(Debug, Clone)]
pub struct HeadOperands {
    /// The graph output the head would have written.
    pub output: String,
    /// The head's left operand, `[.., width]`: one row per row of the logits.
    pub hidden: FloatValue,
    /// The head's right operand, `[width, columns]`, padded to the head's columns.
    pub table: FloatValue,
    /// The precision the products read their operands in and write the logits in (the
    /// autocast precision, or f32).
    pub compute: FloatDType,
    /// Whether the loss computes the gradients too (a training pass).
    pub gradients: bool,
}

impl OnnxModel {
    /// This model with the MatMul head producing graph output `output` marked to leave its
    /// product to the loss (see the module doc), and whether it was one.
    pub fn with_fused_head_loss(self, output: &str) -> (OnnxModel, bool) {
        self.with_head_mark(output, FUSED_HEAD_LOSS)
    }

    /// Whether a pass skips node `node` (the fused head).
    pub(super) fn leaves_to_loss(&self, node: usize) -> bool {
        self.graph().nodes[node]
            .attrs
            .int(FUSED_HEAD_LOSS, 0)
            .is_ok_and(|v| v != 0)
    }

    /// The operands of the fused head, read from a pass's values `env` (its inputs stay
    /// there: the pass skipped their last reader), the loss's gradients wanted when
    /// `gradients`; `None` without one.
    pub(super) fn head_operands(
        &self,
        env: &HashMap<String, Value>,
        device: &Device,
        autocast: Option<FloatDType>,
        gradients: bool,
    ) -> Result<Option<HeadOperands>> {
        let graph = self.graph();
        let Some(i) = (0..graph.nodes.len()).find(|&i| self.leaves_to_loss(i)) else {
            return Ok(None);
        };
        let node = &graph.nodes[i];
        let err = |m: String| OnnxError::Node {
            node: node.name.clone(),
            op_type: node.op_type.clone(),
            message: m,
        };
        let float = |name: &str| match self.fetch(env, name, device).map_err(|e| err(e.0))? {
            Value::Float(f) => Ok(f),
            other => Err(err(format!(
                "'{name}' is {}, not a float tensor",
                other.kind()
            ))),
        };
        let hidden = float(&node.inputs[0])?;
        let table = pad_columns(&node.attrs, float(&node.inputs[1])?).map_err(|e| err(e.0))?;
        if table.rank != 2 || hidden.shape().last() != table.shape().first() {
            return Err(err(format!(
                "a fused head loss needs [.., k] x [k, n] operands, got {:?} x {:?}",
                hidden.shape(),
                table.shape()
            )));
        }
        Ok(Some(HeadOperands {
            output: node.outputs[0].clone(),
            hidden,
            table,
            compute: autocast.unwrap_or(FloatDType::F32),
            gradients,
        }))
    }
}
