//! One pipeline rank running its schedule over the micro-batches of a batch, through its
//! stage (or, with virtual stages, its model chunks: one stage each).
//!
//! Forward of micro-batch `j` through stage `s`: receive the activations from stage `s - 1`
//! (as leaves that collect gradients), run the stage's nodes, send what crosses the next
//! cut to stage `s + 1` (the last stage instead computes the loss). Backward: receive the
//! gradients of what it sent, back-propagate their vector-Jacobian product
//! `sum(output * gradient)` through Burn's autodiff (the last stage: the loss, scaled by
//! `1 / (micro-batches x accumulation steps)`), accumulate the parameters' gradients, send
//! the received activations' gradients back. Every message is tagged with its flow, stage
//! and micro-batch, and received through a [`Mailbox`].
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
use crate::parallel::pipeline::schedule::{Pass, PipelineSchedule, Shape};
use crate::parallel::pipeline::wire::{Flow, Mailbox, Tag, send_values};
use crate::parallel::pipeline::{Partition, Stage};
use crate::train::data::Batch;
use crate::train::passes::LossValue;
use crate::train::passes::segmented::track_received;
use crate::train::passes::step::{PassSettings, loss_of_outputs, scalar};
use crate::value::{FloatValue, PhysTensor, Value};

/// A rank of a pipeline: its stages and the group of its ranks.
pub struct StageExec<'a> {
    /// The stages and the ranks they run on ([`Partition::rank_of`]).
    pub partition: &'a Partition,
    /// The pipeline group (this rank runs [`Partition::stages_of`] its rank).
    pub comm: &'a dyn Communicator,
    /// Where float values live.
    pub device: &'a Device,
    /// Time spent blocked receiving from the neighbouring stages (the pipeline bubble).
    pub waited: Cell<Duration>,
    /// Recompute the stage's forward in backward instead of keeping its activations.
    pub recompute: bool,
    /// Values that arrived before they were asked for.
    pub mailbox: Mailbox,
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

/// The gradients a rank accumulated over one batch, and the batch loss on the last stage's.
pub struct StageResult {
    /// Accumulated parameter gradients (already scaled).
    pub grads: GradientsParams,
    /// Sum of the micro-batch losses (last stage's rank; 0 elsewhere).
    pub loss_sum: f64,
    /// Time spent blocked receiving from the neighbouring stages.
    pub waited: Duration,
}

/// One micro-batch of a batch: its index, samples and dropout seed.
#[derive(Clone, Copy)]
struct Micro<'b> {
    index: usize,
    batch: &'b Batch,
    seed: u64,
}

/// What a forward pass gives: what its backward needs, the loss (last stage; 0 elsewhere)
/// and the state updates by parameter name.
struct Forwarded {
    flight: InFlight,
    loss: LossValue,
    state: Vec<(String, PhysTensor)>,
}

/// A stage and this rank's model of it for one batch.
struct Chunk<'s> {
    stage: &'s Stage,
    model: OnnxModel,
}

