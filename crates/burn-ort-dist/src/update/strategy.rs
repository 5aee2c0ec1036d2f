//! The update a training loop calls after backward: [`UpdateStrategy`]. It owns the
//! optimizer state and decides how gradients cross ranks and where the update runs:
//! [`Replicated`] (plain data parallelism, ZeRO stage 0: all-reduce, every rank updates
//! everything with a [`ReplicaOptimizer`]: Burn's, or a fused one) or
//! [`crate::update::zero::Zero`] (stages 1 to 3: each rank updates its shard of a flat buffer).
//! The loop does not branch on the kind.

use std::collections::HashSet;
use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;

use burn::module::{Module, ModuleVisitor, Param, ParamId};
use burn::optim::{GradientsParams, ModuleOptimizer};
use burn::tensor::Tensor;

use crate::comm::communicator::{Communicator, ReduceOp};
use crate::error::{DistError, DistResult, state_error};
use crate::grads::data_parallel::DataParallel;
use crate::grads::grad_sync::Reduction;
use crate::storage::record::{REPLICATED_STATE_FILE, merged_record};
use crate::update::grad_norm::{GradNorm, clip, grad_squares, total_norm};
use crate::update::replica_optimizer::ReplicaOptimizer;

/// What an update measured.
#[derive(Debug, Clone, Default)]
pub struct UpdateReport {
    /// L2 norm of the synchronised gradient over all parameters, before clipping.
    pub grad_norm: GradNorm,
    /// Per-parameter gradient norms, when asked for.
    pub tensor_grad_norms: Vec<(ParamId, f32)>,
}

impl UpdateReport {
    /// The report of an update with global norm `grad_norm`; with `per_tensor`, each
    /// parameter's norm from its gradient's sum of squares.
    pub fn new(
        grad_norm: impl Into<GradNorm>,
        squares: impl IntoIterator<Item = (ParamId, f64)>,
        per_tensor: bool,
    ) -> Self {
        let tensor_grad_norms = if per_tensor {
            squares
                .into_iter()
                .map(|(id, s)| (id, s.sqrt() as f32))
                .collect()
        } else {
            Vec::new()
        };
        UpdateReport {
            grad_norm: grad_norm.into(),
            tensor_grad_norms,
        }
    }
}

/// An update of gradients still multiplied by a loss scale ([`UpdateStrategy::update_scaled`]).
pub enum ScaledUpdate<M> {
    /// The strategy divided the gradients inside its update.
    Done {
        /// The updated module (unchanged when `overflow`).
        module: M,
        /// The norm of the divided gradients (inf when `overflow`).
        report: UpdateReport,
        /// A gradient was inf or NaN: the update was skipped on every rank (weights and
        /// optimizer state untouched).
        overflow: bool,
    },
    /// The strategy does not divide inside its update: the module and the gradients,
    /// untouched, for the caller to divide first and [`UpdateStrategy::update`].
    Declined(M, GradientsParams),
}

/// Bytes one rank holds for training, by kind.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MemoryUse {
    /// Optimizer state (moments, velocities).
    pub optimizer_state_bytes: usize,
    /// Gradients kept through the update.
    pub gradient_bytes: usize,
    /// Parameters.
    pub parameter_bytes: usize,
}

/// The ranks that hold the other parts of one model (pipeline stages): the global gradient
/// norm sums their squares, counting a parameter several of them hold (a tied embedding)
/// once, as Megatron does.
#[derive(Clone)]
pub struct ModelParallel {
    comm: Arc<dyn Communicator>,
    counted_elsewhere: HashSet<ParamId>,
}

impl ModelParallel {
    /// The group `comm` of model parts; this rank leaves out `counted_elsewhere` (copies
    /// of parameters whose squares another rank of the group contributes).
    pub fn new(comm: Arc<dyn Communicator>, counted_elsewhere: HashSet<ParamId>) -> Self {
        ModelParallel {
            comm,
            counted_elsewhere,
        }
    }

    /// The L2 norm over the whole model from this part's per-parameter sums of squares; a
    /// collective of the group when there is one.
    pub fn global_norm(
        group: Option<&Self>,
        squares: impl Iterator<Item = (ParamId, f64)>,
    ) -> DistResult<f32> {
        let Some(g) = group else {
            return Ok(total_norm(squares.map(|(_, s)| s)));
        };
        let local: f64 = squares
            .filter(|(id, _)| !g.counted_elsewhere.contains(id))
            .map(|(_, s)| s)
            .sum();
        // f64 across the wire as two f32 halves would lose nothing, but the communicator
        // is f32: send the sum split into a high and a low part.
        let hi = local as f32;
        let mut buf = [hi, (local - f64::from(hi)) as f32];
        g.comm.all_reduce(&mut buf, ReduceOp::Sum)?;
        Ok((f64::from(buf[0]) + f64::from(buf[1])).max(0.0).sqrt() as f32)
    }
}

