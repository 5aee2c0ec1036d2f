//! Cutting a graph into pipeline stages along its execution order.
//!
//! A stage is a contiguous range of nodes. What crosses a cut is every value a node before
//! it produced that a node after it (or the graph's outputs) still reads; a value produced
//! two stages back passes through the stage in between. Graph inputs are not activations:
//! every stage reads the ones its nodes need from the batch, which all stages of a
//! data-parallel group share. A parameter belongs to every stage that reads it, so a tied
//! embedding read by the first and the last stage is held by both (their gradients are
//! summed, see `pipeline::schedule`).
//!
//! The automatic cut balances an estimate of each node's work: half by the parameter
//! elements it reads (memory), half by the multiply-adds of the weighted ops (MatMul, Gemm,
//! Conv, ConvTranspose, Einsum: twice the weight elements per position). Near each balanced
//! point it prefers the cut that the fewest values cross. The estimate ignores activation
//! sizes (a convolution on a large image costs more than its weights say); a manual cut
//! (`pipeline_cut_after`, ORT's cut edges) overrides it.

use std::collections::{HashMap, HashSet};
use std::ops::Range;

use crate::error::{OnnxError, Result};
use crate::model::OnnxModel;
use crate::model::stage::StagePart;

/// One pipeline stage of a partition.
#[derive(Debug, Clone, PartialEq)]
pub struct Stage {
    /// Position in the pipeline.
    pub index: usize,
    /// The nodes it runs (indices into the graph's execution order).
    pub nodes: Range<usize>,
    /// Values it receives from the previous stage, in wire order.
    pub receives: Vec<String>,
    /// Values it sends to the next stage (the last stage: the graph outputs), in wire order.
    pub sends: Vec<String>,
    /// Graph inputs its nodes read.
    pub graph_inputs: Vec<String>,
    /// Parameters its nodes read (ONNX initializer names), in the model's order.
    pub params: Vec<String>,
    /// Elements of those parameters.
    pub param_elements: usize,
    /// Estimated multiply-adds per position (see the module doc).
    pub flops: f64,
}

impl Stage {
    /// The model's view of this stage, for [`OnnxModel::into_stage`].
    pub fn part(&self) -> StagePart<'_> {
        StagePart {
            nodes: &self.nodes,
            graph_inputs: &self.graph_inputs,
            receives: &self.receives,
            sends: &self.sends,
            params: &self.params,
        }
    }
}

/// A parameter that several stages read (a tied embedding).
#[derive(Debug, Clone, PartialEq)]
pub struct SharedParam {
    /// ONNX initializer name.
    pub name: String,
    /// The stages holding a copy.
    pub stages: Vec<usize>,
    /// Elements.
    pub elements: usize,
    /// Whether it trains (its copies' gradients are summed).
    pub trainable: bool,
}

/// A graph cut into stages, laid out on pipeline ranks: stage `s` runs on rank
/// `s % ranks`, so with more stages than ranks each rank holds `stages / ranks` model
/// chunks (virtual stages), `ranks` apart.
#[derive(Debug, Clone, PartialEq)]
pub struct Partition {
    /// The stages, first to last.
    pub stages: Vec<Stage>,
    /// Parameters held by more than one stage, in the model's order.
    pub shared: Vec<SharedParam>,
    /// The pipeline ranks the stages run on (the stage count unless [`Self::on_ranks`]).
    pub ranks: usize,
}

/// Ops whose weight elements each cost a multiply-add per position.
const WEIGHTED_OPS: &[&str] = &["MatMul", "Gemm", "Conv", "ConvTranspose", "Einsum"];

