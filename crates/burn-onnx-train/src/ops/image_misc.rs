//! Image ops built from gathers, scatters and pooling: `Col2Im`, `CenterCropPad`,
//! `MaxUnpool`, `LpPool` and `RoiAlign`.
//!
//! Which element goes where is worked out on the host (it depends only on shapes,
//! attributes and integer or setting inputs); the float data moves on the device with
//! Burn's row `select` / `select_assign`, `narrow`, `cat`, pooling and convolution, all
//! differentiable, so gradients reach the data input of each op.

use burn::tensor::module::{avg_pool2d, conv1d, conv2d, conv3d};
use burn::tensor::ops::{AvgPoolOptions, ConvOptions};
use burn::tensor::{IndexingUpdateOp, Tensor, TensorData};
use ndarray::{ArrayD, IxDyn};

use super::{Inputs, OpContext, OpOutput};
use crate::error::OpResult;
use crate::op_bail;
use crate::value::{FloatValue, MAX_RANK, PhysTensor, Value, int_tensor_1d, norm_axis, padded};

/// An attribute list of non-negative ints, `default` when absent; `positive` refuses zeros.
fn usize_list(
    ctx: &OpContext,
    name: &str,
    len: usize,
    default: usize,
    positive: bool,
) -> OpResult<Vec<usize>> {
    let Some(v) = ctx.attrs.ints(name)? else {
        return Ok(vec![default; len]);
    };
    if v.len() != len {
        op_bail!("attribute `{name}` must have {len} entries, got {v:?}");
    }
    v.iter()
        .map(|&x| match usize::try_from(x) {
            Ok(u) if u > 0 || !positive => Ok(u),
            _ => op_bail!("attribute `{name}` has an invalid entry: {v:?}"),
        })
        .collect()
}

/// Row-major strides of a shape.
fn strides(shape: &[usize]) -> Vec<usize> {
    let mut s = vec![1; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        s[i] = s[i + 1] * shape[i + 1];
    }
    s
}

/// `[rows, inner]` zeros on the device with the values `values` (`[targets.len(), inner]`)
/// added at rows `targets`.
fn scatter_add_rows(
    ctx: &OpContext,
    rows: usize,
    inner: usize,
    targets: Vec<i64>,
    values: Tensor<2>,
) -> Tensor<2> {
    let zeros = Tensor::<2>::zeros([rows, inner], ctx.device);
    if targets.is_empty() {
        return zeros;
    }
    zeros.select_assign(
        0,
        int_tensor_1d(targets, ctx.device),
        values,
        IndexingUpdateOp::Add,
    )
}

/// Zeros of a logical shape as a float value (zero-size shapes included).
fn zeros_value(ctx: &OpContext, shape: &[usize]) -> OpResult<FloatValue> {
    Ok(FloatValue::new(
        PhysTensor::zeros(padded(shape)?, ctx.device),
        shape.len(),
    ))
}

