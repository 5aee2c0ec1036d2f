//! `Attention` and `RotaryEmbedding` (opset 23; `Attention`'s `nonpad_kv_seqlen` input of
//! opset 24 too), composed of Burn tensor ops and so differentiable in Q, K, V (and the past
//! key/value caches) and in RotaryEmbedding's input.
//!
//! Grouped-query attention does not repeat K and V: the query heads sharing a key/value
//! head are stacked along the sequence axis (`[B, kv_heads, group * S, head_size]`, a free
//! reshape of `[B, q_heads, S, head_size]`), so each product runs against K and V as they
//! are. Masks (the boolean or float `attn_mask`, the causal mask, the padding of
//! `nonpad_kv_seqlen`) all become one additive bias of `0` and `-inf`, added to the scores
//! after the softcap, as the spec's diagram and the reference implementation order them
//! (a masked score stays `-inf` and gets no probability).

use burn::tensor::Tensor;
use ndarray::{ArrayD, Axis, IxDyn, Slice};

use super::broadcast::broadcast_shapes;
use super::matmul::matmul_values;
use super::{Inputs, OpContext, OpOutput};
use crate::error::OpResult;
use crate::op_bail;
use crate::value::{FloatValue, MAX_RANK, Value, int_tensor_1d};

/// Q, K or V as `[batch, heads, seq, head_size]`: a 4-D input as it is, a 3-D
/// `[batch, seq, heads * head_size]` split into `heads` heads (the `attr` attribute).
fn to_heads(v: FloatValue, heads: i64, what: &str, attr: &str) -> OpResult<Tensor<4>> {
    let shape = v.shape();
    match shape[..] {
        [_, h, _, _] => {
            if heads != 0 && heads != h as i64 {
                op_bail!("{what} has shape {shape:?} ({h} heads) but `{attr}` is {heads}");
            }
            v.into_rank::<4>()
        }
        [b, s, hidden] => {
            if heads <= 0 {
                op_bail!("3-D {what} ({shape:?}) needs a positive `{attr}` attribute, got {heads}");
            }
            let h = heads as usize;
            if hidden % h != 0 {
                op_bail!("{what}'s hidden size {hidden} is not divisible by `{attr}` = {h}");
            }
            Ok(v.reshape(&[b, s, h, hidden / h])?
                .into_rank::<4>()?
                .swap_dims(1, 2))
        }
        _ => op_bail!("{what} must be 3-D or 4-D, got shape {shape:?}"),
    }
}

/// Batched product of rank-4 tensors with equal batch dims.
fn bmm(a: Tensor<4>, b: Tensor<4>) -> OpResult<Tensor<4>> {
    matmul_values(FloatValue::from_rank(a)?, FloatValue::from_rank(b)?)?.into_rank::<4>()
}

/// A past cache as `[batch, kv_heads, past, width]`, checked against the new K or V;
/// `None` when it is empty (a first step), which Burn could not concatenate.
fn past_cache(
    v: FloatValue,
    what: &str,
    b: usize,
    h: usize,
    width: usize,
) -> OpResult<Option<Tensor<4>>> {
    match v.shape()[..] {
        [pb, ph, 0, pw] if pb == b && ph == h && pw == width => Ok(None),
        [pb, ph, _, pw] if pb == b && ph == h && pw == width => v.into_rank::<4>().map(Some),
        _ => op_bail!(
            "{what} has shape {:?}, expected [{b}, {h}, past_sequence_length, {width}]",
            v.shape()
        ),
    }
}

