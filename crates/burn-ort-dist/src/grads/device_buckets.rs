//! Gradient averaging with the buckets on the GPU: each bucket is its gradients laid end
//! to end on the device, averaged by the group's [`DeviceCollectives`] (NCCL), and cut
//! back into the gradients, with no host copy. Same bucket sizes and order as the host
//! path of [`crate::grads::grad_sync`].

use std::collections::{HashMap, HashSet};

use burn::module::{Module, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::Tensor;

use crate::comm::communicator::{DeviceCollectives, ReduceOp};
use crate::error::DistResult;
use crate::grads::buckets::bucket_ranges;

/// Takes every gradient out, flattened.
struct Take<'a> {
    grads: &'a mut GradientsParams,
    skip: &'a HashSet<ParamId>,
    taken: Vec<(ParamId, Tensor<1>)>,
}

impl ModuleVisitor for Take<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        if self.skip.contains(&param.id) {
            return;
        }
        if let Some(g) = self.grads.remove::<D>(param.id) {
            let n: usize = g.dims().iter().product();
            self.taken.push((param.id, g.reshape([n])));
        }
    }
}

/// Puts the averaged gradients back in their parameters' shapes.
struct Put<'a> {
    grads: &'a mut GradientsParams,
    reduced: HashMap<ParamId, Tensor<1>>,
}

impl ModuleVisitor for Put<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        if let Some(g) = self.reduced.remove(&param.id) {
            self.grads.register(param.id, g.reshape(param.val().dims()));
        }
    }
}

/// Average the gradients of `module` over the group of `device`, bucket by bucket, on the
/// device, leaving out the parameters in `skip` (averaged already).
pub fn reduce_on_device<M: Module>(
    device: &dyn DeviceCollectives,
    module: &M,
    grads: &mut GradientsParams,
    bucket_bytes: usize,
    skip: &HashSet<ParamId>,
) -> DistResult<()> {
    let mut take = Take {
        grads,
        skip,
        taken: Vec::new(),
    };
    module.visit(&mut take);
    let Take { grads, taken, .. } = take;
    let lens: Vec<usize> = taken.iter().map(|(_, g)| g.dims()[0]).collect();
    let mut reduced = HashMap::with_capacity(taken.len());
    for range in bucket_ranges(&lens, bucket_bytes) {
        let parts: Vec<Tensor<1>> = taken[range.clone()]
            .iter()
            .map(|(_, g)| g.clone())
            .collect();
        let bucket = device.all_reduce(Tensor::cat(parts, 0), ReduceOp::Mean)?;
        let mut offset = 0;
        for (id, g) in &taken[range] {
            let n = g.dims()[0];
            reduced.insert(*id, bucket.clone().slice(offset..offset + n));
            offset += n;
        }
    }
    module.visit(&mut Put { grads, reduced });
    Ok(())
}
