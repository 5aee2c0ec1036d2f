//! `Resize` with `nearest` (all four `nearest_mode`s), `linear` and `cubic` interpolation
//! (`cubic_coeff_a`, `exclude_outside`, `antialias` when downsampling), on any axes (or the
//! `axes` attribute's), for every coordinate mode (`half_pixel`, `half_pixel_symmetric`,
//! `pytorch_half_pixel`, `align_corners`, `asymmetric`, `tf_half_pixel_for_nn`,
//! `tf_crop_and_resize` with `roi` and `extrapolation_value`) and `keep_aspect_ratio_policy`.
//! Each resized axis is a weighted sum of a few index selections (its taps), so the op is
//! exact and differentiable. The deprecated `Upsample` (opsets 7 to 9) reuses the same taps.

use burn::tensor::{Tensor, TensorData};

use super::{Inputs, OpContext, OpOutput};
use crate::error::OpResult;
use crate::op_bail;
use crate::value::{FloatValue, MAX_RANK, Value, int_tensor_1d};

/// One axis's resize: sizes, scale, and the `roi` span for `tf_crop_and_resize`.
struct AxisResize {
    n_in: usize,
    n_out: usize,
    scale: f64,
    roi: (f64, f64),
}

/// Source coordinate of output index `o`, or `None` outside the input (extrapolated, only
/// in `tf_crop_and_resize`).
fn source_coord(mode: &str, o: usize, a: &AxisResize) -> OpResult<Option<f64>> {
    // The output width as the scale gives it (not rounded): the spec's `output_width`.
    let (o, n_in, n_out) = (o as f64, a.n_in as f64, a.n_out as f64);
    let width = a.scale * n_in;
    Ok(Some(match mode {
        "half_pixel" => (o + 0.5) / a.scale - 0.5,
        "half_pixel_symmetric" => {
            let offset = n_in / 2.0 * (1.0 - n_out / width);
            offset + (o + 0.5) / a.scale - 0.5
        }
        "pytorch_half_pixel" if width > 1.0 => (o + 0.5) / a.scale - 0.5,
        "pytorch_half_pixel" => -0.5,
        "align_corners" if width != 1.0 => o * (n_in - 1.0) / (width - 1.0),
        "align_corners" => 0.0,
        "asymmetric" => o / a.scale,
        "tf_half_pixel_for_nn" => (o + 0.5) / a.scale,
        "tf_crop_and_resize" => {
            let (lo, hi) = a.roi;
            let x = if width != 1.0 {
                lo * (n_in - 1.0) + o * (hi - lo) * (n_in - 1.0) / (width - 1.0)
            } else {
                lo * (n_in - 1.0) + (hi - lo) * (n_in - 1.0) / 2.0
            };
            if x < 0.0 || x > n_in - 1.0 {
                return Ok(None);
            }
            x
        }
        other => op_bail!("coordinate_transformation_mode {other:?} is not supported"),
    }))
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

/// How the output of one position mixes input positions.
struct Interpolation<'a> {
    mode: &'a str,
    nearest: &'a str,
    cubic_a: f64,
    antialias: bool,
    exclude_outside: bool,
}

impl Interpolation<'_> {
    /// Coefficients of the taps `ceil(x) - n/2 ..` for the fraction `ratio` in (0, 1].
    fn coeffs(&self, ratio: f64, scale: f64) -> Vec<f64> {
        let a = self.cubic_a;
        let cubic = |x: f64| {
            let x = x.abs();
            if x <= 1.0 {
                ((a + 2.0) * x - (a + 3.0)) * x * x + 1.0
            } else if x < 2.0 {
                ((a * x - 5.0 * a) * x + 8.0 * a) * x - 4.0 * a
            } else {
                0.0
            }
        };
        let normalised = |c: Vec<f64>| {
            let sum: f64 = c.iter().sum();
            c.into_iter().map(|v| v / sum).collect()
        };
        match (self.mode, self.antialias && scale < 1.0) {
            ("linear", false) => vec![1.0 - ratio, ratio],
            ("cubic", false) => [1.0 + ratio, ratio, 1.0 - ratio, 2.0 - ratio]
                .map(cubic)
                .to_vec(),
            ("linear", true) => {
                let start = (-1.0 / scale).floor() as i64 + 1;
                let taps = (start..2 - start)
                    .map(|i| (1.0 - ((i as f64 - ratio) * scale).abs()).clamp(0.0, 1.0));
                normalised(taps.collect())
            }
            (_, true) => {
                let start = (-2.0 / scale).floor() as i64 + 1;
                normalised(
                    (start..2 - start)
                        .map(|i| cubic(scale * (i as f64 - ratio)))
                        .collect(),
                )
            }
            _ => Vec::new(),
        }
    }

    /// The `(input index, weight)` taps of an output position at source coordinate `x`.
    fn taps(&self, x: f64, a: &AxisResize) -> OpResult<Vec<(usize, f64)>> {
        if self.mode == "nearest" {
            return Ok(vec![(nearest_index(self.nearest, x, a.n_in)?, 1.0)]);
        }
        let ratio = if x.fract() == 0.0 { 1.0 } else { x - x.floor() };
        let mut coeffs = self.coeffs(ratio, a.scale);
        let start = x.ceil() as i64 - coeffs.len() as i64 / 2;
        let last = a.n_in as i64 - 1;
        if self.exclude_outside {
            for (k, c) in coeffs.iter_mut().enumerate() {
                if !(0..=last).contains(&(start + k as i64)) {
                    *c = 0.0;
                }
            }
            let sum: f64 = coeffs.iter().sum();
            coeffs.iter_mut().for_each(|c| *c /= sum);
        }
        Ok(coeffs
            .into_iter()
            .enumerate()
            .map(|(k, c)| ((start + k as i64).clamp(0, last) as usize, c))
            .collect())
    }
}

