//! [`Pipelined`]: the runner's passes when this rank is one rank of a pipeline, running one
//! stage or (virtual stages) several model chunks.
//!
//! Every stage of a replica reads the same batches (they share the data-parallel rank); each
//! accumulation micro-step's batch is cut into `num_pipeline_micro_batches` micro-batches
//! that go through the stage's schedule. Afterwards the gradients of parameters held by
//! several stages (a tied embedding) are summed across them, so their copies take the same
//! update and stay identical, and the last stage's loss is broadcast to the group.

use std::sync::Arc;

use burn::module::Param;
use burn::optim::GradientsParams;
use burn::tensor::{Device, TensorData};
use burn_ort_dist::{Communicator, ReduceOp};

use crate::error::{OnnxError, Result};
use crate::model::OnnxModel;
use crate::parallel::pipeline::{Partition, PipelineSchedule};
use crate::train::data::{Batch, Prefetcher};
use crate::train::passes::step::PassSettings;
use crate::train::passes::{
    Accumulated, LoopTotals, LossValue, MicroResult, Passes, UpdateLoss, accumulation_loop,
};
use crate::util::seeds::mix_seed;
use executor::StageExec;

pub mod executor;
use crate::value::{MAX_RANK, PhysTensor};

/// This rank's stage of a pipeline.
pub struct Pipelined {
    /// The partition of the whole model.
    pub partition: Arc<Partition>,
    /// The pipeline group (stage `s` runs on rank `s % ranks`).
    pub comm: Arc<dyn Communicator>,
    /// The replica (data-parallel rank) this stage belongs to.
    pub replica: usize,
    /// Schedule kind.
    pub schedule: PipelineSchedule,
    /// Micro-batches per batch.
    pub micro_batches: usize,
    /// The training device.
    pub device: Device,
    /// Each stage recomputes its forward in backward (`recompute_segments`).
    pub recompute: bool,
    /// What the passes read from the config.
    pub settings: PassSettings,
}

impl Pipelined {
    fn exec<'a>(&'a self, device: &'a Device) -> StageExec<'a> {
        StageExec {
            partition: &self.partition,
            comm: self.comm.as_ref(),
            device,
            waited: Default::default(),
            recompute: self.recompute,
            mailbox: Default::default(),
        }
    }

    /// Sum the gradients of parameters held by several stages over the group (zeros from
    /// stages without the parameter), one all-reduce for all of them.
    fn sum_shared(&self, model: &OnnxModel, grads: &mut GradientsParams) -> Result<()> {
        let shared: Vec<_> = self
            .partition
            .shared
            .iter()
            .filter(|s| s.trainable)
            .collect();
        if shared.is_empty() {
            return Ok(());
        }
        // Under ZeRO-3 every stage holds the same chunk of the parameter (one data-parallel
        // rank's), so the sum runs over chunks.
        let held = |elements: usize| match model.sharding() {
            Some(s) => elements.div_ceil(s.world),
            None => elements,
        };
        let mut flat = Vec::new();
        let mut spans = Vec::new();
        for s in &shared {
            let (name, n) = (&s.name, held(s.elements));
            let start = flat.len();
            flat.resize(start + n, 0.0);
            if let Some(g) = model
                .param_index(name)
                .and_then(|i| grads.get::<MAX_RANK>(model.params()[i].id))
            {
                let v = burn_ort_dist::collective_host_values(g).map_err(|e| {
                    OnnxError::field("pipeline", format!("gradient of '{name}': {e}"))
                })?;
                flat[start..].copy_from_slice(&v);
            }
            spans.push(start..start + n);
        }
        self.comm.all_reduce(&mut flat, ReduceOp::Sum)?;
        for (s, span) in shared.iter().zip(spans) {
            let name = &s.name;
            let Some(i) = model.param_index(name) else {
                continue;
            };
            let p: &Param<PhysTensor> = &model.params()[i];
            if !p.val().is_require_grad() {
                continue;
            }
            // The parameter's own shape: whole, or its chunk under ZeRO-3.
            let shape = p.val().dims();
            let device = p.val().inner().device();
            grads.register(
                p.id,
                PhysTensor::from_data(
                    TensorData::new(flat[span].to_vec(), shape.to_vec()),
                    &device,
                ),
            );
        }
        Ok(())
    }
}

impl Passes for Pipelined {
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
        let m = self.micro_batches;
        let exec = self.exec(&self.device);
        let scale = loss_scale / (m * k) as f64;
        let mut acc = burn::optim::GradientsAccumulator::<OnnxModel>::new();
        let totals = accumulation_loop((k, c.seed, self.replica), prefetch, micro, update, |s| {
            // Each pipeline micro-batch mixes its index into the micro-step's seed.
            let parts = s.batch.split(m)?;
            let seeds: Vec<u64> = (0..m).map(|j| mix_seed(s.seed, j as u64)).collect();
            tracing::debug!(rank = self.comm.rank(), "pipeline batch");
            let out = exec.run(model, &parts, c, self.schedule, &seeds, scale)?;
            acc.accumulate(model, out.grads);
            Ok(MicroResult {
                loss: LossValue::Read(out.loss_sum / m as f64),
                waited: out.waited,
            })
        })?;
        let mut grads = acc.grads();
        self.sum_shared(model, &mut grads)?;
        // The last stage computed the loss; every rank reports it.
        let mut loss = [totals.loss.mean()? as f32];
        let last = self.partition.rank_of(self.partition.stages.len() - 1);
        self.comm.broadcast(&mut loss, last)?;
        let totals = LoopTotals {
            loss: UpdateLoss::read(f64::from(loss[0])),
            ..totals
        };
        Ok(totals.into_update(grads, burn_ort_dist::SyncTimes::default()))
    }

    fn eval(&self, model: &OnnxModel, batch: &Batch) -> Result<Option<(f32, usize)>> {
        let c = &self.settings;
        let device = model.device();
        self.exec(&device).eval(model, batch, c)
    }
}
