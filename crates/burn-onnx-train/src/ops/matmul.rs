//! `MatMul` (NumPy semantics, batched and broadcast) and `Gemm`.

use burn::tensor::FloatDType;

use super::broadcast::{broadcast_shapes, float_binary};
use super::{Inputs, OpContext, OpOutput};
use crate::error::OpResult;
use crate::graph::attributes::{Attributes, LOW_PRECISION_RESULT, PAD_COLUMNS};
use crate::kernels;
use crate::op_bail;
use crate::value::{FloatValue, Value};

/// Matrix product of two float values with ONNX/NumPy `matmul` rules.
pub fn matmul_values(a: FloatValue, b: FloatValue) -> OpResult<FloatValue> {
    matmul_values_in(a, b, None)
}

/// [`matmul_values`], the products computed in `low` when it is given, their results in
/// the paired precision ([`kernels::matmul_autocast`]).
fn matmul_values_in(
    a: FloatValue,
    b: FloatValue,
    low: Option<(FloatDType, FloatDType)>,
) -> OpResult<FloatValue> {
    let product = |x, y| match low {
        Some((low, result)) => kernels::matmul_autocast(x, y, low, result),
        None => kernels::matmul(x, y),
    };
    let (sa, sb) = (a.shape(), b.shape());
    if sa.is_empty() || sb.is_empty() {
        op_bail!("MatMul operands must have rank >= 1, got {sa:?} and {sb:?}");
    }
    // Rank-1 operands are promoted, then the added axis is removed from the result.
    let a_vec = sa.len() == 1;
    let b_vec = sb.len() == 1;
    let a = if a_vec { a.reshape(&[1, sa[0]])? } else { a };
    let b = if b_vec { b.reshape(&[sb[0], 1])? } else { b };
    let (sa, sb) = (a.shape(), b.shape());
    let (m, k) = (sa[sa.len() - 2], sa[sa.len() - 1]);
    let (k2, n) = (sb[sb.len() - 2], sb[sb.len() - 1]);
    if k != k2 {
        op_bail!("MatMul inner dimensions differ: {sa:?} x {sb:?}");
    }
    let batch = broadcast_shapes(&sa[..sa.len() - 2], &sb[..sb.len() - 2])?;
    let out = if sb.len() == 2 {
        // [.., M, K] x [K, N]: one GEMM over all rows.
        let rows: usize = sa[..sa.len() - 1].iter().product();
        let a2 = a.reshape(&[rows, k])?;
        let prod = FloatValue::new(product(a2.tensor, b.tensor), 2);
        let mut shape = sa[..sa.len() - 1].to_vec();
        shape.push(n);
        prod.reshape(&shape)?
    } else {
        let mut sa_full = batch.clone();
        sa_full.extend([m, k]);
        let mut sb_full = batch.clone();
        sb_full.extend([k, n]);
        let a = a.broadcast_to(&sa_full)?;
        let b = b.broadcast_to(&sb_full)?;
        FloatValue::new(product(a.tensor, b.tensor), sa_full.len())
    };
    // Drop N (a rank-1 `b`) and M (a rank-1 `a`): two vectors give a scalar.
    let mut shape = out.shape();
    let r = shape.len();
    if b_vec {
        shape.remove(r - 1);
    }
    if a_vec {
        shape.remove(r - 2);
    }
    out.reshape(&shape)
}

/// `a x b` in the autocast precision, if any: on CubeCL devices each product reads the
/// operands' low-precision casts and writes f32 itself; elsewhere the operands are cast
/// down before the product and its result back after it ([`OpContext::autocast`]).
pub(super) fn autocast_product(
    ctx: &OpContext,
    a: FloatValue,
    b: FloatValue,
) -> OpResult<FloatValue> {
    autocast_product_to(ctx, a, b, false)
}

/// [`autocast_product`], its result left in the autocast precision on CubeCL devices when
/// `keep_low` (the loss's logits, marked [`LOW_PRECISION_RESULT`]).
fn autocast_product_to(
    ctx: &OpContext,
    a: FloatValue,
    b: FloatValue,
    keep_low: bool,
) -> OpResult<FloatValue> {
    match ctx.autocast {
        Some(low) if kernels::runs_cubecl(ctx.device) => {
            let result = if keep_low { low } else { FloatDType::F32 };
            matmul_values_in(a, b, Some((low, result)))
        }
        _ => ctx.autocast([a, b], |[a, b]| matmul_values(a, b)),
    }
}