/// `attn_mask` as an additive bias broadcastable to `[B, q_heads, S, total]`: a boolean
/// mask gives `0` where true and `-inf` where false; a float mask is added as it is. A mask
/// whose last dimension is shorter than `total` is padded with `-inf` (false), as the
/// reference implementation does.
fn mask_bias(mask: Value, scores: &[usize], ctx: &OpContext) -> OpResult<FloatValue> {
    let shape = mask.shape();
    let total = scores[3];
    if shape.is_empty() || shape.len() > 4 {
        op_bail!("attn_mask must have rank 1 to 4, got shape {shape:?}");
    }
    let last = shape.len() - 1;
    let m = shape[last];
    if m == 0 || m > total {
        op_bail!(
            "attn_mask has shape {shape:?}: its last dimension {m} must be from 1 to the total \
             sequence length {total}"
        );
    }
    let mut full = shape.clone();
    full[last] = total;
    if broadcast_shapes(&full, scores)? != scores {
        op_bail!("attn_mask of shape {shape:?} does not broadcast to the scores {scores:?}");
    }
    match mask {
        Value::Str(_) => op_bail!("expected a numeric tensor, got strings"),
        Value::Sequence(_) => op_bail!("expected a tensor, got a sequence"),
        Value::Bool(a) => {
            let mut bias = ArrayD::from_elem(IxDyn(&full), f32::NEG_INFINITY);
            bias.slice_axis_mut(Axis(last), Slice::from(0..m))
                .assign(&a.mapv(|keep| if keep { 0.0 } else { f32::NEG_INFINITY }));
            FloatValue::from_array(&bias, ctx.device)
        }
        Value::Float(f) if m == total => Ok(f),
        Value::Float(f) => {
            let mut pad = f.tensor.dims();
            pad[MAX_RANK - 1] = total - m;
            let fill = Tensor::full(
                pad,
                f32::NEG_INFINITY,
                (&f.tensor.device(), f.tensor.dtype()),
            );
            Ok(FloatValue::new(
                Tensor::cat(vec![f.tensor, fill], MAX_RANK - 1),
                f.rank,
            ))
        }
        Value::Int(_) => op_bail!("attn_mask must be a bool or float tensor, got int"),
    }
}

/// `-inf` above the causal diagonal, aligned to the top left of the new keys (shifted right
/// by the past length only): query `i` sees keys `0 ..= past + i`, whatever the number of
/// new keys.
fn causal_bias(s: usize, total: usize, past: usize, ctx: &OpContext) -> OpResult<FloatValue> {
    let bias = ArrayD::from_shape_fn(IxDyn(&[s, total]), |ix| {
        if ix[1] > ix[0] + past {
            f32::NEG_INFINITY
        } else {
            0.0
        }
    });
    FloatValue::from_array(&bias, ctx.device)
}

/// `-inf` on the padded keys of each batch entry (`nonpad_kv_seqlen`), `[B, 1, 1, total]`.
fn padding_bias(lens: &[i64], b: usize, total: usize, ctx: &OpContext) -> OpResult<FloatValue> {
    if lens.len() != b {
        op_bail!(
            "nonpad_kv_seqlen has {} elements, expected one per batch entry ({b})",
            lens.len()
        );
    }
    let bias = ArrayD::from_shape_fn(IxDyn(&[b, 1, 1, total]), |ix| {
        if (ix[3] as i64) < lens[ix[0]] {
            0.0
        } else {
            f32::NEG_INFINITY
        }
    });
    FloatValue::from_array(&bias, ctx.device)
}

