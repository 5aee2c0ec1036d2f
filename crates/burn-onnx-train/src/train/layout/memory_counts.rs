//! What a rank keeps besides its working set, counted from its part of the model:
//! parameters (ZeRO-3: its chunks), gradients held through the update (ZeRO-1: the
//! padded flat buffer, ZeRO-2/3: its shard), optimizer state in memory or in files, as the
//! update strategies hold them. The run's pre-flight line and `memory_plan` read it.

use std::collections::HashSet;

use serde::Serialize;

use crate::kernels::FLAT_CHUNK;
use crate::model::{OnnxModel, ParamRole};
use crate::train::config::{
    OffloadTarget, OptimizerConfig, OptimizerKind, ParamOffload, TrainingConfig,
};

/// What one rank of a layout holds at its peak, in bytes (every data-parallel replica of
/// a tensor-parallel rank and pipeline stage holds the same).
#[derive(Debug, Clone, Serialize)]
pub struct RankMemory {
    /// Tensor-parallel rank.
    pub tp_rank: usize,
    /// Pipeline stage.
    pub stage: usize,
    /// Parameters this rank holds in memory (ZeRO-3: its chunks; none on disk).
    pub parameter_bytes: u64,
    /// Gradients held through the update (ZeRO-2/3: its shard).
    pub gradient_bytes: u64,
    /// Optimizer state in memory.
    pub optimizer_state_bytes: u64,
    /// Optimizer state and parameter chunks in files (`offload_optimizer = "disk"`,
    /// `offload_params = "disk"`).
    pub on_disk_bytes: u64,
    /// Forward/backward working set of one micro-step (see the module doc).
    pub working_set_bytes: u64,
    /// The rank's peak, without the process's own footprint.
    pub peak_bytes: u64,
}

/// Elements of `model`'s parameters named in `names` (all when `None`): (all, trainable),
/// and the per-parameter counts.
pub(crate) fn elements(
    model: &OnnxModel,
    names: Option<&HashSet<String>>,
) -> (Vec<usize>, Vec<usize>) {
    let (mut all, mut trainable) = (Vec::new(), Vec::new());
    for info in model.param_infos() {
        if names.is_some_and(|n| !n.contains(&info.name)) {
            continue;
        }
        let n: usize = info.shape.iter().product();
        all.push(n);
        if info.role == ParamRole::Trainable {
            trainable.push(n);
        }
    }
    (all, trainable)
}

/// Optimizer state vectors per trainable element.
pub(crate) fn state_slots(optimizer: &OptimizerConfig) -> u64 {
    match optimizer.kind {
        OptimizerKind::Adam | OptimizerKind::Adamw | OptimizerKind::Lamb => 2,
        OptimizerKind::Sgd if optimizer.momentum > 0.0 => 1,
        OptimizerKind::Sgd => 0,
    }
}

/// Elements of the fused update's flat buffers (Adam, AdamW and LAMB at ZeRO stage 0)
/// for parameters of `trainable` elements: each padded to whole chunks.
fn fused_elements(trainable: &[usize]) -> u64 {
    trainable
        .iter()
        .map(|&n| (n.div_ceil(FLAT_CHUNK).max(1) * FLAT_CHUNK) as u64)
        .sum()
}

/// What a rank holding `part` (its part of the model, whole parameters) keeps besides its
/// working set, at `c`'s ZeRO stage and data-parallel size: the pre-flight line of a run.
pub fn counted_memory(c: &TrainingConfig, part: &OnnxModel) -> RankMemory {
    rank_memory(c, part, None, c.parallel.data_parallel_size.max(1), 0, 0, 0)
}

/// One rank's figures: the parameters `names` of `part` (all when `None`) at `c`'s ZeRO
/// stage over `dp` replicas, with a working set of `working` bytes.
pub(crate) fn rank_memory(
    c: &TrainingConfig,
    part: &OnnxModel,
    names: Option<&HashSet<String>>,
    dp: usize,
    tp_rank: usize,
    stage: usize,
    working: u64,
) -> RankMemory {
    let (all, trainable) = elements(part, names);
    let (all_n, train_n) = (
        all.iter().sum::<usize>() as u64,
        trainable.iter().sum::<usize>() as u64,
    );
    let zero = c.parallel.zero_stage;
    let shard = train_n.div_ceil(dp as u64);
    let held = 4 * if zero == 3 {
        all.iter().map(|&n| (n as u64).div_ceil(dp as u64)).sum()
    } else {
        all_n
    };
    let params_on_disk = c.offload.offload_params == ParamOffload::Disk;
    let parameter_bytes = if params_on_disk { 0 } else { held };
    let gradient_bytes = 4 * match zero {
        0 => train_n,
        1 => shard * dp as u64,
        _ => shard,
    };
    let slots = state_slots(&c.optimizer);
    let state = 4
        * slots
        * match zero {
            0 if slots == 2 => fused_elements(&trainable),
            0 => train_n,
            _ => shard,
        };
    let on_disk = c.offload.offload_optimizer == OffloadTarget::Disk;
    let optimizer_state_bytes = if on_disk { 0 } else { state };
    let accumulated = if c.train.gradient_accumulation_steps > 1 {
        gradient_bytes
    } else {
        0
    };
    RankMemory {
        tp_rank,
        stage,
        parameter_bytes,
        gradient_bytes,
        optimizer_state_bytes,
        on_disk_bytes: if on_disk { state } else { 0 } + if params_on_disk { held } else { 0 },
        working_set_bytes: working,
        peak_bytes: parameter_bytes
            + gradient_bytes
            + optimizer_state_bytes
            + working
            + accumulated,
    }
}
