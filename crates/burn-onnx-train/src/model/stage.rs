//! A pipeline stage of an [`OnnxModel`]: the same interpreter on a slice of the graph,
//! holding only the parameters that slice reads.
//!
//! The stage's graph takes the values it receives from the previous stage as inputs next
//! to the graph inputs its nodes read, and returns what it sends on as outputs. Roles
//! (trainable, frozen, state, constant) come from the whole model, so a stage trains
//! exactly the weights the whole model would. Random streams are keyed by the node's index
//! in the whole graph, so a stage's dropout masks are the whole model's.

use std::collections::{HashMap, HashSet};
use std::ops::Range;
use std::sync::Arc;

use super::{OnnxModel, Source, Spec};
use crate::error::{OnnxError, Result};
use crate::graph::{Graph, TensorInfo};

/// The part of the graph a pipeline stage runs (what `crate::parallel::pipeline::Stage::part` gives).
#[derive(Debug, Clone, Copy)]
pub struct StagePart<'a> {
    /// The nodes (indices into the whole graph's execution order).
    pub nodes: &'a Range<usize>,
    /// Graph inputs its nodes read.
    pub graph_inputs: &'a [String],
    /// Values it receives from the previous stage, in wire order.
    pub receives: &'a [String],
    /// Values it returns: those it sends on (the last stage: the graph outputs).
    pub sends: &'a [String],
    /// Parameters its nodes read.
    pub params: &'a [String],
}

impl OnnxModel {
    /// Keep what a pipeline rank runs: one stage's part ([`Self::into_stage`]), or with
    /// several stages (virtual stages) the whole graph with only the parameters their nodes
    /// read; each pass then runs its stage's part of that.
    pub fn into_stages(mut self, stages: &[StagePart]) -> Result<OnnxModel> {
        if let [one] = stages {
            return self.into_stage(*one);
        }
        let keep: HashSet<&String> = stages.iter().flat_map(|s| s.params.iter()).collect();
        let mut params = Vec::new();
        let mut infos = Vec::new();
        let mut sources = HashMap::new();
        let old = std::mem::take(&mut self.params);
        for (p, info) in old.into_iter().zip(&self.spec.params) {
            if keep.contains(&info.name) {
                sources.insert(info.name.clone(), Source::Param(params.len()));
                params.push(p);
                infos.push(info.clone());
            }
        }
        for (name, source) in &self.spec.sources {
            if let Source::Constant(_) = source {
                sources.insert(name.clone(), source.clone());
            }
        }
        let spec = Spec {
            params: infos,
            sources,
            ..(*self.spec).clone()
        };
        Ok(OnnxModel {
            params,
            spec: Arc::new(spec),
        })
    }

    /// Keep only `stage`'s part of the model (see the module doc); the other parameters
    /// are dropped.
    pub fn into_stage(mut self, stage: StagePart) -> Result<OnnxModel> {
        let whole = &self.spec.graph;
        if stage.nodes.end > whole.nodes.len() || stage.nodes.is_empty() {
            return Err(OnnxError::field(
                "pipeline stage",
                format!(
                    "nodes {:?} of a graph of {}",
                    stage.nodes,
                    whole.nodes.len()
                ),
            ));
        }
        let nodes = whole.nodes[stage.nodes.clone()].to_vec();
        let mut last_use = HashMap::new();
        for (i, n) in nodes.iter().enumerate() {
            for input in n.inputs.iter().filter(|i| !i.is_empty()) {
                last_use.insert(input.clone(), i);
            }
        }
        let declared = |name: &String, list: &[TensorInfo]| {
            list.iter()
                .find(|i| &i.name == name)
                .cloned()
                .unwrap_or_else(|| TensorInfo {
                    name: name.clone(),
                    ..TensorInfo::default()
                })
        };
        let inputs = stage
            .graph_inputs
            .iter()
            .chain(stage.receives)
            .map(|n| declared(n, &whole.inputs))
            .collect();
        let outputs = stage
            .sends
            .iter()
            .map(|n| declared(n, &whole.outputs))
            .collect();
        let constants = whole
            .constants
            .iter()
            .filter(|(k, _)| last_use.contains_key(*k))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        let graph = Graph {
            source: whole.source.clone(),
            model: whole.model.clone(),
            opset: whole.opset,
            nodes,
            inputs,
            outputs,
            initializers: Vec::new(),
            constants,
            last_use,
            node_offset: whole.node_offset + stage.nodes.start,
            ties: whole.ties.clone(),
        };

        let mut params = Vec::new();
        let mut infos = Vec::new();
        let mut sources = HashMap::new();
        let mut kept = Vec::new();
        let old = std::mem::take(&mut self.params);
        for (i, (p, info)) in old.into_iter().zip(&self.spec.params).enumerate() {
            if stage.params.contains(&info.name) {
                sources.insert(info.name.clone(), Source::Param(params.len()));
                params.push(p);
                infos.push(info.clone());
                kept.push(i);
            }
        }
        for (name, source) in &self.spec.sources {
            if let Source::Constant(_) = source
                && graph.last_use.contains_key(name)
            {
                sources.insert(name.clone(), source.clone());
            }
        }
        let constants = self.spec.constants.clone();
        let vocab_shard = self
            .spec
            .vocab_shard
            .clone()
            .filter(|v| graph.outputs.iter().any(|o| o.name == v.output));
        let padded_head = self
            .spec
            .padded_head
            .clone()
            .filter(|h| graph.outputs.iter().any(|o| o.name == h.output));
        Ok(OnnxModel {
            params,
            spec: Arc::new(Spec {
                graph: Arc::new(graph),
                params: infos,
                constants,
                sources,
                device: self.spec.device.clone(),
                sharding: self.spec.sharding,
                param_file: self
                    .spec
                    .param_file
                    .as_ref()
                    .map(|f| Arc::new(f.select(&kept))),
                collectives: self.spec.collectives.clone(),
                vocab_shard,
                padded_head,
                prefetch: self.spec.prefetch,
                prefetch_times: self.spec.prefetch_times.clone(),
                profiler: self.spec.profiler.clone(),
                grad_sink: self.spec.grad_sink.clone(),
                folds: Default::default(),
                uploads: Default::default(),
            }),
        })
    }
}