impl StageExec<'_> {
    fn last(&self, stage: &Stage) -> bool {
        stage.index + 1 == self.partition.stages.len()
    }

    /// Receive `count` values tagged `tag` from stage `stage`'s rank, counting the time
    /// blocked.
    fn recv(&self, stage: usize, tag: Tag, count: usize) -> Result<Vec<Value>> {
        let started = Instant::now();
        let values = self.mailbox.recv(
            self.comm,
            self.partition.rank_of(stage),
            tag,
            count,
            self.device,
        );
        self.waited.set(self.waited.get() + started.elapsed());
        values
    }

    /// Send `values` tagged `tag` to stage `tag.stage`'s rank.
    fn send(&self, tag: Tag, values: &[Value]) -> Result<()> {
        send_values(
            self.comm,
            self.partition.rank_of(tag.stage),
            tag,
            &values.iter().collect::<Vec<_>>(),
        )
    }

    /// This rank's model of each of its stages for a batch: the rank's model itself with
    /// one stage, each stage's part of it with several.
    fn chunks(&self, model: &OnnxModel) -> Result<Vec<Chunk<'_>>> {
        let stages = self.partition.stages_of(self.comm.rank());
        if let [stage] = stages[..] {
            return Ok(vec![Chunk {
                stage,
                model: model.clone(),
            }]);
        }
        stages
            .into_iter()
            .map(|stage| {
                Ok(Chunk {
                    stage,
                    model: model.clone().into_stage(stage.part())?,
                })
            })
            .collect()
    }

    /// Run `schedule` over `micro` (the micro-batches) on `model` (this rank's part).
    /// `seeds[j]` drives micro-batch `j`'s dropout; `scale` multiplies the loss before
    /// backward.
    pub fn run(
        &self,
        model: &mut OnnxModel,
        micro: &[Batch],
        c: &PassSettings,
        schedule: PipelineSchedule,
        seeds: &[u64],
        scale: f64,
    ) -> Result<StageResult> {
        let mut chunks = self.chunks(model)?;
        let mut flights: Vec<Vec<Option<InFlight>>> = chunks
            .iter()
            .map(|_| (0..micro.len()).map(|_| None).collect())
            .collect();
        let mut acc = GradientsAccumulator::<OnnxModel>::new();
        let mut state = Vec::new();
        let mut losses = Vec::new();
        let shape = Shape {
            ranks: self.partition.ranks,
            chunks: chunks.len(),
            micro: micro.len(),
        };
        for pass in schedule.passes(shape, self.comm.rank()) {
            match pass {
                Pass::Forward { chunk, micro: j } => {
                    let m = Micro {
                        index: j,
                        batch: &micro[j],
                        seed: seeds[j],
                    };
                    let f = self.forward(&mut chunks[chunk], m, c, scale)?;
                    losses.push(f.loss);
                    state.extend(f.state);
                    flights[chunk][j] = Some(f.flight);
                }
                Pass::Backward { chunk, micro: j } => {
                    let flight = flights[chunk][j].take().ok_or_else(|| {
                        OnnxError::field(
                            "pipeline",
                            format!("backward of micro-batch {j} before its forward"),
                        )
                    })?;
                    let part = &chunks[chunk];
                    let tracked = match flight {
                        InFlight::Kept(t) => t,
                        InFlight::Replay { inputs, seed } => {
                            let m = Micro {
                                index: j,
                                batch: &micro[j],
                                seed,
                            };
                            self.replay(part, m, inputs, c, scale)?
                        }
                    };
                    let grads = self.backward(part, j, tracked)?;
                    acc.accumulate(model, grads);
                }
            }
        }
        self.mailbox.check_empty()?;
        *model = model.clone().apply_named_state(state)?;
        // Read once every backward of the batch is launched.
        let loss_sum = losses.iter().map(LossValue::read).sum::<Result<f64>>()?;
        Ok(StageResult {
            grads: acc.grads(),
            loss_sum,
            waited: self.waited.take(),
        })
    }

    /// Evaluation forward of `batch` through this rank's stages: the last stage's rank
    /// returns the loss and correct predictions.
    pub fn eval(
        &self,
        model: &OnnxModel,
        batch: &Batch,
        c: &PassSettings,
    ) -> Result<Option<(f32, usize)>> {
        for chunk in self.chunks(model)? {
            let stage = chunk.stage;
            let (inputs, _) = self.inputs(stage, Flow::Eval, 0, batch, c, false)?;
            let out = chunk
                .model
                .forward_with(inputs, Mode::Eval, 0, c.precision.autocast())?;
            if self.last(stage) {
                let step = loss_of_outputs(out, batch, c, self.device, Mode::Eval)?;
                return Ok(Some((scalar(step.loss)?, step.correct.unwrap_or(0))));
            }
            let sent: Vec<Value> = out.outputs.into_iter().map(|(_, v)| v).collect();
            self.send(Self::tag(Flow::Eval, stage.index + 1, 0), &sent)?;
        }
        self.mailbox.check_empty()?;
        Ok(None)
    }

    fn tag(flow: Flow, stage: usize, micro: usize) -> Tag {
        Tag { flow, stage, micro }
    }

    /// Stage `stage`'s inputs for `batch` (micro-batch `micro`): graph inputs from the
    /// batch, activations from the previous stage (as gradient leaves when `track`,
    /// returned apart too).
    fn inputs(
        &self,
        stage: &Stage,
        flow: Flow,
        micro: usize,
        batch: &Batch,
        c: &PassSettings,
        track: bool,
    ) -> Result<(Vec<(String, Value)>, Vec<FloatValue>)> {
        let mut inputs = Vec::new();
        for name in &stage.graph_inputs {
            if name != &c.input_name {
                return Err(OnnxError::field(
                    "config.model.input_name",
                    format!(
                        "stage {} reads graph input '{name}', but batches feed only '{}'",
                        stage.index, c.input_name
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
        if stage.index > 0 {
            let tag = Self::tag(flow, stage.index, micro);
            let mut values = self.recv(stage.index - 1, tag, stage.receives.len())?;
            if track {
                (values, received) = vjp::track(values);
            }
            inputs.extend(stage.receives.iter().cloned().zip(values));
        }
        Ok((inputs, received))
    }

    /// Forward of micro-batch `m` through `chunk` (whose model takes the state updates at
    /// once).
    fn forward(
        &self,
        chunk: &mut Chunk,
        m: Micro,
        c: &PassSettings,
        scale: f64,
    ) -> Result<Forwarded> {
        let (stage, seed) = (chunk.stage, m.seed);
        let (inputs, received) = self.inputs(
            stage,
            Flow::Activation,
            m.index,
            m.batch,
            c,
            !self.recompute,
        )?;
        let replay = self.recompute.then(|| inputs.clone());
        let model = &chunk.model;
        let out = if self.recompute {
            // No tape: the backward makes its own from the kept inputs.
            model
                .untracked()
                .forward_with(inputs, Mode::Train, seed, c.precision.autocast())?
        } else {
            model.forward_with(inputs, Mode::Train, seed, c.precision.autocast())?
        };
        let updates = out.state_updates.clone();
        let state = updates
            .iter()
            .map(|(i, t)| (model.param_infos()[*i].name.clone(), t.clone()))
            .collect();
        let (tracked, loss) = self.finish_forward(stage, m, out, received, c, scale)?;
        if !self.last(stage) {
            let tag = Self::tag(Flow::Activation, stage.index + 1, m.index);
            self.send(tag, &tracked.sent)?;
        }
        chunk.model = chunk.model.clone().apply_state(updates);
        let flight = match replay {
            Some(inputs) => InFlight::Replay { inputs, seed },
            None => InFlight::Kept(tracked),
        };
        Ok(Forwarded {
            flight,
            loss,
            state,
        })
    }

    /// The forward of a recomputing stage run again for its backward: the kept inputs with
    /// the received activations as fresh gradient leaves; nothing is sent.
    fn replay(
        &self,
        chunk: &Chunk,
        m: Micro,
        inputs: Vec<(String, Value)>,
        c: &PassSettings,
        scale: f64,
    ) -> Result<Tracked> {
        let (inputs, received) = track_received(inputs, chunk.stage.graph_inputs.len());
        let out = chunk
            .model
            .forward_with(inputs, Mode::Train, m.seed, c.precision.autocast())?;
        Ok(self
            .finish_forward(chunk.stage, m, out, received, c, scale)?
            .0)
    }

    /// The scaled loss (last stage) or the outputs to send on.
    fn finish_forward(
        &self,
        stage: &Stage,
        m: Micro,
        out: ForwardOutput,
        received: Vec<FloatValue>,
        c: &PassSettings,
        scale: f64,
    ) -> Result<(Tracked, LossValue)> {
        if self.last(stage) {
            let step = loss_of_outputs(out, m.batch, c, self.device, Mode::Train)?;
            let loss = LossValue::on_device(&step.loss);
            let tracked = Tracked {
                received,
                sent: Vec::new(),
                loss: Some(step.loss.mul_scalar(scale)),
            };
            return Ok((tracked, loss));
        }
        let sent: Vec<Value> = out.outputs.into_iter().map(|(_, v)| v).collect();
        let tracked = Tracked {
            received,
            sent,
            loss: None,
        };
        Ok((tracked, LossValue::Read(0.0)))
    }

    fn backward(&self, chunk: &Chunk, micro: usize, flight: Tracked) -> Result<GradientsParams> {
        let stage = chunk.stage;
        let surrogate = match flight.loss {
            Some(loss) => Some(loss),
            None => {
                let outputs = vjp::floats(&flight.sent);
                let tag = Self::tag(Flow::Gradient, stage.index, micro);
                let grads = self.recv(stage.index + 1, tag, outputs.len())?;
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
        if stage.index > 0 {
            let back: Vec<Value> = vjp::leaf_grads(&flight.received, grads.as_ref())
                .into_iter()
                .map(Value::Float)
                .collect();
            self.send(Self::tag(Flow::Gradient, stage.index - 1, micro), &back)?;
        }
        Ok(match grads {
            Some(g) => GradientsParams::from_grads(g, &chunk.model),
            None => GradientsParams::new(),
        })
    }
}
