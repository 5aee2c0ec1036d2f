//! Where a run starts: from the checkpoint `checkpoint_to_load_path` names, from the newest
//! intact one in the checkpoint directory (which must come from a compatible run), or, with
//! `resume = "never"` (or none there), from the model file. Rank 0 checks the checkpoint's
//! files against its manifest first: a damaged newest checkpoint is skipped with a warning
//! naming the file, a damaged named one is an error.

use std::path::{Path, PathBuf};

use burn_ort_dist::{Communicator, Topology, UpdateStrategy};

use super::manifest::check_files;
use super::params::{from_other_model, read_params};
use super::tp_resume::regrouped_state_dirs;
use super::{list_checkpoints, read_state, remove_stale_temporaries, state_dirs};
use crate::error::{OnnxError, Result};
use crate::model::OnnxModel;
use crate::train::config::{CheckpointConfig, Resume, TrainingConfig};
use crate::train::layout::parallel_plan::ParallelPlan;
use crate::train::precision::LossScaler;

/// `resume = "never"` in a directory holding checkpoints: refused, or with
/// `overwrite_output_dir` the checkpoints are deleted (by rank 0) so that this run's
/// rotation and a later resume see only its own.
fn start_over(checkpoint: &CheckpointConfig, dir: &Path, root: bool) -> Result<()> {
    let old = list_checkpoints(dir);
    let Some((_, newest)) = old.last() else {
        return Ok(());
    };
    if !checkpoint.overwrite_output_dir {
        return Err(OnnxError::field(
            "resume",
            format!(
                "\"never\", but {} holds {} checkpoint(s) of an earlier run (newest {}): pass --overwrite (overwrite_output_dir = true) to delete them, or use another --output-dir",
                dir.display(),
                old.len(),
                newest.display()
            ),
        ));
    }
    if root {
        for (_, path) in &old {
            std::fs::remove_dir_all(path).map_err(|e| OnnxError::io(path, e))?;
        }
        tracing::warn!(deleted = old.len(), dir = %dir.display(), "--overwrite: the earlier checkpoints are deleted");
    }
    Ok(())
}

/// Rank 0's choice of checkpoint (see [`checked_choice`]), handed to every rank: a
/// broadcast of (found, step high, step low), so a step travels exactly as f32 values.
fn choose_checkpoint(
    checkpoint: &CheckpointConfig,
    dir: &Path,
    world: &dyn Communicator,
) -> Result<Option<PathBuf>> {
    let mut msg = [0.0f32; 3];
    let chosen = if world.rank() == 0 {
        let chosen = checked_choice(checkpoint, dir);
        if let Ok(Some((step, _))) = &chosen {
            msg = [1.0, (step >> 20) as f32, (step & 0xF_FFFF) as f32];
        } else if chosen.is_err() {
            msg[0] = -1.0;
        }
        Some(chosen)
    } else {
        None
    };
    world.broadcast(&mut msg, 0)?;
    match chosen {
        Some(choice) => Ok(choice?.map(|(_, path)| path)),
        None if msg[0] < 0.0 => Err(OnnxError::field(
            "resume",
            "rank 0 found the checkpoint to resume from damaged (its error says which file)",
        )),
        None if msg[0] == 0.0 => Ok(None),
        None => {
            let step = ((msg[1] as usize) << 20) | msg[2] as usize;
            Ok(Some(
                checkpoint
                    .checkpoint_to_load_path
                    .clone()
                    .unwrap_or_else(|| dir.join(super::checkpoint_name(step))),
            ))
        }
    }
}

