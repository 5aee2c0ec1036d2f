//! ZeRO's update rules over flat device tensors of this rank's shard: the arithmetic of
//! [`super::flat_optim::apply`] operation by operation, in f32, as tensor operations (one
//! pass over the shard each, on any backend), with the optimizer state kept on the device
//! between updates ([`DeviceState`]) and brought to the host only for a checkpoint.

use burn::tensor::{Device, Int, Tensor, TensorData};

use super::flat_optim::{AdamStep, Rule, ShardState};
use super::layout::{FlatLayout, Piece};
use super::state_vectors::StateVectors;
use crate::comm::communicator::{Communicator, ReduceOp};
use crate::error::{DistResult, state_error};

/// One rank's optimizer state on the device.
pub struct DeviceState {
    /// Velocity, or first and second moments, each of the shard's length.
    vectors: Vec<Tensor<1>>,
    /// Each element's weight decay (0 in frozen parameters and the padding).
    decay: Tensor<1>,
    /// Each element's piece (the number of pieces for the padding): LAMB's trust ratios
    /// are per piece.
    piece_of: Option<Tensor<1, Int>>,
}

/// A flat f32 tensor of `values` on `device`.
fn upload(values: Vec<f32>, device: &Device) -> Tensor<1> {
    let n = values.len();
    Tensor::from_data(TensorData::new(values, [n]), device)
}

impl DeviceState {
    /// `state` (in host memory or on disk) on `device`, for `rule` over the shard made of
    /// `pieces` of `layout`; `decay[i]` is slot `i`'s weight decay.
    pub fn upload(
        rule: Rule,
        state: &ShardState,
        (layout, pieces): (&FlatLayout, &[Piece]),
        decay: &[f32],
        device: &Device,
    ) -> Self {
        let n = layout.shard_len();
        let vectors = state
            .slots
            .get()
            .into_iter()
            .map(|v| upload(v.to_vec(), device))
            .collect();
        let mut per_element = vec![0.0f32; n];
        for p in pieces.iter().filter(|p| layout.slots[p.slot].trainable) {
            per_element[p.local.clone()].fill(decay[p.slot]);
        }
        let piece_of = matches!(rule, Rule::Lamb { .. }).then(|| {
            let mut of = vec![pieces.len() as i32; n];
            for (k, p) in pieces.iter().enumerate() {
                of[p.local.clone()].fill(k as i32);
            }
            Tensor::from_data(TensorData::new(of, [n]), device)
        });
        DeviceState {
            vectors,
            decay: upload(per_element, device),
            piece_of,
        }
    }

    /// The state in host memory, for a checkpoint: `step` updates applied.
    pub fn download(&self, step: usize) -> DistResult<ShardState> {
        let vectors = self
            .vectors
            .iter()
            .map(|v| {
                crate::collective_host_values(v.clone())
                    .map_err(|e| state_error(format!("cannot read the optimizer state: {e}")))
            })
            .collect::<DistResult<Vec<_>>>()?;
        Ok(ShardState {
            step,
            slots: StateVectors::from(vectors),
        })
    }

    /// Device bytes of the state (the decay and piece indices included).
    pub fn bytes(&self) -> usize {
        let n = self.decay.dims()[0];
        n * 4 * (self.vectors.len() + 1 + usize::from(self.piece_of.is_some()))
    }

