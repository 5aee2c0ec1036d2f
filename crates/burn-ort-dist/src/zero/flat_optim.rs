//! Optimizer updates over flat `f32` buffers: SGD (momentum, L2 decay), Adam (L2 decay),
//! AdamW (decoupled decay) and LAMB (per-tensor trust ratio), applied to one shard of the
//! flat layout in one pass ("multi-tensor apply"). The arithmetic follows Burn's
//! optimizers operation by operation, in f32, so a sharded run matches a replicated one.
//! LAMB's per-tensor norms are partial sums over the shard, all-reduced.

use crate::communicator::{Communicator, ReduceOp};
use crate::error::DistResult;
use crate::zero::layout::{FlatLayout, Piece};

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
    /// Velocity, or first and second moments.
    pub slots: Vec<Vec<f32>>,
}

/// Update `params` (this rank's shard) with `grads` (the reduced gradient of the same
/// shard). `decay[i]` is the weight decay of layout slot `i`; untrainable slots are left as
/// they are.
#[allow(clippy::too_many_arguments)]
pub fn apply(
    rule: Rule,
    lr: f64,
    layout: &FlatLayout,
    pieces: &[Piece],
    decay: &[f32],
    params: &mut [f32],
    grads: &[f32],
    state: &mut ShardState,
    comm: &dyn Communicator,
) -> DistResult<()> {
    state.step += 1;
    let t = state.step as i32;
    let lr32 = lr as f32;
    let trained = |p: &&Piece| layout.slots[p.slot].trainable;
    match rule {
        Rule::Sgd { momentum } => {
            for p in pieces.iter().filter(trained) {
                let wd = decay[p.slot];
                for i in p.local.clone() {
                    let g = if wd != 0.0 {
                        params[i] * wd + grads[i]
                    } else {
                        grads[i]
                    };
                    let step = if momentum == 0.0 {
                        g
                    } else {
                        let v = &mut state.slots[0][i];
                        *v = if t == 1 {
                            g
                        } else {
                            g * 1.0 + *v * momentum as f32
                        };
                        *v
                    };
                    params[i] -= step * lr32;
                }
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
            let (c1, c2) = (1f32 - beta1.powi(t), 1f32 - beta2.powi(t));
            let (f1, f2) = (1.0 - beta1, 1.0 - beta2);
            for p in pieces.iter().filter(trained) {
                let wd = decay[p.slot];
                let keep = (1.0 - lr * f64::from(wd)) as f32;
                for i in p.local.clone() {
                    let g = if !decoupled && wd != 0.0 {
                        params[i] * wd + grads[i]
                    } else {
                        grads[i]
                    };
                    let (m, v) = moments(state, i, g, beta1, beta2, f1, f2);
                    let delta = (m / c1) / ((v / c2).sqrt() + epsilon);
                    let p0 = if decoupled && wd != 0.0 {
                        params[i] * keep
                    } else {
                        params[i]
                    };
                    params[i] = p0 - delta * lr32;
                }
            }
        }
        Rule::Lamb {
            beta1,
            beta2,
            epsilon,
        } => {
            let (c1, c2) = (1f32 - beta1.powi(t), 1f32 - beta2.powi(t));
            let (f1, f2) = (1.0 - beta1, 1.0 - beta2);
            // The update direction u into `direction`, with per-slot partial |p|^2 and |u|^2.
            let mut direction = vec![0.0f32; params.len()];
            let mut norms = vec![0.0f32; 2 * layout.slots.len()];
            for p in pieces.iter().filter(trained) {
                let wd = decay[p.slot];
                let (mut pp, mut uu) = (0.0f64, 0.0f64);
                for i in p.local.clone() {
                    let (m, v) = moments(state, i, grads[i], beta1, beta2, f1, f2);
                    let mut u = (m / c1) / ((v / c2).sqrt() + epsilon);
                    if wd != 0.0 {
                        u += params[i] * wd;
                    }
                    direction[i] = u;
                    pp += f64::from(params[i]).powi(2);
                    uu += f64::from(u).powi(2);
                }
                norms[2 * p.slot] = pp as f32;
                norms[2 * p.slot + 1] = uu as f32;
            }
            if comm.world_size() > 1 {
                comm.all_reduce(&mut norms, ReduceOp::Sum)?;
            }
            for p in pieces.iter().filter(trained) {
                let (pn, un) = (norms[2 * p.slot].sqrt(), norms[2 * p.slot + 1].sqrt());
                let trust = if pn > 0.0 && un > 0.0 { pn / un } else { 1.0 };
                for i in p.local.clone() {
                    params[i] -= direction[i] * trust * lr32;
                }
            }
        }
    }
    Ok(())
}

/// Burn's moment update: `m = m b1 + g (1 - b1)`, `v = v b2 + g^2 (1 - b2)` (from zero on
/// the first step, which gives the same values).
fn moments(
    state: &mut ShardState,
    i: usize,
    g: f32,
    b1: f32,
    b2: f32,
    f1: f32,
    f2: f32,
) -> (f32, f32) {
    let m = state.slots[0][i] * b1 + g * f1;
    let v = state.slots[1][i] * b2 + (g * g) * f2;
    state.slots[0][i] = m;
    state.slots[1][i] = v;
    (m, v)
}
