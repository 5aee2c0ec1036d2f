//! One stage running its schedule over the micro-batches of a batch.
//!
//! Forward of micro-batch `j`: receive the activations from the previous stage (as leaves
//! that collect gradients), run the stage's nodes, send what crosses the next cut (the
//! last stage instead computes the loss). Backward of `j`: receive the gradients of what
//! it sent, back-propagate their vector-Jacobian product `sum(output * gradient)` through
//! Burn's autodiff (the last stage: the loss, scaled by `1 / (micro-batches x accumulation
//! steps)`), accumulate the parameters' gradients, send the received activations'
//! gradients back.
//!
//! With `recompute` (Megatron's full activation recomputation, one segment per stage) the
//! forward keeps only the stage's inputs: its outputs and their autodiff graph are dropped
//! once sent, and the backward runs the stage's forward again (the same seed, so the same
//! dropout masks; batch-norm state is updated once, by the first forward) before
//! back-propagating.

use std::cell::Cell;
use std::time::{Duration, Instant};

use burn::optim::{GradientsAccumulator, GradientsParams};
use burn::tensor::{Device, Tensor};
use burn_ort_dist::Communicator;

use crate::error::{OnnxError, Result};
use crate::model::{ForwardOutput, Mode, OnnxModel, vjp};
use crate::pipeline::Stage;
use crate::pipeline::schedule::{Pass, PipelineSchedule};
use crate::pipeline::wire::{recv_values, send_values};
use crate::train::data::Batch;
use crate::train::segmented::track_received;
use crate::train::step::{PassSettings, loss_of_outputs, scalar};
use crate::value::{FloatValue, Value};

/// A stage of a pipeline and the group of its stages.
pub struct StageExec<'a> {
    /// This stage's plan.
    pub stage: &'a Stage,
    /// Number of stages.
    pub stages: usize,
    /// The pipeline group: rank `k` runs stage `k`.
    pub comm: &'a dyn Communicator,
    /// Where float values live.
    pub device: &'a Device,
    /// Time spent blocked receiving from the neighbouring stages (the pipeline bubble).
    pub waited: Cell<Duration>,
    /// Recompute the stage's forward in backward instead of keeping its activations.
    pub recompute: bool,
}

/// What a forward pass leaves for its backward.
enum InFlight {
    /// The forward's autodiff graph, kept.
    Kept(Tracked),
    /// Only the stage's inputs and the seed, to run the forward again in backward.
    Replay {
        inputs: Vec<(String, Value)>,
        seed: u64,
    },
}

/// A forward pass with its autodiff graph.
struct Tracked {
    /// Received float activations (gradient leaves), by position in `receives`.
    received: Vec<FloatValue>,
    /// What was sent on, or the scaled loss on the last stage.
    sent: Vec<Value>,
    loss: Option<Tensor<1>>,
}

/// The gradients a stage accumulated over one batch, and the batch loss on the last stage.
pub struct StageResult {
    /// Accumulated parameter gradients (already scaled).
    pub grads: GradientsParams,
    /// Sum of the micro-batch losses (last stage; 0 elsewhere).
    pub loss_sum: f64,
    /// Time spent blocked receiving from the neighbouring stages.
    pub waited: Duration,
}

