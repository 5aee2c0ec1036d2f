//! Activation recomputation (ORT's gradient checkpointing, PyTorch's
//! `checkpoint_sequential`): the graph is cut into `recompute_segments` consecutive
//! segments, balanced as pipeline stages are. The forward pass runs without an autodiff
//! tape and keeps only what crosses the cuts; backward goes from the last segment to the
//! first, re-running each segment's forward with a tape just before its vector-Jacobian
//! product. Peak activation memory drops to one segment's tape plus the cut values, for
//! one extra forward of all but the last segment. Gradients equal the plain pass's.

use std::collections::HashMap;
use std::sync::Arc;

use burn::optim::{GradientsAccumulator, GradientsParams};
use burn::tensor::Device;

use super::config::TrainingConfig;
use super::data::{Batch, Prefetcher};
use super::passes::{Accumulated, Passes, Sequential, scaled_loss};
use super::step::{loss_of_outputs, scalar};
use crate::error::{OnnxError, Result};
use crate::model::{Mode, OnnxModel, mix_seed, vjp};
use crate::pipeline::{Partition, Stage};
use crate::value::{FloatValue, Value};

/// The whole model on this rank, trained segment by segment.
pub struct Recomputed {
    /// The segments (a partition of the whole graph).
    pub partition: Arc<Partition>,
    /// The rank's position among the replicas (seeds its dropout).
    pub replica: usize,
    /// The training device.
    pub device: Device,
}

impl Recomputed {
    /// The inputs of `stage` for `batch`: the graph inputs it reads and the values that
    /// cross into it (`env`, by name).
    fn inputs(
        &self,
        stage: &Stage,
        batch: &Batch,
        c: &TrainingConfig,
        env: &HashMap<String, Value>,
    ) -> Result<Vec<(String, Value)>> {
        let mut inputs = Vec::new();
        for name in &stage.graph_inputs {
            if name != &c.input_name {
                return Err(OnnxError::field(
                    "config.input_name",
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
                    "recompute",
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

    /// Gradients of one batch's loss (scaled as [`scaled_loss`] does), and the loss.
    fn batch(
        &self,
        c: &TrainingConfig,
        model: &mut OnnxModel,
        batch: &Batch,
        seed: u64,
        loss_scale: f64,
    ) -> Result<(GradientsParams, f64)> {
        let accumulation = c.gradient_accumulation_steps;
        let stages = &self.partition.stages;
        let segments = stages
            .iter()
            .map(|s| model.clone().into_stage(s))
            .collect::<Result<Vec<_>>>()?;
        let autocast = c.precision.autocast();
        // Forward without a tape, keeping the values that cross each cut.
        let mut env: HashMap<String, Value> = HashMap::new();
        let mut state = Vec::new();
        for (stage, seg) in stages.iter().zip(&segments).take(stages.len() - 1) {
            let out = seg.untracked().forward_with(
                self.inputs(stage, batch, c, &env)?,
                Mode::Train,
                seed,
                autocast,
            )?;
            state.extend(named_state(seg, out.state_updates.clone()));
            env.extend(out.outputs);
        }
        // The last segment with its tape, then every earlier one re-run with its tape, each
        // backward seeded with the gradients of what it sent on.
        let (last_stage, last) = (&stages[stages.len() - 1], &segments[stages.len() - 1]);
        let (inputs, leaves) = track_received(
            self.inputs(last_stage, batch, c, &env)?,
            last_stage.graph_inputs.len(),
        );
        let out = last.forward_with(inputs, Mode::Train, seed, autocast)?;
        state.extend(named_state(last, out.state_updates.clone()));
        let step = loss_of_outputs(out, batch, c, &self.device, Mode::Train)?;
        let loss = f64::from(scalar(step.loss.clone()));
        let grads = scaled_loss(step.loss, accumulation, loss_scale).backward();
        let mut sent_grads = vjp::leaf_grads(&leaves, Some(&grads));
        let mut acc = GradientsAccumulator::<OnnxModel>::new();
        acc.accumulate(model, GradientsParams::from_grads(grads, last));
        for (stage, seg) in stages.iter().zip(&segments).rev().skip(1) {
            let (inputs, leaves) = track_received(
                self.inputs(stage, batch, c, &env)?,
                stage.graph_inputs.len(),
            );
            let out = seg.forward_with(inputs, Mode::Train, seed, autocast)?;
            let sent: Vec<Value> = out.outputs.into_iter().map(|(_, v)| v).collect();
            let grads = vjp::surrogate(&vjp::floats(&sent), sent_grads).map(|s| s.backward());
            sent_grads = vjp::leaf_grads(&leaves, grads.as_ref());
            if let Some(g) = grads {
                acc.accumulate(model, GradientsParams::from_grads(g, seg));
            }
        }
        *model = model.clone().apply_named_state(state)?;
        Ok((acc.grads(), loss))
    }
}

/// `inputs` with the received values (after the first `graph_inputs`) made gradient leaves.
fn track_received(
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

impl Passes for Recomputed {
    fn train(
        &self,
        c: &TrainingConfig,
        model: &mut OnnxModel,
        prefetch: &Prefetcher,
        micro: &mut usize,
        update: usize,
        loss_scale: f64,
    ) -> Result<Accumulated> {
        let k = c.gradient_accumulation_steps;
        let mut acc = GradientsAccumulator::<OnnxModel>::new();
        let (mut loss_sum, mut items) = (0.0f64, 0usize);
        for _ in 0..k {
            tracing::debug!(micro_step = *micro, update, "recomputed step");
            let batch = prefetch.next_batch()?;
            let seed = mix_seed(mix_seed(c.seed, self.replica as u64), *micro as u64);
            let (grads, loss) = self.batch(c, model, &batch, seed, loss_scale)?;
            acc.accumulate(model, grads);
            loss_sum += loss;
            items += batch.items;
            *micro += 1;
        }
        Ok(Accumulated {
            grads: acc.grads(),
            loss: loss_sum / k as f64,
            items,
            waited: std::time::Duration::ZERO,
        })
    }

    fn eval(
        &self,
        c: &TrainingConfig,
        model: &OnnxModel,
        batch: &Batch,
    ) -> Result<Option<(f32, usize)>> {
        Sequential {
            replica: self.replica,
            device: self.device.clone(),
        }
        .eval(c, model, batch)
    }
}
