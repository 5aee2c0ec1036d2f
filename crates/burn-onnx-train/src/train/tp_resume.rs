//! Resuming a checkpoint written at another tensor-parallel size: the optimizer records of
//! the saved tp ranks (per pipeline stage) are regrouped into this rank's: the moments of a
//! split weight are reassembled by the saved split and cut by this run's, like the weight
//! itself (`read_params`). ZeRO shards hold flat buffers laid out per tp rank and do not
//! regroup.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use burn_ort_dist::{DistError, RecordTensor, regroup_records};
use ndarray::{ArrayD, IxDyn};

use super::checkpoint::{CheckpointState, state_dir};
use super::placement::Placement;
use crate::error::{OnnxError, Result};
use crate::model::OnnxModel;
use crate::tensor_parallel::AxisSplit;

/// Directories under `scratch` holding this rank's optimizer records regrouped from the
/// checkpoint at `path` (one per pipeline stage of the saved run).
pub fn regrouped_state_dirs(
    path: &Path,
    state: &CheckpointState,
    place: &Placement,
    model: &OnnxModel,
    scratch: &Path,
) -> Result<Vec<PathBuf>> {
    if state.zero_stage > 0 {
        return Err(OnnxError::field(
            "horizontal_parallel_size",
            format!(
                "{} was written by {} tensor-parallel rank(s) with ZeRO: its optimizer shards are laid out per tp rank and do not regroup onto {} (resume at the same tp size)",
                path.display(),
                state.tensor_parallel,
                place.topology.tp
            ),
        ));
    }
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
        place
            .tensor_parallel
            .as_ref()
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
        regroup_records(&sources, &join, &out)?;
        dirs.push(out);
    }
    Ok(dirs)
}
