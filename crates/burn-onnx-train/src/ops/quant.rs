//! Quantization: `QuantizeLinear`, `DequantizeLinear` (per tensor, per axis and blocked),
//! `DynamicQuantizeLinear`, and the integer ops `MatMulInteger`, `ConvInteger`,
//! `QLinearMatMul`, `QLinearConv`.
//!
//! # Where quantized values live
//!
//! `QuantizeLinear` of a float tensor returns a *float* value on the device that holds the
//! integer codes, exactly (every code of a 16-bit or narrower type is an f32 integer). Its
//! consumer is nearly always a `DequantizeLinear` (the QDQ pattern of quantization-aware
//! training and of ONNX QDQ models), which then stays on the device: a QDQ pair costs a few
//! element-wise ops, with no trip to the host, in evaluation as in training. A value read as
//! an integer ([`Value::into_int`]: the integer ops here, `Cast` to an integer type, a graph
//! output declared `uint8`) truncates toward zero, which on exact integers is the identity,
//! so `onnx-train run` writes the codes exactly in the output's declared type.
//! `DynamicQuantizeLinear` and the integer ops, which carry no gradient, return host
//! integers ([`Value::Int`]).
//!
//! # Training: fake quantization with the straight-through estimator
//!
//! Where the input or the scale is tracked by autodiff, the codes are
//! `q = codes + mask * (x / s + zp - detach(x / s + zp))`: the value is exactly `codes`, and
//! the gradient is that of `x / s + zp` where `round(x / s) + zp` lies inside the target
//! range (`mask` = 1) and zero outside it, as PyTorch's `fake_quantize_per_*_affine`.
//! Through the following `DequantizeLinear`, `y = (q - zp) * s`, the gradient reaching `x` is
//! the output gradient itself inside the range and zero outside; a scale with a gradient gets
//! the LSQ estimate (`round(x/s) - x/s` inside the range, the clamped code minus `zp`
//! outside).
//!
//! # Element types
//!
//! All integers are i64 at run time, so an op cannot see whether its zero point is `uint8` or
//! `int8`, which decides `QuantizeLinear`'s (and `QLinearMatMul`'s, `QLinearConv`'s) output
//! type and range. [`annotate_zero_point_types`] settles it at load time: it records on each
//! such node the element type of its zero-point input under the attribute
//! [`ZERO_POINT_TYPE`], where the graph states it (initializers, graph inputs and outputs,
//! `value_info`, `Constant` nodes, and outputs of `Cast`, the quantization ops and
//! type-preserving shape ops fed by those). At run time the target type is: the zero point's
//! recorded type; else the `output_dtype` attribute (opset 21+); else, with no zero point,
//! `uint8` (the ONNX default); else, for a zero point of unknown type, `int8` if one of its
//! values is negative and `uint8` otherwise.
//!
//! `uint8`, `int8`, `uint16`, `int16`, `uint4`, `int4`, `uint2` and `int2` targets are
//! supported, and so are the float8 and float4 targets (`x / scale` rounded to the type's
//! grid, with `saturate`, as values in a float value; see
//! [`crate::value::host_tensor::low_precision`]). `.npy` files carry the 4- and 2-bit integers as
//! int8 / uint8 and the float8 / float4 values as float32.
//!
//! The integer ops compute exactly on the host, in wrapping i64 arithmetic whose result is
//! wrapped to 32 bits (int32 accumulation, as ONNX Runtime); the rescaling of the `QLinear*`
//! ops is done in f64 with f32 scales, as the ONNX reference, rounding half to even and
//! saturating to the output type.

use std::collections::HashMap;

use burn::tensor::FloatDType;
use ndarray::{ArrayD, IxDyn};
use rayon::prelude::*;

use super::broadcast::{broadcast_shapes, float_binary, host_binary};
use super::window::Window2d;
use super::{Inputs, OpContext, OpOutput};
use crate::error::OpResult;
use crate::graph::Graph;
use crate::graph::attributes::Attr;
use crate::op_bail;
use crate::value::host_tensor::dtype;
use crate::value::{FloatValue, MAX_RANK, PhysTensor, Value, int_tensor_1d, norm_axis};

/// Internal attribute set by [`annotate_zero_point_types`]: the ONNX element type of a
/// node's zero-point input, where the graph states it.
pub const ZERO_POINT_TYPE: &str = "__zero_point_type";

/// Internal attribute set by [`annotate_zero_point_types`] on `CastLike` nodes: the ONNX
/// element type of the `target_type` input, where the graph states it.
pub const CAST_LIKE_TYPE: &str = "__cast_like_type";

