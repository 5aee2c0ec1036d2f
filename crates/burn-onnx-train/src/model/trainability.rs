//! Which initializers a model trains, by the rule the source framework implies.
//!
//! An ONNX file does not say which initializers were parameters: exporters also write graph
//! constants as initializers (PyTorch's dynamo exporter writes the attention scale, GELU
//! coefficients and mask fill values as scalar initializers such as `val_5`). Training those
//! would move them away from the framework's run from the first update (AdamW moves every
//! element by about `lr` whatever its gradient). The default rule trains an initializer only
//! where a framework would have made it a parameter:
//! - integer and bool tensors are constants;
//! - float initializers read only through setting inputs (shapes, axes, indices, scales,
//!   bounds, ratios, conditions) are constants kept on the host;
//! - batch-norm running statistics are state (updated by the forward pass, not trained);
//! - scalars and one-element tensors are constants;
//! - float initializers from which no gradient path reaches a graph output (they only feed
//!   comparisons, shapes, casts to integers, ...) are constants;
//! - everything else is trainable.
//!
//! `weights_to_train` / `weights_not_to_train` override the rule both ways (see
//! `OnnxModel::select_trainable`).

use std::collections::HashSet;

use crate::graph::initializer::Initializer;
use crate::graph::{Graph, Node};
use crate::value::host_tensor::dtype;

/// Input slots that are settings, not differentiable data (scales, bounds, ratios, shapes,
/// axes, indices, conditions): no gradient flows through them.
const SETTING_SLOTS: &[(&str, &[usize])] = &[
    ("Resize", &[1, 2, 3]),
    ("Clip", &[1, 2]),
    ("Pad", &[1, 2, 3]),
    ("Dropout", &[1, 2]),
    ("Range", &[0, 1, 2]),
    ("ConstantOfShape", &[0]),
    ("Reshape", &[1]),
    ("Expand", &[1]),
    ("Tile", &[1]),
    ("Slice", &[1, 2, 3, 4]),
    ("Gather", &[1]),
    ("GatherElements", &[1]),
    ("Where", &[0]),
    ("Squeeze", &[1]),
    ("Unsqueeze", &[1]),
    ("Split", &[1]),
    ("ReduceMean", &[1]),
    ("ReduceSum", &[1]),
    ("ReduceMax", &[1]),
    ("ReduceMin", &[1]),
    ("ReduceL2", &[1]),
    ("ReduceSumSquare", &[1]),
    ("ReduceLogSumExp", &[1]),
    ("ReduceL1", &[1]),
    ("ReduceProd", &[1]),
    ("ReduceLogSum", &[1]),
    ("CumSum", &[1]),
    ("CumProd", &[1]),
    ("GatherND", &[1]),
    ("ScatterND", &[1]),
    ("ScatterElements", &[1]),
    ("Scatter", &[1]),
    ("TopK", &[1]),
    ("Compress", &[1]),
    ("OneHot", &[0, 1, 2]),
    ("EyeLike", &[0]),
    ("CastLike", &[1]),
    ("SoftmaxCrossEntropyLoss", &[1, 2]),
    ("NegativeLogLikelihoodLoss", &[1, 2]),
    ("RotaryEmbedding", &[1, 2, 3]),
    ("Attention", &[3, 6]),
    ("QuantizeLinear", &[1, 2]),
    ("DequantizeLinear", &[1, 2]),
    ("Trilu", &[1]),
    ("Shape", &[0]),
    ("Size", &[0]),
    ("AffineGrid", &[1]),
    ("Col2Im", &[1, 2]),
    ("CenterCropPad", &[1]),
    ("MaxUnpool", &[1, 2]),
    ("RoiAlign", &[1, 2]),
    ("ReverseSequence", &[1]),
    ("HannWindow", &[0]),
    ("HammingWindow", &[0]),
    ("BlackmanWindow", &[0]),
    ("If", &[0]),
    ("Loop", &[0, 1]),
    ("DFT", &[1, 2]),
    ("STFT", &[1, 2, 3]),
    ("MelWeightMatrix", &[0, 1, 2, 3, 4]),
    ("NonMaxSuppression", &[2, 3, 4]),
    ("TensorScatter", &[2]),
    ("RandomUniformLike", &[0]),
    ("RandomNormalLike", &[0]),
];