/// Resize physical axis `phys` of `t`: the sum over tap slots of a selection times its
/// weights, plus the extrapolation value where the source is outside the input.
fn resize_axis(
    ctx: &OpContext,
    t: crate::value::PhysTensor,
    phys: usize,
    a: &AxisResize,
    coord: &str,
    interp: &Interpolation,
    extrapolation: f32,
) -> OpResult<crate::value::PhysTensor> {
    let mut per_output = Vec::with_capacity(a.n_out);
    for o in 0..a.n_out {
        per_output.push(match source_coord(coord, o, a)? {
            Some(x) => Some(interp.taps(x, a)?),
            None => None,
        });
    }
    let slots = per_output.iter().flatten().map(Vec::len).max().unwrap_or(0);
    let mut wshape = [1usize; MAX_RANK];
    wshape[phys] = a.n_out;
    let column = |v: Vec<f32>| -> Tensor<MAX_RANK> {
        Tensor::from_data(TensorData::new(v, wshape.to_vec()), ctx.device)
    };
    let mut out: Option<crate::value::PhysTensor> = None;
    for slot in 0..slots {
        let (idx, w): (Vec<i64>, Vec<f32>) = per_output
            .iter()
            .map(|taps| match taps.as_ref().and_then(|t| t.get(slot)) {
                Some(&(i, w)) => (i as i64, w as f32),
                None => (0, 0.0),
            })
            .unzip();
        let picked = t.clone().select(phys, int_tensor_1d(idx, ctx.device));
        let term = if w.iter().all(|&v| v == 1.0) {
            picked
        } else {
            picked * column(w)
        };
        out = Some(match out {
            Some(acc) => acc + term,
            None => term,
        });
    }
    let Some(mut out) = out else {
        op_bail!("no input position feeds the output");
    };
    if per_output.iter().any(Option::is_none) {
        let fill = per_output
            .iter()
            .map(|t| if t.is_none() { extrapolation } else { 0.0 })
            .collect();
        out = out + column(fill);
    }
    Ok(out)
}