/// ONNX element type codes of the narrow types (now all in [`dtype`]).
mod narrow {
    pub use crate::value::host_tensor::dtype::{
        FLOAT4E2M1, FLOAT8E4M3FN, FLOAT8E4M3FNUZ, FLOAT8E5M2, FLOAT8E5M2FNUZ, FLOAT8E8M0, INT2,
        INT4, UINT2, UINT4,
    };
}

/// The input slot holding the zero point that decides each op's output type.
fn zero_point_slot(op_type: &str) -> Option<usize> {
    match op_type {
        "QuantizeLinear" => Some(2),
        "QLinearMatMul" | "QLinearConv" => Some(7),
        _ => None,
    }
}

/// Ops whose first output has the element type of their first input.
const TYPE_PRESERVING: &[&str] = &[
    "Identity",
    "Reshape",
    "Flatten",
    "Squeeze",
    "Unsqueeze",
    "Transpose",
    "Expand",
    "Slice",
    "Gather",
    "Concat",
    "Tile",
    "Pad",
];

/// Load-time pass: record on every `QuantizeLinear`, `QLinearMatMul` and `QLinearConv` node
/// the element type of its zero-point input under [`ZERO_POINT_TYPE`], where the graph
/// states it (see the module documentation for the sources followed).
pub fn annotate_zero_point_types(graph: &mut Graph) {
    if !graph
        .nodes
        .iter()
        .any(|n| zero_point_slot(&n.op_type).is_some() || n.op_type == "CastLike")
    {
        return;
    }
    let mut types: HashMap<String, i32> = HashMap::new();
    if let Some(g) = graph.model.graph.as_ref() {
        for t in &g.initializer {
            types.insert(t.name.clone(), t.data_type);
        }
        for vi in g.input.iter().chain(&g.output).chain(&g.value_info) {
            let t = vi.type_.tensor_type().elem_type;
            if t != 0 {
                types.entry(vi.name.clone()).or_insert(t);
            }
        }
        for n in g.node.iter().filter(|n| n.op_type == "Constant") {
            let t = n.attribute.iter().find_map(|a| match a.name.as_str() {
                "value" => Some(a.t.data_type),
                "value_int" | "value_ints" => Some(dtype::INT64),
                "value_float" | "value_floats" => Some(dtype::FLOAT),
                _ => None,
            });
            if let (Some(t), Some(out)) = (t, n.output.first()) {
                types.entry(out.clone()).or_insert(t);
            }
        }
    }
    for node in &mut graph.nodes {
        let type_of = |slot: usize| {
            node.inputs
                .get(slot)
                .and_then(|name| types.get(name))
                .copied()
                .unwrap_or(0)
        };
        let zero_point = zero_point_slot(&node.op_type).map(|slot| {
            let present = node.inputs.get(slot).is_some_and(|n| !n.is_empty());
            (present, type_of(slot))
        });
        let first = type_of(0);
        let like = type_of(1);
        if node.op_type == "CastLike" && like != 0 {
            node.attrs.set(CAST_LIKE_TYPE, Attr::Int(i64::from(like)));
        }
        if let Some((_, t)) = zero_point
            && t != 0
        {
            node.attrs.set(ZERO_POINT_TYPE, Attr::Int(i64::from(t)));
        }
        let attr = |name: &str| node.attrs.int(name, 0).unwrap_or(0) as i32;
        let outputs: Vec<i32> = match node.op_type.as_str() {
            "Cast" => vec![attr("to")],
            "CastLike" => vec![like],
            "QuantizeLinear" => match zero_point {
                Some((_, t)) if t != 0 => vec![t],
                _ if attr("output_dtype") != 0 => vec![attr("output_dtype")],
                Some((false, _)) => vec![dtype::UINT8],
                _ => vec![],
            },
            "QLinearMatMul" | "QLinearConv" => vec![zero_point.map_or(0, |(_, t)| t)],
            "DynamicQuantizeLinear" => vec![dtype::UINT8, dtype::FLOAT, dtype::UINT8],
            "MatMulInteger" | "ConvInteger" => vec![dtype::INT32],
            op if TYPE_PRESERVING.contains(&op) => vec![first],
            _ => vec![],
        };
        for (name, t) in node.outputs.iter().zip(outputs) {
            if t != 0 && !name.is_empty() {
                types.entry(name.clone()).or_insert(t);
            }
        }
    }
}