impl StageExec<'_> {
    fn first(&self) -> bool {
        self.stage.index == 0
    }

    fn last(&self) -> bool {
        self.stage.index + 1 == self.stages
    }

    /// Receive `count` values from stage `src`, counting the time blocked.
    fn recv(&self, src: usize, count: usize) -> Result<Vec<Value>> {
        let started = Instant::now();
        let values = recv_values(self.comm, src, count, self.device);
        self.waited.set(self.waited.get() + started.elapsed());
        values
    }

    /// Run `schedule` over `micro` (the micro-batches) on `model` (this stage). `seeds[j]`
    /// drives micro-batch `j`'s dropout; `scale` multiplies the loss before backward.
    pub fn run(
        &self,
        model: &mut OnnxModel,
        micro: &[Batch],
        c: &PassSettings,
        schedule: PipelineSchedule,
        seeds: &[u64],
        scale: f64,
    ) -> Result<StageResult> {
        let mut flights: Vec<Option<InFlight>> = (0..micro.len()).map(|_| None).collect();
        let mut acc = GradientsAccumulator::<OnnxModel>::new();
        let mut loss_sum = 0.0;
        for pass in schedule.passes(self.stages, self.stage.index, micro.len()) {
            match pass {
                Pass::Forward(j) => {
                    let (flight, loss) = self.forward(model, &micro[j], c, seeds[j], scale)?;
                    loss_sum += loss;
                    flights[j] = Some(flight);
                }
                Pass::Backward(j) => {
                    let flight = flights[j].take().ok_or_else(|| {
                        OnnxError::field(
                            "pipeline",
                            format!("backward of micro-batch {j} before its forward"),
                        )
                    })?;
                    let tracked = match flight {
                        InFlight::Kept(t) => t,
                        InFlight::Replay { inputs, seed } => {
                            self.replay(model, inputs, &micro[j], c, seed, scale)?
                        }
                    };
                    let grads = self.backward(model, tracked)?;
                    acc.accumulate(model, grads);
                }
            }
        }
        Ok(StageResult {
            grads: acc.grads(),
            loss_sum,
            waited: self.waited.take(),
        })
    }

    /// Evaluation forward of `batch` through this stage: the last stage returns the loss
    /// and correct predictions.
    pub fn eval(
        &self,
        model: &OnnxModel,
        batch: &Batch,
        c: &PassSettings,
    ) -> Result<Option<(f32, usize)>> {
        let (inputs, _) = self.inputs(batch, c, false)?;
        let out = model.forward_with(inputs, Mode::Eval, 0, c.precision.autocast())?;
        if self.last() {
            let step = loss_of_outputs(out, batch, c, self.device, Mode::Eval)?;
            return Ok(Some((scalar(step.loss), step.correct.unwrap_or(0))));
        }
        let sent: Vec<&Value> = out.outputs.iter().map(|(_, v)| v).collect();
        send_values(self.comm, self.stage.index + 1, &sent)?;
        Ok(None)
    }

    /// The stage's inputs for `batch`: graph inputs from the batch, activations from the
    /// previous stage (as gradient leaves when `track`, returned apart too).
    fn inputs(
        &self,
        batch: &Batch,
        c: &PassSettings,
        track: bool,
    ) -> Result<(Vec<(String, Value)>, Vec<FloatValue>)> {
        let mut inputs = Vec::new();
        for name in &self.stage.graph_inputs {
            if name != &c.input_name {
                return Err(OnnxError::field(
                    "config.model.input_name",
                    format!(
                        "stage {} reads graph input '{name}', but batches feed only '{}'",
                        self.stage.index, c.input_name
                    ),
                ));
            }
            inputs.push((
                name.clone(),
                Value::from_host(&batch.input, self.device)
                    .map_err(|e| OnnxError::field("batch", e.0))?,
            ));
        }
        let mut received = Vec::new();
        if !self.first() {
            let mut values = self.recv(self.stage.index - 1, self.stage.receives.len())?;
            if track {
                (values, received) = vjp::track(values);
            }
            inputs.extend(self.stage.receives.iter().cloned().zip(values));
        }
        Ok((inputs, received))
    }

    fn forward(
        &self,
        model: &mut OnnxModel,
        batch: &Batch,
        c: &PassSettings,
        seed: u64,
        scale: f64,
    ) -> Result<(InFlight, f64)> {
        let (inputs, received) = self.inputs(batch, c, !self.recompute)?;
        let replay = self.recompute.then(|| inputs.clone());
        let out = if self.recompute {
            // No tape: the backward makes its own from the kept inputs.
            model
                .untracked()
                .forward_with(inputs, Mode::Train, seed, c.precision.autocast())?
        } else {
            model.forward_with(inputs, Mode::Train, seed, c.precision.autocast())?
        };
        let state = out.state_updates.clone();
        let (tracked, loss) = self.finish_forward(out, received, batch, c, scale, true)?;
        *model = model.clone().apply_state(state);
        let flight = match replay {
            Some(inputs) => InFlight::Replay { inputs, seed },
            None => InFlight::Kept(tracked),
        };
        Ok((flight, loss))
    }

    /// The forward of a recomputing stage run again for its backward: the kept inputs with
    /// the received activations as fresh gradient leaves; nothing is sent.
    fn replay(
        &self,
        model: &OnnxModel,
        inputs: Vec<(String, Value)>,
        batch: &Batch,
        c: &PassSettings,
        seed: u64,
        scale: f64,
    ) -> Result<Tracked> {
        let (inputs, received) = track_received(inputs, self.stage.graph_inputs.len());
        let out = model.forward_with(inputs, Mode::Train, seed, c.precision.autocast())?;
        Ok(self
            .finish_forward(out, received, batch, c, scale, false)?
            .0)
    }

    /// The loss (last stage) or the outputs, sent on to the next stage when `send`.
    fn finish_forward(
        &self,
        out: ForwardOutput,
        received: Vec<FloatValue>,
        batch: &Batch,
        c: &PassSettings,
        scale: f64,
        send: bool,
    ) -> Result<(Tracked, f64)> {
        if self.last() {
            let step = loss_of_outputs(out, batch, c, self.device, Mode::Train)?;
            let loss = f64::from(scalar(step.loss.clone()));
            let tracked = Tracked {
                received,
                sent: Vec::new(),
                loss: Some(step.loss.mul_scalar(scale)),
            };
            return Ok((tracked, loss));
        }
        let sent: Vec<Value> = out.outputs.into_iter().map(|(_, v)| v).collect();
        if send {
            send_values(
                self.comm,
                self.stage.index + 1,
                &sent.iter().collect::<Vec<_>>(),
            )?;
        }
        let tracked = Tracked {
            received,
            sent,
            loss: None,
        };
        Ok((tracked, 0.0))
    }

    fn backward(&self, model: &OnnxModel, flight: Tracked) -> Result<GradientsParams> {
        let surrogate = match flight.loss {
            Some(loss) => Some(loss),
            None => {
                let outputs = vjp::floats(&flight.sent);
                let grads = self.recv(self.stage.index + 1, outputs.len())?;
                let grads = grads.into_iter().map(|g| match g {
                    Value::Float(g) => Ok(g),
                    _ => Err(OnnxError::field(
                        "pipeline",
                        "a gradient arrived as a non-float value",
                    )),
                });
                vjp::surrogate(&outputs, grads.collect::<Result<_>>()?)
            }
        };
        // Untracked surrogates (outputs that depend on no parameter or received value)
        // back-propagate to nothing.
        let grads = surrogate.map(|s| s.backward());
        if !self.first() {
            let back: Vec<Value> = vjp::leaf_grads(&flight.received, grads.as_ref())
                .into_iter()
                .map(Value::Float)
                .collect();
            send_values(
                self.comm,
                self.stage.index - 1,
                &back.iter().collect::<Vec<_>>(),
            )?;
        }
        Ok(match grads {
            Some(g) => GradientsParams::from_grads(g, model),
            None => GradientsParams::new(),
        })
    }
}
