//! How the forward and backward passes of one update run: [`Passes`]. The runner calls it
//! once per update and does not know whether the whole model is here ([`Sequential`]) or one
//! pipeline stage of it (`crate::train::passes::pipelined::Pipelined`).

pub mod pipelined;
pub mod ready_grads;
pub mod segmented;
pub mod step;

use std::sync::Arc;
use std::time::Duration;

use burn::optim::{GradientsAccumulator, GradientsParams};
use burn::tensor::{Device, Tensor};
use burn_ort_dist::{DataParallel, SyncTimes};

use self::ready_grads::ReadyGrads;
use self::step::{PassSettings, forward_loss, scalar};
use super::data::{Batch, Prefetcher};
use crate::error::Result;
use crate::model::{Mode, OnnxModel};
use crate::util::seeds::micro_step_seed;

/// The three kinds of session runs of ORT's training loop.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum SessionMode {
    /// Forward + backward, gradients accumulated, no update.
    GradientAccumulateStep,
    /// Forward + backward, then synchronise, clip and update.
    ModelUpdateStep,
    /// Forward only, evaluation mode.
    EvaluateStep,
}

/// A loss as a pass measured it: read, or still on the device. A loss left on the device
/// is read when a report shows it, so that no update waits for the device (a read after the
/// forward pass would hold back the launches of the backward pass until the device has
/// finished the forward).
#[derive(Clone)]
pub enum LossValue {
    /// On the host.
    Read(f64),
    /// A scalar (`[1]`) on the device, with no autodiff graph.
    OnDevice(Tensor<1>),
}

impl LossValue {
    /// The value (a device read for [`LossValue::OnDevice`]).
    pub fn read(&self) -> Result<f64> {
        Ok(match self {
            LossValue::Read(v) => *v,
            LossValue::OnDevice(t) => f64::from(scalar(t.clone())?),
        })
    }

    /// `loss`, kept on the device (detached from the autodiff graph).
    pub fn on_device(loss: &Tensor<1>) -> Self {
        LossValue::OnDevice(loss.clone().detach())
    }
}

/// The mean loss of an update's micro-steps, each [`LossValue`] read only when asked.
#[derive(Clone)]
pub struct UpdateLoss(Vec<LossValue>);

impl UpdateLoss {
    /// A loss read already.
    pub fn read(value: f64) -> Self {
        UpdateLoss(vec![LossValue::Read(value)])
    }

    /// Micro-steps' losses on the device.
    pub fn on_device_values(losses: Vec<Tensor<1>>) -> Self {
        UpdateLoss(losses.into_iter().map(LossValue::OnDevice).collect())
    }

    /// Each micro-step's loss on the device; `None` when one was read.
    pub fn on_device(&self) -> Option<Vec<Tensor<1>>> {
        self.0
            .iter()
            .map(|v| match v {
                LossValue::OnDevice(t) => Some(t.clone()),
                LossValue::Read(_) => None,
            })
            .collect()
    }

    /// The losses with `copy` of each one on the device.
    pub fn snapshot(&self, copy: impl Fn(&Tensor<1>) -> Tensor<1>) -> Self {
        let copied = self.0.iter().map(|v| match v {
            LossValue::OnDevice(t) => LossValue::OnDevice(copy(t)),
            LossValue::Read(x) => LossValue::Read(*x),
        });
        UpdateLoss(copied.collect())
    }

    /// The mean over the micro-steps (device reads for those on the device).
    pub fn mean(&self) -> Result<f64> {
        let sum = self.0.iter().map(LossValue::read).sum::<Result<f64>>()?;
        Ok(sum / self.0.len().max(1) as f64)
    }
}

/// The gradients of one update with what the micro-steps measured.
pub struct Accumulated {
    /// Gradients of this rank's parameters, averaged over the micro-steps.
    pub grads: GradientsParams,
    /// Mean loss of the update (the same on every rank of a model replica).
    pub loss: UpdateLoss,
    /// Items (tokens or images) this replica processed.
    pub items: usize,
    /// Time blocked waiting for other pipeline stages (zero without a pipeline).
    pub waited: Duration,
    /// Gradient averaging done during backward (zero unless overlapped).
    pub sync: SyncTimes,
}

/// The forward and backward passes of training and evaluation.
pub trait Passes {
    /// The `gradient_accumulation_steps` micro-steps of update `update`: batches from
    /// `prefetch`, `micro` counts micro-steps (dropout masks are a function of it); the
    /// gradients are those of the loss times `loss_scale`.
    fn train(
        &self,
        model: &mut OnnxModel,
        prefetch: &Prefetcher,
        micro: &mut usize,
        update: usize,
        loss_scale: f64,
    ) -> Result<Accumulated>;
    /// An evaluation batch's loss and correct predictions, on the rank that computes them
    /// (`None` on the others; the evaluation sums over ranks).
    fn eval(&self, model: &OnnxModel, batch: &Batch) -> Result<Option<(f32, usize)>>;
}

/// One micro-step as [`accumulation_loop`] hands it to a pass.
pub struct MicroStep<'a> {
    /// Whether it is the update's last (`ModelUpdateStep`: gradients may be averaged during
    /// its backward; DDP's `no_sync` before it).
    pub last: bool,
    /// Its batch.
    pub batch: &'a Batch,
    /// The seed of its random streams ([`micro_step_seed`]).
    pub seed: u64,
}

