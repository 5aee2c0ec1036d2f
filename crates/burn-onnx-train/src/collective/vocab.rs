//! Losses on logits split along the vocabulary over the tensor-parallel group (Megatron's
//! vocabulary-parallel cross-entropy): no rank ever holds a whole row of logits.
//!
//! For a row `z` split into the ranks' slices `z_r`, with `m` the row's maximum over the
//! group, `s_r = sum(exp(z_r - m))` and `t_r` the target's logit where rank `r` holds it
//! (0 elsewhere): `nll = log(sum_r s_r) + m - sum_r t_r`. The two sums are Megatron's `g`
//! (all-reduce forward, gradient passed through), so rank `r`'s logits get
//! `softmax - one_hot` on its own slice, as the whole model's would; `m` is a constant
//! shift (no gradient). Per row, forward moves three floats per rank; backward nothing.
//! On a GPU whose group moves device tensors (NCCL) they stay on the device.

use burn::tensor::{Int, Tensor, TensorData};

use super::CollectiveGroup;
use super::megatron::tp_reduce;
use crate::error::{OpError, OpResult};
use crate::value::FloatValue;

/// Which slice of the vocabulary a rank's logits hold.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VocabShard {
    /// The graph output holding the logits.
    pub output: String,
    /// The whole vocabulary.
    pub vocab: usize,
    /// First id of this rank's slice.
    pub start: usize,
    /// Ids of this rank's slice that exist (the rest of the slice is padding).
    pub valid: usize,
}

/// Logits split along the vocabulary, with the group holding the other slices.
#[derive(Debug, Clone)]
pub struct ShardedLogits {
    /// This rank's slice.
    pub shard: VocabShard,
    /// The tensor-parallel group.
    pub group: CollectiveGroup,
}

impl ShardedLogits {
    /// Negative log-likelihood of each row of `logits` (`[n, local]`: this rank's slice,
    /// padding included) at `targets` (ids of the whole vocabulary, already checked; any
    /// id for rows the caller weighs 0). A collective of the group.
    pub fn nll_rows(&self, logits: Tensor<2>, targets: &[i64]) -> OpResult<Tensor<1>> {
        let [n, local] = logits.dims();
        let device = logits.device();
        let z = if self.shard.valid < local {
            logits.narrow(1, 0, self.shard.valid)
        } else {
            logits
        };
        let row_max = self.group_max(z.clone().detach().max_dim(1))?;
        let sum_exp = (z.clone() - row_max.clone()).exp().sum_dim(1);
        let (start, valid) = (self.shard.start as i64, self.shard.valid as i64);
        let (local_ids, held): (Vec<i64>, Vec<f32>) = targets
            .iter()
            .map(|&t| {
                let at = t - start;
                if (0..valid).contains(&at) {
                    (at, 1.0)
                } else {
                    (0, 0.0)
                }
            })
            .unzip();
        let ids: Tensor<2, Int> =
            Tensor::from_data(TensorData::new(local_ids, vec![n, 1]), &device);
        let held: Tensor<2> = Tensor::from_data(TensorData::new(held, vec![n, 1]), &device);
        let target_logit = z.gather(1, ids) * held;
        let nll = self.sum(sum_exp)?.log() + row_max - self.sum(target_logit)?;
        Ok(nll.reshape([n]))
    }

    /// The whole vocabulary's top-1 id of each row of `logits` (`[n, local]` on the host;
    /// the first of equal maxima, as over one whole row). A collective of the group.
    pub fn argmax_rows(&self, logits: &ndarray::Array2<f32>) -> OpResult<Vec<usize>> {
        let n = logits.nrows();
        let mut mine = Vec::with_capacity(2 * n);
        for row in logits.outer_iter() {
            let (at, best) = row.iter().take(self.shard.valid).enumerate().fold(
                (0, f32::NEG_INFINITY),
                |acc, (i, &v)| if v > acc.1 { (i, v) } else { acc },
            );
            mine.extend([best, (self.shard.start + at) as f32]);
        }
        let all = self.gather(&mine)?;
        Ok((0..n)
            .map(|row| {
                all.chunks(2 * n)
                    .map(|r| (r[2 * row], r[2 * row + 1]))
                    .fold(
                        (f32::NEG_INFINITY, 0.0),
                        |acc, x| if x.0 > acc.0 { x } else { acc },
                    )
                    .1 as usize
            })
            .collect())
    }

    /// The maximum over the group of each entry of `x` (`[n, 1]`, no gradient).
    fn group_max(&self, x: Tensor<2>) -> OpResult<Tensor<2>> {
        let (dims, device) = (x.dims(), x.device());
        let on_device = self.group.0.device_collectives();
        let f32_here = x.dtype() == burn::tensor::DType::F32;
        if let Some(moves) = on_device.filter(|d| f32_here && d.works_on(&device)) {
            // The ranks' maxima side by side on the device, and their maximum.
            let n = dims[0] * dims[1];
            let all = moves
                .all_gather(x.without_autodiff().reshape([n]))
                .map_err(|e| OpError(format!("vocabulary-parallel loss: {e}")))?;
            return Ok(all
                .reshape([moves.world_size(), n])
                .max_dim(0)
                .reshape(dims));
        }
        let mine = burn_ort_dist::collective_host_values(x)
            .map_err(|e| OpError(format!("vocabulary-parallel loss: {e}")))?;
        let all = self.gather(&mine)?;
        let max: Vec<f32> = (0..mine.len())
            .map(|i| {
                all.chunks(mine.len())
                    .map(|r| r[i])
                    .fold(f32::NEG_INFINITY, f32::max)
            })
            .collect();
        Ok(Tensor::from_data(
            TensorData::new(max, dims.to_vec()),
            &device,
        ))
    }

    /// Megatron's `g` on a `[n, 1]` tensor.
    fn sum(&self, x: Tensor<2>) -> OpResult<Tensor<2>> {
        let dims = x.dims();
        let summed = tp_reduce(FloatValue::from_rank(x)?.tensor, &self.group);
        Ok(summed.reshape(dims))
    }

    fn gather(&self, mine: &[f32]) -> OpResult<Vec<f32>> {
        let mut all = vec![0f32; mine.len() * self.group.0.world_size()];
        self.group
            .0
            .all_gather(mine, &mut all)
            .map_err(|e| OpError(format!("vocabulary-parallel loss: {e}")))?;
        Ok(all)
    }
}
