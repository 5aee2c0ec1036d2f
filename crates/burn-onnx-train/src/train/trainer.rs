//! One run's state between updates, and the steps of the runner's loop as one call each:
//! [`Trainer::start`] (the parallel layout applied to the model, its passes and update
//! strategy, the resume), [`Trainer::train_update`], [`Trainer::evaluate`],
//! [`Trainer::checkpoint`] and [`Trainer::finish`] (export and reports).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use burn::tensor::Device;
use burn_ort_dist::{Communicator, DataParallel, GradNorm, SyncTimes, UpdateStrategy};

use super::checkpoint::resume::resume;
use super::checkpoint::{CheckpointState, save_checkpoint};
use super::config::TrainingConfig;
use super::data::documents::training_sampler;
use super::data::{Dataset, Prefetcher};
use super::evaluate::evaluate;
use super::layout::memory_counts::counted_memory;
use super::layout::parallel_plan::{ParallelPlan, Parallelized};
use super::passes::{Passes, UpdateLoss};
use super::precision::LossScaler;
use super::preflight::{check_fits_device, check_model_and_data};
use super::process::preemption::{agreed_stop, install};
use super::report::overview::RunOverview;
use super::report::perf::{DeviceMeter, MemoryReport};
use super::report::{Reporter, RunSummary, UpdateReport};
use super::schedule::LrSchedule;
use super::update_graph::{Next, UpdateGraph};
use crate::error::{OnnxError, Result};
use crate::model::OnnxModel;
use crate::model::profile::NodeProfiler;
use crate::util::atomic_file::write_atomic;

mod recorded;

/// A run between updates: the layout and this rank's passes and update strategy, the
/// counters, the reporters.
pub(super) struct Trainer {
    c: TrainingConfig,
    comm: Arc<dyn Communicator>,
    /// Where this rank computes.
    device: Device,
    plan: ParallelPlan,
    passes: Box<dyn Passes>,
    strategy: Box<dyn UpdateStrategy<OnnxModel>>,
    scaler: LossScaler,
    schedule: LrSchedule,
    prefetch: Prefetcher,
    out: Reporter,
    /// The node times of the model's passes (`logging.profile`).
    profiler: Option<Arc<NodeProfiler>>,
    /// Updates done (counting those of the run resumed from).
    pub update: usize,
    /// The last update of the run.
    pub total: usize,
    start_step: usize,
    micro: usize,
    /// Updates whose loss and gradient norm may still be on the device: read and reported
    /// together at the next displayed update (every `display_loss_steps`), evaluation,
    /// checkpoint or stop, so that the updates between never wait for the device.
    unreported: Vec<Unreported>,
    /// The recorded update its updates replay (`train.cuda_graph`).
    graph: Option<UpdateGraph>,
}

/// What an update's passes and step leave for its report.
struct Done {
    loss: UpdateLoss,
    items: usize,
    waited: std::time::Duration,
    /// Gradient averaging during backward, and the prefetching of parameters.
    overlapped: [SyncTimes; 2],
    lr: f64,
    /// The strategy's report of its step.
    report: burn_ort_dist::UpdateReport,
    /// The step's time (synchronisation included).
    sync_time: std::time::Duration,
    display: bool,
}

/// An update's figures before they are read from the device.
struct Unreported {
    step: usize,
    loss: UpdateLoss,
    lr: f64,
    grad_norm: GradNorm,
    loss_scale: Option<f64>,
    display: bool,
}

