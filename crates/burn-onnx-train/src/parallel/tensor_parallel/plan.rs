//! Finding Megatron's blocks in any ONNX graph by following a column split forward.
//!
//! Every MatMul/Gemm whose weight is a 2-D trainable initializer is a candidate
//! column-parallel projection: its output is split along the last axis (period: the whole
//! width, a third of it for fused Q/K/V, or a half for fused gate/up), and the split is
//! followed through the nodes that read it: element-wise ops, softmax on another axis,
//! transposes, reshapes (the head split and merge), splits, gathers and batched MatMuls
//! (attention scores and values, per head). It ends where a MatMul/Gemm contracts the
//! split axis against a 2-D weight: a row-parallel projection, whose output is a partial
//! sum to all-reduce. Every other use of a split value (a graph output, a LayerNorm, a
//! reduction over the split axis, an op not listed) makes the candidates it came from fail;
//! they are retried with the next period, then dropped, and the rest planned again. What
//! is left are closed regions, which is what the Megatron MLP and self-attention are, in
//! the forms the TorchScript and dynamo exporters and our builder emit.
//!
//! Shapes come from one probe pass of the whole model on a sample batch.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use super::vocab::VocabPlan;
use crate::collective::axis_split::AxisSplit;
use crate::graph::attributes::ATTENTION_CORE;
use crate::graph::{Graph, Node};
use crate::model::{OnnxModel, ParamRole, Probe};
use crate::value::norm_axis;

/// What the rewrite does to the graph for `tp` ranks.
#[derive(Debug, Clone, Default)]
pub struct SplitPlan {
    /// Rank count.
    pub tp: usize,
    /// Parameters each rank holds a part of.
    pub params: BTreeMap<String, AxisSplit>,
    /// Values entering a block (Megatron's `f` goes on them).
    pub copies: BTreeSet<String>,
    /// Row-parallel projections: nodes whose first output is a partial sum (`g` after them).
    pub ends: BTreeSet<usize>,
    /// The column-parallel projections the blocks start at.
    pub starts: BTreeSet<usize>,
    /// Reshape nodes whose target shape names the full size of the split axis: `(axis, full size)`.
    pub reshapes: BTreeMap<usize, (usize, usize)>,
    /// Split nodes cutting the split axis (their sizes shrink by `tp`).
    pub splits: BTreeSet<usize>,
    /// Nodes reading a split value.
    pub region: BTreeSet<usize>,
    /// The embedding and head split along the vocabulary ([`super::vocab::plan`]).
    pub vocab: VocabPlan,
}

impl SplitPlan {
    /// Every split parameter: the blocks' and the vocabulary's.
    pub fn all_params(&self) -> BTreeMap<String, AxisSplit> {
        let mut all = self.params.clone();
        all.extend(self.vocab.params.clone());
        all
    }

    /// Whether nothing is split.
    pub fn is_empty(&self) -> bool {
        self.starts.is_empty() && self.vocab.params.is_empty()
    }
}

/// The periods tried for a candidate, as divisors of its output width: plain, fused
/// q/k/v, fused pairs.
const GROUPINGS: [usize; 3] = [1, 3, 2];

/// Ops applied element by element (with broadcasting).
pub(crate) const ELEMENTWISE: &[&str] = &[
    "Add",
    "Sub",
    "Mul",
    "Div",
    "Pow",
    "Where",
    "Max",
    "Min",
    "Relu",
    "Tanh",
    "Erf",
    "Sigmoid",
    "Gelu",
    "Sqrt",
    "Exp",
    "Log",
    "Neg",
    "Abs",
    "Reciprocal",
    "Cast",
    "Identity",
    "Dropout",
    "Softplus",
    "Softsign",
    "Clip",
    "LeakyRelu",
    "Elu",
    "Selu",
    "Celu",
    "HardSigmoid",
    "HardSwish",
    "Mish",
    "Sin",
    "Cos",
    "Floor",
    "Ceil",
    "Round",
    "Sign",
    "Equal",
    "Less",
    "Greater",
    "LessOrEqual",
    "GreaterOrEqual",
    "Not",
    "And",
    "Or",
    "IsNaN",
    "IsInf",
];

/// Why propagation stopped, and which candidates the offending split came from.
struct Failure {
    origins: BTreeSet<usize>,
    /// The node (or graph output) where it stopped.
    at: String,
}