/// What a micro-step measured.
pub struct MicroResult {
    /// Its mean loss.
    pub loss: LossValue,
    /// Time blocked waiting for other pipeline stages.
    pub waited: Duration,
}

/// What the micro-steps of an update measured together.
pub struct LoopTotals {
    /// Mean loss over the micro-steps.
    pub loss: UpdateLoss,
    /// Items (tokens or images) processed.
    pub items: usize,
    /// Time blocked waiting for other pipeline stages.
    pub waited: Duration,
}

impl LoopTotals {
    /// The update these micro-steps make: `grads`, with the gradient averaging `sync`
    /// did during backward.
    pub fn into_update(self, grads: GradientsParams, sync: SyncTimes) -> Accumulated {
        Accumulated {
            grads,
            loss: self.loss,
            items: self.items,
            waited: self.waited,
            sync,
        }
    }
}

/// The accumulation loop every pass runs: `steps` micro-steps of update `update`, each on
/// the next batch of `prefetch` with its seed (a function of the run's `seed`, the
/// `replica` and the micro-step count `micro`, which it advances); `step` does the
/// forward and backward passes and keeps the gradients.
pub fn accumulation_loop(
    (steps, seed, replica): (usize, u64, usize),
    prefetch: &Prefetcher,
    micro: &mut usize,
    update: usize,
    mut step: impl FnMut(MicroStep) -> Result<MicroResult>,
) -> Result<LoopTotals> {
    let (mut losses, mut items, mut waited) = (Vec::with_capacity(steps), 0usize, Duration::ZERO);
    for m in 0..steps {
        let last = m + 1 == steps;
        let mode = if last {
            SessionMode::ModelUpdateStep
        } else {
            SessionMode::GradientAccumulateStep
        };
        tracing::debug!(?mode, micro_step = *micro, update, "session run");
        let batch = prefetch.next_batch()?;
        let seed = micro_step_seed(seed, replica, *micro);
        let out = step(MicroStep {
            last,
            batch: &batch,
            seed,
        })?;
        losses.push(out.loss);
        waited += out.waited;
        items += batch.items;
        *micro += 1;
    }
    Ok(LoopTotals {
        loss: UpdateLoss(losses),
        items,
        waited,
    })
}

/// The whole model on this rank: ORT's micro-steps (`GradientAccumulateStep`, then
/// `ModelUpdateStep`), each a forward and a backward.
pub struct Sequential {
    /// The rank's position among the replicas (seeds its dropout).
    pub replica: usize,
    /// The training device.
    pub device: Device,
    /// Average each parameter's gradient across this data-parallel group as soon as the
    /// last micro-step's backward has finished it ([`ReadyGrads`]).
    pub overlap: Option<DataParallel>,
    /// What the passes read from the config.
    pub settings: PassSettings,
}

impl Passes for Sequential {
    fn train(
        &self,
        model: &mut OnnxModel,
        prefetch: &Prefetcher,
        micro: &mut usize,
        update: usize,
        loss_scale: f64,
    ) -> Result<Accumulated> {
        let c = &self.settings;
        let k = c.accumulation;
        let mut acc = GradientsAccumulator::<OnnxModel>::new();
        let mut ready: Option<Arc<ReadyGrads>> = None;
        let totals = accumulation_loop((k, c.seed, self.replica), prefetch, micro, update, |s| {
            if s.last
                && let Some(ddp) = &self.overlap
            {
                ready = Some(ReadyGrads::start(ddp, model, &mut acc)?);
            }
            let hooked = ready.clone().map(|h| model.clone().with_grad_sink(h));
            let forward = hooked.as_ref().unwrap_or(model);
            let out = forward_loss(forward, s.batch, c, &self.device, Mode::Train, s.seed)?;
            let loss = LossValue::on_device(&out.loss);
            let scaled = scaled_loss(out.loss, k, loss_scale);
            acc.accumulate(model, GradientsParams::from_grads(scaled.backward(), model));
            *model = model.clone().apply_state(out.state_updates);
            Ok(MicroResult {
                loss,
                waited: Duration::ZERO,
            })
        })?;
        let mut grads = acc.grads();
        let sync = match ready {
            Some(hooks) => hooks.finish(model, &mut grads)?,
            None => SyncTimes::default(),
        };
        Ok(totals.into_update(grads, sync))
    }

    fn eval(&self, model: &OnnxModel, batch: &Batch) -> Result<Option<(f32, usize)>> {
        let c = &self.settings;
        let out = forward_loss(model, batch, c, &self.device, Mode::Eval, 0)?;
        Ok(Some((scalar(out.loss)?, out.correct.unwrap_or(0))))
    }
}

/// What a micro-step back-propagates: its loss averaged over the `accumulation` micro-steps
/// of an update and multiplied by the loss scale.
pub fn scaled_loss(loss: Tensor<1>, accumulation: usize, loss_scale: f64) -> Tensor<1> {
    let loss = if accumulation > 1 {
        loss.div_scalar(accumulation as f64)
    } else {
        loss
    };
    if loss_scale != 1.0 {
        loss.mul_scalar(loss_scale)
    } else {
        loss
    }
}