/// Name of an element type code, the narrow types included.
fn type_name(t: i32) -> String {
    match t {
        narrow::FLOAT8E4M3FN => "float8e4m3fn".into(),
        narrow::FLOAT8E4M3FNUZ => "float8e4m3fnuz".into(),
        narrow::FLOAT8E5M2 => "float8e5m2".into(),
        narrow::FLOAT8E5M2FNUZ => "float8e5m2fnuz".into(),
        narrow::UINT4 => "uint4".into(),
        narrow::INT4 => "int4".into(),
        narrow::FLOAT4E2M1 => "float4e2m1".into(),
        narrow::FLOAT8E8M0 => "float8e8m0".into(),
        narrow::UINT2 => "uint2".into(),
        narrow::INT2 => "int2".into(),
        other => dtype::name(other),
    }
}

/// The range of an integer quantization type.
fn int_range(t: i32) -> OpResult<(i64, i64)> {
    Ok(match t {
        dtype::UINT8 => (0, 255),
        dtype::INT8 => (-128, 127),
        dtype::UINT16 => (0, 65535),
        dtype::INT16 => (-32768, 32767),
        narrow::UINT4 => (0, 15),
        narrow::INT4 => (-8, 7),
        narrow::UINT2 => (0, 3),
        narrow::INT2 => (-2, 1),
        narrow::FLOAT8E4M3FN
        | narrow::FLOAT8E4M3FNUZ
        | narrow::FLOAT8E5M2
        | narrow::FLOAT8E5M2FNUZ
        | narrow::FLOAT8E8M0
        | narrow::FLOAT4E2M1 => op_bail!(
            "quantization to the float type {} is not supported (integer types only)",
            type_name(t)
        ),
        other => op_bail!("{} is not a quantization type", type_name(other)),
    })
}

/// The quantized output type (see the module documentation): the zero point's recorded
/// type, else `output_dtype`, else `uint8` without a zero point, else guessed from the
/// zero point's values.
fn target_type(ctx: &OpContext, zero_point: Option<&Value>) -> OpResult<i32> {
    let recorded = ctx.attrs.int(ZERO_POINT_TYPE, 0)? as i32;
    let declared = ctx.attrs.int("output_dtype", 0)? as i32;
    if recorded != 0 {
        if declared != 0 && declared != recorded {
            op_bail!(
                "output_dtype {} differs from the zero point's type {}",
                type_name(declared),
                type_name(recorded)
            );
        }
        return Ok(recorded);
    }
    if declared != 0 {
        return Ok(declared);
    }
    let Some(zp) = zero_point else {
        return Ok(dtype::UINT8);
    };
    let negative = zp.clone().into_int()?.iter().any(|&v| v < 0);
    Ok(if negative { dtype::INT8 } else { dtype::UINT8 })
}

/// A scale or zero point laid out to broadcast against an input of shape `x`: one element
/// (per tensor), a 1-D tensor of `x[axis]` elements (per axis), or with `block_size`, a
/// tensor of `x`'s rank with `ceil(x[axis] / block_size)` elements along `axis` (blocked).
fn layout(
    param: FloatValue,
    x: &[usize],
    axis: i64,
    block_size: i64,
    what: &str,
) -> OpResult<FloatValue> {
    let ps = param.shape();
    if param.numel() == 1 {
        return param.reshape(&[]);
    }
    let a = norm_axis(axis, x.len())?;
    if block_size < 0 {
        op_bail!("block_size must not be negative, got {block_size}");
    }
    if block_size == 0 {
        if ps != [x[a]] {
            op_bail!(
                "{what} of shape {ps:?} is neither one element nor a 1-D tensor of the {} elements \
                 of axis {axis} of the input {x:?} (set block_size for blocked quantization)",
                x[a]
            );
        }
        let mut shape = vec![1; x.len()];
        shape[a] = x[a];
        return param.reshape(&shape);
    }
    let bs = block_size as usize;
    let blocks = x[a].div_ceil(bs);
    let expected: Vec<usize> = x
        .iter()
        .enumerate()
        .map(|(i, &d)| if i == a { blocks } else { d })
        .collect();
    if ps != expected {
        op_bail!(
            "blocked {what} should have shape {expected:?} (input {x:?}, axis {axis}, \
             block_size {block_size}), got {ps:?}"
        );
    }
    let index: Vec<i64> = (0..x[a]).map(|i| (i / bs) as i64).collect();
    let device = param.tensor.device();
    let phys = a + MAX_RANK - x.len();
    Ok(FloatValue::new(
        param.tensor.select(phys, int_tensor_1d(index, &device)),
        param.rank,
    ))
}

