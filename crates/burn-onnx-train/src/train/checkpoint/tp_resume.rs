//! Resuming a checkpoint written at another tensor-parallel size: the optimizer records of
//! the saved tp ranks (per pipeline stage) are regrouped into this rank's: the moments of a
//! split weight are reassembled by the saved split and cut by this run's, like the weight
//! itself (`read_params`). ZeRO state is regrouped the same way from its shards joined
//! into whole per-parameter vectors (laid out as the parameter's tp part, row-major), and
//! the update strategy cuts its own shard from the result.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use burn_ort_dist::update::zero::state_files::{read_whole, write_whole};
use burn_ort_dist::{DistError, RecordTensor, regroup_records};
use ndarray::{ArrayD, IxDyn};

use super::{CheckpointState, state_dir};
use crate::error::{OnnxError, Result};
use crate::model::OnnxModel;
use crate::parallel::tensor_parallel::AxisSplit;
use crate::train::layout::parallel_plan::ParallelPlan;

/// Directories under `scratch` holding this rank's optimizer records regrouped from the
/// checkpoint at `path` (one per pipeline stage of the saved run).
pub fn regrouped_state_dirs(
    path: &Path,
    state: &CheckpointState,
    plan: &ParallelPlan,
    model: &OnnxModel,
    scratch: &Path,
) -> Result<Vec<PathBuf>> {
    // Parameter id -> (name, logical rank).
    let params: HashMap<u64, (String, usize)> = model
        .param_infos()
        .iter()
        .zip(model.params())
        .map(|(info, p)| (p.id.val(), (info.name.clone(), info.shape.len())))
        .collect();
    let saved = |name: &str| {
        (state.tensor_parallel > 1)
            .then(|| state.tensor_parallel_splits.get(name).copied())
            .flatten()
    };
    let current = |name: &str| {
        plan.tensor_parallel()
            .and_then(|t| t.params.get(name).map(|s| (*s, t.rank, t.size)))
    };
    let join = |id: u64,
                copies: Vec<RecordTensor>|
     -> std::result::Result<Option<RecordTensor>, DistError> {
        let Some((name, rank)) = params.get(&id) else {
            return Ok(None);
        };
        let (from, to) = (saved(name), current(name));
        if from.is_none() && to.is_none() {
            return Ok(None);
        }
        // Records hold tensors at the interpreter's physical rank: shift the axis.
        let physical = |s: AxisSplit, dims: usize| s.on(s.axis + dims - rank);
        let arrays: Vec<ArrayD<f32>> = copies
            .into_iter()
            .map(|(shape, v)| {
                ArrayD::from_shape_vec(IxDyn(&shape), v).expect("a record tensor of its shape")
            })
            .collect();
        let dims = arrays[0].ndim();
        let whole = match from {
            Some(s) => physical(s, dims).assemble(&arrays),
            None => arrays.into_iter().next().expect("one copy per rank"),
        };
        let part = match to {
            Some((s, r, tp)) => physical(s, dims).slice(&whole, r, tp),
            None => whole,
        };
        Ok(Some((
            part.shape().to_vec(),
            part.iter().copied().collect(),
        )))
    };
    let stages: Vec<Option<usize>> = if state.pipeline_stages > 1 {
        (0..state.pipeline_stages).map(Some).collect()
    } else {
        vec![None]
    };
    let mut dirs = Vec::new();
    for stage in stages {
        let sources: Vec<PathBuf> = (0..state.tensor_parallel)
            .map(|r| {
                state_dir(stage, (state.tensor_parallel > 1).then_some(r))
                    .map_or_else(|| path.to_path_buf(), |d| path.join(d))
            })
            .collect();
        let out = scratch.join(stage.map_or_else(|| "whole".to_string(), |k| format!("stage-{k}")));
        if state.zero_stage > 0 {
            regroup_zero(&sources, state, plan, model, &out)?;
        } else {
            regroup_records(&sources, &join, &out)?;
        }
        dirs.push(out);
    }
    Ok(dirs)
}

/// ZeRO state of the saved tp ranks `sources` (one pipeline stage's) regrouped for this
/// rank's parameters into the one-rank directory `out`: a split parameter's state vectors
/// are reassembled by the saved split (each rank's vector in the shape of its part) and
/// cut by this run's; a parameter split in neither takes the first saved rank's state (tp
/// ranks hold identical state for replicated weights).
fn regroup_zero(
    sources: &[PathBuf],
    state: &CheckpointState,
    plan: &ParallelPlan,
    model: &OnnxModel,
    out: &Path,
) -> Result<()> {
    let mut step = 0;
    let mut saved: Vec<HashMap<u64, Vec<Vec<f32>>>> = Vec::new();
    for dir in sources {
        let (s, params) = read_whole(dir)?;
        step = s;
        saved.push(params.into_iter().collect());
    }
    let vectors = saved
        .first()
        .and_then(|p| p.values().next())
        .map_or(0, Vec::len);
    let mut params = Vec::new();
    for (info, p) in model.param_infos().iter().zip(model.params()) {
        let id = p.id.val();
        let Some(first) = saved.first().and_then(|s| s.get(&id)) else {
            continue;
        };
        let from = (state.tensor_parallel > 1)
            .then(|| state.tensor_parallel_splits.get(&info.name).copied())
            .flatten();
        let to = plan
            .tensor_parallel()
            .and_then(|t| t.params.get(&info.name).map(|s| (*s, t.rank, t.size)));
        if from.is_none() && to.is_none() {
            params.push((id, first.clone()));
            continue;
        }
        // The whole logical shape, then the saved parts' shape.
        let mut whole_shape = info.shape.clone();
        if let Some((s, _, tp)) = to {
            whole_shape[s.axis] *= tp;
        }
        let mut part_shape = whole_shape.clone();
        if let Some(s) = from {
            part_shape[s.axis] /= state.tensor_parallel;
        }
        let mut joined = Vec::with_capacity(vectors);
        for k in 0..vectors {
            let parts = saved
                .iter()
                .map(|s| {
                    let v = s.get(&id).ok_or_else(|| {
                        OnnxError::field(
                            "checkpoint",
                            format!("a tensor-parallel rank's ZeRO state lacks '{}'", info.name),
                        )
                    })?;
                    ArrayD::from_shape_vec(IxDyn(&part_shape), v[k].clone()).map_err(|e| {
                        OnnxError::field(
                            format!("checkpoint state of '{}'", info.name),
                            e.to_string(),
                        )
                    })
                })
                .collect::<Result<Vec<_>>>()?;
            let whole = match from {
                Some(s) => s.assemble(&parts),
                None => parts.into_iter().next().expect("one part per saved rank"),
            };
            let part = match to {
                Some((s, r, tp)) => s.slice(&whole, r, tp),
                None => whole,
            };
            joined.push(part.iter().copied().collect());
        }
        params.push((id, joined));
    }
    write_whole(out, state.zero_stage, step, vectors, &params)?;
    Ok(())
}
