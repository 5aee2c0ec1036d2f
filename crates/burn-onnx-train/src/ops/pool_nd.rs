//! Pooling in any number of spatial dims, with dilations, for the cases the 2-D kernels
//! do not take: 3-D (and higher) `MaxPool` / `AveragePool`, dilated `AveragePool`, and
//! `MaxPool`'s optional `Indices` output.
//!
//! The window geometry is resolved on the host into, for each output position and kernel
//! tap, the input position it reads (or none, in the padding). On the device the input,
//! flattened to `[N*C, S]` with one extra padding column, is gathered by those positions
//! into `[N*C, P, K]` and reduced over the taps: a `select`, then `max_dim` or a sum, all
//! differentiable.

use burn::tensor::Tensor;

use super::{Inputs, OpContext, OpOutput};
use crate::error::OpResult;
use crate::op_bail;
use crate::value::{FloatValue, Value, int_tensor_1d};

/// The resolved geometry of an N-D pooling window.
struct Geometry {
    /// Output spatial dims.
    out: Vec<usize>,
    /// For output position `p` and tap `k`: the input spatial offset (row-major), or `None`
    /// in the padding; `taps[p * K + k]`.
    taps: Vec<Option<usize>>,
    /// Taps per window.
    k: usize,
    /// Taps inside the input plus explicit padding, per output position (the
    /// `count_include_pad` divisor).
    padded_count: Vec<usize>,
}

fn ints(ctx: &OpContext, name: &str, n: usize, default: i64) -> OpResult<Vec<i64>> {
    let v = ctx.attrs.ints(name)?.unwrap_or_else(|| vec![default; n]);
    if v.len() != n {
        op_bail!(
            "attribute `{name}` has {} entries for {n} spatial dims",
            v.len()
        );
    }
    Ok(v)
}

fn geometry(ctx: &OpContext, input: &[usize]) -> OpResult<Geometry> {
    let n = input.len();
    let Some(kernel) = ctx.attrs.ints("kernel_shape")? else {
        op_bail!("attribute `kernel_shape` is required");
    };
    if kernel.len() != n || kernel.iter().any(|&k| k < 1) {
        op_bail!("kernel_shape {kernel:?} does not fit {n} spatial dims");
    }
    let strides = ints(ctx, "strides", n, 1)?;
    let dilations = ints(ctx, "dilations", n, 1)?;
    let mut pads = ints(ctx, "pads", 2 * n, 0)?;
    let ceil = ctx.attrs.int("ceil_mode", 0)? != 0;
    let auto_pad = ctx.attrs.string("auto_pad", "NOTSET")?;
    if strides.iter().chain(&dilations).any(|&v| v < 1) || pads.iter().any(|&p| p < 0) {
        op_bail!("strides, dilations and pads must be positive (pads non-negative)");
    }
    let mut out = Vec::with_capacity(n);
    for d in 0..n {
        let (i, s) = (input[d] as i64, strides[d]);
        let span = (kernel[d] - 1) * dilations[d] + 1;
        let o = match auto_pad.as_str() {
            "SAME_UPPER" | "SAME_LOWER" => {
                let o = (i + s - 1) / s;
                let total = ((o - 1) * s + span - i).max(0);
                let small = total / 2;
                (pads[d], pads[d + n]) = if auto_pad == "SAME_UPPER" {
                    (small, total - small)
                } else {
                    (total - small, small)
                };
                o
            }
            "VALID" => {
                (pads[d], pads[d + n]) = (0, 0);
                (i - span) / s + 1
            }
            "NOTSET" => {
                let room = i + pads[d] + pads[d + n] - span;
                let mut o = if ceil {
                    (room + s - 1) / s + 1
                } else {
                    room / s + 1
                };
                // A last window may not start past the input and its leading padding.
                if ceil && (o - 1) * s >= i + pads[d] {
                    o -= 1;
                }
                o
            }
            other => {
                op_bail!("auto_pad {other:?} is not one of NOTSET, SAME_UPPER, SAME_LOWER, VALID")
            }
        };
        if o < 1 {
            op_bail!("the window {span} does not fit spatial dim {d} of size {i} with its padding");
        }
        out.push(o as usize);
    }
    let k: usize = kernel.iter().map(|&v| v as usize).product();
    let p: usize = out.iter().product();
    let mut taps = Vec::with_capacity(p * k);
    let mut padded_count = Vec::with_capacity(p);
    let mut pos = vec![0usize; n];
    for _ in 0..p {
        let mut count = 0;
        let mut tap = vec![0usize; n];
        for _ in 0..k {
            let mut offset = Some(0usize);
            let mut in_padded = true;
            for d in 0..n {
                let at = (pos[d] as i64) * strides[d] - pads[d] + (tap[d] as i64) * dilations[d];
                let i = input[d] as i64;
                in_padded &= at >= -pads[d] && at < i + pads[d + n];
                offset = match offset {
                    Some(o) if (0..i).contains(&at) => Some(o * input[d] + at as usize),
                    _ => None,
                };
            }
            count += usize::from(in_padded);
            taps.push(offset);
            increment(
                &mut tap,
                &kernel.iter().map(|&v| v as usize).collect::<Vec<_>>(),
            );
        }
        padded_count.push(count);
        increment(&mut pos, &out);
    }
    Ok(Geometry {
        out,
        taps,
        k,
        padded_count,
    })
}

