//! The updates of `train.cuda_graph` (`crate::train::update_graph`): the one before the
//! recording (seeded, the allocator prepared), the recorded one, and its replays, as
//! [`Trainer`] methods beside the usual update (`Trainer::plain_update`).

use std::time::Instant;

use burn_ort_dist::GradNorm;

use super::{Done, Trainer};
use crate::error::{OnnxError, Result};
use crate::kernels::device_graph;
use crate::model::OnnxModel;
use crate::train::passes::UpdateLoss;
use crate::train::report::perf::DeviceMeter;
use crate::train::update_graph::{Recorded, UpdateGraph, seed_batches, snapshot};

impl Trainer {
    /// Turn the recorded update off (`why`), for this run.
    fn graph_off(&mut self, why: &str) {
        if let Some(graph) = self.graph.as_mut()
            && graph.turn_off(why)
        {
            // Prepared for a recording that will not come: give the allocator back.
            device_graph::abandon(&self.device);
        }
    }

    /// The update before the recording: as usual, its batches seeded and the allocator
    /// prepared, so that the recorded one finds what it takes; off when its passes
    /// still upload values of their own.
    pub(super) fn warm_update(&mut self, model: OnnxModel) -> Result<OnnxModel> {
        let batches = self
            .prefetch
            .peek(self.c.train.gradient_accumulation_steps)?;
        let uploads = model.uploads().clone();
        if let Err(why) = seed_batches(&uploads, &batches, &self.device) {
            self.graph_off(&why);
            return self.plain_update(model);
        }
        if let Err(why) = device_graph::prepare(&self.device) {
            self.graph_off(&why);
            return self.plain_update(model);
        }
        if let Some(graph) = self.graph.as_mut() {
            graph.set_prepared(true);
        }
        let made = uploads.made_so_far();
        let model = self.plain_update(model)?;
        let more = uploads.made_so_far() - made;
        if more > 0 {
            self.graph_off(&format!(
                "the passes upload {more} value(s) of their own each update"
            ));
        }
        Ok(model)
    }

    /// The update recorded: its batches seeded and the optimizer's tables written first
    /// (nothing may cross from the host inside the recording), its launches recorded,
    /// then replayed once (a recording runs nothing), and kept for the next updates
    /// where every parameter kept its device place.
    pub(super) fn recorded_update(&mut self, model: OnnxModel) -> Result<OnnxModel> {
        let k = self.c.train.gradient_accumulation_steps;
        let batches = self.prefetch.peek(k)?;
        let uploads = model.uploads().clone();
        let shape = match seed_batches(&uploads, &batches, &self.device) {
            Ok(shape) => shape,
            Err(why) => {
                self.graph_off(&why);
                return self.plain_update(model);
            }
        };
        if !uploads.seeds_distinct() {
            // A batch equal to another copy (a constant): record a later one.
            return self.plain_update(model);
        }
        if !self.strategy.write_next_step(self.schedule.lr(self.update)) {
            self.graph_off("the update is not the fused optimizer's on this device");
            return self.plain_update(model);
        }
        let places = param_places(&model);
        model.take_prefetch_times();
        let device_meter = DeviceMeter::start(&self.device);
        let started = Instant::now();
        if let Err(why) = device_graph::start(&self.device) {
            self.graph_off(&why);
            return self.plain_update(model);
        }
        let computed = self.passes_and_step(model);
        let graph = device_graph::stop(&self.device).map_err(recording_failed)?;
        if let Some(g) = self.graph.as_mut() {
            g.set_prepared(false);
        }
        let (model, mut done) = computed?;
        // Safety: the recording's buffers are the model's, the optimizer's, the uploads'
        // and the outputs in `done`, all held here; one stream.
        unsafe { graph.replay() }.map_err(recording_failed)?;
        let losses = done.loss.on_device();
        let norm = match &done.report.grad_norm {
            GradNorm::OnDevice(t) => Some(t.clone()),
            GradNorm::Read(_) => None,
        };
        done.loss = done.loss.snapshot(snapshot);
        done.report.grad_norm = snapshot_norm(&done.report.grad_norm);
        match (param_places(&model) == places, losses) {
            (true, Some(losses)) => {
                let recorded = Recorded {
                    graph,
                    shape,
                    losses,
                    norm,
                    _held: uploads.held(),
                };
                if let Some(g) = self.graph.as_mut() {
                    g.keep(recorded);
                }
            }
            (false, _) => self.graph_off("a parameter left its device buffer in the update"),
            (_, None) => self.graph_off("a loss was read inside the update"),
        }
        self.finish_update(&model, done, started, device_meter)?;
        Ok(model)
    }

