//! ZeRO's update where the group moves device tensors itself (NCCL on CUDA devices): the
//! shard's gradient, parameters and optimizer state stay on the device, as PyTorch's
//! `ZeroRedundancyOptimizer` and DeepSpeed keep them. Stage 1 slices the device-averaged
//! gradients, stage 2 reduce-scatters them, stage 3 takes the module's chunks' gradients;
//! the global norm and the clip factor are computed on the device ([`GradNorm::OnDevice`]);
//! the update runs over the flat shard ([`super::device_step`]); stages 1 and 2 all-gather
//! the new shard into every parameter, stage 3 writes its chunks. The host reads per-tensor
//! sums only where something asks for them: per-tensor norms, pipeline model parallelism's
//! shared norm, LAMB's trust ratios.

use burn::module::Module;
use burn::optim::GradientsParams;
use burn::tensor::{Device, Tensor};

use super::Zero;
use super::device_flat::{
    flat_range, gather_params, grad_tensors, param_tensors, put_chunks, reduce_scatter,
};
use super::device_step::{DeviceState, lamb_trust, piece_squares};
use super::layout::FlatLayout;
use crate::comm::communicator::{DeviceCollectives, ReduceOp};
use crate::error::{DistError, DistResult};
use crate::grads::grad_sync::{DEFAULT_BUCKET_BYTES, Reduction, reduce_gradients};
use crate::update::grad_norm::{GradNorm, clip_scale};
use crate::update::strategy::{MemoryUse, ModelParallel, UpdateReport};

impl Zero {
    /// The update on the device, through `group`.
    pub(super) fn update_on_device<M: Module>(
        &mut self,
        group: &dyn DeviceCollectives,
        (lr, module, mut grads): (f64, M, GradientsParams),
        (max_norm, tensor_norms): (f32, bool),
    ) -> DistResult<(M, UpdateReport)> {
        let device = module.devices().into_iter().next().unwrap_or_default();
        let local = (self.stage == 3).then(|| FlatLayout::of(&module, 1));
        let g = self.shard_gradient(group, &module, &mut grads, local.as_ref(), &device)?;
        let (g, report) = self.clipped(group, g, max_norm, tensor_norms)?;
        let (layout, rank) = (&self.layout, self.comm.rank());
        let p = match &local {
            Some(l) => flat_range(l, &param_tensors(&module), 0..l.len, &device),
            None => flat_range(layout, &param_tensors(&module), layout.shard(rank), &device),
        };
        if self.device_state.is_none() {
            let state = DeviceState::upload(
                self.rule,
                &self.state,
                (&self.layout, &self.pieces),
                &self.decay,
                &device,
            );
            // The host copy is not kept up to date: a checkpoint reads the device's.
            self.state.slots = super::state_vectors::StateVectors::in_memory(0, 0);
            if self.comm.rank() == 0 {
                tracing::info!(
                    stage = self.stage,
                    shard_values = self.layout.shard_len(),
                    "ZeRO: shards updated on the device"
                );
            }
            self.device_state = Some(state);
        }
        self.state.step += 1;
        let (comm, layout, pieces) = (self.comm.as_ref(), &self.layout, &self.pieces);
        let state = self.device_state.as_mut().expect("made above");
        let p = state.step((self.rule, lr, self.state.step as i32), p, g, |p, u| {
            lamb_trust(
                comm,
                layout,
                pieces,
                piece_squares(p, pieces)?,
                piece_squares(u, pieces)?,
            )
        })?;
        let module = match &local {
            Some(l) => put_chunks(module, l, &p),
            None => gather_params(group, &self.layout, module, p)?,
        };
        self.memory = MemoryUse {
            optimizer_state_bytes: state.bytes(),
            gradient_bytes: match self.stage {
                1 => self.layout.padded * 4,
                _ => self.layout.shard_len() * 4,
            },
            parameter_bytes: local.as_ref().map_or(self.layout.len, |l| l.len) * 4,
        };
        Ok((module, report))
    }

    /// This rank's shard of the reduced gradient, flat on `device`.
    fn shard_gradient<M: Module>(
        &self,
        group: &dyn DeviceCollectives,
        module: &M,
        grads: &mut GradientsParams,
        local: Option<&FlatLayout>,
        device: &Device,
    ) -> DistResult<Tensor<1>> {
        let (layout, rank) = (&self.layout, self.comm.rank());
        let g = match local {
            Some(l) => flat_range(l, &grad_tensors(l, module, grads), 0..l.len, device),
            None if self.stage == 1 => {
                // Averaged on the device in buckets (the group's device collectives).
                reduce_gradients(
                    self.comm.as_ref(),
                    module,
                    grads,
                    DEFAULT_BUCKET_BYTES,
                    Reduction::Mean,
                )?;
                let tensors = grad_tensors(layout, module, grads);
                flat_range(layout, &tensors, layout.shard(rank), device)
            }
            None => reduce_scatter(group, layout, &grad_tensors(layout, module, grads), device)?,
        };
        if g.dims()[0] != layout.shard_len() {
            return Err(DistError::Invalid {
                rank,
                message: format!(
                    "ZeRO-{}: a gradient shard of {} values, the layout's is {} (is the module sharded as the stage expects?)",
                    self.stage,
                    g.dims()[0],
                    layout.shard_len()
                ),
            });
        }
        Ok(g)
    }

    /// `g` clipped to the global norm `max_norm` (0: not clipped), and the report: the norm
    /// left on the device, unless per-tensor norms or other model parts need the per-tensor
    /// sums on the host.
    fn clipped(
        &self,
        group: &dyn DeviceCollectives,
        g: Tensor<1>,
        max_norm: f32,
        tensor_norms: bool,
    ) -> DistResult<(Tensor<1>, UpdateReport)> {
        let layout = &self.layout;
        if tensor_norms || self.model_parallel.is_some() {
            let mut mine = vec![0.0f64; layout.slots.len()];
            for (p, s) in self.pieces.iter().zip(piece_squares(&g, &self.pieces)?) {
                mine[p.slot] = f64::from(s);
            }
            let squares = super::combine_slot_squares(self.comm.as_ref(), layout, &mine)?;
            let ids = layout.slots.iter().map(|s| s.id);
            let norm = ModelParallel::global_norm(
                self.model_parallel.as_ref(),
                ids.clone().zip(squares.iter().copied()),
            )?;
            let scale = clip_scale(norm, max_norm);
            let g = if scale != 1.0 { g.mul_scalar(scale) } else { g };
            let report = UpdateReport::new(norm, ids.zip(squares), tensor_norms);
            return Ok((g, report));
        }
        let squares = group.all_reduce(g.clone().square().sum(), ReduceOp::Sum)?;
        let g = if max_norm > 0.0 {
            // clip_grad_norm_'s factor, max_norm / (norm + 1e-6) above max_norm.
            let norm = squares.clone().sqrt();
            let factor =
                Tensor::<1>::full([1], max_norm, &g.device()).div(norm.clone().add_scalar(1e-6));
            let factor =
                Tensor::ones([1], &g.device()).mask_where(norm.greater_elem(max_norm), factor);
            g.mul(factor)
        } else {
            g
        };
        Ok((g, UpdateReport::new(GradNorm::OnDevice(squares), [], false)))
    }
}