/// Advance a row-major multi-index within `dims`.
fn increment(ix: &mut [usize], dims: &[usize]) {
    for d in (0..ix.len()).rev() {
        ix[d] += 1;
        if ix[d] < dims[d] {
            return;
        }
        ix[d] = 0;
    }
}

/// `x` gathered into windows: `[N*C, P, K]`, padding taps reading `fill`.
fn windows(ctx: &OpContext, x: FloatValue, g: &Geometry, fill: f32) -> OpResult<Tensor<3>> {
    let s = x.shape();
    let (nc, spatial): (usize, usize) = (s[0] * s[1], s[2..].iter().product());
    let flat = x.reshape(&[nc, spatial])?.into_rank::<2>()?;
    let pad = Tensor::full([nc, 1], fill, ctx.device);
    let flat = Tensor::cat(vec![flat, pad], 1);
    let idx = g.taps.iter().map(|t| t.unwrap_or(spatial) as i64).collect();
    let picked = flat.select(1, int_tensor_1d(idx, ctx.device));
    let p: usize = g.out.iter().product();
    Ok(picked.reshape([nc, p, g.k]))
}

fn output_shape(x: &[usize], g: &Geometry) -> Vec<usize> {
    let mut shape = x[..2].to_vec();
    shape.extend(&g.out);
    shape
}

fn input(ctx: &OpContext, inputs: &mut Inputs) -> OpResult<FloatValue> {
    let x = inputs.float(0, "X", ctx.device)?;
    if x.rank < 3 {
        op_bail!("pooling needs [N, C, D1, ...], got {:?}", x.shape());
    }
    Ok(x)
}

/// `MaxPool` in N-D, with the optional `Indices` output (flat indices into the input,
/// row-major, or column-major over the spatial dims with `storage_order = 1`).
pub fn max_pool_nd(ctx: &OpContext, mut inputs: Inputs) -> OpResult<OpOutput> {
    let x = input(ctx, &mut inputs)?;
    let shape = x.shape();
    let g = geometry(ctx, &shape[2..])?;
    let w = windows(ctx, x, &g, f32::NEG_INFINITY)?;
    let out_shape = output_shape(&shape, &g);
    let y = FloatValue::from_rank(w.clone().max_dim(2))?.reshape(&out_shape)?;
    let mut values = vec![Value::Float(y)];
    if ctx.num_outputs > 1 {
        let best = w.argmax(2).try_into_data().map_err(|e| format!("{e:?}"))?;
        let best: Vec<i64> = best
            .convert::<i64>()
            .try_to_vec::<i64>()
            .map_err(|e| format!("{e:?}"))?;
        let column_major = ctx.attrs.int("storage_order", 0)? != 0;
        let spatial: usize = shape[2..].iter().product();
        let p: usize = g.out.iter().product();
        let indices = best
            .iter()
            .enumerate()
            .map(|(j, &t)| {
                let (plane, pos) = (j / p, j % p);
                let offset = g.taps[pos * g.k + t as usize].unwrap_or(0);
                let offset = if column_major {
                    transpose_offset(offset, &shape[2..])
                } else {
                    offset
                };
                (plane * spatial + offset) as i64
            })
            .collect();
        values.push(Value::Int(ndarray::ArrayD::from_shape_vec(
            ndarray::IxDyn(&out_shape),
            indices,
        )?));
    }
    Ok(values.into())
}

/// A row-major spatial offset as the column-major one of the same position.
fn transpose_offset(offset: usize, dims: &[usize]) -> usize {
    let mut rest = offset;
    let mut ix = vec![0; dims.len()];
    for d in (0..dims.len()).rev() {
        ix[d] = rest % dims[d];
        rest /= dims[d];
    }
    let mut out = 0;
    for d in (0..dims.len()).rev() {
        out = out * dims[d] + ix[d];
    }
    out
}

/// `AveragePool` in N-D with dilations (`count_include_pad` counts the explicit padding,
/// not what `ceil_mode` adds past it).
pub fn average_pool_nd(ctx: &OpContext, mut inputs: Inputs) -> OpResult<OpOutput> {
    let x = input(ctx, &mut inputs)?;
    let shape = x.shape();
    let g = geometry(ctx, &shape[2..])?;
    let include_pad = ctx.attrs.int("count_include_pad", 0)? != 0;
    let w = windows(ctx, x, &g, 0.0)?;
    let p = g.out.iter().product::<usize>();
    let counts: Vec<f32> = (0..p)
        .map(|pos| {
            let valid = g.taps[pos * g.k..(pos + 1) * g.k].iter().flatten().count();
            (if include_pad {
                g.padded_count[pos]
            } else {
                valid
            })
            .max(1) as f32
        })
        .collect();
    let counts: Tensor<3> =
        Tensor::<1>::from_floats(counts.as_slice(), ctx.device).reshape([1, p, 1]);
    let y = FloatValue::from_rank(w.sum_dim(2) / counts)?.reshape(&output_shape(&shape, &g))?;
    Ok(Value::Float(y).into())
}
