//! `Resize` with `nearest` (all four `nearest_mode`s) and `linear` interpolation, on any
//! axes, for the coordinate modes `half_pixel`, `pytorch_half_pixel`, `align_corners`,
//! `asymmetric` and `tf_half_pixel_for_nn`. Each resized axis is an index selection (and
//! for `linear` a weighted sum of two selections), so the op is exact and differentiable.

use burn::tensor::{Tensor, TensorData};

use super::{Inputs, OpContext, OpOutput};
use crate::error::OpResult;
use crate::op_bail;
use crate::value::{FloatValue, MAX_RANK, Value, int_tensor_1d};

/// Source coordinate of output index `o` on an axis resized from `n_in` to `n_out`.
fn source_coord(mode: &str, o: usize, n_in: usize, n_out: usize, scale: f64) -> OpResult<f64> {
    let o = o as f64;
    Ok(match mode {
        "half_pixel" => (o + 0.5) / scale - 0.5,
        "pytorch_half_pixel" => {
            if n_out > 1 {
                (o + 0.5) / scale - 0.5
            } else {
                0.0
            }
        }
        "align_corners" => {
            if n_out > 1 {
                o * (n_in as f64 - 1.0) / (n_out as f64 - 1.0)
            } else {
                0.0
            }
        }
        "asymmetric" => o / scale,
        "tf_half_pixel_for_nn" => (o + 0.5) / scale,
        other => op_bail!("coordinate_transformation_mode {other:?} is not supported"),
    })
}

fn nearest_index(mode: &str, x: f64, n_in: usize) -> OpResult<usize> {
    let i = match mode {
        "round_prefer_floor" => {
            if x.fract() == 0.5 {
                x.floor()
            } else {
                x.round()
            }
        }
        "round_prefer_ceil" => x.round(),
        "floor" => x.floor(),
        "ceil" => x.ceil(),
        other => op_bail!("nearest_mode {other:?} is not supported"),
    };
    Ok(i.clamp(0.0, n_in as f64 - 1.0) as usize)
}

/// `Resize`
pub fn resize(ctx: &OpContext, mut inputs: Inputs) -> OpResult<OpOutput> {
    let x = inputs.float(0, "X", ctx.device)?;
    let shape = x.shape();
    let rank = shape.len();
    if ctx.opset < 11 {
        op_bail!("Resize before opset 11 is not supported");
    }
    let scales: Option<Vec<f32>> = match inputs.opt(2) {
        Some(Value::Float(f)) if f.numel() > 0 => Some(f.to_array()?.iter().copied().collect()),
        _ => None,
    };
    let sizes = inputs
        .opt(3)
        .map(|v| v.dims_list("sizes"))
        .transpose()?
        .filter(|s| !s.is_empty());
    if ctx.attrs.has("axes") || ctx.attrs.int("antialias", 0)? != 0 {
        op_bail!("the `axes` and `antialias` attributes are not supported");
    }
    let (out, scale): (Vec<usize>, Vec<f64>) = match (sizes, scales) {
        (Some(s), _) if s.len() == rank => (
            s.clone(),
            s.iter()
                .zip(&shape)
                .map(|(&o, &i)| o as f64 / i as f64)
                .collect(),
        ),
        (None, Some(sc)) if sc.len() == rank => (
            sc.iter()
                .zip(&shape)
                .map(|(&s, &i)| (i as f64 * s as f64).floor() as usize)
                .collect(),
            sc.iter().map(|&s| s as f64).collect(),
        ),
        _ => op_bail!("needs `scales` or `sizes` with one entry per axis of {shape:?}"),
    };
    let mode = ctx.attrs.string("mode", "nearest")?;
    let coord = ctx
        .attrs
        .string("coordinate_transformation_mode", "half_pixel")?;
    let nearest = ctx.attrs.string("nearest_mode", "round_prefer_floor")?;
    let mut t = x.tensor;
    for axis in 0..rank {
        let (n_in, n_out) = (shape[axis], out[axis]);
        if n_in == n_out && scale[axis] == 1.0 {
            continue;
        }
        let phys = axis + MAX_RANK - rank;
        let coords: Vec<f64> = (0..n_out)
            .map(|o| source_coord(&coord, o, n_in, n_out, scale[axis]))
            .collect::<OpResult<_>>()?;
        t = match mode.as_str() {
            "nearest" => {
                let idx: Vec<i64> = coords
                    .iter()
                    .map(|&c| nearest_index(&nearest, c, n_in).map(|i| i as i64))
                    .collect::<OpResult<_>>()?;
                t.select(phys, int_tensor_1d(idx, ctx.device))
            }
            "linear" => {
                let mut lo = Vec::with_capacity(n_out);
                let mut hi = Vec::with_capacity(n_out);
                let mut w_hi = Vec::with_capacity(n_out);
                for &c in &coords {
                    let c = c.clamp(0.0, n_in as f64 - 1.0);
                    let i0 = c.floor() as usize;
                    lo.push(i0 as i64);
                    hi.push((i0 + 1).min(n_in - 1) as i64);
                    w_hi.push((c - i0 as f64) as f32);
                }
                let mut wshape = [1usize; MAX_RANK];
                wshape[phys] = n_out;
                let w_hi: Tensor<MAX_RANK> =
                    Tensor::from_data(TensorData::new(w_hi, wshape.to_vec()), ctx.device);
                let a = t.clone().select(phys, int_tensor_1d(lo, ctx.device));
                let b = t.select(phys, int_tensor_1d(hi, ctx.device));
                a.clone() + (b - a) * w_hi
            }
            other => op_bail!("mode {other:?} is not supported (nearest, linear)"),
        };
    }
    Ok(Value::Float(FloatValue::new(t, rank)).into())
}