impl Partition {
    /// Cut `model`'s graph into `n` balanced stages.
    pub fn auto(model: &OnnxModel, n: usize) -> Result<Self> {
        let nodes = model.graph().nodes.len();
        if n == 0 || n > nodes {
            return Err(OnnxError::field(
                "config.parallel.pipeline_parallel_size",
                format!("{n} stages for a graph of {nodes} nodes: use 1 to {nodes}"),
            ));
        }
        let (elements, flops) = node_costs(model);
        let (te, tf) = (
            elements.iter().sum::<f64>().max(1.0),
            flops.iter().sum::<f64>().max(1.0),
        );
        // Every node also weighs a little, so parameter-free stretches (attention) spread.
        let unit = 0.05 / nodes as f64;
        let weight: Vec<f64> = elements
            .iter()
            .zip(&flops)
            .map(|(e, f)| 0.475 * e / te + 0.475 * f / tf + unit)
            .collect();
        let mut prefix = vec![0.0; nodes + 1];
        for i in 0..nodes {
            prefix[i + 1] = prefix[i] + weight[i];
        }
        let crossing = crossing_counts(model);
        let total = prefix[nodes];
        let slack = 0.2 * total / n as f64;
        let mut bounds = vec![0];
        for k in 1..n {
            let target = total * k as f64 / n as f64;
            let lo = bounds[k - 1] + 1;
            let hi = nodes - (n - k);
            let best = (lo..=hi)
                .min_by(|&a, &b| {
                    let key = |c: usize| {
                        let off = (prefix[c] - target).abs();
                        (
                            if off <= slack { 0 } else { 1 },
                            if off <= slack { crossing[c] } else { 0 },
                            off,
                        )
                    };
                    let (ka, kb) = (key(a), key(b));
                    (ka.0, ka.1).cmp(&(kb.0, kb.1)).then(ka.2.total_cmp(&kb.2))
                })
                .unwrap_or(lo);
            bounds.push(best);
        }
        bounds.push(nodes);
        Self::from_bounds(model, &bounds)
    }

    /// Cut after the nodes that produce the named values (ORT's cut edges), in order.
    pub fn after(model: &OnnxModel, cuts: &[String]) -> Result<Self> {
        let graph = model.graph();
        let producer: HashMap<&str, usize> = graph
            .nodes
            .iter()
            .enumerate()
            .flat_map(|(i, n)| n.outputs.iter().map(move |o| (o.as_str(), i)))
            .collect();
        let mut bounds = vec![0];
        for cut in cuts {
            let &p = producer.get(cut.as_str()).ok_or_else(|| {
                OnnxError::field(
                    "config.parallel.pipeline_cut_after",
                    format!("'{cut}' is not the output of a node"),
                )
            })?;
            if p + 1 <= *bounds.last().unwrap_or(&0) || p + 1 >= graph.nodes.len() {
                return Err(OnnxError::field(
                    "config.parallel.pipeline_cut_after",
                    format!(
                        "cutting after '{cut}' (node {p} of {}) leaves an empty stage: list cuts in execution order, none after the last node",
                        graph.nodes.len()
                    ),
                ));
            }
            bounds.push(p + 1);
        }
        bounds.push(graph.nodes.len());
        Self::from_bounds(model, &bounds)
    }

    /// The stages between consecutive `bounds` (node indices, from 0 to the node count).
    fn from_bounds(model: &OnnxModel, bounds: &[usize]) -> Result<Self> {
        let graph = model.graph();
        let (_, flops) = node_costs(model);
        let inputs: HashSet<&str> = graph.inputs.iter().map(|i| i.name.as_str()).collect();
        let stages = bounds
            .windows(2)
            .enumerate()
            .map(|(index, w)| {
                let nodes = w[0]..w[1];
                let mut params = HashSet::new();
                let mut graph_inputs = Vec::new();
                for n in &graph.nodes[nodes.clone()] {
                    for i in n.inputs.iter().filter(|i| !i.is_empty()) {
                        if model.param_index(i).is_some() {
                            params.insert(i.as_str());
                        } else if inputs.contains(i.as_str()) && !graph_inputs.contains(i) {
                            graph_inputs.push(i.clone());
                        }
                    }
                }
                let sends = if w[1] == graph.nodes.len() {
                    graph.outputs.iter().map(|o| o.name.clone()).collect()
                } else {
                    live_at(model, w[1])
                };
                Stage {
                    index,
                    receives: if w[0] == 0 {
                        Vec::new()
                    } else {
                        live_at(model, w[0])
                    },
                    sends,
                    graph_inputs,
                    params: model
                        .param_infos()
                        .iter()
                        .filter(|p| params.contains(p.name.as_str()))
                        .map(|p| p.name.clone())
                        .collect(),
                    param_elements: model
                        .param_infos()
                        .iter()
                        .filter(|p| params.contains(p.name.as_str()))
                        .map(|p| p.shape.iter().product::<usize>())
                        .sum(),
                    flops: flops[nodes.clone()].iter().sum(),
                    nodes,
                }
            })
            .collect::<Vec<Stage>>();
        let shared = model
            .param_infos()
            .iter()
            .map(|p| SharedParam {
                name: p.name.clone(),
                stages: stages
                    .iter()
                    .filter(|s| s.params.contains(&p.name))
                    .map(|s| s.index)
                    .collect(),
                elements: p.shape.iter().product(),
                trainable: p.role == crate::model::ParamRole::Trainable,
            })
            .filter(|s| s.stages.len() > 1)
            .collect();
        let ranks = stages.len();
        Ok(Partition {
            stages,
            shared,
            ranks,
        })
    }

