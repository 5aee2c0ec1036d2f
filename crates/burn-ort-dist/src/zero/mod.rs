//! ZeRO (Rajbhandari et al. 2020; DeepSpeed's stages; ORT had stage 1): data parallelism
//! without replicating what the update needs.
//!
//! Parameters and gradients are laid out in one flat buffer ([`layout::FlatLayout`]); rank
//! `r` owns one contiguous shard of it.
//! - Stage 1: the gradient is all-reduced (or Adasum-combined) whole, as in plain data
//!   parallelism; each rank keeps the optimizer state of its shard only, updates its
//!   shard, and the new parameters are all-gathered.
//! - Stage 2: the gradient is reduce-scattered: each rank receives (and keeps) only the
//!   reduced gradient of its shard.
//!
//! Global-norm clipping and LAMB's per-tensor trust ratios work on shards: partial sums of
//! squares, combined across ranks. Weight decay exclusions are per parameter.
//!
//! Checkpoints: every rank writes `zero-<rank>.bin` (its state vectors) and rank 0 writes
//! `zero.json` (world size, stage, layout, step): a run on any world size and either stage
//! reassembles the full state from all shards and takes its own slice.

pub mod flat_optim;
pub mod layout;
pub mod state_files;

use std::path::PathBuf;
use std::sync::Arc;

use burn::module::Module;
use burn::optim::GradientsParams;

use crate::communicator::{Communicator, ReduceOp};
use crate::error::{DistError, DistResult};
use crate::grad_sync::{DEFAULT_BUCKET_BYTES, Reduction, reduce_gradients};
use crate::strategy::{
    MemoryUse, ModelParallel, UpdateReport, UpdateStrategy, clip_scale, sum_squares,
};
use flat_optim::{Rule, ShardState, apply};
use layout::{FlatLayout, Piece};

/// ZeRO stages 1 and 2 over a communicator.
pub struct Zero {
    stage: usize,
    comm: Arc<dyn Communicator>,
    rule: Rule,
    reduction: Reduction,
    /// Weight decay of a parameter.
    decay_of: Box<dyn Fn(burn::module::ParamId) -> f32 + Send>,
    /// The layout, this rank's pieces of it and each slot's weight decay (made on first use).
    layout: Option<(FlatLayout, Vec<Piece>, Vec<f32>)>,
    state: ShardState,
    memory: MemoryUse,
    model_parallel: Option<ModelParallel>,
}

impl Zero {
    /// Stage `stage` (1 or 2) with update `rule`; `decay_of` gives each parameter's weight
    /// decay (0 for the excluded ones).
    pub fn new(
        stage: usize,
        comm: Arc<dyn Communicator>,
        rule: Rule,
        reduction: Reduction,
        decay_of: Box<dyn Fn(burn::module::ParamId) -> f32 + Send>,
    ) -> DistResult<Self> {
        let rank = comm.rank();
        if !(1..=2).contains(&stage) {
            return Err(DistError::Invalid {
                rank,
                message: format!(
                    "ZeRO stage {stage} is not available here (1 or 2; stage 0 is Replicated)"
                ),
            });
        }
        if stage >= 2 && reduction == Reduction::Adasum {
            return Err(DistError::Invalid {
                rank,
                message: "Adasum combines whole per-tensor gradients of rank pairs, but ZeRO-2 reduce-scatters the gradient so no rank ever holds another's whole tensor: use stage 1 or mean reduction".into(),
            });
        }
        Ok(Zero {
            stage,
            comm,
            rule,
            reduction,
            decay_of,
            layout: None,
            state: ShardState {
                step: 0,
                slots: Vec::new(),
            },
            memory: MemoryUse::default(),
            model_parallel: None,
        })
    }

    /// The layout for `module`, made on first use with fresh (zero) state.
    fn prepare<M: Module>(&mut self, module: &M) {
        if self.layout.is_some() {
            return;
        }
        let layout = FlatLayout::of(module, self.comm.world_size());
        let pieces = layout.pieces(self.comm.rank());
        let decay = layout.slots.iter().map(|s| (self.decay_of)(s.id)).collect();
        if self.state.slots.is_empty() {
            self.state.slots = vec![vec![0.0; layout.shard_len()]; self.rule.state_slots()];
        }
        self.layout = Some((layout, pieces, decay));
    }

    /// This rank's shard of the reduced gradient: stage 1 all-reduces (or Adasum-combines)
    /// the whole gradient and keeps its shard; stage 2 reduce-scatters.
    fn reduce<M: Module>(
        &self,
        module: &M,
        mut grads: GradientsParams,
        layout: &FlatLayout,
    ) -> DistResult<Vec<f32>> {
        let shard = layout.shard(self.comm.rank());
        if self.stage == 1 {
            reduce_gradients(
                self.comm.as_ref(),
                module,
                &mut grads,
                DEFAULT_BUCKET_BYTES,
                self.reduction,
            )?;
            let full = layout.take_grads(module, &mut grads)?;
            return Ok(full[shard].to_vec());
        }
        let full = layout.take_grads(module, &mut grads)?;
        let mut mine = vec![0.0; layout.shard_len()];
        self.comm.reduce_scatter(&full, &mut mine, ReduceOp::Mean)?;
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
        self.prepare(&module);
        let (layout, pieces, decay) = self.layout.as_ref().expect("prepared above");
        let mut g = self.reduce(&module, grads, layout)?;
        let squares = slot_squares(self.comm.as_ref(), layout, pieces, &g)?;
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
        let mut mine = layout.shard_params(&module, self.comm.rank())?;
        apply(
            self.rule,
            lr,
            layout,
            pieces,
            decay,
            &mut mine,
            &g,
            &mut self.state,
            self.comm.as_ref(),
        )?;
        let mut all = vec![0.0; layout.padded];
        self.comm.all_gather(&mine, &mut all)?;
        let full_grad = if self.stage == 1 {
            layout.padded
        } else {
            layout.shard_len()
        };
        self.memory = MemoryUse {
            optimizer_state_bytes: self.state.slots.iter().map(Vec::len).sum::<usize>() * 4,
            gradient_bytes: full_grad * 4,
            parameter_bytes: layout.len * 4,
        };
        let tensor_grad_norms = if tensor_norms {
            layout
                .slots
                .iter()
                .zip(&squares)
                .map(|(s, q)| (s.id, q.sqrt() as f32))
                .collect()
        } else {
            Vec::new()
        };
        let module = layout.scatter_params(module, &all);
        Ok((
            module,
            UpdateReport {
                grad_norm,
                tensor_grad_norms,
            },
        ))
    }

    fn memory(&self) -> MemoryUse {
        self.memory
    }

    fn state_files(&self) -> DistResult<Vec<(String, Vec<u8>)>> {
        let Some((layout, ..)) = &self.layout else {
            return Ok(Vec::new());
        };
        state_files::write(self.comm.rank(), self.stage, layout, &self.state)
    }

    fn load_state(&mut self, module: &M, dirs: &[PathBuf]) -> DistResult<()> {
        self.prepare(module);
        let (layout, ..) = self.layout.as_ref().expect("prepared above");
        self.state = state_files::read(dirs, self.comm.rank(), layout, self.rule.state_slots())?;
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
