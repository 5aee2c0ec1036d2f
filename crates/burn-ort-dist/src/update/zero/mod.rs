//! ZeRO (Rajbhandari et al. 2020; DeepSpeed's stages; ORT had stage 1): data parallelism
//! without replicating what the update needs.
//!
//! Parameters and gradients are laid out in one flat buffer ([`layout::FlatLayout`]); rank
//! `r` owns one shard of it.
//! - Stage 1: the gradient is all-reduced (or Adasum-combined) whole, as in plain data
//!   parallelism; each rank keeps the optimizer state of its shard only, updates its
//!   shard, and the new parameters are all-gathered.
//! - Stage 2: the gradient is reduce-scattered: each rank receives (and keeps) only the
//!   reduced gradient of its shard.
//! - Stage 3: the module itself holds only this rank's chunk of every parameter (per-tensor
//!   partitioning); the model gathers a parameter where a node reads it and its backward
//!   reduce-scatters the gradient, so the update receives the reduced gradient shards,
//!   updates them in place and all-gathers nothing.
//!
//! Global-norm clipping and LAMB's per-tensor trust ratios work on shards: partial sums of
//! squares, combined across ranks. Weight decay exclusions are per parameter. A rank's
//! state vectors may live in a memory-mapped file ([`Zero::with_state_on_disk`],
//! ZeRO-Infinity's optimizer offload), updated with the same arithmetic.
//!
//! Where the group moves device tensors itself (NCCL), all of it stays on the device
//! (`on_device`: the flat shard as device tensors in `device_flat`, the rules as tensor
//! operations in `device_step`); elsewhere, or with [`Zero::on_host`], the shard lives and
//! is updated in host memory (`flat_optim`, `host_chunks`).
//!
//! Checkpoints: every rank writes `zero-<rank>.safetensors` (its state vectors) and rank 0 writes
//! `zero.json` (world size, stage, layout, step): a run on any world size and either stage
//! reassembles the full state from all shards and takes its own slice.

mod buckets;
mod device_flat;
mod device_step;
pub mod flat_optim;
mod host_chunks;
pub mod layout;
mod on_device;
pub mod state_files;
pub mod state_vectors;

use std::path::PathBuf;
use std::sync::Arc;

use burn::module::Module;
use burn::optim::GradientsParams;

use crate::comm::communicator::{Communicator, DeviceCollectives};
use crate::error::{DistError, DistResult};
use crate::grads::grad_sync::{DEFAULT_BUCKET_BYTES, Reduction, reduce_gradients};
use crate::update::grad_norm::{clip_scale, sum_squares};
use crate::update::strategy::{MemoryUse, ModelParallel, StateFile, UpdateReport, UpdateStrategy};
use device_step::DeviceState;
use flat_optim::{Rule, ShardState, apply, piece_values};
use host_chunks::HostChunks;
use layout::{FlatLayout, Partitioning, Piece};
use state_vectors::StateVectors;

/// ZeRO stages 1, 2 and 3 over a communicator.
pub struct Zero {
    stage: usize,
    comm: Arc<dyn Communicator>,
    rule: Rule,
    reduction: Reduction,
    /// The layout of the whole module.
    layout: FlatLayout,
    /// This rank's pieces of it.
    pieces: Vec<Piece>,
    /// Each slot's weight decay.
    decay: Vec<f32>,
    /// The state in host memory (the updates counted here on either path).
    state: ShardState,
    /// The state on the device, once an update ran there ([`on_device`]).
    device_state: Option<DeviceState>,
    /// Update on the host even where the group moves device tensors.
    on_host: bool,
    /// Where the state vectors live on disk (`None`: in memory).
    state_dir: Option<PathBuf>,
    memory: MemoryUse,
    model_parallel: Option<ModelParallel>,
}

impl Zero {
    /// Stage `stage` (1 to 3) for `module` (whole: at stage 3, before its parameters are
    /// sharded) with update `rule`; `decay_of` gives each parameter's weight decay (0 for
    /// the excluded ones).
    pub fn new<M: Module>(
        stage: usize,
        comm: Arc<dyn Communicator>,
        rule: Rule,
        reduction: Reduction,
        decay_of: impl Fn(burn::module::ParamId) -> f32,
        module: &M,
    ) -> DistResult<Self> {
        let rank = comm.rank();
        if !(1..=3).contains(&stage) {
            return Err(DistError::Invalid {
                rank,
                message: format!(
                    "ZeRO stage {stage} is not available here (1 to 3; stage 0 is Replicated)"
                ),
            });
        }
        if stage >= 2 && reduction == Reduction::Adasum {
            return Err(DistError::Invalid {
                rank,
                message: "Adasum combines whole per-tensor gradients of rank pairs, but ZeRO-2 and 3 reduce-scatter the gradient so no rank ever holds another's whole tensor: use stage 1 or mean reduction".into(),
            });
        }
        let partitioning = if stage == 3 {
            Partitioning::PerTensor
        } else {
            Partitioning::Contiguous
        };
        let layout = FlatLayout::partitioned(module, comm.world_size(), partitioning);
        let pieces = layout.pieces(rank);
        let decay = layout.slots.iter().map(|s| decay_of(s.id)).collect();
        let state = ShardState {
            step: 0,
            slots: StateVectors::in_memory(rule.state_slots(), layout.shard_len()),
        };
        Ok(Zero {
            stage,
            comm,
            rule,
            reduction,
            layout,
            pieces,
            decay,
            state,
            device_state: None,
            on_host: false,
            state_dir: None,
            memory: MemoryUse::default(),
            model_parallel: None,
        })
    }