/// `Attention` (opset 23): `softmax(softcap(Q K^T * scale) + bias) V` per head, with 3-D
/// (`q_num_heads`/`kv_num_heads`) or 4-D inputs, grouped-query attention (the key/value
/// heads must divide the query heads), `attn_mask` (bool: true attends; float: added;
/// broadcast, and padded with `-inf` when shorter than the total sequence), `is_causal`
/// (top-left aligned after the past: query `i` sees keys up to `past + i`), the past
/// key/value caches concatenated before the new keys and values and returned as
/// `present_key`/`present_value`, and `qk_matmul_output` in the four
/// `qk_matmul_output_mode`s (0: the scaled product; 1: after the softcap; 2: after the mask;
/// 3: after the softmax). `softmax_precision` is not consulted: the softmax runs in f32,
/// the precision the values already have.
pub fn attention(ctx: &OpContext, mut inputs: Inputs) -> OpResult<OpOutput> {
    let q = inputs.float(0, "Q", ctx.device)?;
    let k = inputs.float(1, "K", ctx.device)?;
    let v = inputs.float(2, "V", ctx.device)?;
    let mask = inputs.opt(3);
    let past_key = inputs
        .opt(4)
        .map(|p| p.into_float(ctx.device))
        .transpose()?;
    let past_value = inputs
        .opt(5)
        .map(|p| p.into_float(ctx.device))
        .transpose()?;
    let nonpad = inputs.int_list(6, "nonpad_kv_seqlen")?;
    let rank = q.rank;
    if k.rank != rank || v.rank != rank {
        op_bail!(
            "Q, K and V must have the same rank, got shapes {:?}, {:?} and {:?}",
            q.shape(),
            k.shape(),
            v.shape()
        );
    }
    let mode = ctx.attrs.int("qk_matmul_output_mode", 0)?;
    if !(0..=3).contains(&mode) {
        op_bail!("qk_matmul_output_mode must be 0, 1, 2 or 3, got {mode}");
    }
    let softcap = ctx.attrs.float("softcap", 0.0)?;
    let q_heads = ctx.attrs.int("q_num_heads", 0)?;
    let kv_heads = ctx.attrs.int("kv_num_heads", 0)?;
    let q = to_heads(q, q_heads, "Q", "q_num_heads")?;
    let k = to_heads(k, kv_heads, "K", "kv_num_heads")?;
    let v = to_heads(v, kv_heads, "V", "kv_num_heads")?;
    let [b, hq, s, d] = q.dims();
    let [bk, hkv, kv_len, dk] = k.dims();
    let [bv, hv, kv_len_v, dv] = v.dims();
    if bk != b || bv != b || hv != hkv || kv_len_v != kv_len || dk != d {
        op_bail!(
            "Q [{b}, {hq}, {s}, {d}], K [{bk}, {hkv}, {kv_len}, {dk}] and V [{bv}, {hv}, \
             {kv_len_v}, {dv}] (as [batch, heads, sequence, head size]) disagree: batch, \
             K/V heads, K/V sequence and Q/K head sizes must match"
        );
    }
    if hkv == 0 || hq % hkv != 0 {
        op_bail!("the {hq} query heads are not a multiple of the {hkv} key/value heads");
    }
    let (k, v) = match (past_key, past_value) {
        (None, None) => (k, v),
        (Some(pk), Some(pv)) => {
            let (pk_shape, pv_shape) = (pk.shape(), pv.shape());
            if pk_shape.get(2) != pv_shape.get(2) {
                op_bail!(
                    "past_key {pk_shape:?} and past_value {pv_shape:?} have different \
                     sequence lengths"
                );
            }
            let pk = past_cache(pk, "past_key", b, hkv, d)?;
            let pv = past_cache(pv, "past_value", b, hkv, dv)?;
            match (pk, pv) {
                (Some(pk), Some(pv)) => (Tensor::cat(vec![pk, k], 2), Tensor::cat(vec![pv, v], 2)),
                _ => (k, v),
            }
        }
        _ => op_bail!("past_key and past_value must be given together"),
    };
    let total = k.dims()[2];
    let scores_shape = [b, hq, s, total];

    // Q and K each scaled by sqrt(scale), as the spec does against overflow.
    let scale = if ctx.attrs.has("scale") {
        ctx.attrs.float("scale", 1.0)? as f64
    } else {
        1.0 / (d as f64).sqrt()
    };
    if !scale.is_finite() || scale <= 0.0 {
        op_bail!("scale must be positive and finite, got {scale} (head size {d})");
    }
    let root = scale.sqrt();
    let group = hq / hkv;
    let q_grouped = q.mul_scalar(root).reshape([b, hkv, group * s, d]);
    let kt = k.clone().mul_scalar(root).swap_dims(2, 3);
    let qk = bmm(q_grouped, kt)?.reshape(scores_shape);
    let qk = FloatValue::from_rank(qk)?;
    let want_qk = ctx.num_outputs >= 4;
    let mut qk_out = (want_qk && mode == 0).then(|| qk.clone());

    let capped = if softcap > 0.0 {
        let c = softcap as f64;
        let t = crate::kernels::tanh(qk.tensor.div_scalar(c)).mul_scalar(c);
        FloatValue::new(t, 4)
    } else {
        qk
    };
    if want_qk && mode == 1 {
        qk_out = Some(capped.clone());
    }

    let mut biases = Vec::new();
    if let Some(m) = mask {
        biases.push(mask_bias(m, &scores_shape, ctx)?);
    }
    if ctx.attrs.int("is_causal", 0)? != 0 {
        biases.push(causal_bias(s, total, total - kv_len, ctx)?);
    }
    if let Some(lens) = nonpad {
        biases.push(padding_bias(&lens, b, total, ctx)?);
    }
    let biased = biases.into_iter().fold(capped, |acc, bias| {
        FloatValue::new(acc.tensor + bias.tensor, 4)
    });
    if want_qk && mode == 2 {
        qk_out = Some(biased.clone());
    }

    let probs = FloatValue::new(crate::kernels::softmax(biased.tensor, MAX_RANK - 1), 4);
    if want_qk && mode == 3 {
        qk_out = Some(probs.clone());
    }
    let probs = probs.into_rank::<4>()?.reshape([b, hkv, group * s, total]);
    let y = bmm(probs, v.clone())?.reshape([b, hq, s, dv]);
    let y = if rank == 3 {
        FloatValue::from_rank(y.swap_dims(1, 2).reshape([b, s, hq * dv]))?
    } else {
        FloatValue::from_rank(y)?
    };

    let mut values = vec![Value::Float(y)];
    if ctx.num_outputs > 1 {
        values.push(Value::Float(FloatValue::from_rank(k)?));
        values.push(Value::Float(FloatValue::from_rank(v)?));
    }
    if let Some(out) = qk_out {
        values.push(Value::Float(out));
    }
    Ok(values.into())
}