impl Trainer {
    /// Load the model, apply the parallel layout, build the passes and the update strategy,
    /// resume from the newest checkpoint: the trainer and this rank's model, broadcast from
    /// the first replica and sharded as the layout says.
    pub fn start(
        mut c: TrainingConfig,
        comm: Arc<dyn Communicator>,
        device: &Device,
        train: &Arc<dyn Dataset>,
        test: Option<&dyn Dataset>,
    ) -> Result<(Self, OnnxModel)> {
        install();
        let mut plan = ParallelPlan::new(&c, comm.as_ref())?;
        let sampler = training_sampler(
            &c.data,
            c.train.seed,
            train.as_ref(),
            plan.groups.dp_rank,
            plan.topology.dp,
        );
        c.train.resolve_epochs(sampler.batches_per_epoch())?;
        sampler.batch_indices(0)?;
        if comm.rank() == 0 {
            write_effective_config(&c)?;
        }
        let model = c.model.load_for_training(device)?;
        check_model_and_data(&c, &model, train.as_ref(), test)?;
        check_fits_device(&c, &model, device)?;
        if comm.rank() == 0 {
            tracing::info!("training\n{}", RunOverview::new(&c, &model, train.as_ref()));
        }
        let Parallelized {
            model,
            passes,
            mut strategy,
        } = plan.parallelize(&c, model, train.as_ref(), device)?;
        if comm.rank() == 0 {
            let m = counted_memory(&c, &model);
            tracing::info!(
                parameters_mib = m.parameter_bytes >> 20,
                gradients_mib = m.gradient_bytes >> 20,
                optimizer_state_mib = m.optimizer_state_bytes >> 20,
                on_disk_mib = m.on_disk_bytes >> 20,
                "memory pre-flight (rank 0, before its working set: `onnx-train plan` measures that)"
            );
        }
        let mut scaler = LossScaler::new(
            c.precision.dtype,
            c.precision.loss_scale,
            c.precision.loss_scale_growth_interval,
        );
        DataParallel::new(comm.clone()).check_consistent(c.to_toml()?.as_bytes())?;
        // Sharded before the resume, which then sets each value as this rank's chunk.
        let model = plan.replicate_or_shard(model)?;
        let (model, update, micro) = resume(
            &c,
            comm.as_ref(),
            &plan,
            model,
            strategy.as_mut(),
            &mut scaler,
        )?;
        let profiler = c.logging.profile.then(Arc::<NodeProfiler>::default);
        let model = match &profiler {
            Some(p) => model.with_profiler(p.clone()),
            None => model,
        };
        let total = c.train.num_updates();
        let out = Reporter::open(
            &c.logging,
            &c.checkpoint,
            &plan,
            comm.rank(),
            train.unit(),
            (update, total),
        )?;
        let loss_scaled = scaler.state().is_some() || scaler.scale() != 1.0;
        let world = comm.world_size();
        let graph = UpdateGraph::for_run(&c, world, device, &model, loss_scaled);
        let trainer = Trainer {
            graph,
            schedule: LrSchedule::new(&c.lr, total),
            prefetch: Prefetcher::start(
                train.clone(),
                sampler,
                micro,
                4,
                c.train.gradient_accumulation_steps,
            ),
            profiler,
            out,
            comm,
            device: device.clone(),
            plan,
            passes,
            strategy,
            scaler,
            update,
            total,
            start_step: update,
            micro,
            unreported: Vec::new(),
            c,
        };
        Ok((trainer, model))
    }

    /// One optimizer update: the micro-steps' forward and backward passes, the strategy's
    /// update at the scheduled learning rate, then the reports (loss, rate, norms); or the
    /// replay of a recorded update (`train.cuda_graph`).
    pub fn train_update(&mut self, model: OnnxModel) -> Result<OnnxModel> {
        match self.graph.as_ref().map_or(Next::Plain, UpdateGraph::next) {
            Next::Plain => self.plain_update(model),
            Next::Warm => self.warm_update(model),
            Next::Record => self.recorded_update(model),
            Next::Replay => self.replayed_update(model),
        }
    }

    /// An update as usual, timed and reported.
    fn plain_update(&mut self, model: OnnxModel) -> Result<OnnxModel> {
        // Gathers prefetched outside the update (an evaluation's) are not its own.
        model.take_prefetch_times();
        let device_meter = DeviceMeter::start(&self.device);
        let started = Instant::now();
        let (model, done) = self.passes_and_step(model)?;
        if let Some(graph) = self.graph.as_mut() {
            graph.ran_plain();
        }
        self.finish_update(&model, done, started, device_meter)?;
        Ok(model)
    }

    /// The micro-steps' passes and the strategy's step: what the report needs.
    fn passes_and_step(&mut self, mut model: OnnxModel) -> Result<(OnnxModel, Done)> {
        let acc = self.passes.train(
            &mut model,
            &self.prefetch,
            &mut self.micro,
            self.update,
            self.scaler.scale(),
        )?;
        let prefetched = model.take_prefetch_times();
        let display = self.displays_next();
        let (lr, update_started) = (self.schedule.lr(self.update), Instant::now());
        let (model, report) = self.scaler.step(
            self.strategy.as_mut(),
            self.comm.as_ref(),
            lr,
            model,
            acc.grads,
            self.c.train.max_grad_norm,
            display && self.out.tb.wants_norms(),
        )?;
        let (model, settled) = model.settle_offloaded()?;
        if settled.copied_back + settled.in_memory > 0 {
            tracing::debug!(?settled, "parameter chunks on disk after the update");
        }
        let done = Done {
            loss: acc.loss,
            items: acc.items,
            waited: acc.waited,
            overlapped: [acc.sync, prefetched],
            lr,
            report,
            sync_time: update_started.elapsed(),
            display,
        };
        Ok((model, done))
    }