    /// The same, with this rank's optimizer state in a memory-mapped file under `dir`
    /// (ZeRO-Infinity's optimizer offload): the update reads and releases it parameter by
    /// parameter, checkpoints and resumes read and write it there.
    pub fn with_state_on_disk(mut self, dir: PathBuf) -> DistResult<Self> {
        let rank = self.comm.rank();
        let (count, len) = (self.rule.state_slots(), self.layout.shard_len());
        self.state.slots =
            StateVectors::zeros(count, len, Some(&dir)).map_err(|e| DistError::Invalid {
                rank,
                message: format!("optimizer state on disk under {}: {e}", dir.display()),
            })?;
        self.state_dir = Some(dir);
        Ok(self)
    }

    /// The same, updating on the host even where the group moves device tensors
    /// (`offload_optimizer = "cpu"`, ZeRO-Offload): the shard's state stays in host memory.
    pub fn on_host(mut self) -> Self {
        self.on_host = true;
        self
    }

    /// The group's device collectives when this update runs on the device: the module's
    /// parameters are on a device they move, the state is not kept on the host or on disk,
    /// and the gradient is averaged in f32 (Adasum and f16 on the wire take the host path).
    fn device_group<M: Module>(&self, module: &M) -> Option<Arc<dyn Communicator>> {
        if self.on_host || self.state_dir.is_some() || self.reduction != Reduction::Mean {
            return None;
        }
        let device = module.devices().into_iter().next()?;
        self.comm
            .device_collectives()
            .is_some_and(|d| d.works_on(&device))
            .then(|| self.comm.clone())
    }

    /// The update of this rank's shard applied to `module`: at stage 3 with the chunks on
    /// the CPU, in their own buffers (`host_chunks`); otherwise on a flat copy of the
    /// shard, then scattered into the chunks (stage 3) or all-gathered (stages 1, 2).
    fn apply_to<M: Module>(
        &mut self,
        lr: f64,
        module: M,
        g: &[f32],
        local: Option<&FlatLayout>,
    ) -> DistResult<M> {
        let taken = match local {
            Some(_) => HostChunks::take(module),
            None => Err(module),
        };
        let module = match taken {
            Ok((module, mut chunks)) => {
                let step = self.step_pieces(lr, g, &mut chunks.piece_values(&self.pieces));
                let module = chunks.put_back(module);
                step?;
                return Ok(module);
            }
            Err(module) => module,
        };
        let (layout, rank) = (&self.layout, self.comm.rank());
        let mut mine = match local {
            Some(l) => l.shard_params(&module, 0)?,
            None => layout.shard_params(&module, rank)?,
        };
        self.step_pieces(lr, g, &mut piece_values(&mut mine, &self.pieces))?;
        Ok(match local {
            Some(l) => l.scatter_params(module, &mine),
            None => buckets::gather_params(
                self.comm.as_ref(),
                &self.layout,
                module,
                &mine,
                buckets::BUCKET,
            )?,
        })
    }

    /// The update rule applied to this rank's shard, `values` holding its pieces in order.
    fn step_pieces(&mut self, lr: f64, g: &[f32], values: &mut [&mut [f32]]) -> DistResult<()> {
        apply(
            self.rule,
            lr,
            &self.layout,
            &self.pieces,
            &self.decay,
            values,
            g,
            &mut self.state,
            self.comm.as_ref(),
        )
    }

    /// This rank's shard of the reduced gradient: stage 1 all-reduces (or Adasum-combines)
    /// the whole gradient and keeps its shard; stage 2 reduce-scatters; at stage 3 the
    /// backward pass did (the gradients are the module's chunks, laid out by `local`).
    fn reduce<M: Module>(
        &self,
        module: &M,
        mut grads: GradientsParams,
        local: Option<&FlatLayout>,
    ) -> DistResult<Vec<f32>> {
        let layout = &self.layout;
        if let Some(local) = local {
            return local.take_grads(module, &mut grads);
        }
        let rank = self.comm.rank();
        if self.stage == 1 {
            reduce_gradients(
                self.comm.as_ref(),
                module,
                &mut grads,
                DEFAULT_BUCKET_BYTES,
                self.reduction,
            )?;
            return layout.take_shard_grads(module, &mut grads, rank);
        }
        let tensors = layout.take_grad_tensors(module, &mut grads);
        let mut mine = vec![0.0; layout.shard_len()];
        let fp16 = self.reduction == Reduction::MeanFp16;
        buckets::reduce_scatter(
            self.comm.as_ref(),
            layout,
            tensors,
            &mut mine,
            fp16,
            buckets::BUCKET,
        )?;
        Ok(mine)
    }
}