/// `Col2Im(input, image_shape, block_shape)` (`dilations`, `pads`, `strides`): sums the
/// columns `[N, C * prod(block), L]` back into images `[N, C, *image_shape]`.
pub fn col2im(ctx: &OpContext, mut inputs: Inputs) -> OpResult<OpOutput> {
    let x = inputs.float(0, "input", ctx.device)?;
    let image = inputs.take(1, "image_shape")?.dims_list("image_shape")?;
    let block = inputs.take(2, "block_shape")?.dims_list("block_shape")?;
    let nd = image.len();
    if nd == 0 || block.len() != nd || block.contains(&0) {
        op_bail!(
            "image_shape {image:?} and block_shape {block:?} must be non-empty, of one length, with positive blocks"
        );
    }
    let dil = usize_list(ctx, "dilations", nd, 1, true)?;
    let st = usize_list(ctx, "strides", nd, 1, true)?;
    let pads = usize_list(ctx, "pads", 2 * nd, 0, false)?;
    let xs = x.shape();
    let [n, ck, l] = xs[..] else {
        op_bail!("input must be [N, C * prod(block_shape), L], got {xs:?}");
    };
    let kernel: usize = block.iter().product();
    if ck % kernel != 0 {
        op_bail!("input dimension 1 ({ck}) is not a multiple of prod(block_shape) = {kernel}");
    }
    let c = ck / kernel;
    let mut blocks = Vec::with_capacity(nd);
    for i in 0..nd {
        let span = dil[i] * (block[i] - 1) + 1;
        let padded = image[i] + pads[i] + pads[nd + i];
        if padded < span {
            op_bail!(
                "block {block:?} (dilations {dil:?}) does not fit image {image:?} with pads {pads:?}"
            );
        }
        blocks.push((padded - span) / st[i] + 1);
    }
    if blocks.iter().product::<usize>() != l {
        op_bail!("input has {l} blocks, image {image:?} with block {block:?} holds {blocks:?}");
    }
    let img_strides = strides(&image);
    let s: usize = image.iter().product();
    let (mut sources, mut targets) = (Vec::new(), Vec::new());
    for kk in 0..kernel {
        let mut off = vec![0; nd];
        let mut rem = kk;
        for i in (0..nd).rev() {
            off[i] = rem % block[i];
            rem /= block[i];
        }
        'col: for col in 0..l {
            let mut rem = col;
            let mut flat = 0;
            for i in (0..nd).rev() {
                let bi = rem % blocks[i];
                rem /= blocks[i];
                let pos = (bi * st[i] + off[i] * dil[i]) as i64 - pads[i] as i64;
                if pos < 0 || pos >= image[i] as i64 {
                    continue 'col;
                }
                flat += pos as usize * img_strides[i];
            }
            sources.push((kk * l + col) as i64);
            targets.push(flat as i64);
        }
    }
    let mut out_shape = vec![n, c];
    out_shape.extend_from_slice(&image);
    if n * c == 0 || s == 0 {
        return Ok(Value::Float(zeros_value(ctx, &out_shape)?).into());
    }
    let cols = x
        .reshape(&[n * c, kernel * l])?
        .into_rank::<2>()?
        .swap_dims(0, 1);
    let picked = cols.select(0, int_tensor_1d(sources, ctx.device));
    let out = scatter_add_rows(ctx, s, n * c, targets, picked).swap_dims(0, 1);
    Ok(Value::Float(FloatValue::from_rank(out)?.reshape(&out_shape)?).into())
}

/// Zeros `before` and `after` around a physical tensor along physical axis `phys`.
fn zero_pad(t: PhysTensor, phys: usize, before: usize, after: usize) -> PhysTensor {
    if before == 0 && after == 0 {
        return t;
    }
    let dims = t.dims();
    let device = t.device();
    let part = |len: usize| {
        let mut d = dims;
        d[phys] = len;
        PhysTensor::zeros(d, &device)
    };
    let mut parts = Vec::with_capacity(3);
    if before > 0 {
        parts.push(part(before));
    }
    if dims[phys] > 0 {
        parts.push(t);
    }
    if after > 0 {
        parts.push(part(after));
    }
    Tensor::cat(parts, phys)
}

/// Host crop/pad: `out[i] = src[i + offset]` where that is in range, `fill` elsewhere.
fn shift_host<T: Clone>(a: &ArrayD<T>, out_shape: &[usize], offsets: &[i64], fill: T) -> ArrayD<T> {
    ArrayD::from_shape_fn(IxDyn(out_shape), |ix| {
        let mut src = Vec::with_capacity(out_shape.len());
        for (d, &o) in offsets.iter().enumerate() {
            let j = ix[d] as i64 + o;
            if j < 0 || j >= a.shape()[d] as i64 {
                return fill.clone();
            }
            src.push(j as usize);
        }
        a[IxDyn(&src)].clone()
    })
}