/// Magnitude from which a float initializer's values are mask fillers (exporters fold
/// attention masks with `-inf`, `finfo.min` = -3.4e38 or -1e30 into initializers), not
/// weights: no trained weight gets there.
const MASK_MAGNITUDE: f32 = 1e30;

/// Input slots that hold state updated by the forward pass (batch-norm running statistics).
const STATE_SLOTS: &[(&str, &[usize])] = &[("BatchNormalization", &[3, 4])];

/// Ops whose outputs never carry a gradient (integer, boolean or piecewise-constant results).
const NO_GRADIENT_OPS: &[&str] = &[
    "Shape",
    "Size",
    "Range",
    "ConstantOfShape",
    "Equal",
    "Less",
    "LessOrEqual",
    "Greater",
    "GreaterOrEqual",
    "Not",
    "And",
    "Or",
    "ArgMax",
    "ArgMin",
    "Floor",
    "Ceil",
    "Round",
    "Sign",
    "IsNaN",
    "IsInf",
    "Xor",
    "BitwiseAnd",
    "BitwiseOr",
    "BitwiseXor",
    "BitwiseNot",
    "BitShift",
    "NonZero",
    "OneHot",
    "Hardmax",
    "EyeLike",
    "Unique",
    "HannWindow",
    "HammingWindow",
    "BlackmanWindow",
    "DynamicQuantizeLinear",
    "MatMulInteger",
    "ConvInteger",
    "QLinearMatMul",
    "QLinearConv",
    "MelWeightMatrix",
    "NonMaxSuppression",
    "BitCast",
    "RandomUniform",
    "RandomNormal",
    "RandomUniformLike",
    "RandomNormalLike",
    "Bernoulli",
    "Multinomial",
];

fn listed(table: &[(&str, &[usize])], op: &str, slot: usize) -> bool {
    table
        .iter()
        .any(|(o, slots)| *o == op && slots.contains(&slot))
}

/// Is input `slot` of `op` a setting (no gradient flows through it)?
pub fn is_setting_slot(op: &str, slot: usize) -> bool {
    listed(SETTING_SLOTS, op, slot)
}

/// Is input `slot` of `op` forward-updated state?
pub fn is_state_slot(op: &str, slot: usize) -> bool {
    listed(STATE_SLOTS, op, slot)
}

/// The inputs of `n` by how they are read, into the three sets. The outer values a node's
/// subgraphs read (its trailing inputs) are classified by the subgraphs' own readers, so a
/// weight used only inside an `If` branch or a `Loop` body counts as data, and one read
/// there only as a shape as a setting.
fn classify(
    nodes: &[Node],
    setting: &mut HashSet<String>,
    data: &mut HashSet<String>,
    state: &mut HashSet<String>,
) {
    for n in nodes {
        let formal = n.inputs.len().saturating_sub(n.attrs.captured().len());
        for (slot, name) in n.inputs[..formal]
            .iter()
            .enumerate()
            .filter(|(_, n)| !n.is_empty())
        {
            if is_state_slot(&n.op_type, slot) {
                state.insert(name.clone());
            }
            if is_setting_slot(&n.op_type, slot) {
                setting.insert(name.clone());
            } else {
                data.insert(name.clone());
            }
        }
        for body in n.attrs.graphs() {
            classify(&body.nodes, setting, data, state);
            // An outer value returned as it is by a branch is data.
            data.extend(body.outputs.iter().map(|o| o.name.clone()));
        }
    }
}

