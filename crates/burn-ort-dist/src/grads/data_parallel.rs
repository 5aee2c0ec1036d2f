//! [`DataParallel`]: the one-line wrapper a Burn user puts around their optimizer, the way
//! PyTorch users write `DistributedDataParallel(model)` or Horovod users
//! `DistributedOptimizer(opt)`:
//!
//! ```ignore
//! let ddp = DataParallel::new(comm);
//! let model = ddp.broadcast_parameters(model)?;   // every rank starts from rank 0's weights
//! let mut optim = ddp.wrap(optim);                // averages gradients inside step()
//! model = optim.step(lr, model, grads)?;
//! ```
//!
//! To hide the averaging behind backward, hand finished gradients to the
//! [`crate::OverlappedSync`] of [`DataParallel::overlapped`] (in `overlap.rs`) as backward produces them; `sync` then
//! averages only the rest.

use std::collections::HashSet;
use std::sync::{Arc, Mutex, PoisonError};

use burn::module::{Module, ModuleMapper, Param, ParamId};
use burn::optim::{GradientsParams, ModuleOptimizer};
use burn::tensor::{Tensor, TensorData};

use crate::comm::communicator::Communicator;
use crate::error::{DistError, DistResult};
use crate::grads::grad_sync::{DEFAULT_BUCKET_BYTES, Reduction, reduce_gradients_except};

/// Data-parallel settings around a communicator. Clones share the record of gradients
/// averaged during backward.
#[derive(Clone)]
pub struct DataParallel {
    comm: Arc<dyn Communicator>,
    bucket_bytes: usize,
    reduction: Reduction,
    reduced: Arc<Mutex<HashSet<ParamId>>>,
}

impl DataParallel {
    /// Mean reduction, 25 MB buckets.
    pub fn new(comm: Arc<dyn Communicator>) -> Self {
        DataParallel {
            comm,
            bucket_bytes: DEFAULT_BUCKET_BYTES,
            reduction: Reduction::Mean,
            reduced: Arc::default(),
        }
    }

    /// Bucket size in bytes.
    pub fn with_bucket_bytes(mut self, bytes: usize) -> Self {
        self.bucket_bytes = bytes;
        self
    }

    /// Gradient combination rule.
    pub fn with_reduction(mut self, reduction: Reduction) -> Self {
        self.reduction = reduction;
        self
    }

    /// The communicator.
    pub fn comm(&self) -> &Arc<dyn Communicator> {
        &self.comm
    }

    /// The gradient combination rule.
    pub fn reduction(&self) -> Reduction {
        self.reduction
    }

    /// Bucket size in bytes.
    pub fn bucket_bytes(&self) -> usize {
        self.bucket_bytes
    }

    /// The gradients of `ids` for the coming [`Self::sync`] are averaged already.
    pub(crate) fn mark_reduced(&self, ids: impl IntoIterator<Item = ParamId>) {
        self.reduced
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .extend(ids);
    }

    /// Combine `grads` across ranks (those marked reduced excepted; the marks are used up).
    pub fn sync<M: Module>(&self, module: &M, grads: &mut GradientsParams) -> DistResult<()> {
        let skip =
            std::mem::take(&mut *self.reduced.lock().unwrap_or_else(PoisonError::into_inner));
        reduce_gradients_except(
            self.comm.as_ref(),
            module,
            grads,
            self.bucket_bytes,
            self.reduction,
            &skip,
        )
    }

    /// Replace every float parameter by rank 0's value.
    pub fn broadcast_parameters<M: Module>(&self, module: M) -> DistResult<M> {
        if self.comm.world_size() == 1 {
            return Ok(module);
        }
        let mut mapper = Broadcast {
            comm: self.comm.as_ref(),
            error: None,
        };
        let module = module.map(&mut mapper);
        match mapper.error {
            Some(e) => Err(e),
            None => Ok(module),
        }
    }

    /// Check that every rank passes the same bytes (e.g. its serialised config); the error
    /// says which rank differs from rank 0.
    pub fn check_consistent(&self, fingerprint: &[u8]) -> DistResult<()> {
        let h = fnv(fingerprint);
        // Two 24-bit halves are exact in f32.
        let mine = [(h & 0xff_ffff) as f32, ((h >> 24) & 0xff_ffff) as f32];
        let mut all = vec![0.0; 2 * self.comm.world_size()];
        self.comm.all_gather(&mine, &mut all)?;
        for (r, pair) in all.chunks(2).enumerate() {
            if pair != &all[..2] {
                return Err(DistError::Invalid {
                    rank: self.comm.rank(),
                    message: format!("rank {r} runs a different configuration than rank 0"),
                });
            }
        }
        Ok(())
    }

    /// Wrap an optimizer so that `step` synchronises gradients first.
    pub fn wrap(&self, optim: ModuleOptimizer) -> DistributedOptimizer {
        DistributedOptimizer {
            inner: optim,
            ddp: self.clone(),
        }
    }
}

fn fnv(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3)
    })
}

struct Broadcast<'a> {
    comm: &'a dyn Communicator,
    error: Option<DistError>,
}

impl ModuleMapper for Broadcast<'_> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        if self.error.is_some() {
            return param;
        }
        let comm = self.comm;
        let mut failed = None;
        let param = param.map(|t| {
            let require = t.is_require_grad();
            let device = t.device();
            let shape = t.dims().to_vec();
            let mut values = match crate::collective_host_values(t.clone()) {
                Ok(v) => v,
                Err(e) => {
                    failed = Some(DistError::Invalid {
                        rank: comm.rank(),
                        message: format!("cannot read a parameter: {e}"),
                    });
                    return t;
                }
            };
            if let Err(e) = comm.broadcast(&mut values, 0) {
                failed = Some(e);
                return t;
            }
            Tensor::<D>::from_data(TensorData::new(values, shape), &device)
                .set_require_grad(require)
        });
        self.error = failed;
        param
    }
}

/// An optimizer whose `step` averages gradients across ranks before updating.
pub struct DistributedOptimizer {
    inner: ModuleOptimizer,
    ddp: DataParallel,
}

impl DistributedOptimizer {
    /// Synchronise `grads`, then update `module` at learning rate `lr`.
    pub fn step<M: Module>(
        &mut self,
        lr: f64,
        module: M,
        mut grads: GradientsParams,
    ) -> DistResult<M> {
        self.ddp.sync(&module, &mut grads)?;
        Ok(self.inner.step(lr, module, grads))
    }

    /// The wrapped optimizer (for checkpoints).
    pub fn inner(&self) -> &ModuleOptimizer {
        &self.inner
    }
}