/// `CenterCropPad(input, shape)` (`axes`): crops or zero-pads each listed axis to its
/// target length around the centre (an odd difference leaves the extra element at the end).
pub fn center_crop_pad(ctx: &OpContext, mut inputs: Inputs) -> OpResult<OpOutput> {
    let x = inputs.take(0, "input_data")?;
    let target = inputs.take(1, "shape")?.dims_list("shape")?;
    let shape = x.shape();
    let rank = shape.len();
    let axes: Vec<usize> = match ctx.attrs.ints("axes")? {
        Some(a) => a
            .iter()
            .map(|&a| norm_axis(a, rank))
            .collect::<OpResult<_>>()?,
        None => (0..rank).collect(),
    };
    if axes.len() != target.len() {
        op_bail!("shape {target:?} must have one entry per axis {axes:?}");
    }
    let mut out_shape = shape.clone();
    // Per axis: (crop start, pad before, pad after).
    let mut plan = vec![(0usize, 0usize, 0usize); rank];
    for (&a, &t) in axes.iter().zip(&target) {
        let dim = shape[a];
        out_shape[a] = t;
        plan[a] = if t <= dim {
            ((dim - t) / 2, 0, 0)
        } else {
            let d = t - dim;
            (0, d / 2, d - d / 2)
        };
    }
    let offsets: Vec<i64> = plan
        .iter()
        .map(|&(start, before, _)| start as i64 - before as i64)
        .collect();
    Ok(match x {
        Value::Str(_) => op_bail!("expected a numeric tensor, got strings"),
        Value::Sequence(_) => op_bail!("expected a tensor, got a sequence"),
        Value::Float(f) => {
            let mut t = f.tensor;
            let lead = MAX_RANK - rank;
            for (a, &(start, before, after)) in plan.iter().enumerate() {
                let phys = lead + a;
                let dim = t.dims()[phys];
                if before + after > 0 {
                    t = zero_pad(t, phys, before, after);
                } else if out_shape[a] < dim {
                    if out_shape[a] == 0 {
                        return Ok(Value::Float(zeros_value(ctx, &out_shape)?).into());
                    }
                    t = t.narrow(phys, start, out_shape[a]);
                }
            }
            Value::Float(FloatValue::new(t, rank))
        }
        Value::Int(a) => Value::Int(shift_host(&a, &out_shape, &offsets, 0)),
        Value::Bool(a) => Value::Bool(shift_host(&a, &out_shape, &offsets, false)),
    }
    .into())
}

/// `MaxUnpool(X, I, output_shape?)` (`kernel_shape`, `pads`, `strides`): each value of `X`
/// is written at its flat index `I` of the output (of `output_shape` when given, else the
/// shape the pooling attributes imply); the last write to an index wins.
pub fn max_unpool(ctx: &OpContext, mut inputs: Inputs) -> OpResult<OpOutput> {
    let x = inputs.float(0, "X", ctx.device)?;
    let idx = inputs.take(1, "I")?.into_int()?;
    let out_shape = inputs
        .opt(2)
        .map(|v| v.dims_list("output_shape"))
        .transpose()?;
    let xs = x.shape();
    if xs.len() < 3 || idx.shape() != xs.as_slice() {
        op_bail!(
            "X must be [N, C, D1, ...] and I of the same shape, got {xs:?} and {:?}",
            idx.shape()
        );
    }
    let nd = xs.len() - 2;
    let Some(kernel) = ctx.attrs.ints("kernel_shape")? else {
        op_bail!("attribute `kernel_shape` is required");
    };
    if kernel.len() != nd || kernel.iter().any(|&k| k < 1) {
        op_bail!("attribute `kernel_shape` {kernel:?} does not fit X {xs:?}");
    }
    let st = usize_list(ctx, "strides", nd, 1, true)?;
    let pads = usize_list(ctx, "pads", 2 * nd, 0, false)?;
    let shape = match out_shape {
        Some(s) => {
            if s.len() != xs.len() {
                op_bail!("output_shape {s:?} must have the rank of X {xs:?}");
            }
            s
        }
        None => {
            let mut s = xs[..2].to_vec();
            for i in 0..nd {
                let full = (xs[i + 2].saturating_sub(1)) * st[i] + kernel[i] as usize;
                match full.checked_sub(pads[i] + pads[nd + i]) {
                    Some(d) => s.push(d),
                    None => op_bail!("pads {pads:?} exceed the unpooled size"),
                }
            }
            s
        }
    };
    let total: usize = shape.iter().product();
    // The last source written to each target.
    let mut writer: Vec<Option<usize>> = vec![None; total];
    for (e, &i) in idx.iter().enumerate() {
        if i < 0 || i as usize >= total {
            op_bail!("index {i} is outside the output of {total} elements (shape {shape:?})");
        }
        writer[i as usize] = Some(e);
    }
    let (mut sources, mut targets) = (Vec::new(), Vec::new());
    for (t, w) in writer.iter().enumerate() {
        if let Some(e) = w {
            sources.push(*e as i64);
            targets.push(t as i64);
        }
    }
    if sources.is_empty() {
        return Ok(Value::Float(zeros_value(ctx, &shape)?).into());
    }
    let n = x.numel();
    let vals = x
        .reshape(&[n, 1])?
        .into_rank::<2>()?
        .select(0, int_tensor_1d(sources, ctx.device));
    let out = scatter_add_rows(ctx, total, 1, targets, vals);
    Ok(Value::Float(FloatValue::from_rank(out)?.reshape(&shape)?).into())
}