/// `MatMul`
pub fn matmul(ctx: &OpContext, mut inputs: Inputs) -> OpResult<OpOutput> {
    let a = inputs.float(0, "A", ctx.device)?;
    let b = padded_columns(ctx, inputs.float(1, "B", ctx.device)?)?;
    let keep_low = ctx.attrs.int(LOW_PRECISION_RESULT, 0)? != 0;
    Ok(Value::Float(autocast_product_to(ctx, a, b, keep_low)?).into())
}

/// `v` with its last axis widened with zeros to the node's [`PAD_COLUMNS`], if it has
/// that mark (a head padded to an aligned vocabulary, `crate::model::padded_head`).
fn padded_columns(ctx: &OpContext, v: FloatValue) -> OpResult<FloatValue> {
    pad_columns(ctx.attrs, v)
}

/// [`padded_columns`] of a node with attributes `attrs` (also the fused head loss's
/// table, `crate::model::fused_head_loss`).
pub fn pad_columns(attrs: &Attributes, v: FloatValue) -> OpResult<FloatValue> {
    let to = attrs.int(PAD_COLUMNS, 0)?;
    let Some(&n) = v.shape().last() else {
        return Ok(v);
    };
    if to <= 0 || to as usize == n {
        return Ok(v);
    }
    if (to as usize) < n {
        op_bail!("cannot pad {n} columns to {to}");
    }
    let axis = v.axis(-1)?;
    Ok(FloatValue::new(
        kernels::pad_end(v.tensor, axis, to as usize),
        v.rank,
    ))
}

fn transpose2(v: FloatValue) -> OpResult<FloatValue> {
    let [r, c] = v.shape()[..] else {
        op_bail!("Gemm operands must be 2-D, got {:?}", v.shape())
    };
    let t = v.into_rank::<2>()?.transpose();
    debug_assert_eq!(t.dims(), [c, r]);
    FloatValue::from_rank(t)
}

/// `Gemm`: `alpha * A' B' + beta * C`
pub fn gemm(ctx: &OpContext, mut inputs: Inputs) -> OpResult<OpOutput> {
    let a = inputs.float(0, "A", ctx.device)?;
    let b = inputs.float(1, "B", ctx.device)?;
    let c = inputs
        .opt(2)
        .map(|v| v.into_float(ctx.device))
        .transpose()?;
    let alpha = ctx.attrs.float("alpha", 1.0)?;
    let beta = ctx.attrs.float("beta", 1.0)?;
    if a.rank != 2 || b.rank != 2 {
        op_bail!(
            "Gemm operands must be 2-D, got {:?} and {:?}",
            a.shape(),
            b.shape()
        );
    }
    let a = if ctx.attrs.int("transA", 0)? != 0 {
        transpose2(a)?
    } else {
        a
    };
    let b = if ctx.attrs.int("transB", 0)? != 0 {
        transpose2(b)?
    } else {
        b
    };
    let b = padded_columns(ctx, b)?;
    // A bias as wide as the product is widened with it; one broadcast (a scalar or a single
    // column) stays as it is.
    let c = match c {
        Some(c) if c.shape().last().is_some_and(|&w| w > 1) => Some(padded_columns(ctx, c)?),
        c => c,
    };
    let mut y = autocast_product(ctx, a, b)?;
    if alpha != 1.0 {
        y = FloatValue::new(y.tensor.mul_scalar(alpha), y.rank);
    }
    if let Some(c) = c {
        let c = if beta != 1.0 {
            FloatValue::new(c.tensor.mul_scalar(beta), c.rank)
        } else {
            c
        };
        let shape = y.shape();
        if broadcast_shapes(&shape, &c.shape())? != shape {
            op_bail!(
                "Gemm bias {:?} does not broadcast to the product {shape:?}",
                c.shape()
            );
        }
        y = float_binary(y, c, |p, q| p + q)?;
    }
    Ok(Value::Float(y).into())
}