/// `QuantizeLinear`: `saturate(round_half_even(x / scale) + zero_point)`, returned as
/// exact integer codes in a float value (see the module documentation), differentiable by
/// the straight-through estimator.
pub fn quantize_linear(ctx: &OpContext, mut inputs: Inputs) -> OpResult<OpOutput> {
    let x = inputs.float(0, "x", ctx.device)?;
    let scale = inputs.float(1, "y_scale", ctx.device)?;
    let zp = inputs.opt(2);
    let target = target_type(ctx, zp.as_ref())?;
    let float_target = matches!(
        target,
        narrow::FLOAT8E4M3FN
            | narrow::FLOAT8E4M3FNUZ
            | narrow::FLOAT8E5M2
            | narrow::FLOAT8E5M2FNUZ
            | narrow::FLOAT4E2M1
    );
    let (lo, hi) = if float_target {
        (0, 0)
    } else {
        int_range(target)?
    };
    let shape = x.shape();
    if x.numel() == 0 {
        return Ok(Value::Float(x).into());
    }
    let axis = ctx.attrs.int("axis", 1)?;
    let block = ctx.attrs.int("block_size", 0)?;
    let scale = layout(scale, &shape, axis, block, "y_scale")?;
    let zp = zp
        .map(|z| {
            layout(
                z.into_float(ctx.device)?,
                &shape,
                axis,
                block,
                "y_zero_point",
            )
        })
        .transpose()?;
    let grad = x.tensor.is_tracked() || scale.tensor.is_tracked();
    let scaled = float_binary(x, scale, |x, s| x / s)?;
    let rank = scaled.rank;
    let shift = |t: PhysTensor| match &zp {
        Some(z) => t + z.tensor.clone(),
        None => t,
    };
    if float_target {
        // Float targets: x / scale (+ zero point, 0 for float8) rounded to the type's grid
        // (float4 always saturates; float8 per `saturate`), straight-through gradient.
        let saturate = ctx.attrs.int("saturate", 1)? != 0;
        let linear = shift(scaled.tensor);
        let values = FloatValue::new(linear.clone().detach(), rank).to_array()?;
        let rounded = values.mapv(|v| {
            crate::value::host_tensor::low_precision::round_float(target, v, saturate, "up")
        });
        let codes = FloatValue::from_array(&rounded, ctx.device)?.tensor;
        let codes = if grad {
            codes + (linear.clone() - linear.detach())
        } else {
            codes
        };
        return Ok(Value::Float(FloatValue::new(codes, rank)).into());
    }
    let (lo, hi) = (lo as f32, hi as f32);
    let unclamped = shift(scaled.tensor.clone().detach().round());
    let codes = unclamped.clone().clamp(lo, hi);
    if !grad {
        return Ok(Value::Float(FloatValue::new(codes, rank)).into());
    }
    let outside = unclamped
        .clone()
        .greater_equal_elem(lo)
        .bool_and(unclamped.lower_equal_elem(hi))
        .bool_not();
    let linear = shift(scaled.tensor);
    let straight_through = (linear.clone() - linear.detach()).mask_fill(outside, 0.0);
    Ok(Value::Float(FloatValue::new(codes + straight_through, rank)).into())
}

/// `DequantizeLinear`: `(x - zero_point) * scale`, per tensor, per axis or blocked, on the
/// device (differentiable in `x` and the scale).
pub fn dequantize_linear(ctx: &OpContext, mut inputs: Inputs) -> OpResult<OpOutput> {
    let x = inputs.float(0, "x", ctx.device)?;
    let scale = inputs.float(1, "x_scale", ctx.device)?;
    let zp = inputs.opt(2);
    let shape = x.shape();
    if x.numel() == 0 {
        return Ok(Value::Float(x).into());
    }
    let axis = ctx.attrs.int("axis", 1)?;
    let block = ctx.attrs.int("block_size", 0)?;
    let scale = layout(scale, &shape, axis, block, "x_scale")?;
    let x = match zp {
        Some(z) => {
            let z = layout(
                z.into_float(ctx.device)?,
                &shape,
                axis,
                block,
                "x_zero_point",
            )?;
            float_binary(x, z, |x, z| x - z)?
        }
        None => x,
    };
    let y = float_binary(x, scale, |x, s| x * s)?;
    let low = match ctx.attrs.int("output_dtype", 0)? as i32 {
        0 | dtype::FLOAT | dtype::DOUBLE => None,
        dtype::FLOAT16 => Some(FloatDType::F16),
        dtype::BFLOAT16 => Some(FloatDType::BF16),
        other => op_bail!("output_dtype {} is not a float type", type_name(other)),
    };
    let y = match low {
        Some(low) => FloatValue::new(y.tensor.cast(low).cast(FloatDType::F32), y.rank),
        None => y,
    };
    Ok(Value::Float(y).into())
}

