//! Values that depend only on the shapes of the graph's inputs, computed once per input
//! shape instead of once per pass: the attention masks exporters cut from a constant
//! buffer by the sequence length in every layer (dynamo's GPT-2: two `Slice`s and a `Not`
//! of a `[1, 1, 1024, 1024]` boolean buffer per layer, each `t^2` values on the host),
//! position ranges, the shapes fed to `Reshape`. onnxruntime folds the constant part of a
//! graph once at load; here the part that also reads the inputs' shapes is folded per
//! shape.
//!
//! A node folds when its op is deterministic (no random draws, no subgraphs) and every
//! input it reads is fixed: a constant (an initializer that is not a parameter, a
//! `Constant` node), the `Shape` or `Size` of a graph input, or another folding node's
//! output. The first pass for a set of input shapes (and an autocast precision) runs the
//! folding nodes and keeps the outputs the rest of the graph reads; later passes with the
//! same ones take those instead of running them. The last few are kept (training's and evaluation's
//! batches alternate).

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, OnceLock};

use burn::tensor::{Device, FloatDType};

use crate::graph::Graph;
use crate::value::Value;

/// Ops that never fold: random draws, subgraphs, and ops whose output is not a function
/// of their inputs alone.
const NEVER_FOLDED: &[&str] = &[
    "Bernoulli",
    "Dropout",
    "If",
    "Loop",
    "Multinomial",
    "RandomNormal",
    "RandomNormalLike",
    "RandomUniform",
    "RandomUniformLike",
    "Scan",
    "SequenceMap",
];

/// Keys kept at once.
const KEPT_SHAPES: usize = 4;

/// What the folded values of a pass depend on: the shapes of the graph's inputs (`None`:
/// an optional one left out), the autocast precision (a product of constants is computed
/// in it) and the device its float values live on (a model forked to another device keeps
/// its spec).
#[derive(Debug, Clone, PartialEq)]
pub(super) struct FoldKey {
    pub shapes: Vec<Option<Vec<usize>>>,
    pub autocast: Option<FloatDType>,
    pub device: Device,
}

/// A model's folded values (see the module): the plan worked out once, the values per
/// input shape. A model made with another graph (every `with_*` builder makes a new spec)
/// starts empty: cloning gives an empty one.
#[derive(Default)]
pub(super) struct ShapeFolds {
    plan: OnceLock<FoldPlan>,
    kept: Mutex<Vec<(FoldKey, Arc<HashMap<String, Value>>)>>,
}

impl Clone for ShapeFolds {
    fn clone(&self) -> Self {
        ShapeFolds::default()
    }
}

impl std::fmt::Debug for ShapeFolds {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let keys = self.kept.lock().map(|k| k.len()).unwrap_or(0);
        f.debug_struct("ShapeFolds")
            .field("keys_kept", &keys)
            .finish()
    }
}

/// Which nodes fold, and which of their outputs the rest of the graph reads.
#[derive(Debug)]
pub(super) struct FoldPlan {
    folds: Vec<bool>,
    read_after: HashSet<String>,
}

impl FoldPlan {
    /// The plan of `graph`, whose values named in `constants` are fixed.
    fn of(graph: &Graph, constants: &dyn Fn(&str) -> bool) -> Self {
        let inputs: HashSet<&str> = graph.inputs.iter().map(|i| i.name.as_str()).collect();
        let mut fixed: HashSet<&str> = HashSet::new();
        let mut folds = Vec::with_capacity(graph.nodes.len());
        for node in &graph.nodes {
            let read: Vec<&str> = node
                .inputs
                .iter()
                .map(String::as_str)
                .filter(|n| !n.is_empty())
                .collect();
            let is_fixed = |n: &&str| fixed.contains(n) || constants(n);
            let of_shape = matches!(node.op_type.as_str(), "Shape" | "Size")
                && read.len() == 1
                && (inputs.contains(read[0]) || is_fixed(&read[0]));
            let folded = !NEVER_FOLDED.contains(&node.op_type.as_str())
                && !read.is_empty()
                && (of_shape || read.iter().all(is_fixed));
            if folded {
                fixed.extend(node.outputs.iter().map(String::as_str));
            }
            folds.push(folded);
        }
        let mut read_after: HashSet<String> = graph
            .nodes
            .iter()
            .zip(&folds)
            .filter(|(_, folded)| !**folded)
            .flat_map(|(n, _)| n.inputs.iter())
            .chain(graph.outputs.iter().map(|o| &o.name))
            .filter(|n| fixed.contains(n.as_str()))
            .cloned()
            .collect();
        read_after.retain(|n| !constants(n));
        FoldPlan { folds, read_after }
    }

