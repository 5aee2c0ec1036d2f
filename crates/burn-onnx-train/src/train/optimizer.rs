//! Optimizers for a run: Burn's own SGD, Adam, AdamW and LAMB (their update rules match
//! PyTorch's for the settings used here, see the tests), weight decay skipped on the
//! parameters named in `no_weight_decay` (a second parameter group), and global
//! gradient-norm clipping (Burn's own clipping is per tensor; ORT and PyTorch clip by
//! the norm over all gradients); and the update strategy a run uses (replicated, or a ZeRO
//! stage with the same rule over flat buffers).

use std::collections::HashMap;
use std::sync::Arc;

use burn::module::{ParamGroup, ParamId};
use burn::optim::decay::WeightDecayConfig;
use burn::optim::momentum::MomentumConfig;
use burn::optim::{
    AdamConfig, AdamWConfig, GradientsParams, LambConfig, ModuleOptimizer, SgdConfig,
};
use burn_ort_dist::update::zero::flat_optim::Rule;
use burn_ort_dist::{Communicator, DataParallel, Reduction, Replicated, UpdateStrategy, Zero};

use super::config::{MomentPlace, OptimizerConfig, OptimizerKind, ParallelConfig};
use crate::error::Result;
use crate::model::{OnnxModel, ParamRole};

fn sgd(c: &OptimizerConfig, weight_decay: f32) -> SgdConfig {
    SgdConfig::new()
        .with_momentum((c.momentum > 0.0).then_some(MomentumConfig {
            momentum: c.momentum,
            dampening: 0.0,
            nesterov: false,
        }))
        .with_weight_decay((weight_decay > 0.0).then_some(WeightDecayConfig {
            penalty: weight_decay,
        }))
}

fn adam(c: &OptimizerConfig, weight_decay: f32) -> AdamConfig {
    AdamConfig::new()
        .with_beta_1(c.beta1)
        .with_beta_2(c.beta2)
        .with_epsilon(c.epsilon)
        .with_weight_decay((weight_decay > 0.0).then_some(WeightDecayConfig {
            penalty: weight_decay,
        }))
}

fn adamw(c: &OptimizerConfig, weight_decay: f32) -> AdamWConfig {
    AdamWConfig::new()
        .with_beta_1(c.beta1)
        .with_beta_2(c.beta2)
        .with_epsilon(c.epsilon)
        .with_weight_decay(weight_decay)
}

fn lamb(c: &OptimizerConfig, weight_decay: f32) -> LambConfig {
    LambConfig::new()
        .with_beta_1(c.beta1)
        .with_beta_2(c.beta2)
        .with_epsilon(c.epsilon)
        .with_weight_decay(weight_decay)
}

/// Is `name` excluded from weight decay by the configured substrings?
pub fn skips_weight_decay(c: &OptimizerConfig, name: &str) -> bool {
    c.no_weight_decay
        .iter()
        .any(|s| !s.is_empty() && name.contains(s.as_str()))
}

/// The optimizer for `model`: one group with weight decay, one without for the parameters
/// matched by `no_weight_decay`.
pub fn build_optimizer(c: &OptimizerConfig, model: &OnnxModel) -> ModuleOptimizer {
    let wd = c.weight_decay;
    let optim = match c.kind {
        OptimizerKind::Sgd => sgd(c, wd).init(),
        OptimizerKind::Adam => adam(c, wd).init(),
        OptimizerKind::Adamw => adamw(c, wd).init(),
        OptimizerKind::Lamb => lamb(c, wd).init(),
    };
    let excluded: Vec<_> = model
        .param_infos()
        .iter()
        .zip(model.params())
        .filter(|(info, _)| info.role == ParamRole::Trainable && skips_weight_decay(c, &info.name))
        .map(|(_, p)| p.clone())
        .collect();
    if c.weight_decay == 0.0 || excluded.is_empty() {
        return optim;
    }
    let group = ParamGroup::ids_from_module(excluded);
    match c.kind {
        OptimizerKind::Sgd => optim.with_group(group, sgd(c, 0.0).build(), None),
        OptimizerKind::Adam => optim.with_group(group, adam(c, 0.0).build(), None),
        OptimizerKind::Adamw => optim.with_group(group, adamw(c, 0.0).build(), None),
        OptimizerKind::Lamb => optim.with_group(group, lamb(c, 0.0).build(), None),
    }
}