    /// Whether the next update's figures are displayed (read from the device).
    fn displays_next(&self) -> bool {
        (self.update + 1).is_multiple_of(self.c.logging.display_loss_steps.max(1))
            || self.update + 1 == self.total
    }

    /// Count the update `done` and report it.
    fn finish_update(
        &mut self,
        model: &OnnxModel,
        done: Done,
        started: Instant,
        device_meter: DeviceMeter,
    ) -> Result<()> {
        self.update += 1;
        if done.display && !self.c.logging.norm_weights.is_empty() {
            let whole = self.plan.readable(model, true)?;
            self.out
                .tb
                .norms(&whole, &done.report.tensor_grad_norms, self.update)?;
        }
        self.unreported.push(Unreported {
            step: self.update,
            loss: done.loss,
            lr: done.lr,
            grad_norm: done.report.grad_norm,
            loss_scale: self.scaler.state().map(|s| s.scale),
            display: done.display,
        });
        // A displayed update waits for the device to read the figures: inside its time.
        let read = if done.display {
            self.read_unreported()?
        } else {
            Vec::new()
        };
        let items = done.items * self.plan.topology.dp;
        self.out.perf.record(
            items,
            started.elapsed(),
            done.sync_time,
            done.waited,
            done.overlapped,
            device_meter.finish(),
        );
        for r in &read {
            self.out.update(r)?;
        }
        Ok(())
    }

    /// Read the losses and norms of the updates not reported yet and report them, in order.
    fn report_updates(&mut self) -> Result<()> {
        for r in self.read_unreported()? {
            self.out.update(&r)?;
        }
        Ok(())
    }

    /// The figures of the updates not reported yet, read from the device, in order; a loss
    /// that is not finite ends the run with an error naming its update.
    fn read_unreported(&mut self) -> Result<Vec<UpdateReport>> {
        std::mem::take(&mut self.unreported)
            .into_iter()
            .map(|u| {
                let loss = u.loss.mean()?;
                if !loss.is_finite() {
                    return Err(OnnxError::field(
                        "training",
                        format!("loss became {loss} at update {}", u.step),
                    ));
                }
                Ok(UpdateReport {
                    step: u.step,
                    loss,
                    lr: u.lr,
                    grad_norm: u.grad_norm.value()?,
                    loss_scale: u.loss_scale,
                    display: u.display,
                })
            })
            .collect()
    }

    /// Whether the test set is evaluated after this update: every `evaluation_period`
    /// updates and after the last.
    pub fn eval_due(&self) -> bool {
        let period = self.c.eval.evaluation_period;
        (period > 0 && self.update.is_multiple_of(period)) || self.update == self.total
    }

    /// Evaluate on `test`, all ranks together, and report.
    pub fn evaluate(&mut self, model: &OnnxModel, test: &dyn Dataset) -> Result<()> {
        self.report_updates()?;
        let metrics = evaluate(
            &self.c.eval,
            self.c.model.loss,
            self.comm.as_ref(),
            self.plan.eval_place(),
            self.passes.as_ref(),
            model,
            test,
            self.update,
        )?;
        let readable = self
            .plan
            .readable(model, !self.c.logging.histogram_weights.is_empty())?;
        self.out.eval(metrics, &readable)
    }

    /// Whether a checkpoint is written after this update: every `checkpoint_period`
    /// updates and after the last (never with a period of 0).
    pub fn checkpoint_due(&self) -> bool {
        let period = self.c.checkpoint.checkpoint_period;
        period > 0 && (self.update.is_multiple_of(period) || self.update == self.total)
    }