/// A cos or sin cache as `[batch or 1, S, half]`: rows picked by `position_ids` from a
/// `[max_position, half]` cache, or without them the cache itself, `[B or 1, S, half]`
/// (or `[S, half]`).
fn rotary_cache(
    c: FloatValue,
    ids: Option<&ArrayD<i64>>,
    (b, s, half): (usize, usize, usize),
    what: &str,
    ctx: &OpContext,
) -> OpResult<Tensor<3>> {
    let shape = c.shape();
    if shape.last() != Some(&half) {
        op_bail!(
            "{what} has shape {shape:?}: its last dimension must be rotary_embedding_dim / 2 \
             = {half}"
        );
    }
    match ids {
        Some(ids) => {
            let [max_pos, _] = shape[..] else {
                op_bail!("with position_ids, {what} must be [max_position, {half}], got {shape:?}")
            };
            let ib = match ids.shape() {
                [ib, is] if (*ib == b || *ib == 1) && *is == s => *ib,
                other => op_bail!("position_ids has shape {other:?}, expected [{b}, {s}]"),
            };
            if let Some(p) = ids.iter().find(|&&p| p < 0 || p as usize >= max_pos) {
                op_bail!("position id {p} is outside {what}'s {max_pos} positions");
            }
            let idx = int_tensor_1d(ids.iter().copied().collect(), ctx.device);
            Ok(c.into_rank::<2>()?.select(0, idx).reshape([ib, s, half]))
        }
        None => match shape[..] {
            [cb, cs, _] if (cb == b || cb == 1) && cs == s => c.into_rank::<3>(),
            [cs, _] if cs == s => Ok(c.into_rank::<2>()?.unsqueeze::<3>()),
            _ => op_bail!(
                "without position_ids, {what} must be [{b}, {s}, {half}] (batch, sequence, \
                 rotary_embedding_dim / 2), got {shape:?}"
            ),
        },
    }
}