/// `DynamicQuantizeLinear`: `uint8` quantization of `x` over the range `[min(x, 0),
/// max(x, 0)]`; outputs `y` (`uint8`, on the host), `y_scale` and `y_zero_point`. Computed in
/// f32 on the host as the ONNX reference; no gradient.
pub fn dynamic_quantize_linear(ctx: &OpContext, mut inputs: Inputs) -> OpResult<OpOutput> {
    let x = inputs.float(0, "x", ctx.device)?.to_array()?;
    let max = x.iter().fold(0.0f32, |m, &v| m.max(v));
    let min = x.iter().fold(0.0f32, |m, &v| m.min(v));
    let scale = if max == min { 1.0 } else { max - min } / 255.0;
    let zp = (0.0 - min / scale).clamp(0.0, 255.0).round_ties_even();
    let y = x.mapv(|v| ((v / scale).round_ties_even() + zp).clamp(0.0, 255.0) as i64);
    let scale = FloatValue::from_array(&ArrayD::from_elem(IxDyn(&[]), scale), ctx.device)?;
    Ok(vec![
        Value::Int(y),
        Value::Float(scale),
        Value::Int(ArrayD::from_elem(IxDyn(&[]), zp as i64)),
    ]
    .into())
}

/// `a - zero_point` on the host. A 1-D zero point of `a`'s row count (`per_row`, for a
/// matrix product's left operand) or output-channel count (`per_channel`, for a convolution
/// weight) applies along that axis; otherwise it broadcasts as NumPy, without growing `a`.
fn minus_zero_point(
    a: ArrayD<i64>,
    zp: Option<Value>,
    along: Option<usize>,
    what: &str,
) -> OpResult<ArrayD<i64>> {
    let Some(zp) = zp else {
        return Ok(a);
    };
    let zp = zp.into_int()?;
    if zp.len() == 1 {
        let z = zp.iter().next().copied().unwrap_or(0);
        return Ok(a.mapv(|v| v.wrapping_sub(z)));
    }
    let zp = match along {
        Some(axis) if zp.ndim() == 1 && axis < a.ndim() && zp.len() == a.shape()[axis] => {
            let mut shape = vec![1; a.ndim() - axis];
            shape[0] = zp.len();
            zp.into_shape_with_order(IxDyn(&shape))?
        }
        _ => zp,
    };
    let out = host_binary(&a, &zp, |v, z| v.wrapping_sub(*z))?;
    if out.shape() != a.shape() {
        op_bail!(
            "{what} of shape {:?} does not fit its input {:?}",
            zp.shape(),
            a.shape()
        );
    }
    Ok(out)
}

/// Row-major `[m, k] x [k, n]` product of i64 matrices, rows in parallel.
fn gemm_i64(a: &[i64], b: &[i64], m: usize, k: usize, n: usize) -> Vec<i64> {
    let mut out = vec![0i64; m * n];
    if n == 0 {
        return out;
    }
    out.par_chunks_mut(n).enumerate().for_each(|(i, row)| {
        for (p, &av) in a[i * k..(i + 1) * k].iter().enumerate() {
            if av != 0 {
                for (o, &bv) in row.iter_mut().zip(&b[p * n..(p + 1) * n]) {
                    *o = o.wrapping_add(av.wrapping_mul(bv));
                }
            }
        }
    });
    debug_assert_eq!(out.len(), m * n);
    out
}

/// Integer matrix product with ONNX/NumPy `matmul` rules (rank-1 promotion, broadcast batch).
fn matmul_i64(a: ArrayD<i64>, b: ArrayD<i64>) -> OpResult<ArrayD<i64>> {
    let (sa, sb) = (a.shape().to_vec(), b.shape().to_vec());
    if sa.is_empty() || sb.is_empty() {
        op_bail!("matrix product operands must have rank >= 1, got {sa:?} and {sb:?}");
    }
    let (a_vec, b_vec) = (sa.len() == 1, sb.len() == 1);
    let a = if a_vec {
        a.into_shape_with_order(IxDyn(&[1, sa[0]]))?
    } else {
        a
    };
    let b = if b_vec {
        b.into_shape_with_order(IxDyn(&[sb[0], 1]))?
    } else {
        b
    };
    let (sa, sb) = (a.shape().to_vec(), b.shape().to_vec());
    let (m, k) = (sa[sa.len() - 2], sa[sa.len() - 1]);
    let (k2, n) = (sb[sb.len() - 2], sb[sb.len() - 1]);
    if k != k2 {
        op_bail!("inner dimensions differ: {sa:?} x {sb:?}");
    }
    let batch = broadcast_shapes(&sa[..sa.len() - 2], &sb[..sb.len() - 2])?;
    let mut shape = batch.clone();
    shape.extend([m, n]);
    let values = if sb.len() == 2 {
        // [.., M, K] x [K, N]: one product over all rows.
        let rows: usize = sa[..sa.len() - 1].iter().product();
        let a: Vec<i64> = a.iter().copied().collect();
        let b: Vec<i64> = b.iter().copied().collect();
        gemm_i64(&a, &b, rows, k, n)
    } else {
        let mut full_a = batch.clone();
        full_a.extend([m, k]);
        let mut full_b = batch.clone();
        full_b.extend([k, n]);
        let (Some(av), Some(bv)) = (a.broadcast(IxDyn(&full_a)), b.broadcast(IxDyn(&full_b)))
        else {
            op_bail!("batch dimensions of {sa:?} and {sb:?} do not broadcast");
        };
        let av: Vec<i64> = av.iter().copied().collect();
        let bv: Vec<i64> = bv.iter().copied().collect();
        let count: usize = batch.iter().product();
        let mut out = Vec::with_capacity(count * m * n);
        for i in 0..count {
            out.extend(gemm_i64(
                &av[i * m * k..(i + 1) * m * k],
                &bv[i * k * n..(i + 1) * k * n],
                m,
                k,
                n,
            ));
        }
        out
    };
    let out = ArrayD::from_shape_vec(IxDyn(&shape), values)?;
    let mut shape = shape;
    if b_vec {
        shape.pop();
    }
    if a_vec {
        let last = shape.pop();
        shape.pop();
        shape.extend(last);
    }
    Ok(out.into_shape_with_order(IxDyn(&shape))?)
}