/// The role an initializer takes under the default rule, with the reason `inspect` shows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DefaultRole {
    /// Trained.
    Trainable,
    /// Forward-updated state.
    State,
    /// A constant held as a (non-trained) parameter: it can still be trained on request.
    Constant(&'static str),
    /// A constant held on the host (integer, bool, or read only as a setting): never trained.
    HostConstant(&'static str),
}

/// What the graph tells about its initializers: which are read only as settings, which as
/// state, and which can send a gradient to a graph output.
pub struct Usage {
    setting_only: HashSet<String>,
    state: HashSet<String>,
    differentiable: HashSet<String>,
}

impl Usage {
    /// Analyse `graph`.
    pub fn of(graph: &Graph) -> Self {
        let mut setting = HashSet::new();
        let mut data = HashSet::new();
        let mut state = HashSet::new();
        classify(&graph.nodes, &mut setting, &mut data, &mut state);
        setting.retain(|n| !data.contains(n));
        Usage {
            setting_only: setting,
            state,
            differentiable: differentiable_edges(graph),
        }
    }

    /// The default role of initializer `name` with `elements` elements of ONNX type `elem_type`
    /// (`float` tells whether the importer holds it as a float tensor).
    pub fn default_role(&self, name: &str, tensor: &Initializer) -> DefaultRole {
        let role = self.role_of(name, tensor);
        tensor.release();
        role
    }

    fn role_of(&self, name: &str, tensor: &Initializer) -> DefaultRole {
        let Some(values) = tensor.floats() else {
            return DefaultRole::HostConstant("integer or bool tensor");
        };
        let elements = values.len();
        if self.setting_only.contains(name) {
            return DefaultRole::HostConstant(
                "only read as a setting (shape, axes, indices, scale, bound, ratio or condition)",
            );
        }
        if self.state.contains(name) {
            return DefaultRole::State;
        }
        match elements {
            0 => DefaultRole::Constant("empty"),
            1 => DefaultRole::Constant("scalar or one-element tensor"),
            _ if values
                .iter()
                .any(|v| !v.is_finite() || v.abs() >= MASK_MAGNITUDE) =>
            {
                DefaultRole::Constant("holds infinite or >= 1e30 values (an attention mask)")
            }
            _ if !self.differentiable.contains(name) => {
                DefaultRole::Constant("no gradient path to a graph output")
            }
            _ => DefaultRole::Trainable,
        }
    }
}

/// Edges from which a gradient can flow to a float graph output: walk the nodes backwards
/// from the outputs, through every input that is neither a setting nor state, skipping ops
/// whose outputs carry no gradient and casts to non-float types.
fn differentiable_edges(graph: &Graph) -> HashSet<String> {
    let mut live: HashSet<String> = graph
        .outputs
        .iter()
        .filter(|o| o.elem_type == 0 || dtype::is_float(o.elem_type))
        .map(|o| o.name.clone())
        .collect();
    walk_live(&graph.nodes, &mut live);
    live
}

/// Grow `live` backwards through `nodes`. A node with subgraphs passes liveness to its
/// non-setting formal inputs, and to the outer values its subgraphs read on a path to one
/// of their outputs.
fn walk_live(nodes: &[Node], live: &mut HashSet<String>) {
    for n in nodes.iter().rev() {
        if NO_GRADIENT_OPS.contains(&n.op_type.as_str())
            || !n.outputs.iter().any(|o| live.contains(o))
        {
            continue;
        }
        if n.op_type == "Cast"
            && !n
                .attrs
                .int("to", 0)
                .is_ok_and(|to| dtype::is_float(to as i32))
        {
            continue;
        }
        let formal = n.inputs.len().saturating_sub(n.attrs.captured().len());
        for (slot, input) in n.inputs[..formal].iter().enumerate() {
            if !input.is_empty()
                && !is_setting_slot(&n.op_type, slot)
                && !is_state_slot(&n.op_type, slot)
            {
                live.insert(input.clone());
            }
        }
        for body in n.attrs.graphs() {
            let mut inner: HashSet<String> = body.outputs.iter().map(|o| o.name.clone()).collect();
            walk_live(&body.nodes, &mut inner);
            live.extend(body.captured.iter().filter(|c| inner.contains(*c)).cloned());
        }
    }
}
