//! Backward segment by segment ([`Segmented`]): the graph is cut into consecutive segments,
//! balanced as pipeline stages are, and backward runs from the last segment to the first,
//! each seeded with the gradients of what it sent on (a vector-Jacobian product). Two uses,
//! alone or together; gradients equal the plain pass's either way.
//!
//! - Activation recomputation (ORT's gradient checkpointing, PyTorch's
//!   `checkpoint_sequential`): the forward pass runs without an autodiff tape and keeps only
//!   what crosses the cuts, and each segment's forward is re-run with its tape just before
//!   its backward. Peak activation memory drops to one segment's tape plus the cut values,
//!   for one extra forward of all but the last segment.
//! - Data-parallel averaging hidden behind backward (PyTorch DDP's overlap): in the last
//!   micro-step of an update, a parameter's gradient is final once the first segment that
//!   reads it is done, and is averaged on a communication thread
//!   ([`burn_ort_dist::OverlappedSync`]) while the earlier segments' backward runs.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use burn::module::ParamId;
use burn::optim::{GradientsAccumulator, GradientsParams};
use burn::tensor::Device;
use burn_ort_dist::{DataParallel, OverlappedSync, SyncTimes};

use super::step::{PassSettings, loss_of_outputs};
use super::{
    Accumulated, LossValue, MicroResult, Passes, Sequential, accumulation_loop, scaled_loss,
};
use crate::error::{OnnxError, Result};
use crate::model::{Mode, OnnxModel, vjp};
use crate::parallel::pipeline::{Partition, Stage};
use crate::train::data::{Batch, Prefetcher};
use crate::value::{FloatValue, Value};

/// The whole model on this rank, trained segment by segment.
pub struct Segmented {
    /// The segments (a partition of the whole graph).
    pub partition: Arc<Partition>,
    /// The rank's position among the replicas (seeds its dropout).
    pub replica: usize,
    /// The training device.
    pub device: Device,
    /// Forward without tapes, each segment's forward re-run before its backward.
    pub recompute: bool,
    /// Average finished gradients across this data-parallel group during backward.
    pub overlap: Option<DataParallel>,
    /// What the passes read from the config.
    pub settings: PassSettings,
}

/// Where a segment's gradients go when its backward is done.
struct Sink<'a> {
    /// The gradients so far (earlier micro-steps, later segments).
    total: GradientsParams,
    /// With overlap: the averaging in flight, and the segment each parameter is first read
    /// in (its gradient is final once that segment is done).
    overlap: Option<(OverlappedSync, &'a HashMap<ParamId, usize>)>,
}

impl Sink<'_> {
    /// Segment `index` (`seg`, a part of `model`) produced `grads`.
    fn segment_done(
        &mut self,
        model: &OnnxModel,
        index: usize,
        seg: &OnnxModel,
        grads: GradientsParams,
    ) -> Result<()> {
        let mut acc = GradientsAccumulator::<OnnxModel>::new();
        acc.accumulate(model, std::mem::take(&mut self.total));
        acc.accumulate(model, grads);
        self.total = acc.grads();
        if let Some((sync, first)) = &mut self.overlap {
            sync.reduce(seg, &mut self.total, |id| first.get(&id) == Some(&index))?;
        }
        Ok(())
    }
}

impl Segmented {
    /// The inputs of `stage` for `batch`: the graph inputs it reads and the values that
    /// cross into it (`env`, by name).
    fn inputs(
        &self,
        stage: &Stage,
        batch: &Batch,
        c: &PassSettings,
        env: &HashMap<String, Value>,
    ) -> Result<Vec<(String, Value)>> {
        let mut inputs = Vec::new();
        for name in &stage.graph_inputs {
            if name != &c.input_name {
                return Err(OnnxError::field(
                    "config.model.input_name",
                    format!(
                        "segment {} reads graph input '{name}', but batches feed only '{}'",
                        stage.index, c.input_name
                    ),
                ));
            }
            inputs.push((
                name.clone(),
                Value::from_host(&batch.input, &self.device)
                    .map_err(|e| OnnxError::field("batch", e.0))?,
            ));
        }
        for name in &stage.receives {
            let v = env.get(name).cloned().ok_or_else(|| {
                OnnxError::field(
                    "segments",
                    format!(
                        "segment {} needs '{name}', which no earlier segment produced",
                        stage.index
                    ),
                )
            })?;
            inputs.push((name.clone(), v));
        }
        Ok(inputs)
    }

