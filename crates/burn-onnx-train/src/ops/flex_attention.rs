//! `FlexAttention` (`ai.onnx.preview`, opset 1): `prob_mod(softmax(score_mod(Q K^T * scale))) V`
//! per head, with rank-4 Q, K and V and grouped-query attention (query heads a multiple of
//! the key/value heads).
//!
//! `score_mod` and `prob_mod` are optional one-input, one-output subgraphs applied to the
//! whole `[B, q_heads, L, S]` score (or probability) tensor. They run node by node with the
//! same Burn ops as the main graph, so the op stays differentiable in Q, K, V and in every
//! outer value a subgraph reads (those arrive as the node's trailing inputs,
//! [`crate::graph::attributes::CAPTURED`]). As in `Attention`, Q and K are each scaled by
//! `sqrt(scale)` and the grouped query heads are stacked along the sequence axis instead of
//! repeating K and V. `softmax_precision` is not consulted: the softmax runs in f32.

use std::collections::HashMap;

use burn::tensor::Tensor;

use super::control_flow::{Runner, split_inputs};
use super::matmul::matmul_values;
use super::{Inputs, OpContext, OpOutput};
use crate::error::{OpError, OpResult};
use crate::graph::Body;
use crate::op_bail;
use crate::value::{FloatValue, MAX_RANK, Value};

/// Batched product of rank-4 tensors with equal batch dims.
fn bmm(a: Tensor<4>, b: Tensor<4>) -> OpResult<Tensor<4>> {
    matmul_values(FloatValue::from_rank(a)?, FloatValue::from_rank(b)?)?.into_rank::<4>()
}

/// Run the one-input, one-output subgraph `body` on `x`; the result is broadcast to `shape`.
/// `salt` keeps the random streams of the two subgraphs apart.
fn run_mod(
    ctx: &OpContext,
    body: &Body,
    outer: &HashMap<&str, Value>,
    x: FloatValue,
    shape: &[usize],
    salt: u64,
) -> OpResult<FloatValue> {
    if body.inputs.len() != 1 || body.outputs.len() != 1 {
        op_bail!(
            "{}: a FlexAttention subgraph takes one input and returns one output, this one \
             declares {} inputs and {} outputs",
            body.name,
            body.inputs.len(),
            body.outputs.len()
        );
    }
    let mut outs = Runner::new(ctx, body, outer)?.run(vec![Value::Float(x)], salt)?;
    let out = outs.remove(0).into_float(ctx.device)?;
    let got = out.shape();
    if got != shape {
        if got.len() > shape.len() {
            op_bail!(
                "{}: the subgraph returned shape {got:?}, expected {shape:?}",
                body.name
            );
        }
        return out.broadcast_to(shape);
    }
    Ok(out)
}

/// `FlexAttention` (`ai.onnx.preview` opset 1): `Y = prob_mod(softmax(score_mod(Q K^T *
/// scale))) V` with Q `[B, Hq, L, E]`, K `[B, Hkv, S, E]`, V `[B, Hkv, S, Ev]` and `Hq` a
/// multiple of `Hkv`; `scale` defaults to `1 / sqrt(E)`.
pub fn flex_attention(ctx: &OpContext, inputs: Inputs) -> OpResult<OpOutput> {
    // Formal inputs first, then the outer values the subgraphs read.
    let (args, outer) = split_inputs(ctx, inputs)?;
    let mut inputs = Inputs(args);
    let q = inputs.float(0, "Q", ctx.device)?;
    let k = inputs.float(1, "K", ctx.device)?;
    let v = inputs.float(2, "V", ctx.device)?;
    let (qs, ks, vs) = (q.shape(), k.shape(), v.shape());
    let four = |sh: &[usize]| <[usize; 4]>::try_from(sh).map_err(|_| rank_err(&qs, &ks, &vs));
    let [b, hq, l, e] = four(&qs)?;
    let [bk, hkv, s, ek] = four(&ks)?;
    let [bv, hv, sv, ev] = four(&vs)?;
    if bk != b || bv != b || hv != hkv || sv != s || ek != e {
        op_bail!(
            "Q {qs:?}, K {ks:?} and V {vs:?} (as [batch, heads, sequence, head size]) \
             disagree: batch, K/V heads, K/V sequence and Q/K head sizes must match"
        );
    }
    if hkv == 0 || hq % hkv != 0 {
        op_bail!("the {hq} query heads are not a multiple of the {hkv} key/value heads");
    }
    let scale = if ctx.attrs.has("scale") {
        ctx.attrs.float("scale", 1.0)? as f64
    } else {
        1.0 / (e as f64).sqrt()
    };
    if !scale.is_finite() || scale <= 0.0 {
        op_bail!("scale must be positive and finite, got {scale} (head size {e})");
    }
    let root = scale.sqrt();
    let group = hq / hkv;
    let scores_shape = [b, hq, l, s];

    let q = q
        .into_rank::<4>()?
        .mul_scalar(root)
        .reshape([b, hkv, group * l, e]);
    let kt = k.into_rank::<4>()?.mul_scalar(root).swap_dims(2, 3);
    let scores = FloatValue::from_rank(bmm(q, kt)?.reshape(scores_shape))?;
    let scores = if ctx.attrs.has("score_mod") {
        let body = ctx.attrs.graph("score_mod")?;
        run_mod(ctx, body, &outer, scores, &scores_shape, 0)?
    } else {
        scores
    };
    let probs = FloatValue::new(crate::kernels::softmax(scores.tensor, MAX_RANK - 1), 4);
    let probs = if ctx.attrs.has("prob_mod") {
        let body = ctx.attrs.graph("prob_mod")?;
        run_mod(ctx, body, &outer, probs, &scores_shape, 1)?
    } else {
        probs
    };
    let probs = probs.into_rank::<4>()?.reshape([b, hkv, group * l, s]);
    let y = bmm(probs, v.into_rank::<4>()?)?.reshape([b, hq, l, ev]);
    Ok(Value::Float(FloatValue::from_rank(y)?).into())
}

fn rank_err(q: &[usize], k: &[usize], v: &[usize]) -> OpError {
    OpError(format!(
        "FlexAttention needs rank-4 Q, K and V, got Q {q:?}, K {k:?}, V {v:?}"
    ))
}