/// An i64 wrapped to 32 bits, as int32 arithmetic.
fn wrap_i32(v: i64) -> i64 {
    i64::from(v as i32)
}

/// `MatMulInteger`: `(A - a_zero_point) x (B - b_zero_point)` in int32; the zero points are
/// scalars, per row of `A` and per column of `B`.
pub fn matmul_integer(_ctx: &OpContext, mut inputs: Inputs) -> OpResult<OpOutput> {
    let a = inputs.take(0, "A")?.into_int()?;
    let b = inputs.take(1, "B")?.into_int()?;
    let row_axis = a.ndim().checked_sub(2);
    let a = minus_zero_point(a, inputs.opt(2), row_axis, "a_zero_point")?;
    let col_axis = b.ndim().checked_sub(1);
    let b = minus_zero_point(b, inputs.opt(3), col_axis, "b_zero_point")?;
    Ok(Value::Int(matmul_i64(a, b)?.mapv(wrap_i32)).into())
}

/// A float setting (scale) as a host array.
fn host_floats(v: Value, device: &burn::tensor::Device) -> OpResult<ArrayD<f32>> {
    v.into_float(device)?.to_array()
}

/// A per-row (`axis` = rank - 2) or per-column (rank - 1) scale of a matrix product shaped
/// to broadcast against the `[.., M, N]` result.
fn along_axis<T: Clone>(s: ArrayD<T>, result_rank: usize, from_end: usize) -> OpResult<ArrayD<T>> {
    if s.len() == 1 || s.ndim() != 1 || from_end == 0 || result_rank < from_end {
        return Ok(s);
    }
    let mut shape = vec![1; from_end];
    shape[0] = s.len();
    Ok(s.into_shape_with_order(IxDyn(&shape))?)
}

/// `round_half_even(acc * multiplier + zero_point)` saturated to `range`, in f64.
fn requantize(
    acc: &ArrayD<i64>,
    multiplier: &ArrayD<f32>,
    zp: &ArrayD<i64>,
    range: (i64, i64),
    what: &str,
) -> OpResult<ArrayD<i64>> {
    let scaled = host_binary(acc, multiplier, |&c, &m| c as f64 * f64::from(m))?;
    let out = host_binary(&scaled, zp, |&v, &z| {
        ((v + z as f64).round_ties_even() as i64).clamp(range.0, range.1)
    })?;
    if out.shape() != acc.shape() {
        op_bail!(
            "{what}: scales or zero point do not fit the result {:?}",
            acc.shape()
        );
    }
    Ok(out)
}