/// Per spatial dim: `(pad before, pad after, output length)` of a pooling window, from
/// `auto_pad` or `pads`, with `ceil_mode`; the end padding includes what the ceiling needs.
fn pool_geometry(
    ctx: &OpContext,
    spatial: &[usize],
    kernel: &[usize],
    st: &[usize],
    dil: &[usize],
) -> OpResult<Vec<(usize, usize, usize)>> {
    let nd = spatial.len();
    let auto_pad = ctx.attrs.string("auto_pad", "NOTSET")?;
    let ceil = ctx.attrs.int("ceil_mode", 0)? != 0;
    let pads = usize_list(ctx, "pads", 2 * nd, 0, false)?;
    let mut out = Vec::with_capacity(nd);
    for i in 0..nd {
        let (l, s) = (spatial[i], st[i]);
        let span = dil[i] * (kernel[i] - 1) + 1;
        let (b, e, o) = match auto_pad.as_str() {
            "SAME_UPPER" | "SAME_LOWER" => {
                let o = l.div_ceil(s);
                let total = ((o.max(1) - 1) * s + span).saturating_sub(l);
                let small = total / 2;
                if auto_pad == "SAME_UPPER" {
                    (small, total - small, o)
                } else {
                    (total - small, small, o)
                }
            }
            "VALID" | "NOTSET" => {
                let (b, e) = if auto_pad == "VALID" {
                    (0, 0)
                } else {
                    (pads[i], pads[nd + i])
                };
                let padded = l + b + e;
                if padded < span {
                    op_bail!(
                        "kernel {kernel:?} (dilations {dil:?}) is larger than the padded input"
                    );
                }
                let mut o = if ceil {
                    (padded - span).div_ceil(s) + 1
                } else {
                    (padded - span) / s + 1
                };
                if ceil && (o - 1) * s >= l + b {
                    o -= 1;
                }
                (b, e, o)
            }
            other => op_bail!("attribute `auto_pad` {other:?} is not supported"),
        };
        let need = (o.max(1) - 1) * s + span;
        let e = e + need.saturating_sub(l + b + e);
        out.push((b, e, o));
    }
    Ok(out)
}

