//! `BitCast` (a host op) and `TensorScatter` (opset 24, a KV-cache update).
//!
//! The interpreter holds floats as f32 and integers as i64, so `BitCast` reinterprets on the
//! host through the type widths: the source element type has the width of the target
//! (`BitCast` requires equal widths), a float source is taken as the float type of that
//! width (float16 for 16 bits, float32, float64), an integer source by its low bits, and the
//! bits are read back as the target type (sign-extended for signed integers). A float64
//! source is only as exact as the f32 the interpreter holds it in.
//!
//! `TensorScatter` writes `update` into a copy of `past_cache` along `axis`, starting per
//! batch at `write_indices` (`linear`, or wrapping round in `circular` mode). Floats are one
//! row `select` of the concatenated cache and update on the device, so the output is
//! differentiable in both.

use burn::tensor::Tensor;
use ndarray::{ArrayD, Axis, IxDyn};

use super::{Inputs, OpContext, OpOutput};
use crate::error::OpResult;
use crate::op_bail;
use crate::value::host_tensor::dtype;
use crate::value::{FloatValue, Value, int_tensor_1d, norm_axis};

/// The bit pattern of a float held as f32, as a float type of `bytes` bytes.
fn float_bits(v: f32, bytes: usize) -> u64 {
    match bytes {
        2 => u64::from(half::f16::from_f32(v).to_bits()),
        4 => u64::from(v.to_bits()),
        _ => f64::from(v).to_bits(),
    }
}

/// `BitCast` (`to`): the input's bits read as the element type `to` of the same width.
pub fn bit_cast(ctx: &OpContext, mut inputs: Inputs) -> OpResult<OpOutput> {
    let x = inputs.take(0, "input")?;
    let to = ctx.attrs.int("to", 0)? as i32;
    let bytes = dtype::width(to);
    if bytes == 0 {
        op_bail!("BitCast to {} is not supported", dtype::name(to));
    }
    let shape = x.shape();
    let bits: Vec<u64> = match x {
        Value::Str(_) => op_bail!("expected a numeric tensor, got strings"),
        Value::Sequence(_) => op_bail!("expected a tensor, got a sequence"),
        Value::Float(f) => {
            if bytes == 1 {
                op_bail!(
                    "BitCast of a float input to the 1-byte {} is not possible",
                    dtype::name(to)
                );
            }
            f.to_array()?
                .iter()
                .map(|&v| float_bits(v, bytes))
                .collect()
        }
        Value::Int(a) => a.iter().map(|&v| v as u64).collect(),
        Value::Bool(a) => {
            if bytes != 1 {
                op_bail!(
                    "BitCast of a bool input needs a 1-byte target, got {}",
                    dtype::name(to)
                );
            }
            a.iter().map(|&v| u64::from(v)).collect()
        }
    };
    let bits_width = 8 * bytes as u32;
    let low = |b: u64| {
        if bits_width == 64 {
            b
        } else {
            b & ((1u64 << bits_width) - 1)
        }
    };
    let shape = IxDyn(&shape);
    Ok(if dtype::is_float(to) {
        let values: Vec<f32> = bits
            .iter()
            .map(|&b| match to {
                dtype::FLOAT16 => half::f16::from_bits(low(b) as u16).to_f32(),
                dtype::BFLOAT16 => half::bf16::from_bits(low(b) as u16).to_f32(),
                dtype::FLOAT => f32::from_bits(low(b) as u32),
                _ => f64::from_bits(b) as f32,
            })
            .collect();
        Value::Float(FloatValue::from_array(
            &ArrayD::from_shape_vec(shape, values)?,
            ctx.device,
        )?)
    } else if dtype::is_int(to) {
        let signed = matches!(to, dtype::INT8 | dtype::INT16 | dtype::INT32 | dtype::INT64);
        let values: Vec<i64> = bits
            .iter()
            .map(|&b| {
                let b = low(b);
                if signed && bits_width < 64 {
                    // Sign-extend the low bits.
                    ((b << (64 - bits_width)) as i64) >> (64 - bits_width)
                } else {
                    b as i64
                }
            })
            .collect();
        Value::Int(ArrayD::from_shape_vec(shape, values)?)
    } else if to == dtype::BOOL {
        Value::Bool(ArrayD::from_shape_vec(
            shape,
            bits.iter().map(|&b| low(b) != 0).collect(),
        )?)
    } else {
        op_bail!("BitCast to {} is not supported", dtype::name(to))
    }
    .into())
}