/// `RotaryEmbedding` (opset 23): rotates the first `rotary_embedding_dim` channels of every
/// head (all of them by default) by the cached angles, as pairs of halves or, with
/// `interleaved`, of adjacent channels. The input is `[B, heads, S, head_size]` or
/// `[B, S, hidden]` with `num_heads`; the caches are `[max_position, rot / 2]` indexed by
/// `position_ids` (`[B, S]`), or `[B, S, rot / 2]` without them.
pub fn rotary_embedding(ctx: &OpContext, mut inputs: Inputs) -> OpResult<OpOutput> {
    let x = inputs.float(0, "input", ctx.device)?;
    let cos = inputs.float(1, "cos_cache", ctx.device)?;
    let sin = inputs.float(2, "sin_cache", ctx.device)?;
    let ids = inputs.opt(3).map(Value::into_int).transpose()?;
    let interleaved = ctx.attrs.int("interleaved", 0)? != 0;
    let num_heads = ctx.attrs.int("num_heads", 0)?;
    let rot_attr = ctx.attrs.int("rotary_embedding_dim", 0)?;
    if x.numel() == 0 {
        // Nothing to rotate (and Burn cannot reshape an empty tensor).
        return Ok(Value::Float(x).into());
    }
    let shape = x.shape();
    // [B, H, S, D] (seq axis 2) or, from 3-D, [B, S, H, D] (seq axis 1).
    let (x4, seq_axis) = match shape[..] {
        [_, h, _, _] => {
            if num_heads != 0 && num_heads != h as i64 {
                op_bail!("input has shape {shape:?} ({h} heads) but num_heads is {num_heads}");
            }
            (x.into_rank::<4>()?, 2)
        }
        [b, s, hidden] => {
            if num_heads <= 0 {
                op_bail!("3-D input ({shape:?}) needs a positive num_heads, got {num_heads}");
            }
            let h = num_heads as usize;
            if hidden % h != 0 {
                op_bail!("the hidden size {hidden} is not divisible by num_heads = {h}");
            }
            (x.reshape(&[b, s, h, hidden / h])?.into_rank::<4>()?, 1)
        }
        _ => op_bail!("input must be 3-D or 4-D, got shape {shape:?}"),
    };
    let dims = x4.dims();
    let (b, s, d) = (dims[0], dims[seq_axis], dims[3]);
    let rot = match rot_attr {
        0 => d,
        r if r > 0 && r as usize <= d && r % 2 == 0 => r as usize,
        r => op_bail!("rotary_embedding_dim {r} must be even and at most the head size {d}"),
    };
    if rot % 2 != 0 {
        op_bail!("the head size {d} must be even to rotate every channel");
    }
    let half = rot / 2;
    let cos = rotary_cache(cos, ids.as_ref(), (b, s, half), "cos_cache", ctx)?;
    let sin = rotary_cache(sin, ids.as_ref(), (b, s, half), "sin_cache", ctx)?;
    // The pairs along a new axis: [.., 2, half] (halves) or [.., half, 2] (interleaved).
    let (pair_axis, pair_shape, cache_shape) = if interleaved {
        (4, [half, 2], [half, 1])
    } else {
        (3, [2, half], [1, half])
    };
    let per_head = |c: Tensor<3>| {
        let [cb, cs, _] = c.dims();
        let mut shape = [cb, 1, 1, 1, 1];
        shape[seq_axis] = cs;
        shape[3] = cache_shape[0];
        shape[4] = cache_shape[1];
        c.reshape(shape)
    };
    let (cos, sin) = (per_head(cos), per_head(sin));
    let [_, a1, a2, _] = dims;
    let (rotated_part, rest) = if rot < d {
        (
            x4.clone().narrow(3, 0, rot),
            Some(x4.narrow(3, rot, d - rot)),
        )
    } else {
        (x4, None)
    };
    let pairs = rotated_part.reshape([b, a1, a2, pair_shape[0], pair_shape[1]]);
    let x1 = pairs.clone().narrow(pair_axis, 0, 1);
    let x2 = pairs.narrow(pair_axis, 1, 1);
    let real = cos.clone() * x1.clone() - sin.clone() * x2.clone();
    let imag = sin * x1 + cos * x2;
    let rotated = Tensor::cat(vec![real, imag], pair_axis).reshape([b, a1, a2, rot]);
    let out = match rest {
        Some(rest) => Tensor::cat(vec![rotated, rest], 3),
        None => rotated,
    };
    Ok(Value::Float(FloatValue::from_rank(out)?.reshape(&shape)?).into())
}