/// Clip gradients to a global L2 norm (`torch.nn.utils.clip_grad_norm_`): if the norm over
/// all gradients exceeds `max_norm`, every gradient is scaled by `max_norm / (norm + 1e-6)`.
/// Returns the norm before clipping (summed in f64, as every update strategy does).
pub fn clip_global_norm(
    grads: &mut GradientsParams,
    model: &OnnxModel,
    max_norm: f32,
) -> Result<f32> {
    Ok(burn_ort_dist::clip_grad_norm(model, grads, max_norm)?)
}

/// The flat-buffer rule for ZeRO with the same update as [`build_optimizer`]'s.
pub fn flat_rule(c: &OptimizerConfig) -> Rule {
    let (beta1, beta2, epsilon) = (c.beta1, c.beta2, c.epsilon);
    match c.kind {
        OptimizerKind::Sgd => Rule::Sgd {
            momentum: c.momentum,
        },
        OptimizerKind::Adam => Rule::Adam {
            beta1,
            beta2,
            epsilon,
        },
        OptimizerKind::Adamw => Rule::AdamW {
            beta1,
            beta2,
            epsilon,
        },
        OptimizerKind::Lamb => Rule::Lamb {
            beta1,
            beta2,
            epsilon,
        },
    }
}

/// Every parameter's weight decay: the configured one, or 0 where `no_weight_decay`
/// matches its name.
pub fn weight_decays(c: &OptimizerConfig, model: &OnnxModel) -> HashMap<ParamId, f32> {
    model
        .param_infos()
        .iter()
        .zip(model.params())
        .map(|(info, p)| {
            let wd = if skips_weight_decay(c, &info.name) {
                0.0
            } else {
                c.weight_decay
            };
            (p.id, wd)
        })
        .collect()
}

/// The data-parallel settings of a run over the data-parallel group `comm`: the
/// reduction its `[parallel]` section asks for (mean, mean with f16 on the wire, or Adasum).
pub fn data_parallel(p: &ParallelConfig, comm: Arc<dyn Communicator>) -> DataParallel {
    let reduction = if p.enable_adasum {
        Reduction::Adasum
    } else if p.allreduce_in_fp16 {
        Reduction::MeanFp16
    } else {
        Reduction::Mean
    };
    DataParallel::new(comm).with_reduction(reduction)
}

/// The update strategy of a run: ZeRO stage 0 (replicated: Adam/AdamW/LAMB fused over
/// flat buffers ([`crate::kernels::FusedAdam`]), SGD with Burn's optimizer from
/// [`build_optimizer`]) or stages 1-3 (sharded flat buffers, their state on the device
/// where the group moves device tensors (NCCL), else, or with `moments` on the host, in
/// host memory, or with `moments` on disk in a mapped file), over
/// `ddp`'s group; `model` is this rank's whole part of the model (before stage 3 shards it).
pub fn build_strategy(
    optimizer: &OptimizerConfig,
    zero_stage: usize,
    moments: MomentPlace,
    model: &OnnxModel,
    ddp: &DataParallel,
) -> Result<Box<dyn UpdateStrategy<OnnxModel>>> {
    let decay = weight_decays(optimizer, model);
    if zero_stage == 0 {
        let ddp = ddp.clone();
        if let Some(fused) = crate::kernels::FusedAdam::new(flat_rule(optimizer), decay.clone()) {
            let fused = match moments {
                MomentPlace::Device => fused,
                MomentPlace::Host => fused.on_host(),
                MomentPlace::Disk(dir) => fused.with_moments_on_disk(dir),
            };
            tracing::info!(optimizer = ?optimizer.kind, "fused multi-tensor update");
            return Ok(Box::new(Replicated::new(ddp, fused)));
        }
        return Ok(Box::new(Replicated::new(
            ddp,
            build_optimizer(optimizer, model),
        )));
    }
    let decay_of = |id: ParamId| decay.get(&id).copied().unwrap_or(0.0);
    let zero = Zero::new(
        zero_stage,
        ddp.comm().clone(),
        flat_rule(optimizer),
        ddp.reduction(),
        decay_of,
        model,
    )?;
    Ok(Box::new(match moments {
        MomentPlace::Disk(dir) => zero.with_state_on_disk(dir)?,
        MomentPlace::Host => zero.on_host(),
        MomentPlace::Device => zero,
    }))
}