/// A file of optimizer state for a checkpoint: its name in the checkpoint directory and
/// its contents, as bytes or as a writer that streams them (so state kept in a mapped file
/// or a large record is never copied whole to be written).
pub struct StateFile<'a> {
    /// The file's name (may hold one directory level).
    pub name: String,
    /// What goes into it.
    pub content: StateContent<'a>,
}

/// The contents of a [`StateFile`].
pub enum StateContent<'a> {
    /// The bytes.
    Bytes(Vec<u8>),
    /// A writer of the bytes.
    Stream(Box<dyn FnOnce(&mut dyn Write) -> DistResult<()> + 'a>),
}

impl<'a> StateFile<'a> {
    /// A file of `bytes`.
    pub fn bytes(name: impl Into<String>, bytes: Vec<u8>) -> Self {
        StateFile {
            name: name.into(),
            content: StateContent::Bytes(bytes),
        }
    }

    /// A file `write` streams.
    pub fn stream(
        name: impl Into<String>,
        write: impl FnOnce(&mut dyn Write) -> DistResult<()> + 'a,
    ) -> Self {
        StateFile {
            name: name.into(),
            content: StateContent::Stream(Box::new(write)),
        }
    }

    /// Write the contents to `w`.
    pub fn write_to(self, w: &mut dyn Write) -> DistResult<()> {
        match self.content {
            StateContent::Bytes(b) => w
                .write_all(&b)
                .map_err(|e| state_error(format!("{}: {e}", self.name))),
            StateContent::Stream(f) => f(w),
        }
    }
}

/// Synchronise, clip and apply one update.
pub trait UpdateStrategy<M: Module> {
    /// Combine `grads` across ranks, clip them to global L2 norm `max_norm` (0: no
    /// clipping), update `module` at learning rate `lr`. `tensor_norms` asks for the
    /// per-parameter gradient norms in the report.
    fn update(
        &mut self,
        lr: f64,
        module: M,
        grads: GradientsParams,
        max_norm: f32,
        tensor_norms: bool,
    ) -> DistResult<(M, UpdateReport)>;
    /// [`Self::update`] of `grads` still multiplied by a loss scale (`scale`), where this
    /// strategy divides them inside its update and skips it when a gradient on any of the
    /// run's `world_size` ranks is inf or NaN (a fused optimizer on a GPU: no pass of its
    /// own over the gradients); [`ScaledUpdate::Declined`] by default.
    fn update_scaled(
        &mut self,
        lr: f64,
        module: M,
        grads: GradientsParams,
        (max_norm, tensor_norms): (f32, bool),
        (scale, world_size): (f64, usize),
    ) -> DistResult<ScaledUpdate<M>> {
        let _ = (lr, max_norm, tensor_norms, scale, world_size);
        Ok(ScaledUpdate::Declined(module, grads))
    }
    /// What this rank holds.
    fn memory(&self) -> MemoryUse;
    /// The files of optimizer state this rank writes into a checkpoint directory.
    fn state_files(&self) -> DistResult<Vec<StateFile<'_>>>;
    /// Restore the optimizer state for `module` from the state directories of a checkpoint:
    /// one, or one per pipeline stage of the run that wrote it (each parameter's state is
    /// taken from whichever holds it).
    fn load_state(&mut self, module: &M, dirs: &[PathBuf]) -> DistResult<()>;
    /// The module is one part of a model spread over `group` (pipeline stages): measure
    /// the gradient norm (and clip) over the whole model.
    fn set_model_parallel(&mut self, group: ModelParallel);
    /// Where this rank's update is its optimizer's alone (one rank, nothing combined),
    /// [`ReplicaOptimizer::write_next_step`]: whether the next update's device tables are
    /// written for a captured update's replay. False by default.
    fn write_next_step(&mut self, lr: f64) -> bool {
        let _ = lr;
        false
    }
    /// Count an update a captured update's replay made
    /// ([`ReplicaOptimizer::count_replayed_step`]).
    fn count_replayed_step(&mut self) {}
}

/// ZeRO stage 0: gradients all-reduced (or Adasum-combined) in buckets, every rank runs
/// the optimizer `O` (Burn's by default) on every parameter; rank 0 saves the optimizer
/// record.
pub struct Replicated<O = ModuleOptimizer> {
    ddp: DataParallel,
    optim: O,
    memory: MemoryUse,
    model_parallel: Option<ModelParallel>,
}

impl<O: ReplicaOptimizer> Replicated<O> {
    /// Wrap `optim` with the data-parallel settings `ddp`.
    pub fn new(ddp: DataParallel, optim: O) -> Self {
        Replicated {
            ddp,
            optim,
            memory: MemoryUse::default(),
            model_parallel: None,
        }
    }
}