    /// Back-propagate one batch's loss (scaled as [`scaled_loss`] does) segment by segment
    /// into `sink`; returns the loss (on the device).
    fn batch(
        &self,
        c: &PassSettings,
        model: &mut OnnxModel,
        batch: &Batch,
        seed: u64,
        loss_scale: f64,
        sink: &mut Sink,
    ) -> Result<LossValue> {
        let stages = &self.partition.stages;
        let segments = stages
            .iter()
            .map(|s| model.clone().into_stage(s.part()))
            .collect::<Result<Vec<_>>>()?;
        let autocast = c.precision.autocast();
        let n = stages.len();
        // Forward, keeping the values that cross each cut, and each segment's tape unless
        // it is recomputed: (what it sent, its received leaves).
        let mut env: HashMap<String, Value> = HashMap::new();
        let mut state = Vec::new();
        let mut tapes = Vec::new();
        for (stage, seg) in stages.iter().zip(&segments).take(n - 1) {
            let inputs = self.inputs(stage, batch, c, &env)?;
            if self.recompute {
                let out = seg
                    .untracked()
                    .forward_with(inputs, Mode::Train, seed, autocast)?;
                state.extend(named_state(seg, out.state_updates));
                env.extend(out.outputs);
            } else {
                let (inputs, leaves) = track_received(inputs, stage.graph_inputs.len());
                let out = seg.forward_with(inputs, Mode::Train, seed, autocast)?;
                state.extend(named_state(seg, out.state_updates));
                let sent: Vec<Value> = out.outputs.iter().map(|(_, v)| v.clone()).collect();
                env.extend(out.outputs);
                tapes.push((sent, leaves));
            }
        }
        // The last segment with its tape, then every earlier one (its tape re-made when
        // recomputing), each backward seeded with the gradients of what it sent on.
        let (last_stage, last) = (&stages[n - 1], &segments[n - 1]);
        let (inputs, leaves) = track_received(
            self.inputs(last_stage, batch, c, &env)?,
            last_stage.graph_inputs.len(),
        );
        let out = last.forward_with(inputs, Mode::Train, seed, autocast)?;
        state.extend(named_state(last, out.state_updates.clone()));
        let step = loss_of_outputs(out, batch, c, &self.device, Mode::Train)?;
        let loss = LossValue::on_device(&step.loss);
        let grads = scaled_loss(step.loss, c.accumulation, loss_scale).backward();
        let mut sent_grads = vjp::leaf_grads(&leaves, Some(&grads));
        sink.segment_done(model, n - 1, last, GradientsParams::from_grads(grads, last))?;
        for (i, (stage, seg)) in stages.iter().zip(&segments).enumerate().rev().skip(1) {
            let (sent, leaves) = match tapes.pop() {
                Some(tape) => tape,
                None => {
                    let (inputs, leaves) = track_received(
                        self.inputs(stage, batch, c, &env)?,
                        stage.graph_inputs.len(),
                    );
                    let out = seg.forward_with(inputs, Mode::Train, seed, autocast)?;
                    (out.outputs.into_iter().map(|(_, v)| v).collect(), leaves)
                }
            };
            let grads = vjp::surrogate(&vjp::floats(&sent), sent_grads).map(|s| s.backward());
            sent_grads = vjp::leaf_grads(&leaves, grads.as_ref());
            let grads = grads.map_or_else(GradientsParams::new, |g| {
                GradientsParams::from_grads(g, seg)
            });
            sink.segment_done(model, i, seg, grads)?;
        }
        *model = model.clone().apply_named_state(state)?;
        Ok(loss)
    }

    /// The segment each trainable parameter of `model` is first read in.
    fn first_readers(&self, model: &OnnxModel) -> HashMap<ParamId, usize> {
        let mut first = HashMap::new();
        for stage in &self.partition.stages {
            for name in &stage.params {
                if let Some(i) = model.param_index(name) {
                    first.entry(model.params()[i].id).or_insert(stage.index);
                }
            }
        }
        first
    }
}

/// `inputs` with the values received from earlier segments (after the first
/// `graph_inputs`) cut from their tapes and made gradient leaves, and those leaves.
pub(crate) fn track_received(
    mut inputs: Vec<(String, Value)>,
    graph_inputs: usize,
) -> (Vec<(String, Value)>, Vec<FloatValue>) {
    let received = inputs.split_off(graph_inputs);
    let (names, values): (Vec<String>, Vec<Value>) = received.into_iter().unzip();
    let (values, leaves) = vjp::track(values);
    inputs.extend(names.into_iter().zip(values));
    (inputs, leaves)
}

/// A segment's state updates (batch-norm statistics) keyed by parameter name.
fn named_state(
    seg: &OnnxModel,
    updates: Vec<(usize, crate::value::PhysTensor)>,
) -> Vec<(String, crate::value::PhysTensor)> {
    updates
        .into_iter()
        .map(|(i, t)| (seg.param_infos()[i].name.clone(), t))
        .collect()
}

impl Passes for Segmented {
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
        let first = self.first_readers(model);
        let mut sink = Sink {
            total: GradientsParams::new(),
            overlap: None,
        };
        let totals = accumulation_loop((k, c.seed, self.replica), prefetch, micro, update, |s| {
            if s.last
                && let Some(ddp) = &self.overlap
            {
                sink.overlap = Some((ddp.overlapped()?, &first));
            }
            let loss = self.batch(c, model, s.batch, s.seed, loss_scale, &mut sink)?;
            Ok(MicroResult {
                loss,
                waited: Duration::ZERO,
            })
        })?;
        let mut grads = sink.total;
        let sync = match sink.overlap {
            Some((sync, _)) => sync.finish(model, &mut grads)?,
            None => SyncTimes::default(),
        };
        Ok(totals.into_update(grads, sync))
    }

    fn eval(&self, model: &OnnxModel, batch: &Batch) -> Result<Option<(f32, usize)>> {
        Sequential {
            replica: self.replica,
            device: self.device.clone(),
            overlap: None,
            settings: self.settings.clone(),
        }
        .eval(model, batch)
    }
}