/// `QLinearMatMul`: the product of two quantized matrices, requantized to the output scale
/// and zero point (scales per tensor, per row of `a`, per column of `b` and the output).
pub fn qlinear_matmul(ctx: &OpContext, mut inputs: Inputs) -> OpResult<OpOutput> {
    let a = inputs.take(0, "a")?.into_int()?;
    let a_scale = host_floats(inputs.take(1, "a_scale")?, ctx.device)?;
    let a_zp = inputs.opt(2);
    let b = inputs.take(3, "b")?.into_int()?;
    let b_scale = host_floats(inputs.take(4, "b_scale")?, ctx.device)?;
    let b_zp = inputs.opt(5);
    let y_scale = host_floats(inputs.take(6, "y_scale")?, ctx.device)?;
    let y_zp = inputs.opt(7);
    let range = int_range(target_type(ctx, y_zp.as_ref())?)?;
    let row_axis = a.ndim().checked_sub(2);
    let a_rows = a.ndim() >= 2;
    let a = minus_zero_point(a, a_zp, row_axis, "a_zero_point")?;
    let col_axis = b.ndim().checked_sub(1);
    let b = minus_zero_point(b, b_zp, col_axis, "b_zero_point")?;
    let acc = matmul_i64(a, b)?.mapv(wrap_i32);
    let rank = acc.ndim();
    let a_scale = along_axis(a_scale, rank, if a_rows { 2 } else { 0 })?;
    let ab = host_binary(&a_scale, &b_scale, |x, y| x * y)?;
    let multiplier = host_binary(&ab, &y_scale, |x, y| x / y)?;
    let zp = match y_zp {
        Some(z) => z.into_int()?,
        None => ArrayD::zeros(IxDyn(&[])),
    };
    Ok(Value::Int(requantize(&acc, &multiplier, &zp, range, "QLinearMatMul")?).into())
}

/// One kernel tap of a 2-D convolution: `plane += wgt * x`, output `(r, c)` reading input
/// `(r * sh + dy, c * sw + dx)` (zero outside `x`, which is `h x w`).
fn add_tap(
    plane: &mut [i64],
    ow: usize,
    x: &[i64],
    (h, w): (usize, usize),
    wgt: i64,
    (dy, dx): (isize, isize),
    (sh, sw): (usize, usize),
) {
    for (r, row) in plane.chunks_mut(ow).enumerate() {
        let ih = (r * sh) as isize + dy;
        if ih < 0 || ih as usize >= h {
            continue;
        }
        let xr = &x[ih as usize * w..][..w];
        for (col, acc) in row.iter_mut().enumerate() {
            let iw = (col * sw) as isize + dx;
            if iw >= 0 && (iw as usize) < w {
                *acc = acc.wrapping_add(wgt.wrapping_mul(xr[iw as usize]));
            }
        }
    }
}

/// Direct integer convolution of `x` `[N, C, H, W]` by `w` `[M, C / group, KH, KW]`.
fn conv_i64(
    x: &ArrayD<i64>,
    w: &ArrayD<i64>,
    win: &Window2d,
    group: usize,
) -> OpResult<ArrayD<i64>> {
    let (xs, ws) = (x.shape(), w.shape());
    let (n, c, h, wd) = (xs[0], xs[1], xs[2], xs[3]);
    let (m, cg, kh, kw) = (ws[0], ws[1], ws[2], ws[3]);
    if group == 0 || cg * group != c || m % group != 0 {
        op_bail!("X {xs:?}, W {ws:?} and group {group} are inconsistent");
    }
    let [sh, sw] = win.strides;
    let [dh, dw] = win.dilations;
    let [(pt, pb), (pl, pr)] = win.pads;
    if kh == 0 || kw == 0 {
        op_bail!("W {ws:?} has an empty kernel");
    }
    let (span_h, span_w) = ((kh - 1) * dh + 1, (kw - 1) * dw + 1);
    if span_h > h + pt + pb || span_w > wd + pl + pr {
        op_bail!(
            "kernel {:?} (dilations {:?}) does not fit the padded input {:?}",
            [kh, kw],
            win.dilations,
            [h + pt + pb, wd + pl + pr]
        );
    }
    let (oh, ow) = (
        (h + pt + pb - span_h) / sh + 1,
        (wd + pl + pr - span_w) / sw + 1,
    );
    let xv: Vec<i64> = x.iter().copied().collect();
    let wv: Vec<i64> = w.iter().copied().collect();
    let per_group = m / group;
    let mut out = vec![0i64; n * m * oh * ow];
    if oh * ow > 0 {
        out.par_chunks_mut(oh * ow)
            .enumerate()
            .for_each(|(nm, plane)| {
                let (b, o) = (nm / m, nm % m);
                let g = o / per_group;
                for ci in 0..cg {
                    let xc = &xv[(b * c + g * cg + ci) * h * wd..][..h * wd];
                    let taps = &wv[(o * cg + ci) * kh * kw..][..kh * kw];
                    for (tap, &wgt) in taps.iter().enumerate().filter(|(_, w)| **w != 0) {
                        let (ki, kj) = (tap / kw, tap % kw);
                        let offset = (
                            (ki * dh) as isize - pt as isize,
                            (kj * dw) as isize - pl as isize,
                        );
                        add_tap(plane, ow, xc, (h, wd), wgt, offset, (sh, sw));
                    }
                }
            });
    }
    Ok(ArrayD::from_shape_vec(IxDyn(&[n, m, oh, ow]), out)?)
}