/// `Resize`
pub fn resize(ctx: &OpContext, mut inputs: Inputs) -> OpResult<OpOutput> {
    let x = inputs.float(0, "X", ctx.device)?;
    let shape = x.shape();
    let rank = shape.len();
    if ctx.opset < 11 {
        op_bail!("Resize before opset 11 is not supported");
    }
    let floats = |v: Option<Value>| -> OpResult<Option<Vec<f64>>> {
        Ok(match v {
            Some(Value::Float(f)) if f.numel() > 0 => {
                Some(f.to_array()?.iter().map(|&v| f64::from(v)).collect())
            }
            _ => None,
        })
    };
    let roi = floats(inputs.opt(1))?;
    let scales = floats(inputs.opt(2))?;
    let sizes = inputs
        .opt(3)
        .map(|v| v.dims_list("sizes"))
        .transpose()?
        .filter(|s| !s.is_empty());
    let axes: Vec<usize> = match ctx.attrs.ints("axes")? {
        Some(a) => a
            .iter()
            .map(|&v| crate::value::norm_axis(v, rank))
            .collect::<OpResult<_>>()?,
        None => (0..rank).collect(),
    };
    let n = axes.len();
    let (out, scale): (Vec<usize>, Vec<f64>) = match (sizes, scales) {
        (Some(s), _) if s.len() == n => {
            let ratio: Vec<f64> = s
                .iter()
                .zip(&axes)
                .map(|(&o, &a)| o as f64 / shape[a] as f64)
                .collect();
            match ctx
                .attrs
                .string("keep_aspect_ratio_policy", "stretch")?
                .as_str()
            {
                "stretch" => (s, ratio),
                policy @ ("not_larger" | "not_smaller") => {
                    let pick = if policy == "not_larger" {
                        f64::min
                    } else {
                        f64::max
                    };
                    let r = ratio.iter().copied().reduce(pick).unwrap_or(1.0);
                    (
                        axes.iter()
                            .map(|&a| (r * shape[a] as f64 + 0.5) as usize)
                            .collect(),
                        vec![r; n],
                    )
                }
                other => op_bail!(
                    "keep_aspect_ratio_policy {other:?} is not stretch, not_larger or not_smaller"
                ),
            }
        }
        (None, Some(sc)) if sc.len() == n => (
            sc.iter()
                .zip(&axes)
                .map(|(&s, &a)| (shape[a] as f64 * s).floor() as usize)
                .collect(),
            sc,
        ),
        _ => {
            op_bail!("needs `scales` or `sizes` with one entry per resized axis ({n}) of {shape:?}")
        }
    };
    let mode = ctx.attrs.string("mode", "nearest")?;
    if !matches!(mode.as_str(), "nearest" | "linear" | "cubic") {
        op_bail!("mode {mode:?} is not supported (nearest, linear, cubic)");
    }
    let coord = ctx
        .attrs
        .string("coordinate_transformation_mode", "half_pixel")?;
    let nearest = ctx.attrs.string("nearest_mode", "round_prefer_floor")?;
    let interp = Interpolation {
        mode: &mode,
        nearest: &nearest,
        cubic_a: f64::from(ctx.attrs.float("cubic_coeff_a", -0.75)?),
        antialias: ctx.attrs.int("antialias", 0)? != 0,
        exclude_outside: ctx.attrs.int("exclude_outside", 0)? != 0,
    };
    let extrapolation = ctx.attrs.float("extrapolation_value", 0.0)?;
    if coord == "tf_crop_and_resize" && roi.as_ref().is_none_or(|r| r.len() != 2 * n) {
        op_bail!("tf_crop_and_resize needs `roi` with 2 entries per resized axis ({n})");
    }
    let mut t = x.tensor;
    for (k, &axis) in axes.iter().enumerate() {
        let a = AxisResize {
            n_in: shape[axis],
            n_out: out[k],
            scale: scale[k],
            roi: roi
                .as_ref()
                .filter(|r| r.len() == 2 * n)
                .map_or((0.0, 1.0), |r| (r[k], r[k + n])),
        };
        if a.n_in == a.n_out && a.scale == 1.0 && coord != "tf_crop_and_resize" {
            continue;
        }
        if a.n_in == 0 || a.n_out == 0 {
            op_bail!("cannot resize axis {axis} from {} to {}", a.n_in, a.n_out);
        }
        let phys = axis + MAX_RANK - rank;
        t = resize_axis(ctx, t, phys, &a, &coord, &interp, extrapolation)?;
    }
    Ok(Value::Float(FloatValue::new(t, rank)).into())
}

/// `Upsample` (deprecated, opsets 7 to 9): `scales` as an attribute (opset 7) or as the
/// second input (opset 9), one per axis. `nearest` is Resize's `asymmetric` coordinates
/// with `floor` rounding, `linear` (also spelt `bilinear`) its `asymmetric` linear mode.
pub fn upsample(ctx: &OpContext, mut inputs: Inputs) -> OpResult<OpOutput> {
    let x = inputs.float(0, "X", ctx.device)?;
    let shape = x.shape();
    let rank = shape.len();
    let scales: Vec<f64> = match inputs.opt(1) {
        Some(Value::Float(f)) => f.to_array()?.iter().map(|&v| f64::from(v)).collect(),
        Some(_) => op_bail!("`scales` must be a float tensor"),
        None => match ctx.attrs.get("scales") {
            Some(crate::graph::attributes::Attr::Floats(s)) => {
                s.iter().map(|&v| f64::from(v)).collect()
            }
            _ => op_bail!("needs `scales` (a float list attribute or the second input)"),
        },
    };
    if scales.len() != rank || scales.iter().any(|&s| !(s.is_finite() && s > 0.0)) {
        op_bail!("scales {scales:?} must be one positive value per axis of {shape:?}");
    }
    let mode = match ctx.attrs.string("mode", "nearest")?.as_str() {
        "nearest" => "nearest",
        "linear" | "bilinear" => "linear",
        other => op_bail!("mode {other:?} is not supported (nearest, linear)"),
    };
    let interp = Interpolation {
        mode,
        nearest: "floor",
        cubic_a: -0.75,
        antialias: false,
        exclude_outside: false,
    };
    let mut t = x.tensor;
    for (axis, &scale) in scales.iter().enumerate() {
        let a = AxisResize {
            n_in: shape[axis],
            n_out: (shape[axis] as f64 * scale).floor() as usize,
            scale,
            roi: (0.0, 1.0),
        };
        if a.n_in == a.n_out && scale == 1.0 {
            continue;
        }
        if a.n_in == 0 || a.n_out == 0 {
            op_bail!("cannot upsample axis {axis} from {} to {}", a.n_in, a.n_out);
        }
        let phys = axis + MAX_RANK - rank;
        t = resize_axis(ctx, t, phys, &a, "asymmetric", &interp, 0.0)?;
    }
    Ok(Value::Float(FloatValue::new(t, rank)).into())
}