/// `LpPool` (`p`, `kernel_shape`, `strides`, `pads`, `auto_pad`, `dilations`, `ceil_mode`)
/// over 1 to 3 spatial dims: `(sum over the window of |x|^p)^(1/p)`. The padded input goes
/// through an average pool times the window size (or, with dilations or 3 spatial dims, a
/// convolution with a kernel of ones).
pub fn lp_pool(ctx: &OpContext, mut inputs: Inputs) -> OpResult<OpOutput> {
    let x = inputs.float(0, "X", ctx.device)?;
    let xs = x.shape();
    if !(3..=5).contains(&xs.len()) {
        op_bail!("LpPool supports [N, C, D1, ..] inputs with 1 to 3 spatial dims, got {xs:?}");
    }
    let nd = xs.len() - 2;
    let Some(kernel) = ctx.attrs.ints("kernel_shape")? else {
        op_bail!("attribute `kernel_shape` is required");
    };
    if kernel.len() != nd || kernel.iter().any(|&k| k < 1) {
        op_bail!("attribute `kernel_shape` {kernel:?} does not fit X {xs:?}");
    }
    let kernel: Vec<usize> = kernel.iter().map(|&k| k as usize).collect();
    let st = usize_list(ctx, "strides", nd, 1, true)?;
    let dil = usize_list(ctx, "dilations", nd, 1, true)?;
    let p = ctx.attrs.float("p", 2.0)?;
    if p <= 0.0 {
        op_bail!("attribute `p` must be positive, got {p}");
    }
    let geo = pool_geometry(ctx, &xs[2..], &kernel, &st, &dil)?;
    let (n, c) = (xs[0], xs[1]);
    let mut out_shape = vec![n, c];
    out_shape.extend(geo.iter().map(|g| g.2));
    if out_shape.contains(&0) {
        return Ok(Value::Float(zeros_value(ctx, &out_shape)?).into());
    }
    // |x|^p as [N * C, 1, spatial..], zero-padded (zeros add nothing to the sum).
    let mut flat = vec![n * c, 1];
    flat.extend_from_slice(&xs[2..]);
    let powered = x.reshape(&flat)?;
    let mut t = powered.tensor.abs().powf_scalar(p);
    let lead = MAX_RANK - flat.len();
    for (i, &(b, e, _)) in geo.iter().enumerate() {
        t = zero_pad(t, lead + 2 + i, b, e);
    }
    let padded = FloatValue::new(t, flat.len());
    let window: usize = kernel.iter().product();
    let dilated = dil.iter().any(|&d| d != 1);
    let summed = match nd {
        1 | 2 if !dilated => {
            let ps = padded.shape();
            let (k2, s2, x4) = if nd == 1 {
                (
                    [1, kernel[0]],
                    [1, st[0]],
                    padded.reshape(&[ps[0], 1, 1, ps[2]])?,
                )
            } else {
                ([kernel[0], kernel[1]], [st[0], st[1]], padded)
            };
            let options = AvgPoolOptions {
                kernel_size: k2,
                stride: s2,
                padding: [(0, 0); 2],
                count_include_pad: true,
                ceil_mode: false,
            };
            let y = avg_pool2d(x4.into_rank::<4>()?, options).mul_scalar(window as f32);
            FloatValue::from_rank(y)?
        }
        1 => {
            let w = Tensor::<3>::ones([1, 1, kernel[0]], ctx.device);
            let options = ConvOptions::new([st[0]], [0], [dil[0]], 1);
            FloatValue::from_rank(conv1d(padded.into_rank::<3>()?, w, None, options))?
        }
        2 => {
            let w = Tensor::<4>::ones([1, 1, kernel[0], kernel[1]], ctx.device);
            let options = ConvOptions::new([st[0], st[1]], [0, 0], [dil[0], dil[1]], 1);
            FloatValue::from_rank(conv2d(padded.into_rank::<4>()?, w, None, options))?
        }
        _ => {
            let w = Tensor::<5>::ones([1, 1, kernel[0], kernel[1], kernel[2]], ctx.device);
            let options = ConvOptions::new(
                [st[0], st[1], st[2]],
                [0, 0, 0],
                [dil[0], dil[1], dil[2]],
                1,
            );
            FloatValue::from_rank(conv3d(padded.into_rank::<5>()?, w, None, options))?
        }
    };
    if summed.numel() != out_shape.iter().product::<usize>() {
        op_bail!(
            "pooled {:?} elements do not fill the output {out_shape:?}",
            summed.shape()
        );
    }
    let y = summed.reshape(&out_shape)?;
    Ok(Value::Float(FloatValue::new(y.tensor.powf_scalar(1.0 / p), y.rank)).into())
}

