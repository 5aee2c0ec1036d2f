//! Optimizer updates over flat `f32` buffers: SGD (momentum, L2 decay), Adam (L2 decay),
//! AdamW (decoupled decay) and LAMB (per-tensor trust ratio), applied to one shard of the
//! flat layout in one pass ("multi-tensor apply"). The arithmetic follows Burn's
//! optimizers operation by operation, in f32, so a sharded run matches a replicated one.
//! LAMB's per-tensor norms are partial sums over the shard, all-reduced.

use crate::comm::communicator::{Communicator, ReduceOp};
use crate::error::DistResult;
use crate::update::zero::layout::{FlatLayout, Piece};
use crate::update::zero::state_vectors::StateVectors;

/// An update rule and its hyper-parameters.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Rule {
    /// SGD; `momentum` 0 disables the velocity (no dampening, no Nesterov).
    Sgd {
        /// Momentum factor.
        momentum: f64,
    },
    /// Adam with L2 weight decay added to the gradient.
    Adam {
        /// beta1.
        beta1: f32,
        /// beta2.
        beta2: f32,
        /// epsilon.
        epsilon: f32,
    },
    /// AdamW (decoupled weight decay).
    AdamW {
        /// beta1.
        beta1: f32,
        /// beta2.
        beta2: f32,
        /// epsilon.
        epsilon: f32,
    },
    /// LAMB with bias correction and the trust ratio `|p| / |u|`.
    Lamb {
        /// beta1.
        beta1: f32,
        /// beta2.
        beta2: f32,
        /// epsilon.
        epsilon: f32,
    },
}

impl Rule {
    /// State vectors per element: SGD's velocity, or Adam's two moments.
    pub fn state_slots(&self) -> usize {
        match self {
            Rule::Sgd { momentum } if *momentum == 0.0 => 0,
            Rule::Sgd { .. } => 1,
            _ => 2,
        }
    }
}

/// One rank's optimizer state: `state_slots` vectors of the shard's length.
#[derive(Debug, Clone, PartialEq)]
pub struct ShardState {
    /// Updates applied so far.
    pub step: usize,
    /// Velocity, or first and second moments (in memory or on disk).
    pub slots: StateVectors,
}

/// This rank's shard in one flat buffer as the values of each of its `pieces` (in order,
/// as [`apply`] takes them).
pub fn piece_values<'a>(flat: &'a mut [f32], pieces: &[Piece]) -> Vec<&'a mut [f32]> {
    let mut rest = flat;
    let mut at = 0;
    let mut out = Vec::with_capacity(pieces.len());
    for p in pieces {
        let (_, tail) = std::mem::take(&mut rest).split_at_mut(p.local.start - at);
        let (mine, tail) = tail.split_at_mut(p.local.len());
        out.push(mine);
        rest = tail;
        at = p.local.end;
    }
    out
}