/// The checkpoint `checkpoint_to_load_path` names, which must be intact, or the newest
/// intact one in `dir` (skipping damaged newer ones with a warning), with its step. When
/// every checkpoint there is damaged, the newest one's error: the run does not silently
/// start over.
fn checked_choice(checkpoint: &CheckpointConfig, dir: &Path) -> Result<Option<(usize, PathBuf)>> {
    if let Some(path) = &checkpoint.checkpoint_to_load_path {
        check_files(path)?;
        return Ok(Some((0, path.clone())));
    }
    let mut newest_error = None;
    for (step, path) in list_checkpoints(dir).into_iter().rev() {
        match check_files(&path) {
            Ok(()) => return Ok(Some((step, path))),
            Err(e) => {
                tracing::warn!(
                    checkpoint = %path.display(),
                    error = %e,
                    "skipping a damaged checkpoint; trying the one before it"
                );
                newest_error.get_or_insert(e);
            }
        }
    }
    newest_error.map_or(Ok(None), Err)
}

/// The model to start from with the update and micro-step counters; the strategy's
/// optimizer state and the loss scale are loaded from the checkpoint, if any.
pub(crate) fn resume(
    c: &TrainingConfig,
    world: &dyn Communicator,
    plan: &ParallelPlan,
    model: OnnxModel,
    strategy: &mut dyn UpdateStrategy<OnnxModel>,
    scaler: &mut LossScaler,
) -> Result<(OnnxModel, usize, usize)> {
    let dir = c.checkpoint.checkpoints_dir();
    let root = world.rank() == 0;
    if root {
        remove_stale_temporaries(&dir);
    }
    if c.checkpoint.resume == Resume::Never {
        start_over(&c.checkpoint, &dir, root)?;
        return Ok((model, 0, 0));
    }
    let Some(path) = choose_checkpoint(&c.checkpoint, &dir, world)? else {
        return Ok((model, 0, 0));
    };
    let state = read_state(&path)?;
    let saved = TrainingConfig::from_toml(&state.config_toml, &path)?;
    let saved_layout = Topology::filling(
        state.world_size,
        saved.parallel.horizontal_parallel_size,
        saved.parallel.pipeline_parallel_size,
    )?;
    c.check_resume(
        &saved,
        saved_layout.dp,
        state.zero_stage,
        plan.topology.dp,
        &path,
    )?;
    let model = read_params(&path, model, plan.tensor_parallel())
        .map_err(|e| from_other_model(e, &path, &saved.model.model_path, &c.model.model_path))?;
    if state.tensor_parallel == plan.topology.tp {
        strategy.load_state(
            &model,
            &state_dirs(&path, state.pipeline_stages, plan.tp_rank()),
        )?;
    } else {
        let scratch = c
            .checkpoint
            .output_dir
            .join(format!(".tp-regroup-{}", world.rank()));
        let dirs = regrouped_state_dirs(&path, &state, plan, &model, &scratch)?;
        strategy.load_state(&model, &dirs)?;
        let _ = std::fs::remove_dir_all(&scratch);
    }
    scaler.restore(state.loss_scale);
    let update = state.update_step;
    let micro = rescaled_micro(
        state.micro_step,
        saved.data.batch_size * saved_layout.dp,
        c.data.batch_size * plan.topology.dp,
        &path,
    )?;
    if root {
        tracing::info!(checkpoint = %path.display(), update, total = c.train.num_updates(), "resumed");
        if update >= c.train.num_updates() {
            tracing::warn!(
                "the checkpoint is already at the last update: nothing to train (raise num_train_steps or use a fresh output_dir)"
            );
        }
    }
    Ok((model, update, micro))
}

/// This run's micro-step counter at the checkpoint's place in the data: the samples the
/// saved run consumed (`saved_micro` micro-steps of `saved_per_micro` samples across its
/// replicas) counted in this run's micro-steps of `per_micro`, which differ when the global
/// batch is split over another data-parallel size or accumulation.
fn rescaled_micro(
    saved_micro: usize,
    saved_per_micro: usize,
    per_micro: usize,
    checkpoint: &Path,
) -> Result<usize> {
    let samples = saved_micro * saved_per_micro;
    if per_micro == 0 || samples % per_micro != 0 {
        return Err(OnnxError::field(
            "config.data.batch_size",
            format!(
                "{} stopped after {samples} samples, not a whole number of this run's micro-steps of {per_micro} (batch_size x data-parallel replicas)",
                checkpoint.display()
            ),
        ));
    }
    Ok(samples / per_micro)
}