    /// A replay of the recorded update: the batches' values and the optimizer's tables
    /// written over the buffers it reads, one replay, the losses and the norm copied out.
    pub(super) fn replayed_update(&mut self, model: OnnxModel) -> Result<OnnxModel> {
        let k = self.c.train.gradient_accumulation_steps;
        let batches = self.prefetch.peek(k)?;
        let uploads = model.uploads().clone();
        let (lr, display) = (self.schedule.lr(self.update), self.displays_next());
        let recorded = self.graph.as_ref().and_then(UpdateGraph::recorded);
        let shape = recorded.map(|r| r.shape.clone());
        match seed_batches(&uploads, &batches, &self.device) {
            Ok(s) if Some(&s) == shape.as_ref() => {}
            Ok(s) => {
                self.graph_off(&format!("a batch of shape {s:?}, not {shape:?}"));
                return self.plain_update(model);
            }
            Err(why) => {
                self.graph_off(&why);
                return self.plain_update(model);
            }
        }
        if !self.strategy.write_next_step(lr) {
            self.graph_off("the optimizer no longer writes its tables");
            return self.plain_update(model);
        }
        let device_meter = DeviceMeter::start(&self.device);
        let started = Instant::now();
        for _ in 0..k {
            self.prefetch.next_batch()?;
        }
        self.micro += k;
        let recorded = self
            .graph
            .as_ref()
            .and_then(UpdateGraph::recorded)
            .expect("replayed only once recorded");
        // Safety: the recording's buffers are held by the model, the optimizer, the
        // uploads and `recorded`; one stream.
        unsafe { recorded.graph.replay() }.map_err(recording_failed)?;
        self.strategy.count_replayed_step();
        self.out.perf.replayed += 1;
        let losses = recorded.losses.iter().map(snapshot).collect();
        let grad_norm = match &recorded.norm {
            Some(t) => GradNorm::OnDevice(snapshot(t)),
            None => GradNorm::Read(f32::NAN),
        };
        let done = Done {
            loss: UpdateLoss::on_device_values(losses),
            items: batches.iter().map(|b| b.items).sum(),
            waited: std::time::Duration::ZERO,
            overlapped: Default::default(),
            lr,
            report: burn_ort_dist::UpdateReport {
                grad_norm,
                tensor_grad_norms: Vec::new(),
            },
            sync_time: std::time::Duration::ZERO,
            display,
        };
        self.finish_update(&model, done, started, device_meter)?;
        Ok(model)
    }
}

/// Where each parameter of `model` lives on the device (`kernels::device_place`), in order.
fn param_places(model: &OnnxModel) -> Vec<Option<(usize, u64)>> {
    struct Places(Vec<Option<(usize, u64)>>);
    impl burn::module::ModuleVisitor for Places {
        fn visit_float<const D: usize>(&mut self, p: &burn::module::Param<burn::Tensor<D>>) {
            self.0.push(crate::kernels::device_place(&p.val()));
        }
    }
    let mut places = Places(Vec::new());
    burn::module::Module::visit(model, &mut places);
    places.0
}

/// A copy of `norm` that the next replay does not write over.
fn snapshot_norm(norm: &GradNorm) -> GradNorm {
    match norm {
        GradNorm::OnDevice(t) => GradNorm::OnDevice(snapshot(t)),
        GradNorm::Read(v) => GradNorm::Read(*v),
    }
}

/// The error of a recorded update that could not be recorded or replayed.
fn recording_failed(e: String) -> OnnxError {
    OnnxError::field(
        "train.cuda_graph",
        format!("the recorded update failed ({e}); train without it (train.cuda_graph = false)"),
    )
}