    /// Whether node `i` folds.
    pub fn folds(&self, i: usize) -> bool {
        self.folds[i]
    }

    /// How many nodes fold.
    pub fn count(&self) -> usize {
        self.folds.iter().filter(|f| **f).count()
    }

    /// Whether a folding node's output is read by the rest of the graph.
    pub fn read_after(&self, name: &str) -> bool {
        self.read_after.contains(name)
    }
}

/// One pass's view of the folds: the values of its key when an earlier pass
/// made them, or the map this pass fills.
pub(super) enum FoldPass<'a> {
    /// An earlier pass with this key made them: the folding nodes are skipped.
    Made(&'a FoldPlan, Arc<HashMap<String, Value>>),
    /// This pass runs the folding nodes and keeps what the rest of the graph reads.
    Making(&'a FoldPlan, FoldKey, HashMap<String, Value>),
}

impl ShapeFolds {
    /// The plan of `graph` (worked out on the first ask); `constants` names its fixed
    /// values.
    pub fn plan(&self, graph: &Graph, constants: &dyn Fn(&str) -> bool) -> &FoldPlan {
        self.plan.get_or_init(|| FoldPlan::of(graph, constants))
    }

    /// The pass over `graph` with `key`; `constants` names its fixed values.
    pub fn pass(
        &self,
        graph: &Graph,
        constants: &dyn Fn(&str) -> bool,
        key: FoldKey,
    ) -> FoldPass<'_> {
        let plan = self.plan(graph, constants);
        let kept = self.kept.lock().unwrap_or_else(|p| p.into_inner());
        match kept.iter().find(|(s, _)| *s == key) {
            Some((_, made)) => FoldPass::Made(plan, made.clone()),
            None => FoldPass::Making(plan, key, HashMap::new()),
        }
    }

    /// Keep what a [`FoldPass::Making`] pass made (the newest first, [`KEPT_SHAPES`] at
    /// most).
    pub fn keep(&self, pass: FoldPass<'_>) {
        if let FoldPass::Making(_, key, made) = pass {
            let mut kept = self.kept.lock().unwrap_or_else(|p| p.into_inner());
            kept.retain(|(s, _)| *s != key);
            kept.insert(0, (key, Arc::new(made)));
            kept.truncate(KEPT_SHAPES);
        }
    }
}

impl FoldPass<'_> {
    /// Whether node `i` is skipped: it folds and an earlier pass made its outputs, which
    /// are put in `env` (those the rest of the graph reads).
    pub fn skips(&self, i: usize, outputs: &[String], env: &mut HashMap<String, Value>) -> bool {
        let FoldPass::Made(plan, made) = self else {
            return false;
        };
        if !plan.folds(i) {
            return false;
        }
        for name in outputs {
            if let Some(v) = made.get(name) {
                env.insert(name.clone(), v.clone());
            }
        }
        true
    }

    /// Note node `i`'s outputs (in `env` after it ran) when it folds and this pass makes
    /// the folds.
    pub fn note(&mut self, i: usize, outputs: &[String], env: &HashMap<String, Value>) {
        let FoldPass::Making(plan, _, made) = self else {
            return;
        };
        if !plan.folds(i) {
            return;
        }
        for name in outputs.iter().filter(|n| plan.read_after(n)) {
            if let Some(v) = env.get(name) {
                made.insert(name.clone(), v.clone());
            }
        }
    }
}