    /// The shard's parameters `p` after update `t` (from 1) of `rule` at learning rate `lr`
    /// with the shard's reduced, clipped gradient `g`; `trust` gives LAMB's per-piece trust
    /// ratios from the parameters and the update direction (per-piece norms cross ranks).
    pub fn step(
        &mut self,
        (rule, lr, t): (Rule, f64, i32),
        p: Tensor<1>,
        g: Tensor<1>,
        trust: impl FnOnce(&Tensor<1>, &Tensor<1>) -> DistResult<Vec<f32>>,
    ) -> DistResult<Tensor<1>> {
        let lr32 = lr as f32;
        let l2 = |g: Tensor<1>| p.clone().mul(self.decay.clone()).add(g);
        match rule {
            Rule::Sgd { momentum } => {
                let g = l2(g);
                let step = if momentum == 0.0 {
                    g
                } else {
                    let v = if t == 1 {
                        g
                    } else {
                        g.add(self.vectors[0].clone().mul_scalar(momentum as f32))
                    };
                    self.vectors[0] = v.clone();
                    v
                };
                Ok(p.sub(step.mul_scalar(lr32)))
            }
            Rule::Adam {
                beta1,
                beta2,
                epsilon,
            } => {
                let g = l2(g);
                let direction = self.direction(AdamStep::new(beta1, beta2, epsilon, lr, t), g);
                Ok(p.sub(direction.mul_scalar(lr32)))
            }
            Rule::AdamW {
                beta1,
                beta2,
                epsilon,
            } => {
                let direction = self.direction(AdamStep::new(beta1, beta2, epsilon, lr, t), g);
                let keep = self.decay.clone().mul_scalar(-lr32).add_scalar(1.0);
                Ok(p.mul(keep).sub(direction.mul_scalar(lr32)))
            }
            Rule::Lamb {
                beta1,
                beta2,
                epsilon,
            } => {
                let direction = self.direction(AdamStep::new(beta1, beta2, epsilon, lr, t), g);
                let u = direction.add(p.clone().mul(self.decay.clone()));
                let per_piece = trust(&p, &u)?;
                let piece_of = self
                    .piece_of
                    .clone()
                    .ok_or_else(|| state_error("LAMB's state has no piece indices".into()))?;
                let trust = upload(per_piece, &p.device()).select(0, piece_of);
                Ok(p.sub(u.mul(trust).mul_scalar(lr32)))
            }
        }
    }

    /// Adam's moment update and direction `m^ / (sqrt(v^) + eps)` (as
    /// [`AdamStep::direction`]), the moments kept.
    fn direction(&mut self, s: AdamStep, g: Tensor<1>) -> Tensor<1> {
        let [m, v] = &mut self.vectors[..] else {
            unreachable!("Adam keeps two moments")
        };
        *m = m
            .clone()
            .mul_scalar(s.beta[0])
            .add(g.clone().mul_scalar(s.one_minus_beta[0]));
        *v = v
            .clone()
            .mul_scalar(s.beta[1])
            .add(g.clone().mul(g).mul_scalar(s.one_minus_beta[1]));
        let denominator = v
            .clone()
            .div_scalar(s.correction[1])
            .sqrt()
            .add_scalar(s.epsilon);
        m.clone().div_scalar(s.correction[0]).div(denominator)
    }
}

/// Each piece's sum of squares of `x` (the shard's flat values), on the device, read at
/// once.
pub fn piece_squares(x: &Tensor<1>, pieces: &[Piece]) -> DistResult<Vec<f32>> {
    if pieces.is_empty() {
        return Ok(Vec::new());
    }
    let sums = pieces
        .iter()
        .map(|p| x.clone().slice(p.local.clone()).square().sum())
        .collect();
    crate::collective_host_values(Tensor::cat(sums, 0))
        .map_err(|e| state_error(format!("cannot read the shard's sums of squares: {e}")))
}

/// LAMB's trust ratio `|p| / |u|` of each piece (1 where either norm is 0, 0 for a frozen
/// piece, and a last 0 for the padding) from this rank's per-piece sums of squares of the
/// parameters and the direction, summed per parameter over the ranks.
pub fn lamb_trust(
    comm: &dyn Communicator,
    layout: &FlatLayout,
    pieces: &[Piece],
    p_squares: Vec<f32>,
    u_squares: Vec<f32>,
) -> DistResult<Vec<f32>> {
    let trained = |p: &Piece| layout.slots[p.slot].trainable;
    let mut norms = vec![0.0f32; 2 * layout.slots.len()];
    for ((p, pp), uu) in pieces.iter().zip(p_squares).zip(u_squares) {
        if trained(p) {
            norms[2 * p.slot] = pp;
            norms[2 * p.slot + 1] = uu;
        }
    }
    if comm.world_size() > 1 {
        comm.all_reduce(&mut norms, ReduceOp::Sum)?;
    }
    let mut trust: Vec<f32> = pieces
        .iter()
        .map(|p| {
            let (pn, un) = (norms[2 * p.slot].sqrt(), norms[2 * p.slot + 1].sqrt());
            match trained(p) {
                false => 0.0,
                true if pn > 0.0 && un > 0.0 => pn / un,
                true => 1.0,
            }
        })
        .collect();
    trust.push(0.0);
    Ok(trust)
}