type Step = std::result::Result<(), Failure>;

/// Plan the split of `model`'s graph over `tp` ranks. An empty plan when no block closes.
pub fn plan(model: &OnnxModel, probe: &Probe, tp: usize) -> SplitPlan {
    let graph = model.graph();
    let candidates: Vec<usize> = graph
        .nodes
        .iter()
        .enumerate()
        .filter(|(_, n)| column_weight(model, n).is_some())
        .map(|(i, _)| i)
        .collect();
    let mut choice: BTreeMap<usize, usize> = candidates.into_iter().map(|i| (i, 0)).collect();
    loop {
        if choice.is_empty() {
            return SplitPlan {
                tp,
                ..SplitPlan::default()
            };
        }
        let mut walk = Walk {
            model,
            graph,
            probe,
            tp,
            plan: SplitPlan {
                tp,
                ..SplitPlan::default()
            },
            values: HashMap::new(),
            param_origins: HashMap::new(),
        };
        match walk.run(&choice) {
            Ok(()) => return walk.plan,
            Err(f) => {
                tracing::debug!(at = %f.at, candidates = ?f.origins.iter().map(|&i| graph.nodes[i].name.as_str()).collect::<Vec<_>>(), "tensor parallelism: a split stops here");
                for o in f.origins {
                    let next = choice.get(&o).map_or(GROUPINGS.len(), |k| k + 1);
                    if next >= GROUPINGS.len() {
                        choice.remove(&o);
                    } else {
                        choice.insert(o, next);
                    }
                }
            }
        }
    }
}

/// `(weight input slot, output axis of the weight)` of a candidate column projection.
fn column_weight(model: &OnnxModel, node: &Node) -> Option<(usize, usize)> {
    let w = node.inputs.get(1)?;
    let i = model.param_index(w)?;
    let info = &model.param_infos()[i];
    if info.role != ParamRole::Trainable
        || info.shape.len() != 2
        || model.param_index(&node.inputs[0]).is_some()
    {
        return None;
    }
    match node.op_type.as_str() {
        "MatMul" => Some((1, 1)),
        "Gemm" if node.attrs.int("transA", 0).ok()? == 0 => Some((
            1,
            if node.attrs.int("transB", 0).ok()? == 0 {
                1
            } else {
                0
            },
        )),
        _ => None,
    }
}

/// What the model and a probe pass know of a value of the model's graph.
pub struct Known<'a> {
    /// The model: its parameters, constants and graph.
    pub model: &'a OnnxModel,
    /// The probe pass's full shapes and float values.
    pub probe: &'a Probe,
}

impl Known<'_> {
    /// The full shape of a parameter, constant or probed value.
    pub fn shape(&self, name: &str) -> Option<Vec<usize>> {
        if let Some(i) = self.model.param_index(name) {
            return Some(self.model.param_infos()[i].shape.clone());
        }
        if let Some(shape) = self.probe.shapes.get(name) {
            return Some(shape.clone());
        }
        if let Some(t) = self.model.graph().constants.get(name) {
            return Some(t.shape().to_vec());
        }
        self.model
            .constant_infos()
            .iter()
            .find(|c| c.name == name)
            .map(|c| c.shape.clone())
    }

    /// Whether the value is a float tensor.
    pub fn is_float(&self, name: &str) -> bool {
        self.model.param_index(name).is_some() || self.probe.floats.contains(name)
    }

    /// Whether the value is a constant of the graph (never carries a gradient).
    pub fn is_constant(&self, name: &str) -> bool {
        self.model.graph().constants.contains_key(name)
            || self.model.constant_infos().iter().any(|c| c.name == name)
    }
}

struct Walk<'a> {
    model: &'a OnnxModel,
    graph: &'a Graph,
    probe: &'a Probe,
    tp: usize,
    plan: SplitPlan,
    /// Split values with the candidates they came from.
    values: HashMap<String, (AxisSplit, BTreeSet<usize>)>,
    param_origins: HashMap<String, BTreeSet<usize>>,
}

