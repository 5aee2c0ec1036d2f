//! The optimizer a replicated run ([`crate::Replicated`], ZeRO stage 0) applies on every
//! rank to the whole module: Burn's [`ModuleOptimizer`] (one update per parameter), or a
//! fused one that updates all parameters in one pass over flat device buffers
//! (burn-onnx-train's CubeCL multi-tensor Adam/AdamW/LAMB). Both keep their state as Burn's
//! optimizer record (burn-pack bytes, keyed by parameter id), so a checkpoint written by
//! one resumes with the other: a GPU run's on the CPU and back.

use burn::module::Module;
use burn::optim::{GradientsParams, ModuleOptimizer};
use burn::tensor::Bytes;

use crate::error::{DistResult, state_error};
use crate::update::grad_norm::{GradNorm, clip_grad_norm};

/// An update of a whole module with its state in Burn's optimizer record format.
pub trait ReplicaOptimizer {
    /// Update `module` with `grads` (already synchronised and clipped) at rate `lr`.
    fn step<M: Module>(&mut self, lr: f64, module: M, grads: GradientsParams) -> DistResult<M>;
    /// Clip `grads` (already synchronised) to the global L2 norm `max_norm` (0: only
    /// measure) and update `module` at rate `lr`; returns the module and the norm before
    /// clipping. By default each gradient's sum of squares, then [`Self::step`]; a fused
    /// optimizer that lays every gradient end to end anyway measures and scales the flat
    /// buffer instead, on the device, its norm left there ([`GradNorm::OnDevice`]).
    fn step_clipped<M: Module>(
        &mut self,
        lr: f64,
        module: M,
        grads: GradientsParams,
        max_norm: f32,
    ) -> DistResult<(M, GradNorm)> {
        clip_then_step(self, lr, module, grads, max_norm)
    }
    /// Whether [`Self::step_scaled`] can update `module` (false by default).
    fn steps_scaled<M: Module>(&self, module: &M) -> bool {
        let _ = module;
        false
    }
    /// [`Self::step_clipped`] of `grads` (already synchronised) still multiplied by the
    /// loss scale `scale`: divided inside the step, and the step skipped (module and state
    /// untouched) when one of them is inf or NaN. Returns the module, the norm of the
    /// divided gradients (inf when skipped) and whether it was skipped. Only where
    /// [`Self::steps_scaled`] says so.
    fn step_scaled<M: Module>(
        &mut self,
        lr: f64,
        module: M,
        grads: GradientsParams,
        max_norm: f32,
        scale: f32,
    ) -> DistResult<(M, GradNorm, bool)> {
        let _ = (lr, module, grads, max_norm, scale);
        Err(state_error(
            "this optimizer does not divide loss-scaled gradients itself".into(),
        ))
    }
    /// The state as Burn's optimizer record (burn-pack bytes).
    fn record_bytes(&self) -> DistResult<Bytes>;
    /// Write the state as the optimizer's safetensors file (`record_safetensors`) to `w`;
    /// by default from [`Self::record_bytes`], streamed from the record's buffer.
    fn write_state(&self, w: &mut dyn std::io::Write) -> DistResult<()> {
        crate::storage::record_safetensors::write_record(self.record_bytes()?, w)
    }
    /// Replace the state with a record (from [`Self::record_bytes`] of either kind).
    fn load_record_bytes(&mut self, bytes: Bytes) -> DistResult<()>;
    /// Bytes of optimizer state held.
    fn state_bytes(&self) -> usize;
    /// Write the device tables the next step at rate `lr` reads (learning rate, bias
    /// corrections, decay factors) where the last step's launches read them, without
    /// stepping, and say whether this optimizer did: the launches of a captured update read
    /// them there when it is replayed. False (nothing written) by default.
    fn write_next_step(&mut self, lr: f64) -> bool {
        let _ = lr;
        false
    }
    /// Count a step a captured update's replay took (its tables written by
    /// [`Self::write_next_step`]).
    fn count_replayed_step(&mut self) {}
}

/// [`ReplicaOptimizer::step_clipped`]'s default: each gradient's sum of squares and the
/// clip ([`clip_grad_norm`]), then `optim`'s [`ReplicaOptimizer::step`]; for an override
/// that falls back to it.
pub fn clip_then_step<O: ReplicaOptimizer + ?Sized, M: Module>(
    optim: &mut O,
    lr: f64,
    module: M,
    mut grads: GradientsParams,
    max_norm: f32,
) -> DistResult<(M, GradNorm)> {
    let norm = clip_grad_norm(&module, &mut grads, max_norm)?;
    Ok((optim.step(lr, module, grads)?, GradNorm::Read(norm)))
}

impl ReplicaOptimizer for ModuleOptimizer {
    fn step<M: Module>(&mut self, lr: f64, module: M, grads: GradientsParams) -> DistResult<M> {
        Ok(ModuleOptimizer::step(self, lr, module, grads))
    }

    fn record_bytes(&self) -> DistResult<Bytes> {
        self.into_bytes()
            .map_err(|e| state_error(format!("cannot encode the optimizer record: {e:?}")))
    }

    fn load_record_bytes(&mut self, bytes: Bytes) -> DistResult<()> {
        *self = self
            .clone()
            .from_bytes(bytes)
            .map_err(|e| state_error(format!("not a valid optimizer record: {e:?}")))?;
        Ok(())
    }

    fn state_bytes(&self) -> usize {
        self.into_bytes().map(|b| b.len()).unwrap_or(0)
    }
}
