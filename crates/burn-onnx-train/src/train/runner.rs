//! [`TrainingRunner`]: ORT's `TrainingRunner::Run()` lifecycle on Burn.
//!
//! Per optimizer update: `gradient_accumulation_steps` micro-steps (fetch batch, forward,
//! loss, backward, accumulate; session mode `GradientAccumulateStep`, no optimizer step and
//! no communication), then the update strategy (replicated or a ZeRO stage) synchronises
//! the gradients across data-parallel ranks, clips them to the global norm and updates at
//! the scheduled learning rate (`ModelUpdateStep`).
//! Every `display_loss_steps` updates the loss is logged; every `evaluation_period` the test
//! set is evaluated by all ranks together (`EvaluateStep`); every `checkpoint_period` the
//! ranks write a checkpoint together (rank 0 the model, each rank its optimizer state). At the end rank 0 exports `<model stem>_trained.onnx` and a
//! throughput report `perf.json`.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use burn::tensor::Device;
use burn_ort_dist::{Communicator, DataParallel, UpdateStrategy};
use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;

use super::checkpoint::{
    CheckpointState, list_checkpoints, read_params, read_state, remove_stale_temporaries,
    save_checkpoint, state_dirs,
};
use super::config::TrainingConfig;
use super::data::{Dataset, DistributedSampler, Prefetcher};
pub use super::evaluate::EvalMetrics;
use super::evaluate::evaluate;
use super::optimizer::{build_strategy, data_parallel};
use super::perf::{MemoryReport, PerfMeter};
use super::placement::Placement;
use super::precision::LossScaler;
use super::preflight::{check_data, check_weight_names};
use super::schedule::LrSchedule;
use super::summaries::Summaries;
use super::tp_resume::regrouped_state_dirs;
use crate::error::{OnnxError, Result};
use crate::export::export_onnx;
use crate::model::OnnxModel;
use crate::model::profile::NodeProfiler;

/// What a finished run reports.
#[derive(Debug, Clone, Serialize)]
pub struct RunSummary {
    /// Update step the run started from (non-zero after a resume).
    pub start_step: usize,
    /// `(update step, mean loss of that update)` for every update this run performed.
    pub losses: Vec<(usize, f64)>,
    /// Evaluations.
    pub evals: Vec<EvalMetrics>,
    /// Exported model (rank 0).
    pub exported: Option<PathBuf>,
    /// Throughput report (rank 0).
    pub perf: Option<super::perf::PerfReport>,
}

/// Where the loop reports: throughput meter, run summary, TensorBoard, progress bar, log.
struct Reporter {
    perf: PerfMeter,
    summary: RunSummary,
    tb: Summaries,
    bar: ProgressBar,
    unit: &'static str,
    root: bool,
}

impl Reporter {
    /// After update `step`: summary, progress bar, TensorBoard, and the log line when `display`.
    fn update(
        &mut self,
        step: usize,
        loss: f64,
        lr: f64,
        grad_norm: f32,
        loss_scale: Option<f64>,
        display: bool,
    ) -> Result<()> {
        let (rate, unit) = (self.perf.recent_rate(), self.unit);
        self.summary.losses.push((step, loss));
        self.bar.set_position(step as u64);
        self.bar
            .set_message(format!("loss {loss:.4} | {rate:.0} {unit}/s"));
        self.tb
            .update(step, loss, lr, grad_norm, loss_scale, rate, unit)?;
        if self.root && display {
            self.bar
                .suspend(|| tracing::info!(step, loss, lr, grad_norm, rate, unit, "train"));
        }
        Ok(())
    }

    /// After an evaluation.
    fn eval(&mut self, m: EvalMetrics, model: &OnnxModel) -> Result<()> {
        if self.root {
            self.bar.suspend(|| {
                tracing::info!(
                    step = m.step,
                    loss = m.loss,
                    perplexity = m.perplexity,
                    accuracy = m.accuracy,
                    "eval"
                )
            });
        }
        self.tb.eval(&m, model)?;
        self.summary.evals.push(m);
        Ok(())
    }
}

/// Runs training as configured, on one process or as one rank of a data-parallel group.
pub struct TrainingRunner {
    config: TrainingConfig,
    comm: Arc<dyn Communicator>,
    device: Device,
}

