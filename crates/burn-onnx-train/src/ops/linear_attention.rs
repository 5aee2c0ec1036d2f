//! `LinearAttention` (opset 27): recurrent linear attention with a `[d_k, d_v]` state per
//! key/value head, under one of four update rules (`linear`, `gated`, `delta`,
//! `gated_delta`), as the reference implementation runs it token by token:
//!
//! ```text
//! S <- S * exp(g_t)                         (gated rules; g per head or per key dim)
//! v_t <- beta_t * (v_t - S^T k_t)           (delta rules)
//! S <- S + k_t v_t^T
//! o_t = scale * q_t S                        (query heads grouped over kv heads)
//! ```
//!
//! The loop is made of Burn tensor ops (narrow, matmul, exp, cat), so the op is
//! differentiable in the query, key, value, past state, decay and beta. `chunk_size` is a
//! tuning hint with no effect on the result and is ignored.

use burn::tensor::Tensor;

use super::{Inputs, OpContext, OpOutput};
use crate::error::OpResult;
use crate::op_bail;
use crate::value::{FloatValue, Value};

/// A rank-3 `[batch, seq, width]` input, checked against the batch and sequence lengths.
fn seq3(v: FloatValue, what: &str, b: usize, t: usize) -> OpResult<(Tensor<3>, usize)> {
    match v.shape()[..] {
        [vb, vt, w] if vb == b && vt == t => Ok((v.into_rank::<3>()?, w)),
        _ => op_bail!(
            "{what} must be [batch = {b}, sequence = {t}, width], got shape {:?}",
            v.shape()
        ),
    }
}

