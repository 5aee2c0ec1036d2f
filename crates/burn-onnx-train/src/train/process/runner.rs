//! [`TrainingRunner`]: ORT's `TrainingRunner::Run()` lifecycle on Burn.
//!
//! Per optimizer update: `gradient_accumulation_steps` micro-steps (fetch batch, forward,
//! loss, backward, accumulate; session mode `GradientAccumulateStep`, no optimizer step and
//! no communication), then the update strategy (replicated or a ZeRO stage) synchronises
//! the gradients across data-parallel ranks, clips them to the global norm and updates at
//! the scheduled learning rate (`ModelUpdateStep`).
//! Every `display_loss_steps` updates the loss is logged; every `evaluation_period` the test
//! set is evaluated by all ranks together (`EvaluateStep`); every `checkpoint_period` the
//! ranks write a checkpoint together (rank 0 the model, each rank its optimizer state). At
//! the end rank 0 exports `<model stem>_trained.onnx` and a throughput report `perf.json`.
//! A stop signal (SIGTERM, SIGINT, SIGUSR1) ends the run after the current update with a
//! checkpoint ([`super::preemption`]). The steps are `crate::train::trainer::Trainer`'s methods.

use std::sync::Arc;

use burn::tensor::Device;
use burn_ort_dist::Communicator;

use crate::error::{OnnxError, Result};
use crate::train::config::TrainingConfig;
use crate::train::data::Dataset;
pub use crate::train::evaluate::EvalMetrics;
pub use crate::train::report::RunSummary;
use crate::train::trainer::Trainer;

/// Runs training as configured, on one process or as one rank of a data-parallel group.
pub struct TrainingRunner {
    config: TrainingConfig,
    comm: Arc<dyn Communicator>,
    device: Device,
}

impl TrainingRunner {
    /// Validate the config against the communicator's world (an error here ends the run
    /// before its first update).
    pub fn new(
        config: TrainingConfig,
        comm: Arc<dyn Communicator>,
        device: Device,
    ) -> Result<Self> {
        config
            .validate(comm.world_size())
            .map_err(OnnxError::before_first_update)?;
        Ok(TrainingRunner {
            config,
            comm,
            device,
        })
    }

    /// The config.
    pub fn config(&self) -> &TrainingConfig {
        &self.config
    }

    /// Train on `train`, evaluating on `test`.
    pub fn run(
        &self,
        train: Arc<dyn Dataset>,
        test: Option<Arc<dyn Dataset>>,
    ) -> Result<RunSummary> {
        let c = self.config.clone();
        let (mut trainer, mut model) =
            Trainer::start(c, self.comm.clone(), &self.device, &train, test.as_deref())
                .map_err(OnnxError::before_first_update)?;
        let first = trainer.update;
        while trainer.update < trainer.total {
            model = trainer
                .train_update(model)
                .map_err(|e| match trainer.update {
                    u if u == first => e.before_first_update(),
                    _ => e,
                })?;
            if let Some(test) = test.as_ref().filter(|_| trainer.eval_due()) {
                trainer.evaluate(&model, test.as_ref())?;
            }
            if trainer.checkpoint_due() {
                trainer.checkpoint(&model)?;
            }
            trainer.stop_if_preempted(&model)?;
        }
        trainer.finish(&model)
    }
}