    /// The same stages on `ranks` pipeline ranks, each holding `stages / ranks` of them.
    pub fn on_ranks(self, ranks: usize) -> Result<Self> {
        if ranks == 0 || !self.stages.len().is_multiple_of(ranks) {
            return Err(OnnxError::field(
                "config.parallel.pipeline_virtual_stages",
                format!(
                    "{} stages do not lay out evenly on {ranks} pipeline ranks",
                    self.stages.len()
                ),
            ));
        }
        Ok(Partition { ranks, ..self })
    }

    /// Model chunks per rank.
    pub fn chunks(&self) -> usize {
        self.stages.len() / self.ranks
    }

    /// The rank stage `stage` runs on.
    pub fn rank_of(&self, stage: usize) -> usize {
        stage % self.ranks
    }

    /// The stages rank `rank` runs, in pipeline order.
    pub fn stages_of(&self, rank: usize) -> Vec<&Stage> {
        self.stages.iter().skip(rank).step_by(self.ranks).collect()
    }

    /// The parameters rank `rank` holds (those its stages read), in stage order.
    pub fn params_of(&self, rank: usize) -> Vec<String> {
        let mut out: Vec<String> = Vec::new();
        for s in self.stages_of(rank) {
            for p in &s.params {
                if !out.contains(p) {
                    out.push(p.clone());
                }
            }
        }
        out
    }

    /// The rank that writes parameter `name` (the rank of the first stage reading it).
    pub fn owner(&self, name: &str) -> Option<usize> {
        self.stages
            .iter()
            .find(|s| s.params.iter().any(|p| p == name))
            .map(|s| self.rank_of(s.index))
    }
}

/// Per node: parameter elements read, and estimated multiply-adds per position.
fn node_costs(model: &OnnxModel) -> (Vec<f64>, Vec<f64>) {
    let size = |name: &str| {
        model.param_index(name).map_or(0.0, |i| {
            model.param_infos()[i].shape.iter().product::<usize>() as f64
        })
    };
    let mut seen = HashSet::new();
    model
        .graph()
        .nodes
        .iter()
        .map(|n| {
            let weights: f64 = n
                .inputs
                .iter()
                .filter(|i| model.param_index(i).is_some())
                .map(|i| size(i))
                .sum();
            // Memory counts a shared parameter once, at its first reader.
            let fresh: f64 = n
                .inputs
                .iter()
                .filter(|i| model.param_index(i).is_some() && seen.insert(i.as_str()))
                .map(|i| size(i))
                .sum();
            (
                fresh,
                if WEIGHTED_OPS.contains(&n.op_type.as_str()) {
                    2.0 * weights
                } else {
                    0.0
                },
            )
        })
        .unzip()
}

/// Values produced by nodes before `cut` that nodes from `cut` on, or the graph outputs, read.
fn live_at(model: &OnnxModel, cut: usize) -> Vec<String> {
    let graph = model.graph();
    let outputs: HashSet<&str> = graph.outputs.iter().map(|o| o.name.as_str()).collect();
    let mut live = Vec::new();
    for n in &graph.nodes[..cut] {
        for o in n.outputs.iter().filter(|o| !o.is_empty()) {
            if outputs.contains(o.as_str()) || graph.last_use.get(o).is_some_and(|&u| u >= cut) {
                live.push(o.clone());
            }
        }
    }
    live
}

/// For every cut position `c` (0..=nodes), how many values cross it.
fn crossing_counts(model: &OnnxModel) -> Vec<usize> {
    let graph = model.graph();
    let n = graph.nodes.len();
    let outputs: HashSet<&str> = graph.outputs.iter().map(|o| o.name.as_str()).collect();
    let mut diff = vec![0i64; n + 2];
    for (p, node) in graph.nodes.iter().enumerate() {
        for o in node.outputs.iter().filter(|o| !o.is_empty()) {
            let end = if outputs.contains(o.as_str()) {
                n
            } else {
                graph.last_use.get(o).copied().unwrap_or(p)
            };
            if end > p {
                diff[p + 1] += 1;
                diff[end + 1] -= 1;
            }
        }
    }
    let mut acc = 0i64;
    (0..=n)
        .map(|c| {
            acc += diff[c];
            acc.max(0) as usize
        })
        .collect()
}