impl TrainingRunner {
    /// Validate the config against the communicator's world.
    pub fn new(
        config: TrainingConfig,
        comm: Arc<dyn Communicator>,
        device: Device,
    ) -> Result<Self> {
        config.validate(comm.world_size())?;
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

    fn is_root(&self) -> bool {
        self.comm.rank() == 0
    }

    /// Train on `train`, evaluating on `test`.
    pub fn run(
        &self,
        train: Arc<dyn Dataset>,
        test: Option<Arc<dyn Dataset>>,
    ) -> Result<RunSummary> {
        let mut c = self.config.clone();
        let mut place = Placement::new(&c, self.comm.as_ref())?;
        let (replica, replicas) = (place.groups.dp_rank, place.topology.dp);
        let sampler = DistributedSampler {
            len: train.len(),
            batch_size: c.batch_size,
            rank: replica,
            world: replicas,
            seed: c.seed,
            shuffle: true,
        };
        c.resolve_epochs(sampler.batches_per_epoch())?;
        sampler.batch_indices(0)?;
        let model = c.load_model(&self.device)?.select_trainable(
            &c.weights_to_train,
            &c.weights_not_to_train,
            ("config.weights_to_train", "config.weights_not_to_train"),
        )?;
        check_weight_names(&c, &model)?;
        check_data(&c, &model, train.as_ref(), test.as_deref())?;
        let model = place.model_part(&c, model, train.as_ref())?;
        let _groups = place.enter_groups();
        let ddp = data_parallel(&c, place.groups.dp.clone());
        let passes = place.passes(&c, &model, &self.device, &ddp)?;
        let mut strategy = build_strategy(&c, &model, &ddp)?;
        if let Some(group) = place.model_parallel(&model) {
            strategy.set_model_parallel(group);
        }
        let mut scaler = LossScaler::new(&c);
        let (model, mut update, mut micro) =
            self.resume(&c, &place, model, strategy.as_mut(), &mut scaler)?;
        DataParallel::new(self.comm.clone()).check_consistent(c.to_toml()?.as_bytes())?;
        let mut model =
            place.shard(DataParallel::new(place.groups.dp.clone()).broadcast_parameters(model)?)?;
        let (start_step, total) = (update, c.num_updates());
        let schedule = LrSchedule::new(&c.lr, total);
        let prefetch = Prefetcher::start(train.clone(), sampler, micro, 4);
        let mut out = Reporter {
            perf: PerfMeter::new(train.unit()),
            summary: RunSummary {
                start_step,
                losses: Vec::new(),
                evals: Vec::new(),
                exported: None,
                perf: None,
            },
            tb: Summaries::open(&c, place.summary_role(self.comm.rank()))?,
            bar: self.progress_bar(total, start_step),
            unit: train.unit(),
            root: self.is_root(),
        };
        let profiler = c.profile.then(NodeProfiler::start);

        while update < total {
            let started = Instant::now();
            let acc = passes.train(
                &c,
                &mut model,
                &prefetch,
                &mut micro,
                update,
                scaler.scale(),
            )?;
            let display = (update + 1) % c.display_loss_steps.max(1) == 0 || update + 1 == total;
            let (lr, update_started) = (schedule.lr(update), Instant::now());
            let (next, report) = scaler.step(
                strategy.as_mut(),
                self.comm.as_ref(),
                lr,
                model,
                acc.grads,
                c.max_grad_norm,
                display && out.tb.wants_norms(),
            )?;
            let sync_time = update_started.elapsed();
            model = next;
            update += 1;
            if display && !c.norm_weights.is_empty() {
                let whole = place.readable(&model, true)?;
                out.tb.norms(&whole, &report.tensor_grad_norms, update)?;
            }
            if !acc.loss.is_finite() {
                return Err(OnnxError::field(
                    "training",
                    format!("loss became {} at update {update}", acc.loss),
                ));
            }
            out.perf.record(
                acc.items * replicas,
                started.elapsed(),
                sync_time,
                acc.waited,
                acc.sync,
            );
            out.update(
                update,
                acc.loss,
                lr,
                report.grad_norm,
                scaler.state().map(|s| s.scale),
                display,
            )?;
            let eval_due = c.evaluation_period > 0 && update % c.evaluation_period == 0;
            if let Some(test) = test.as_ref().filter(|_| eval_due || update == total) {
                out.eval(
                    evaluate(
                        &c,
                        self.comm.as_ref(),
                        (replica, replicas),
                        place.groups.tp_rank == 0,
                        passes.as_ref(),
                        &model,
                        test.as_ref(),
                        update,
                    )?,
                    &*place.readable(&model, !c.histogram_weights.is_empty())?,
                )?;
            }
            if c.checkpoint_period > 0 && (update % c.checkpoint_period == 0 || update == total) {
                let state = CheckpointState {
                    update_step: update,
                    micro_step: micro,
                    seed: c.seed,
                    loss_scale: scaler.state(),
                    world_size: self.comm.world_size(),
                    written_by_rank: 0,
                    zero_stage: c.zero_stage,
                    pipeline_stages: place.topology.pp,
                    tensor_parallel: place.topology.tp,
                    tensor_parallel_splits: place
                        .tensor_parallel
                        .as_ref()
                        .map(|t| t.params.clone())
                        .unwrap_or_default(),
                    config_toml: c.to_toml()?,
                };
                let files = place.checkpoint_files(&model, strategy.state_files()?)?;
                let path = save_checkpoint(
                    &c.checkpoints_dir(),
                    files,
                    &state,
                    c.max_num_checkpoints,
                    self.comm.as_ref(),
                )?;
                if self.is_root() {
                    out.bar.suspend(
                        || tracing::info!(step = update, path = %path.display(), "checkpoint"),
                    );
                }
            }
        }
        out.bar.finish_and_clear();
        out.tb.flush()?;
        let profile = profiler.map(|p| p.finish(update - start_step));
        let memory = MemoryReport::gather(strategy.memory(), self.comm.as_ref())?;
        let idle = out.perf.gather_idle(self.comm.as_ref())?;
        if let Some(whole) = place.whole_model(&c, &model, self.comm.as_ref())? {
            out.summary.exported = Some(self.export(&c, &whole)?);
            let report = out.perf.report(&c, self.comm.world_size(), memory, idle);
            report.write(&c.output_dir.join("perf.json"))?;
            out.summary.perf = Some(report);
            if let Some(profile) = &profile {
                profile.write(&c.output_dir.join("profile.json"))?;
            }
        }
        Ok(out.summary)
    }

    /// The model to start from with the update and micro-step counters, the strategy's
    /// optimizer state loaded: a fresh start, or the checkpoint named by
    /// `checkpoint_to_load_path`, or the newest in the checkpoint directory (which must come
    /// from a compatible run).
    fn resume(
        &self,
        c: &TrainingConfig,
        place: &Placement,
        model: OnnxModel,
        strategy: &mut dyn UpdateStrategy<OnnxModel>,
        scaler: &mut LossScaler,
    ) -> Result<(OnnxModel, usize, usize)> {
        let dir = c.checkpoints_dir();
        if self.is_root() {
            remove_stale_temporaries(&dir);
        }
        let Some(path) = c
            .checkpoint_to_load_path
            .clone()
            .or_else(|| list_checkpoints(&dir).pop().map(|(_, p)| p))
        else {
            return Ok((model, 0, 0));
        };
        let state = read_state(&path)?;
        let saved = TrainingConfig::from_toml(&state.config_toml, &path)?;
        let saved_replicas = state.world_size
            / (saved.pipeline_parallel_size * saved.horizontal_parallel_size).max(1);
        c.check_resume(
            &saved,
            saved_replicas,
            state.zero_stage,
            place.topology.dp,
            &path,
        )?;
        let model = read_params(&path, model, place.tensor_parallel.as_ref())?;
        if state.tensor_parallel == place.topology.tp {
            strategy.load_state(
                &model,
                &state_dirs(&path, state.pipeline_stages, place.tp_rank()),
            )?;
        } else {
            let scratch = c
                .output_dir
                .join(format!(".tp-regroup-{}", self.comm.rank()));
            let dirs = regrouped_state_dirs(&path, &state, place, &model, &scratch)?;
            strategy.load_state(&model, &dirs)?;
            let _ = std::fs::remove_dir_all(&scratch);
        }
        scaler.restore(state.loss_scale);
        let (update, micro) = (state.update_step, state.micro_step);
        if self.is_root() {
            tracing::info!(checkpoint = %path.display(), update, total = c.num_updates(), "resumed");
            if update >= c.num_updates() {
                tracing::warn!(
                    "the checkpoint is already at the last update: nothing to train (raise num_train_steps or use a fresh output_dir)"
                );
            }
        }
        Ok((model, update, micro))
    }

    fn export(&self, c: &TrainingConfig, model: &OnnxModel) -> Result<PathBuf> {
        std::fs::create_dir_all(&c.output_dir).map_err(|e| OnnxError::io(&c.output_dir, e))?;
        let stem = c
            .model_path
            .file_stem()
            .and_then(|s| s.to_str())
            .unwrap_or("model");
        let path = c.output_dir.join(format!("{stem}_trained.onnx"));
        export_onnx(model, &path)?;
        tracing::info!(path = %path.display(), "exported");
        Ok(path)
    }

    fn progress_bar(&self, total: usize, start: usize) -> ProgressBar {
        if !(self.config.progress && self.is_root()) {
            return ProgressBar::hidden();
        }
        let bar = ProgressBar::new(total as u64).with_position(start as u64);
        let style =
            ProgressStyle::with_template("{bar:30} {pos}/{len} updates | {msg} | ETA {eta}")
                .unwrap_or_else(|_| ProgressStyle::default_bar());
        bar.set_style(style);
        bar
    }
}