impl Walk<'_> {
    fn shape(&self, name: &str) -> Option<Vec<usize>> {
        self.known().shape(name)
    }

    fn is_float(&self, name: &str) -> bool {
        self.known().is_float(name)
    }

    fn known(&self) -> Known<'_> {
        Known {
            model: self.model,
            probe: self.probe,
        }
    }

    fn run(&mut self, choice: &BTreeMap<usize, usize>) -> Step {
        for (i, node) in self.graph.nodes.iter().enumerate() {
            let split_inputs: Vec<usize> = (0..node.inputs.len())
                .filter(|&k| self.values.contains_key(&node.inputs[k]))
                .collect();
            if split_inputs.is_empty() {
                if let Some(&g) = choice.get(&i) {
                    self.start(i, node, GROUPINGS[g])?;
                }
                continue;
            }
            let origins: BTreeSet<usize> = split_inputs
                .iter()
                .flat_map(|&k| self.values[&node.inputs[k]].1.clone())
                .collect();
            let fail = || Failure {
                origins: origins.clone(),
                at: format!("{} ({})", node.name, node.op_type),
            };
            self.plan.region.insert(i);
            self.through(i, node, &origins).map_err(|_| fail())?;
            // The bias of a row-parallel Gemm moves after the all-reduce, out of the block.
            let moved_bias =
                |k: usize| k == 2 && node.op_type == "Gemm" && self.plan.ends.contains(&i);
            for (k, input) in node.inputs.iter().enumerate() {
                if !input.is_empty()
                    && !split_inputs.contains(&k)
                    && !moved_bias(k)
                    && self.is_float(input)
                    && !self.plan.params.contains_key(input)
                {
                    self.plan.copies.insert(input.clone());
                }
            }
        }
        for o in &self.graph.outputs {
            if let Some((_, origins)) = self.values.get(&o.name) {
                return Err(Failure {
                    origins: origins.clone(),
                    at: format!("graph output {}", o.name),
                });
            }
        }
        // A sliced weight must be read only inside the blocks that slice it.
        for (i, node) in self.graph.nodes.iter().enumerate() {
            if self.plan.region.contains(&i) || self.plan.starts.contains(&i) {
                continue;
            }
            for input in &node.inputs {
                if let Some(origins) = self.param_origins.get(input) {
                    return Err(Failure {
                        origins: origins.clone(),
                        at: format!("{} reads split weight {input}", node.name),
                    });
                }
            }
        }
        Ok(())
    }

    /// A column-parallel projection: its output split along the last axis.
    fn start(&mut self, i: usize, node: &Node, grouping: usize) -> Step {
        let me = BTreeSet::from([i]);
        let fail = || Failure {
            origins: me.clone(),
            at: format!("{} (start)", node.name),
        };
        let (slot, axis) = column_weight(self.model, node).ok_or_else(fail)?;
        let w = &node.inputs[slot];
        let width = self.shape(w).ok_or_else(fail)?[axis];
        if width % grouping != 0 || (width / grouping) % self.tp != 0 {
            return Err(fail());
        }
        let period = width / grouping;
        self.slice_param(w, AxisSplit::new(axis, period), &me)?;
        if node.op_type == "Gemm"
            && let Some(c) = node.inputs.get(2).filter(|c| !c.is_empty())
        {
            let shape = self.shape(c).ok_or_else(fail)?;
            if shape.last() == Some(&width) {
                if self.model.param_index(c).is_none() {
                    return Err(fail());
                }
                self.slice_param(c, AxisSplit::new(shape.len() - 1, period), &me)?;
            }
        }
        self.plan.copies.insert(node.inputs[0].clone());
        self.plan.starts.insert(i);
        let out = &node.outputs[0];
        let rank = self.shape(out).ok_or_else(fail)?.len();
        self.values
            .insert(out.clone(), (AxisSplit::new(rank - 1, period), me));
        Ok(())
    }

    fn slice_param(&mut self, name: &str, split: AxisSplit, origins: &BTreeSet<usize>) -> Step {
        let entry = self.param_origins.entry(name.to_string()).or_default();
        entry.extend(origins.iter().copied());
        match self.plan.params.get(name) {
            Some(s) if *s != split => Err(Failure {
                origins: entry.clone(),
                at: format!("weight {name} split two ways"),
            }),
            _ => {
                self.plan.params.insert(name.to_string(), split);
                Ok(())
            }
        }
    }

    fn split_of(&self, name: &str) -> Option<AxisSplit> {
        self.values.get(name).map(|(s, _)| *s)
    }

    fn set(&mut self, name: &str, split: AxisSplit, origins: &BTreeSet<usize>) {
        if !name.is_empty() {
            self.values
                .insert(name.to_string(), (split, origins.clone()));
        }
    }

    /// The rule of `node`, which reads at least one split value.
    fn through(
        &mut self,
        i: usize,
        node: &Node,
        origins: &BTreeSet<usize>,
    ) -> std::result::Result<(), ()> {
        let op = node.op_type.as_str();
        let x = &node.inputs[0];
        let in_shape = |w: &Self, k: usize| node.inputs.get(k).and_then(|n| w.shape(n)).ok_or(());
        match op {
            _ if ELEMENTWISE.contains(&op) => {
                let out_rank = self.shape(&node.outputs[0]).ok_or(())?.len();
                let mut target: Option<AxisSplit> = None;
                for input in node.inputs.iter().filter(|n| !n.is_empty()) {
                    let shape = self.shape(input).ok_or(())?;
                    let lift = out_rank - shape.len();
                    if let Some(s) = self.split_of(input) {
                        let here = s.on(s.axis + lift);
                        if target.is_some_and(|t| t != here) {
                            return Err(());
                        }
                        target = Some(here);
                    }
                }
                let target = target.ok_or(())?;
                for input in node.inputs.iter().filter(|n| !n.is_empty()) {
                    if self.split_of(input).is_some() {
                        continue;
                    }
                    let shape = self.shape(input).ok_or(())?;
                    let lift = out_rank - shape.len();
                    if target.axis < lift || shape[target.axis - lift] == 1 {
                        continue;
                    }
                    if self.model.param_index(input).is_none() {
                        return Err(());
                    }
                    self.slice_param(input, target.on(target.axis - lift), origins)
                        .map_err(|_| ())?;
                }
                for out in &node.outputs {
                    self.set(out, target, origins);
                }
            }
            "Softmax" if node.attrs.has(ATTENTION_CORE) => {
                // Attention's two products: per head, as the batched MatMuls were.
                let s = self.split_of(x).ok_or(())?;
                let rank = in_shape(self, 0)?.len();
                let per_head = (1..3).all(|k| self.split_of(&node.inputs[k]) == Some(s));
                if s.axis + 2 >= rank || !per_head {
                    return Err(());
                }
                self.set(&node.outputs[0], s, origins);
            }
            "Softmax" | "LogSoftmax" => {
                let s = self.split_of(x).ok_or(())?;
                let rank = in_shape(self, 0)?.len();
                let default = if self.graph.opset >= 13 { -1 } else { 1 };
                let axis = norm_axis(node.attrs.int("axis", default).map_err(|_| ())?, rank)
                    .map_err(|_| ())?;
                if axis == s.axis || (self.graph.opset < 13 && s.axis > axis) {
                    return Err(());
                }
                self.set(&node.outputs[0], s, origins);
            }
            "Transpose" => {
                let s = self.split_of(x).ok_or(())?;
                let rank = in_shape(self, 0)?.len();
                let perm: Vec<usize> = match node.attrs.ints("perm").map_err(|_| ())? {
                    Some(p) => p.iter().map(|&a| a as usize).collect(),
                    None => (0..rank).rev().collect(),
                };
                let axis = perm.iter().position(|&a| a == s.axis).ok_or(())?;
                self.set(&node.outputs[0], s.on(axis), origins);
            }
            "Reshape" | "Flatten" | "Squeeze" | "Unsqueeze" => {
                let s = self.split_of(x).ok_or(())?;
                if node
                    .inputs
                    .iter()
                    .skip(1)
                    .any(|n| self.values.contains_key(n))
                {
                    return Err(());
                }
                let out_shape = self.shape(&node.outputs[0]).ok_or(())?;
                let out = s
                    .through_reshape(&in_shape(self, 0)?, &out_shape, self.tp)
                    .ok_or(())?;
                if op == "Reshape" {
                    self.plan
                        .reshapes
                        .insert(i, (out.axis, out_shape[out.axis]));
                }
                self.set(&node.outputs[0], out, origins);
            }
            "Split" => {
                let s = self.split_of(x).ok_or(())?;
                let shape = in_shape(self, 0)?;
                let axis = norm_axis(node.attrs.int("axis", 0).map_err(|_| ())?, shape.len())
                    .map_err(|_| ())?;
                if axis == s.axis {
                    let mut offset = 0;
                    for out in &node.outputs {
                        let size = self.shape(out).ok_or(())?[axis];
                        if offset % s.period != 0 || size % s.period != 0 {
                            return Err(());
                        }
                        offset += size;
                    }
                    self.plan.splits.insert(i);
                }
                for out in &node.outputs {
                    self.set(out, s, origins);
                }
            }
            "Gather" => {
                let s = self.split_of(x).ok_or(())?;
                let rank = in_shape(self, 0)?.len();
                let axis =
                    norm_axis(node.attrs.int("axis", 0).map_err(|_| ())?, rank).map_err(|_| ())?;
                let indices = in_shape(self, 1)?.len();
                if axis == s.axis || self.values.contains_key(&node.inputs[1]) {
                    return Err(());
                }
                let out = if axis < s.axis {
                    s.axis + indices - 1
                } else {
                    s.axis
                };
                self.set(&node.outputs[0], s.on(out), origins);
            }
            "MatMul" => self.matmul(i, node, origins)?,
            "Gemm" => {
                let s = self.split_of(x).ok_or(())?;
                let trans_a = node.attrs.int("transA", 0).map_err(|_| ())?;
                let trans_b = node.attrs.int("transB", 0).map_err(|_| ())?;
                let w = &node.inputs[1];
                let beta = node.attrs.float("beta", 1.0).map_err(|_| ())?;
                let bias_ok = node
                    .inputs
                    .get(2)
                    .is_none_or(|c| c.is_empty() || (beta == 1.0 && !self.values.contains_key(c)));
                if trans_a != 0
                    || s.axis != 1
                    || self.values.contains_key(w)
                    || self.model.param_index(w).is_none()
                    || !bias_ok
                {
                    return Err(());
                }
                self.slice_param(w, s.on(trans_b as usize), origins)
                    .map_err(|_| ())?;
                self.plan.ends.insert(i);
            }
            "Shape" => {}
            _ => return Err(()),
        }
        Ok(())
    }

    /// Batched products on split heads, or the row-parallel end.
    fn matmul(
        &mut self,
        i: usize,
        node: &Node,
        origins: &BTreeSet<usize>,
    ) -> std::result::Result<(), ()> {
        let (a, b) = (&node.inputs[0], &node.inputs[1]);
        let (sa, sb) = (self.shape(a).ok_or(())?, self.shape(b).ok_or(())?);
        let out_rank = self.shape(&node.outputs[0]).ok_or(())?.len();
        if sa.len() < 2 || sb.len() < 2 {
            return Err(());
        }
        let (ra, rb) = (sa.len(), sb.len());
        match (self.split_of(a), self.split_of(b)) {
            (Some(s), None) if s.axis == ra - 1 => {
                if rb != 2 || self.model.param_index(b).is_none() {
                    return Err(());
                }
                self.slice_param(b, s.on(0), origins).map_err(|_| ())?;
                self.plan.ends.insert(i);
            }
            (Some(s), Some(t)) if s.axis == ra - 1 && t.axis == rb - 2 && s.period == t.period => {
                self.plan.ends.insert(i);
            }
            (sa_split, sb_split) => {
                // Split batch axes (heads), A's rows or B's columns.
                let mut target: Option<AxisSplit> = None;
                let mut agree = |t: AxisSplit| -> std::result::Result<(), ()> {
                    if target.is_some_and(|x| x != t) {
                        return Err(());
                    }
                    target = Some(t);
                    Ok(())
                };
                if let Some(s) = sa_split {
                    if s.axis == ra - 1 {
                        return Err(());
                    }
                    agree(s.on(s.axis + out_rank - ra))?;
                }
                if let Some(t) = sb_split {
                    if t.axis == rb - 2 {
                        return Err(());
                    }
                    agree(t.on(t.axis + out_rank - rb))?;
                }
                let target = target.ok_or(())?;
                // The other operand must be split the same way or broadcast on a batch axis.
                for (shape, split) in [(&sa, sa_split), (&sb, sb_split)] {
                    let lift = out_rank - shape.len();
                    let batch = target.axis + 2 < out_rank;
                    if split.is_none()
                        && batch
                        && target.axis >= lift
                        && shape[target.axis - lift] != 1
                    {
                        return Err(());
                    }
                }
                self.set(&node.outputs[0], target, origins);
            }
        }
        Ok(())
    }
}