impl<M: Module> UpdateStrategy<M> for Zero {
    fn update(
        &mut self,
        lr: f64,
        module: M,
        grads: GradientsParams,
        max_norm: f32,
        tensor_norms: bool,
    ) -> DistResult<(M, UpdateReport)> {
        if let Some(comm) = self.device_group(&module) {
            let group: &dyn DeviceCollectives =
                comm.device_collectives().expect("checked by device_group");
            return self.update_on_device(group, (lr, module, grads), (max_norm, tensor_norms));
        }
        if let Some(device) = self.device_state.take() {
            // Back from the device (the module moved to the host): its state comes along.
            self.state = device.download(self.state.step)?;
        }
        // At stage 3 the module's parameters are this rank's chunks: its local flat buffer
        // is the shard.
        let local = (self.stage == 3).then(|| FlatLayout::of(&module, 1));
        let mut g = self.reduce(&module, grads, local.as_ref())?;
        let (layout, rank) = (&self.layout, self.comm.rank());
        if g.len() != layout.shard_len() {
            return Err(DistError::Invalid {
                rank,
                message: format!(
                    "ZeRO-{}: a gradient shard of {} values, the layout's is {} (is the module sharded as the stage expects?)",
                    self.stage,
                    g.len(),
                    layout.shard_len()
                ),
            });
        }
        let squares = slot_squares(self.comm.as_ref(), layout, &self.pieces, &g)?;
        let grad_norm = ModelParallel::global_norm(
            self.model_parallel.as_ref(),
            layout
                .slots
                .iter()
                .map(|s| s.id)
                .zip(squares.iter().copied()),
        )?;
        let scale = clip_scale(grad_norm, max_norm);
        if scale != 1.0 {
            g.iter_mut().for_each(|x| *x *= scale);
        }
        let module = self.apply_to(lr, module, &g, local.as_ref())?;
        let layout = &self.layout;
        self.memory = MemoryUse {
            optimizer_state_bytes: self.state.slots.memory_bytes(),
            gradient_bytes: if self.stage == 1 {
                layout.padded * 4
            } else {
                layout.shard_len() * 4
            },
            // What the module holds: at stage 3 its chunks.
            parameter_bytes: local.as_ref().map_or(layout.len, |l| l.len) * 4,
        };
        let squares = layout.slots.iter().map(|s| s.id).zip(squares);
        let report = UpdateReport::new(grad_norm, squares, tensor_norms);
        Ok((module, report))
    }

    fn memory(&self) -> MemoryUse {
        self.memory
    }

    fn state_files(&self) -> DistResult<Vec<StateFile<'_>>> {
        let rank = self.comm.rank();
        match &self.device_state {
            Some(device) => {
                let state = device.download(self.state.step)?;
                state_files::write(rank, self.stage, &self.layout, state)
            }
            None => state_files::write(rank, self.stage, &self.layout, &self.state),
        }
    }

    fn load_state(&mut self, _module: &M, dirs: &[PathBuf]) -> DistResult<()> {
        let rank = self.comm.rank();
        self.state = state_files::read(
            dirs,
            rank,
            &self.layout,
            self.rule.state_slots(),
            self.state_dir.as_deref(),
        )?;
        // The next update on the device starts from the state read.
        self.device_state = None;
        Ok(())
    }

    fn set_model_parallel(&mut self, group: ModelParallel) {
        self.model_parallel = Some(group);
    }
}

/// Every trainable slot's gradient sum of squares, in f64: this rank's partial sums, gathered
/// from all ranks (as f64 split into two f32s) and added in rank order, so every rank gets
/// the same values and they equal a whole-tensor sum to f64 rounding.
fn slot_squares(
    comm: &dyn Communicator,
    layout: &FlatLayout,
    pieces: &[Piece],
    g: &[f32],
) -> DistResult<Vec<f64>> {
    let mut mine = vec![0.0f64; layout.slots.len()];
    for p in pieces.iter().filter(|p| layout.slots[p.slot].trainable) {
        mine[p.slot] = sum_squares(&g[p.local.clone()]);
    }
    combine_slot_squares(comm, layout, &mine)
}

/// Per-slot sums of squares over all ranks from this rank's partial sums `mine`.
fn combine_slot_squares(
    comm: &dyn Communicator,
    layout: &FlatLayout,
    mine: &[f64],
) -> DistResult<Vec<f64>> {
    let send: Vec<f32> = mine
        .iter()
        .flat_map(|x| {
            let hi = *x as f32;
            [hi, (*x - f64::from(hi)) as f32]
        })
        .collect();
    let mut all = vec![0.0f32; send.len() * comm.world_size()];
    comm.all_gather(&send, &mut all)?;
    let mut total = vec![0.0f64; layout.slots.len()];
    for rank in all.chunks(send.len()) {
        for (t, pair) in total.iter_mut().zip(rank.chunks(2)) {
            *t += f64::from(pair[0]) + f64::from(pair[1]);
        }
    }
    Ok(total)
}