/// `LinearAttention`: inputs `query` `[B, T, H_q * d_k]`, `key` `[B, T, H_kv * d_k]`,
/// `value` `[B, T, H_kv * d_v]`, optional `past_state` `[B, H_kv, d_k, d_v]`, `decay`
/// `[B, T, H_kv]` or `[B, T, H_kv * d_k]` (log-space) and `beta` `[B, T, H_kv]` or
/// `[B, T, 1]`; outputs `output` `[B, T, H_q * d_v]` and `present_state`.
pub fn linear_attention(ctx: &OpContext, mut inputs: Inputs) -> OpResult<OpOutput> {
    let q = inputs.float(0, "query", ctx.device)?;
    let k = inputs.float(1, "key", ctx.device)?;
    let v = inputs.float(2, "value", ctx.device)?;
    let past = inputs
        .opt(3)
        .map(|x| x.into_float(ctx.device))
        .transpose()?;
    let decay = inputs
        .opt(4)
        .map(|x| x.into_float(ctx.device))
        .transpose()?;
    let beta = inputs
        .opt(5)
        .map(|x| x.into_float(ctx.device))
        .transpose()?;

    let rule = ctx.attrs.string("update_rule", "gated_delta")?;
    let (gating, delta) = match rule.as_str() {
        "linear" => (false, false),
        "gated" => (true, false),
        "delta" => (false, true),
        "gated_delta" => (true, true),
        other => op_bail!(
            "unsupported update_rule '{other}' (expected linear, gated, delta or gated_delta)"
        ),
    };
    let hq = ctx.attrs.int("q_num_heads", 0)?;
    let hkv = ctx.attrs.int("kv_num_heads", 0)?;
    if hq <= 0 || hkv <= 0 || hq % hkv != 0 {
        op_bail!("q_num_heads ({hq}) must be a positive multiple of kv_num_heads ({hkv})");
    }
    let (hq, hkv) = (hq as usize, hkv as usize);
    if gating != decay.is_some() {
        op_bail!(
            "update_rule '{rule}' {} the decay input",
            if gating { "requires" } else { "forbids" }
        );
    }
    if delta != beta.is_some() {
        op_bail!(
            "update_rule '{rule}' {} the beta input",
            if delta { "requires" } else { "forbids" }
        );
    }

    let (b, t, qw) = match q.shape()[..] {
        [b, t, w] => (b, t, w),
        _ => op_bail!(
            "query must be rank 3 [B, T, H_q * d_k], got shape {:?}",
            q.shape()
        ),
    };
    if t == 0 {
        op_bail!("zero-length sequences are not supported");
    }
    let (q, _) = seq3(q, "query", b, t)?;
    let (k, kw) = seq3(k, "key", b, t)?;
    let (v, vw) = seq3(v, "value", b, t)?;
    if qw % hq != 0 || vw % hkv != 0 {
        op_bail!(
            "query width {qw} / value width {vw} not divisible by q_num_heads {hq} / \
             kv_num_heads {hkv}"
        );
    }
    let dk = qw / hq;
    let dv = vw / hkv;
    if kw != hkv * dk {
        op_bail!("key width {kw} must be kv_num_heads ({hkv}) * d_k ({dk})");
    }
    if dk == 0 || dv == 0 {
        op_bail!("head sizes must be positive (d_k = {dk}, d_v = {dv})");
    }
    let group = hq / hkv;

    // decay as [B, T, H_kv * dd] with dd = 1 (per head) or d_k (per key dim).
    let decay = match decay {
        None => None,
        Some(d) => {
            let (d, dw) = seq3(d, "decay", b, t)?;
            let dd = if dw == hkv {
                1
            } else if dw == hkv * dk {
                dk
            } else {
                op_bail!(
                    "decay last dim {dw} must be kv_num_heads ({hkv}) or kv_num_heads * d_k \
                     ({})",
                    hkv * dk
                );
            };
            Some((d, dd))
        }
    };
    let beta = match beta {
        None => None,
        Some(x) => {
            let (x, bw) = seq3(x, "beta", b, t)?;
            if bw != hkv && bw != 1 {
                op_bail!("beta last dim {bw} must be kv_num_heads ({hkv}) or 1");
            }
            Some((x, bw))
        }
    };

    let mut state: Tensor<4> = match past {
        Some(p) => {
            if p.shape() != [b, hkv, dk, dv] {
                op_bail!(
                    "past_state has shape {:?}, expected [{b}, {hkv}, {dk}, {dv}]",
                    p.shape()
                );
            }
            p.into_rank::<4>()?
        }
        None => Tensor::<4>::zeros([b, hkv, dk, dv], ctx.device),
    };

    let scale = ctx.attrs.float("scale", 0.0)? as f64;
    let scale = if scale == 0.0 {
        1.0 / (dk as f64).sqrt()
    } else {
        scale
    };
    if !scale.is_finite() {
        op_bail!("scale must be finite, got {scale}");
    }

    let mut outs = Vec::with_capacity(t);
    for i in 0..t {
        let q_t = q.clone().narrow(1, i, 1).reshape([b, hkv, group, dk]);
        let k_t = k.clone().narrow(1, i, 1);
        let v_t = v.clone().narrow(1, i, 1).reshape([b, hkv, 1, dv]);
        if let Some((d, dd)) = &decay {
            let g = d.clone().narrow(1, i, 1).reshape([b, hkv, *dd, 1]);
            state = state * g.exp();
        }
        let v_t = match &beta {
            Some((x, bw)) => {
                let beta_t = x.clone().narrow(1, i, 1).reshape([b, *bw, 1, 1]);
                let retrieved = k_t.clone().reshape([b, hkv, 1, dk]).matmul(state.clone());
                (v_t - retrieved) * beta_t
            }
            None => v_t,
        };
        state = state + k_t.reshape([b, hkv, dk, 1]).matmul(v_t);
        let o = q_t.matmul(state.clone()).mul_scalar(scale);
        outs.push(o.reshape([b, 1, hq * dv]));
    }
    let output = Tensor::cat(outs, 1);
    Ok(vec![
        Value::Float(FloatValue::from_rank(output)?),
        Value::Float(FloatValue::from_rank(state)?),
    ]
    .into())
}