/// `TensorScatter(past_cache, update, write_indices?)` (`mode`: linear or circular; `axis`,
/// default -2): `past_cache` with `update` written along `axis` from each batch entry's
/// write index.
pub fn tensor_scatter(ctx: &OpContext, mut inputs: Inputs) -> OpResult<OpOutput> {
    let past = inputs.take(0, "past_cache")?;
    let update = inputs.take(1, "update")?;
    let write = inputs.int_list(2, "write_indices")?;
    let circular = match ctx.attrs.string("mode", "linear")?.as_str() {
        "linear" => false,
        "circular" => true,
        other => op_bail!("attribute `mode` must be linear or circular, got {other:?}"),
    };
    let (ps, us) = (past.shape(), update.shape());
    let r = ps.len();
    if us.len() != r {
        op_bail!("update {us:?} must have the rank of past_cache {ps:?}");
    }
    let axis = norm_axis(ctx.attrs.int("axis", -2)?, r)?;
    if axis == 0 {
        op_bail!("axis cannot be the batch axis 0");
    }
    for i in 0..r {
        if (i != axis && ps[i] != us[i]) || (i == axis && us[i] > ps[i]) {
            op_bail!("update {us:?} does not fit past_cache {ps:?} along axis {axis}");
        }
    }
    let batch = ps[0];
    let write = write.unwrap_or_else(|| vec![0; batch]);
    if write.len() != batch {
        op_bail!(
            "write_indices must hold {batch} entries, got {}",
            write.len()
        );
    }
    let prefix: usize = ps[..axis].iter().product();
    let (l, s) = (ps[axis], us[axis]);
    let trailing: usize = ps[axis + 1..].iter().product();
    // Rows of the stacked [past (prefix * l rows); update (prefix * s rows)], each `trailing`
    // wide: which one every output row reads.
    let mut rows: Vec<i64> = (0..(prefix * l) as i64).collect();
    let per_batch = if batch == 0 { 1 } else { prefix / batch };
    for pi in 0..prefix {
        let start = write[pi / per_batch.max(1)];
        for si in 0..s {
            let mut pos = start + si as i64;
            if circular && l > 0 {
                pos = pos.rem_euclid(l as i64);
            }
            if pos < 0 || pos >= l as i64 {
                op_bail!("write index {pos} is outside the cache's {l} positions (linear mode)");
            }
            rows[pi * l + pos as usize] = (prefix * l + pi * s + si) as i64;
        }
    }
    if prefix * l * trailing == 0 || prefix * s * trailing == 0 {
        return Ok(past.into());
    }
    Ok(match (past, update) {
        (Value::Str(_), _) => op_bail!("expected a numeric tensor, got strings"),
        (Value::Sequence(_), _) => op_bail!("expected a tensor, got a sequence"),
        (Value::Float(p), u) => {
            let u = u.into_float(ctx.device)?;
            let table = Tensor::cat(
                vec![
                    p.reshape(&[prefix * l, trailing])?.into_rank::<2>()?,
                    u.reshape(&[prefix * s, trailing])?.into_rank::<2>()?,
                ],
                0,
            );
            let y = table.select(0, int_tensor_1d(rows, ctx.device));
            Value::Float(FloatValue::from_rank(y)?.reshape(&ps)?)
        }
        (Value::Int(p), u) => {
            let u = u.into_int()?;
            Value::Int(scatter_host(p, u, &rows, prefix, l, s, trailing, &ps)?)
        }
        (Value::Bool(p), u) => {
            let u = u.into_bool()?;
            Value::Bool(scatter_host(p, u, &rows, prefix, l, s, trailing, &ps)?)
        }
    }
    .into())
}

/// The host version of `TensorScatter`'s row selection.
#[allow(clippy::too_many_arguments)]
fn scatter_host<T: Clone>(
    past: ArrayD<T>,
    update: ArrayD<T>,
    rows: &[i64],
    prefix: usize,
    l: usize,
    s: usize,
    trailing: usize,
    shape: &[usize],
) -> OpResult<ArrayD<T>> {
    let past = past.into_shape_with_order(IxDyn(&[prefix * l, trailing]))?;
    let update = update.into_shape_with_order(IxDyn(&[prefix * s, trailing]))?;
    let table = ndarray::concatenate(Axis(0), &[past.view(), update.view()])?;
    let idx: Vec<usize> = rows.iter().map(|&r| r as usize).collect();
    Ok(table
        .select(Axis(0), &idx)
        .into_shape_with_order(IxDyn(shape))?)
}