/// Integer convolution shared by `ConvInteger` and `QLinearConv`: zero points subtracted
/// (`x` per tensor, `w` per tensor or per output channel), 1-D or 2-D, in int32.
fn integer_conv(
    ctx: &OpContext,
    x: ArrayD<i64>,
    x_zp: Option<Value>,
    w: ArrayD<i64>,
    w_zp: Option<Value>,
) -> OpResult<ArrayD<i64>> {
    let (xs, ws) = (x.shape().to_vec(), w.shape().to_vec());
    if xs.len() != ws.len() || !(3..=4).contains(&xs.len()) {
        op_bail!(
            "1-D and 2-D inputs with matching weights are supported, got X {xs:?} and W {ws:?}"
        );
    }
    if let Some(z) = &x_zp
        && z.shape().iter().product::<usize>() != 1
    {
        op_bail!(
            "x_zero_point must hold one element, got shape {:?}",
            z.shape()
        );
    }
    let x = minus_zero_point(x, x_zp, None, "x_zero_point")?;
    let w = minus_zero_point(w, w_zp, Some(0), "w_zero_point")?;
    let group = ctx.attrs.int("group", 1)?;
    let group = usize::try_from(group).map_err(|_| format!("group {group} is negative"))?;
    let win = Window2d::from_attrs(ctx.attrs, &xs[2..], &ws[2..])?;
    let one_d = xs.len() == 3;
    let (x4, w4) = if one_d {
        (
            x.into_shape_with_order(IxDyn(&[xs[0], xs[1], 1, xs[2]]))?,
            w.into_shape_with_order(IxDyn(&[ws[0], ws[1], 1, ws[2]]))?,
        )
    } else {
        (x, w)
    };
    let y = conv_i64(&x4, &w4, &win, group)?;
    Ok(if one_d {
        let s = y.shape().to_vec();
        y.into_shape_with_order(IxDyn(&[s[0], s[1], s[3]]))?
    } else {
        y
    })
}

/// `ConvInteger`: `conv(x - x_zero_point, w - w_zero_point)` in int32 (1-D and 2-D).
pub fn conv_integer(ctx: &OpContext, mut inputs: Inputs) -> OpResult<OpOutput> {
    let x = inputs.take(0, "x")?.into_int()?;
    let w = inputs.take(1, "w")?.into_int()?;
    let y = integer_conv(ctx, x, inputs.opt(2), w, inputs.opt(3))?;
    Ok(Value::Int(y.mapv(wrap_i32)).into())
}

/// `QLinearConv`: integer convolution plus the int32 bias, requantized to the output scale
/// and zero point (weight scale per tensor or per output channel).
pub fn qlinear_conv(ctx: &OpContext, mut inputs: Inputs) -> OpResult<OpOutput> {
    let x = inputs.take(0, "x")?.into_int()?;
    let x_scale = host_floats(inputs.take(1, "x_scale")?, ctx.device)?;
    let x_zp = inputs.opt(2);
    let w = inputs.take(3, "w")?.into_int()?;
    let w_scale = host_floats(inputs.take(4, "w_scale")?, ctx.device)?;
    let w_zp = inputs.opt(5);
    let y_scale = host_floats(inputs.take(6, "y_scale")?, ctx.device)?;
    let y_zp = inputs.opt(7);
    let bias = inputs.opt(8).map(Value::into_int).transpose()?;
    let range = int_range(target_type(ctx, y_zp.as_ref())?)?;
    let channels = w.shape().first().copied().unwrap_or(0);
    let mut acc = integer_conv(ctx, x, x_zp, w, w_zp)?;
    let rank = acc.ndim();
    // Per-output-channel vectors apply along axis 1 of the `[N, M, ..]` result.
    let per_channel = |v: ArrayD<f32>| along_axis(v, rank, rank - 1);
    if let Some(b) = bias {
        if b.shape() != [channels] {
            op_bail!("bias shape {:?} should be [{channels}]", b.shape());
        }
        let b = along_axis(b, rank, rank - 1)?;
        acc = host_binary(&acc, &b, |v, b| v.wrapping_add(*b))?;
    }
    let acc = acc.mapv(wrap_i32);
    let xw = host_binary(&x_scale, &per_channel(w_scale)?, |x, w| x * w)?;
    let multiplier = host_binary(&xw, &per_channel(y_scale)?, |x, y| x / y)?;
    let zp = match y_zp {
        Some(z) => z.into_int()?,
        None => ArrayD::zeros(IxDyn(&[])),
    };
    Ok(Value::Int(requantize(&acc, &multiplier, &zp, range, "QLinearConv")?).into())
}