    /// Write a checkpoint, all ranks together (rank 0 the model, each rank its optimizer
    /// state).
    pub fn checkpoint(&mut self, model: &OnnxModel) -> Result<()> {
        self.report_updates()?;
        let (c, plan) = (&self.c, &self.plan);
        let state = CheckpointState {
            update_step: self.update,
            micro_step: self.micro,
            seed: c.train.seed,
            loss_scale: self.scaler.state(),
            world_size: self.comm.world_size(),
            written_by_rank: 0,
            zero_stage: plan.zero_stage(),
            pipeline_stages: plan.topology.pp,
            tensor_parallel: plan.topology.tp,
            tensor_parallel_splits: plan
                .tensor_parallel()
                .map(|t| t.params.clone())
                .unwrap_or_default(),
            config_toml: c.to_toml()?,
        };
        let files = plan.checkpoint_files(model, self.strategy.state_files()?)?;
        let path = save_checkpoint(
            &c.checkpoint.checkpoints_dir(),
            files,
            &state,
            c.checkpoint.max_num_checkpoints,
            self.comm.as_ref(),
        )?;
        let step = self.update;
        self.out
            .log(|| tracing::info!(step, path = %path.display(), "checkpoint"));
        self.out.summary.checkpoint = Some(path);
        Ok(())
    }

    /// After an update: when any rank received a stop signal (agreed by all, see
    /// [`super::process::preemption`]), write a checkpoint (unless this update's was just written)
    /// and stop with [`OnnxError::Preempted`].
    pub fn stop_if_preempted(&mut self, model: &OnnxModel) -> Result<()> {
        let Some(signal) = agreed_stop(self.comm.as_ref())? else {
            return Ok(());
        };
        self.report_updates()?;
        if !self.checkpoint_due() {
            self.checkpoint(model)?;
        }
        self.out.bar.finish_and_clear();
        self.out.tb.flush()?;
        Err(OnnxError::Preempted {
            what: format!("stopped by {signal} after update {}", self.update),
        })
    }

    /// After the last update: rank 0 exports `<model stem>_trained.onnx` and writes
    /// `perf.json` (and `profile.json` when profiling); the run's summary.
    pub fn finish(mut self, model: &OnnxModel) -> Result<RunSummary> {
        self.report_updates()?;
        self.out.bar.finish_and_clear();
        self.out.tb.flush()?;
        let profile = self
            .profiler
            .take()
            .map(|p| p.finish(self.update - self.start_step));
        let memory = MemoryReport::gather(self.strategy.memory(), self.comm.as_ref())?;
        let idle = self.out.perf.gather_idle(self.comm.as_ref())?;
        // The export needs neither the optimizer's state nor the passes: free them first.
        drop(self.strategy);
        drop(self.passes);
        let c = &self.c;
        let path = trained_path(c)?;
        if self.plan.export(model, self.comm.as_ref(), &path)? {
            tracing::info!(path = %path.display(), "exported");
            self.out.summary.exported = Some(path);
            let report = self
                .out
                .perf
                .report(c, self.comm.world_size(), memory, idle);
            report.write(&c.checkpoint.output_dir.join("perf.json"))?;
            if let Some(launches) = report.kernel_launches_per_update {
                tracing::info!(
                    kernel_launches_per_update = launches,
                    device_memory_reserved_mib =
                        report.device_memory_reserved_bytes.map(|b| b >> 20),
                    collective_host_round_trips_per_update =
                        report.collective_host_round_trips_per_update,
                    "device work (perf.json lists the launches by kernel)"
                );
            }
            self.out.summary.perf = Some(report);
            if let Some(profile) = &profile {
                profile.write(&c.checkpoint.output_dir.join("profile.json"))?;
            }
        }
        Ok(self.out.finish())
    }
}

/// The config the run uses (defaults, file and flags resolved) as
/// `<output_dir>/config.toml`, to read or to start the same run from.
fn write_effective_config(c: &TrainingConfig) -> Result<()> {
    std::fs::create_dir_all(&c.checkpoint.output_dir)
        .map_err(|e| OnnxError::io(&c.checkpoint.output_dir, e))?;
    write_atomic(
        &c.checkpoint.output_dir.join("config.toml"),
        c.to_toml()?.as_bytes(),
    )
}

/// Where the trained model is exported: `<output_dir>/<model stem>_trained.onnx` (the
/// directory made).
fn trained_path(c: &TrainingConfig) -> Result<PathBuf> {
    std::fs::create_dir_all(&c.checkpoint.output_dir)
        .map_err(|e| OnnxError::io(&c.checkpoint.output_dir, e))?;
    let stem = c
        .model
        .model_path
        .file_stem()
        .and_then(|s| s.to_str())
        .unwrap_or("model");
    Ok(c.checkpoint.output_dir.join(format!("{stem}_trained.onnx")))
}