/// The elements of a numeric value on the host as f64.
fn host_f64(v: &Value) -> OpResult<Vec<f64>> {
    Ok(match v {
        Value::Str(_) => op_bail!("expected a numeric tensor, got strings"),
        Value::Sequence(_) => op_bail!("expected a tensor, got a sequence"),
        Value::Float(f) => f.to_array()?.iter().map(|&x| f64::from(x)).collect(),
        Value::Int(a) => a.iter().map(|&x| x as f64).collect(),
        Value::Bool(_) => op_bail!("expected a numeric tensor, got bool"),
    })
}

/// `RoiAlign(X, rois, batch_indices)` (`mode` avg or max, `output_height`, `output_width`,
/// `sampling_ratio`, `spatial_scale`, `coordinate_transformation_mode`): bilinear samples
/// on a regular grid inside each bin of each region, averaged (or the largest weighted
/// corner value taken, as the reference). Differentiable with respect to `X`; the regions
/// are settings.
pub fn roi_align(ctx: &OpContext, mut inputs: Inputs) -> OpResult<OpOutput> {
    let x = inputs.float(0, "X", ctx.device)?;
    let rois = inputs.take(1, "rois")?;
    let batch = inputs.take(2, "batch_indices")?.into_int()?;
    let xs = x.shape();
    let [n, c, h, w] = xs[..] else {
        op_bail!("X must be [N, C, H, W], got {xs:?}");
    };
    let rs = rois.shape();
    let r = batch.len();
    if rs != [r, 4] {
        op_bail!("rois must be [{r}, 4] (one per batch index), got {rs:?}");
    }
    let rois = host_f64(&rois)?;
    let max_mode = match ctx.attrs.string("mode", "avg")?.to_lowercase().as_str() {
        "avg" => false,
        "max" => true,
        other => op_bail!("attribute `mode` must be avg or max, got {other:?}"),
    };
    let default_ctm = if ctx.opset >= 16 {
        "half_pixel"
    } else {
        "output_half_pixel"
    };
    let half_pixel = match ctx
        .attrs
        .string("coordinate_transformation_mode", default_ctm)?
        .to_lowercase()
        .as_str()
    {
        "half_pixel" => true,
        "output_half_pixel" => false,
        other => op_bail!(
            "attribute `coordinate_transformation_mode` must be half_pixel or output_half_pixel, got {other:?}"
        ),
    };
    let ph = ctx.attrs.int("output_height", 1)?;
    let pw = ctx.attrs.int("output_width", 1)?;
    let ratio = ctx.attrs.int("sampling_ratio", 0)?;
    let scale = f64::from(ctx.attrs.float("spatial_scale", 1.0)?);
    if ph < 1 || pw < 1 || ratio < 0 {
        op_bail!(
            "output_height {ph}, output_width {pw} must be positive and sampling_ratio {ratio} non-negative"
        );
    }
    let (ph, pw) = (ph as usize, pw as usize);
    let bins = ph * pw;
    let out_shape = [r, c, ph, pw];
    if r == 0 || c == 0 || h == 0 || w == 0 {
        return Ok(Value::Float(zeros_value(ctx, &out_shape)?).into());
    }
    // Per region: the sample grid and, per bin, the (row, weight) of each corner.
    let offset = if half_pixel { 0.5 } else { 0.0 };
    let mut per_roi: Vec<Vec<Vec<(i64, f32)>>> = Vec::with_capacity(r);
    for (i, &b) in batch.iter().enumerate() {
        if b < 0 || b as usize >= n {
            op_bail!("batch index {b} is outside 0..{n}");
        }
        let base = b as usize * h * w;
        let roi = &rois[i * 4..i * 4 + 4];
        let (x0, y0) = (roi[0] * scale - offset, roi[1] * scale - offset);
        let (x1, y1) = (roi[2] * scale - offset, roi[3] * scale - offset);
        let (mut rw, mut rh) = (x1 - x0, y1 - y0);
        if !half_pixel {
            rw = rw.max(1.0);
            rh = rh.max(1.0);
        }
        let (bh, bw) = (rh / ph as f64, rw / pw as f64);
        let grid = |extent: f64, pooled: usize| {
            if ratio > 0 {
                ratio as usize
            } else {
                (extent / pooled as f64).ceil().max(0.0) as usize
            }
        };
        let (gh, gw) = (grid(rh, ph), grid(rw, pw));
        let count = (gh * gw).max(1) as f64;
        let mut roi_bins = Vec::with_capacity(bins);
        for py in 0..ph {
            for px in 0..pw {
                let mut corners = Vec::with_capacity(gh * gw * 4);
                for iy in 0..gh {
                    let yy = y0 + py as f64 * bh + (iy as f64 + 0.5) * bh / gh as f64;
                    for ix in 0..gw {
                        let xx = x0 + px as f64 * bw + (ix as f64 + 0.5) * bw / gw as f64;
                        let norm = if max_mode { 1.0 } else { count };
                        corners.extend(
                            bilinear_corners(yy, xx, h, w)
                                .map(|(pos, wt)| ((base + pos) as i64, (wt / norm) as f32)),
                        );
                    }
                }
                roi_bins.push(corners);
            }
        }
        per_roi.push(roi_bins);
    }
    let width = per_roi
        .iter()
        .flat_map(|bins| bins.iter().map(Vec::len))
        .max()
        .unwrap_or(0)
        .max(1);
    let mut rows = Vec::with_capacity(r * bins * width);
    let mut weights = Vec::with_capacity(r * bins * width);
    for (i, roi_bins) in per_roi.iter().enumerate() {
        let fallback = (batch[i] as usize * h * w) as i64;
        for corners in roi_bins {
            for j in 0..width {
                // Padding entries: no weight when averaging, a repeat of a real entry for max.
                let (row, wt) = match corners.get(j) {
                    Some(&e) => e,
                    None if max_mode && !corners.is_empty() => corners[j % corners.len()],
                    None => (fallback, 0.0),
                };
                rows.push(row);
                weights.push(wt);
            }
        }
    }
    let table = x
        .reshape(&[n, c, h * w])?
        .into_rank::<3>()?
        .swap_dims(1, 2)
        .reshape([n * h * w, c]);
    let picked = table
        .select(0, int_tensor_1d(rows, ctx.device))
        .reshape([r, bins, width, c]);
    let wt: Tensor<4> = Tensor::from_data(
        TensorData::new(weights, vec![r, bins, width, 1]),
        ctx.device,
    );
    let weighted = picked.mul(wt);
    let pooled = if max_mode {
        weighted.max_dim(2)
    } else {
        weighted.sum_dim(2)
    };
    let y = pooled.reshape([r, bins, c]).swap_dims(1, 2);
    Ok(Value::Float(FloatValue::from_rank(y)?.reshape(&out_shape)?).into())
}

/// The four `(flat position, weight)` corners of a bilinear sample at `(y, x)` of an
/// `h x w` plane; a sample more than one pixel outside gets zero weights.
fn bilinear_corners(y: f64, x: f64, h: usize, w: usize) -> [(usize, f64); 4] {
    if y < -1.0 || y > h as f64 || x < -1.0 || x > w as f64 {
        return [(0, 0.0); 4];
    }
    let (mut y, mut x) = (y.max(0.0), x.max(0.0));
    let (mut yl, mut xl) = (y as usize, x as usize);
    let yh = if yl >= h - 1 {
        yl = h - 1;
        y = yl as f64;
        yl
    } else {
        yl + 1
    };
    let xh = if xl >= w - 1 {
        xl = w - 1;
        x = xl as f64;
        xl
    } else {
        xl + 1
    };
    let (ly, lx) = (y - yl as f64, x - xl as f64);
    let (hy, hx) = (1.0 - ly, 1.0 - lx);
    [
        (yl * w + xl, hy * hx),
        (yl * w + xh, hy * lx),
        (yh * w + xl, ly * hx),
        (yh * w + xh, ly * lx),
    ]
}