/// Update this rank's shard with `grads` (the reduced gradient of the shard): `params[k]`
/// holds the values of `pieces[k]` (from [`piece_values`], or the parameters' own buffers
/// when a ZeRO-3 module is updated in place). `decay[i]` is the weight decay of layout
/// slot `i`; untrainable slots are left as they are.
#[allow(clippy::too_many_arguments)]
pub fn apply(
    rule: Rule,
    lr: f64,
    layout: &FlatLayout,
    pieces: &[Piece],
    decay: &[f32],
    params: &mut [&mut [f32]],
    grads: &[f32],
    state: &mut ShardState,
    comm: &dyn Communicator,
) -> DistResult<()> {
    if params.len() != pieces.len()
        || pieces
            .iter()
            .zip(params.iter())
            .any(|(p, w)| w.len() != p.local.len())
    {
        return Err(crate::error::DistError::Invalid {
            rank: comm.rank(),
            message: "ZeRO update: the parameter values do not match the shard's pieces".into(),
        });
    }
    state.step += 1;
    let t = state.step as i32;
    let lr32 = lr as f32;
    let trained = |(p, _): &(&Piece, &mut &mut [f32])| layout.slots[p.slot].trainable;
    // State on disk, and parameters in a registered file mapping: each piece's pages are
    // released once it is updated.
    let (mut vectors, releaser) = state.slots.get_mut();
    let done = |p: &Piece, w: &[f32]| {
        if let Some(r) = &releaser {
            r.release(p.local.clone());
        }
        crate::storage::mapped::release(w);
    };
    match rule {
        Rule::Sgd { momentum } => {
            for (p, w) in pieces.iter().zip(params.iter_mut()).filter(trained) {
                let wd = decay[p.slot];
                for (k, i) in p.local.clone().enumerate() {
                    let g = if wd != 0.0 {
                        w[k] * wd + grads[i]
                    } else {
                        grads[i]
                    };
                    let step = if momentum == 0.0 {
                        g
                    } else {
                        let v = &mut vectors[0][i];
                        *v = if t == 1 {
                            g
                        } else {
                            g * 1.0 + *v * momentum as f32
                        };
                        *v
                    };
                    w[k] -= step * lr32;
                }
                done(p, &**w);
            }
        }
        Rule::Adam {
            beta1,
            beta2,
            epsilon,
        }
        | Rule::AdamW {
            beta1,
            beta2,
            epsilon,
        } => {
            let decoupled = matches!(rule, Rule::AdamW { .. });
            let step = AdamStep::new(beta1, beta2, epsilon, lr, t);
            for (p, w) in pieces.iter().zip(params.iter_mut()).filter(trained) {
                let wd = decay[p.slot];
                let keep = (1.0 - lr * f64::from(wd)) as f32;
                for (k, i) in p.local.clone().enumerate() {
                    let g = if !decoupled && wd != 0.0 {
                        w[k] * wd + grads[i]
                    } else {
                        grads[i]
                    };
                    let [m, v] = &mut vectors[..] else {
                        unreachable!("Adam keeps two moments")
                    };
                    let delta = step.direction(g, &mut m[i], &mut v[i]);
                    let p0 = if decoupled && wd != 0.0 {
                        w[k] * keep
                    } else {
                        w[k]
                    };
                    w[k] = p0 - delta * lr32;
                }
                done(p, &**w);
            }
        }
        Rule::Lamb {
            beta1,
            beta2,
            epsilon,
        } => {
            let step = AdamStep::new(beta1, beta2, epsilon, lr, t);
            // The update direction u into `direction`, with per-slot partial |p|^2 and |u|^2.
            let mut direction = vec![0.0f32; grads.len()];
            let mut norms = vec![0.0f32; 2 * layout.slots.len()];
            for (p, w) in pieces.iter().zip(params.iter_mut()).filter(trained) {
                let wd = decay[p.slot];
                let (mut pp, mut uu) = (0.0f64, 0.0f64);
                for (k, i) in p.local.clone().enumerate() {
                    let [m, v] = &mut vectors[..] else {
                        unreachable!("LAMB keeps two moments")
                    };
                    let mut u = step.direction(grads[i], &mut m[i], &mut v[i]);
                    if wd != 0.0 {
                        u += w[k] * wd;
                    }
                    direction[i] = u;
                    pp += f64::from(w[k]).powi(2);
                    uu += f64::from(u).powi(2);
                }
                norms[2 * p.slot] = pp as f32;
                norms[2 * p.slot + 1] = uu as f32;
                done(p, &**w);
            }
            if comm.world_size() > 1 {
                comm.all_reduce(&mut norms, ReduceOp::Sum)?;
            }
            for (p, w) in pieces.iter().zip(params.iter_mut()).filter(trained) {
                let (pn, un) = (norms[2 * p.slot].sqrt(), norms[2 * p.slot + 1].sqrt());
                let trust = if pn > 0.0 && un > 0.0 { pn / un } else { 1.0 };
                for (k, i) in p.local.clone().enumerate() {
                    w[k] -= direction[i] * trust * lr32;
                }
                crate::storage::mapped::release(&**w);
            }
        }
    }
    Ok(())
}

/// The scalars of one Adam-family step (Adam, AdamW, LAMB), and its per-element arithmetic,
/// shared by the sharded update here and the fused replicated one on the CPU.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamStep {
    /// Learning rate.
    pub lr: f32,
    /// beta1, beta2.
    pub beta: [f32; 2],
    /// `1 - beta1`, `1 - beta2`.
    pub one_minus_beta: [f32; 2],
    /// The bias corrections `1 - beta1^t`, `1 - beta2^t`.
    pub correction: [f32; 2],
    /// epsilon.
    pub epsilon: f32,
}

impl AdamStep {
    /// Step `t` (from 1) at learning rate `lr`.
    pub fn new(beta1: f32, beta2: f32, epsilon: f32, lr: f64, t: i32) -> Self {
        AdamStep {
            lr: lr as f32,
            beta: [beta1, beta2],
            one_minus_beta: [1.0 - beta1, 1.0 - beta2],
            correction: [1f32 - beta1.powi(t), 1f32 - beta2.powi(t)],
            epsilon,
        }
    }

    /// Burn's moment update, `m = m b1 + g (1 - b1)`, `v = v b2 + g^2 (1 - b2)` (from zero on
    /// the first step, which gives the same values), and Adam's direction
    /// `m^ / (sqrt(v^) + eps)`.
    #[inline(always)]
    pub fn direction(&self, g: f32, m: &mut f32, v: &mut f32) -> f32 {
        *m = *m * self.beta[0] + g * self.one_minus_beta[0];
        *v = *v * self.beta[1] + (g * g) * self.one_minus_beta[1];
        (*m / self.correction[0]) / ((*v / self.correction[1]).sqrt() + self.epsilon)
    }
}
