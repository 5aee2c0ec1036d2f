//! Data-parallel averaging started from inside one backward pass (`overlap = "hooks"`,
//! PyTorch DDP's way): in the last micro-step of an update the model reads its parameters
//! through gradient hooks ([`crate::collective::grad_hooks`]), and each parameter's
//! gradient, once final, joins a bucket that a communication thread averages while the
//! rest of backward runs ([`burn_ort_dist::OverlappedSync::reduce_ready`]). With gradient
//! accumulation the earlier micro-steps' sum is added first, so what is averaged is the
//! update's whole gradient, as after backward.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use burn::module::ParamId;
use burn::optim::{GradientsAccumulator, GradientsParams};
use burn_ort_dist::{DataParallel, FlatGrad, OverlappedSync, SyncTimes, put_flat, take_flat};

use crate::collective::grad_hooks::GradSink;
use crate::error::{OnnxError, Result};
use crate::model::OnnxModel;

/// The sink of one update's hooked gradients.
pub struct ReadyGrads {
    sync: Mutex<Option<OverlappedSync>>,
    /// Parameter index (the model's order) to id.
    ids: Vec<ParamId>,
    /// The earlier micro-steps' gradients (empty without accumulation).
    earlier: HashMap<ParamId, Vec<f32>>,
}

fn dist_error(e: burn_ort_dist::DistError) -> OnnxError {
    OnnxError::field("config.parallel.overlap", e.to_string())
}

impl ReadyGrads {
    /// Open the averaging for `model`'s update; `acc` holds the gradients of the update's
    /// earlier micro-steps (read here, left in place).
    pub fn start(
        ddp: &DataParallel,
        model: &OnnxModel,
        acc: &mut GradientsAccumulator<OnnxModel>,
    ) -> Result<Arc<Self>> {
        let mut earlier = acc.grads();
        let flat =
            take_flat(model, &mut earlier, |_| true, ddp.comm().rank()).map_err(dist_error)?;
        let sums = flat.iter().map(|f| (f.id, f.values.clone())).collect();
        put_flat(model, &mut earlier, flat);
        acc.accumulate(model, earlier);
        Ok(Arc::new(ReadyGrads {
            sync: Mutex::new(Some(ddp.overlapped().map_err(dist_error)?)),
            ids: model.params().iter().map(|p| p.id).collect(),
            earlier: sums,
        }))
    }

    /// Wait for the averaging, put the averaged gradients into `grads` (the update's whole
    /// gradients) and mark them averaged for the update strategy.
    pub fn finish(&self, model: &OnnxModel, grads: &mut GradientsParams) -> Result<SyncTimes> {
        let sync = self
            .sync
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
            .expect("finish runs once");
        sync.finish(model, grads).map_err(dist_error)
    }
}

impl GradSink for ReadyGrads {
    fn ready(&self, param: usize, mut values: Vec<f32>, shape: Vec<usize>) {
        let id = self.ids[param];
        if let Some(earlier) = self.earlier.get(&id) {
            values.iter_mut().zip(earlier).for_each(|(v, e)| *v += e);
        }
        if let Some(sync) = self
            .sync
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .as_mut()
        {
            sync.reduce_ready(FlatGrad::new(id, shape, values));
        }
    }
}