impl<O: ReplicaOptimizer> Replicated<O> {
    /// Note what this rank holds for `module`.
    fn count_memory<M: Module>(&mut self, module: &M) {
        let mut census = Census::default();
        module.visit(&mut census);
        self.memory = MemoryUse {
            optimizer_state_bytes: 0,
            gradient_bytes: census.trainable * 4,
            parameter_bytes: census.elements * 4,
        };
    }
}

impl<M: Module, O: ReplicaOptimizer> UpdateStrategy<M> for Replicated<O> {
    fn update(
        &mut self,
        lr: f64,
        module: M,
        mut grads: GradientsParams,
        max_norm: f32,
        tensor_norms: bool,
    ) -> DistResult<(M, UpdateReport)> {
        self.ddp.sync(&module, &mut grads)?;
        self.count_memory(&module);
        // The optimizer measures and clips when nothing asks for a norm per parameter and
        // no other model part adds its squares.
        if !tensor_norms && self.model_parallel.is_none() {
            let (module, grad_norm) = self.optim.step_clipped(lr, module, grads, max_norm)?;
            return Ok((module, UpdateReport::new(grad_norm, [], false)));
        }
        let norms = grad_squares(&module, &grads)?;
        let grad_norm =
            ModelParallel::global_norm(self.model_parallel.as_ref(), norms.iter().copied())?;
        clip(&module, &mut grads, grad_norm, max_norm);
        let report = UpdateReport::new(grad_norm, norms, tensor_norms);
        Ok((self.optim.step(lr, module, grads)?, report))
    }

    /// Taken when every rank of the run is a replica of this one (then each holds the same
    /// averaged gradients: an inf or NaN on one reaches all, and all skip), nothing asks
    /// for per-parameter norms, the gradients cross the wire in f32 (as f16, a scaled
    /// gradient could overflow where its divided value would not) and the optimizer
    /// divides them itself.
    fn update_scaled(
        &mut self,
        lr: f64,
        module: M,
        mut grads: GradientsParams,
        (max_norm, tensor_norms): (f32, bool),
        (scale, world_size): (f64, usize),
    ) -> DistResult<ScaledUpdate<M>> {
        let taken = !tensor_norms
            && self.model_parallel.is_none()
            && self.ddp.reduction() != Reduction::MeanFp16
            && self.ddp.comm().world_size() == world_size
            && self.optim.steps_scaled(&module);
        if !taken {
            return Ok(ScaledUpdate::Declined(module, grads));
        }
        self.ddp.sync(&module, &mut grads)?;
        self.count_memory(&module);
        let (module, norm, overflow) =
            self.optim
                .step_scaled(lr, module, grads, max_norm, scale as f32)?;
        Ok(ScaledUpdate::Done {
            module,
            report: UpdateReport::new(norm, [], false),
            overflow,
        })
    }

    fn memory(&self) -> MemoryUse {
        MemoryUse {
            optimizer_state_bytes: self.optim.state_bytes(),
            ..self.memory
        }
    }

    fn state_files(&self) -> DistResult<Vec<StateFile<'_>>> {
        if self.ddp.comm().rank() != 0 {
            return Ok(Vec::new());
        }
        Ok(vec![StateFile::stream(REPLICATED_STATE_FILE, |w| {
            self.optim.write_state(w)
        })])
    }

    fn load_state(&mut self, module: &M, dirs: &[PathBuf]) -> DistResult<()> {
        let bytes = merged_record(dirs, &param_ids(module))?;
        self.optim.load_record_bytes(bytes).map_err(|e| match e {
            DistError::State { message } => {
                state_error(format!("{}: {message}", dirs[0].display()))
            }
            other => other,
        })
    }

    fn set_model_parallel(&mut self, group: ModelParallel) {
        self.model_parallel = Some(group);
    }

    fn write_next_step(&mut self, lr: f64) -> bool {
        let alone = self.ddp.comm().world_size() == 1 && self.model_parallel.is_none();
        alone && self.optim.write_next_step(lr)
    }

    fn count_replayed_step(&mut self) {
        self.optim.count_replayed_step();
    }
}

/// The ids of `module`'s parameters.
fn param_ids<M: Module>(module: &M) -> HashSet<u64> {
    struct Ids(HashSet<u64>);
    impl ModuleVisitor for Ids {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            self.0.insert(param.id.val());
        }
    }
    let mut ids = Ids(HashSet::new());
    module.visit(&mut ids);
    ids.0
}

#[derive(Default)]
struct Census {
    elements: usize,
    trainable: usize,
}

impl ModuleVisitor for Census {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        let t = param.val();
        let n: usize = t.dims().iter().product();
        self.elements += n;
        if t.is_require_grad() {
            self.trainable += n;
        }
    }
}
