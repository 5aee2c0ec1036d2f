//! Where a run starts: fresh, from the checkpoint `checkpoint_to_load_path` names, or from
//! the newest one in the checkpoint directory (which must come from a compatible run).

use burn_ort_dist::{Communicator, UpdateStrategy};

use super::checkpoint::{
    list_checkpoints, read_params, read_state, remove_stale_temporaries, state_dirs,
};
use super::config::TrainingConfig;
use super::parallel_plan::ParallelPlan;
use super::precision::LossScaler;
use super::tp_resume::regrouped_state_dirs;
use crate::error::Result;
use crate::model::OnnxModel;

/// The model to start from with the update and micro-step counters; the strategy's
/// optimizer state and the loss scale are loaded from the checkpoint, if any.
pub(super) fn resume(
    c: &TrainingConfig,
    world: &dyn Communicator,
    place: &ParallelPlan,
    model: OnnxModel,
    strategy: &mut dyn UpdateStrategy<OnnxModel>,
    scaler: &mut LossScaler,
) -> Result<(OnnxModel, usize, usize)> {
    let dir = c.checkpoints_dir();
    let root = world.rank() == 0;
    if root {
        remove_stale_temporaries(&dir);
    }
    let Some(path) = c
        .checkpoint_to_load_path
        .clone()
        .or_else(|| list_checkpoints(&dir).pop().map(|(_, p)| p))
    else {
        return Ok((model, 0, 0));
    };
    let state = read_state(&path)?;
    let saved = TrainingConfig::from_toml(&state.config_toml, &path)?;
    let saved_replicas =
        state.world_size / (saved.pipeline_parallel_size * saved.horizontal_parallel_size).max(1);
    c.check_resume(
        &saved,
        saved_replicas,
        state.zero_stage,
        place.topology.dp,
        &path,
    )?;
    let model = read_params(&path, model, place.tensor_parallel.as_ref())?;
    if state.tensor_parallel == place.topology.tp {
        strategy.load_state(
            &model,
            &state_dirs(&path, state.pipeline_stages, place.tp_rank()),
        )?;
    } else {
        let scratch = c.output_dir.join(format!(".tp-regroup-{}", world.rank()));
        let dirs = regrouped_state_dirs(&path, &state, place, &model, &scratch)?;
        strategy.load_state(&model, &dirs)?;
        let _ = std::fs::remove_dir_all(&scratch);
    }
    scaler.restore(state.loss_scale);
    let (update, micro) = (state.update_step, state.micro_step);
    if root {
        tracing::info!(checkpoint = %path.display(), update, total = c.num_updates(), "resumed");
        if update >= c.num_updates() {
            tracing::warn!(
                "the checkpoint is already at the last update: nothing to train (raise num_train_steps or use a fresh output_dir)"
            );
        }
    }
    Ok((model, update, micro))
}
