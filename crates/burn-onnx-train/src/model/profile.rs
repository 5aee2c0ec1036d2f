//! Per-node forward timing (`profile = true`, `--profile`): every training-mode forward
//! pass of a model given a [`NodeProfiler`] (`OnnxModel::with_profiler`) records the wall
//! time of each node's op, and the profiler sums them by node and by op type. On the CPU the
//! ops run eagerly, so a node's time is its compute; on a GPU backend it is the time to
//! enqueue it. A node whose values depend only on the inputs' shapes (`shape_folds`) runs
//! in the first pass of a shape and records 0 after. Backward runs inside Burn's autodiff
//! and is not split by node: the runner's `perf.json` has the update's total and its
//! synchronisation and optimizer time.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Mutex;
use std::time::Duration;

use serde::Serialize;

use crate::error::Result;
use crate::util::atomic_file::write_atomic;

/// One node's times so far.
#[derive(Debug, Default)]
struct NodeTotal {
    op_type: String,
    calls: usize,
    time: Duration,
}

/// Collects the node times of the passes of the models it was given to, until
/// [`NodeProfiler::finish`].
#[derive(Debug, Default)]
pub struct NodeProfiler(Mutex<HashMap<(usize, String), NodeTotal>>);

impl NodeProfiler {
    /// Add `elapsed` to node `index` (`name`, `op_type`).
    pub fn record(&self, index: usize, name: &str, op_type: &str, elapsed: Duration) {
        let mut nodes = self.0.lock().unwrap_or_else(|p| p.into_inner());
        let t = nodes
            .entry((index, name.to_string()))
            .or_insert_with(|| NodeTotal {
                op_type: op_type.to_string(),
                ..Default::default()
            });
        t.calls += 1;
        t.time += elapsed;
    }

    /// The totals so far averaged over `updates` optimizer updates (collecting starts
    /// again from nothing).
    pub fn finish(&self, updates: usize) -> Profile {
        let nodes = std::mem::take(&mut *self.0.lock().unwrap_or_else(|p| p.into_inner()));
        let per_update = |d: Duration| d.as_secs_f64() * 1e3 / updates.max(1) as f64;
        let forward_ms: f64 = nodes.values().map(|t| per_update(t.time)).sum();
        let mut by_type: HashMap<String, OpTypeTime> = HashMap::new();
        for t in nodes.values() {
            let e = by_type
                .entry(t.op_type.clone())
                .or_insert_with(|| OpTypeTime {
                    op_type: t.op_type.clone(),
                    ..Default::default()
                });
            e.nodes += 1;
            e.calls += t.calls;
            e.ms_per_update += per_update(t.time);
        }
        let mut by_op_type: Vec<OpTypeTime> = by_type.into_values().collect();
        for t in &mut by_op_type {
            t.share_of_forward = t.ms_per_update / forward_ms.max(f64::MIN_POSITIVE);
        }
        by_op_type.sort_by(|a, b| b.ms_per_update.total_cmp(&a.ms_per_update));
        let mut by_node: Vec<NodeTime> = nodes
            .into_iter()
            .map(|((index, node), t)| NodeTime {
                index,
                node,
                op_type: t.op_type,
                calls: t.calls,
                ms_per_update: per_update(t.time),
            })
            .collect();
        by_node.sort_by(|a, b| b.ms_per_update.total_cmp(&a.ms_per_update));
        Profile {
            updates,
            forward_ms_per_update: forward_ms,
            by_op_type,
            by_node,
        }
    }
}

/// Forward time per optimizer update, by op type and by node (slowest first).
#[derive(Debug, Clone, Serialize)]
pub struct Profile {
    /// Updates the times are averaged over.
    pub updates: usize,
    /// Sum over every node, milliseconds per update.
    pub forward_ms_per_update: f64,
    /// By op type.
    pub by_op_type: Vec<OpTypeTime>,
    /// By node.
    pub by_node: Vec<NodeTime>,
}

/// The nodes of one op type together.
#[derive(Debug, Clone, Default, Serialize)]
pub struct OpTypeTime {
    /// ONNX op type.
    pub op_type: String,
    /// Nodes of this type.
    pub nodes: usize,
    /// Executions (nodes x micro-batches x passes; recomputation runs a node twice).
    pub calls: usize,
    /// Milliseconds per update.
    pub ms_per_update: f64,
    /// Fraction of the forward time.
    pub share_of_forward: f64,
}

/// One node.
#[derive(Debug, Clone, Serialize)]
pub struct NodeTime {
    /// Position in the graph's execution order.
    pub index: usize,
    /// Node name.
    pub node: String,
    /// ONNX op type.
    pub op_type: String,
    /// Executions.
    pub calls: usize,
    /// Milliseconds per update.
    pub ms_per_update: f64,
}

impl Profile {
    /// Write as JSON.
    pub fn write(&self, path: &Path) -> Result<()> {
        let text = serde_json::to_vec_pretty(self)
            .map_err(|e| crate::error::OnnxError::field("profile", e.to_string()))?;
        write_atomic(path, &text)
    }
}
