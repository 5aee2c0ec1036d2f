//! Detection ops: `NonMaxSuppression` (a host op, integer output) and `DeformConv`
//! (opset 19, 2-D).
//!
//! `DeformConv` samples `X` bilinearly (zero outside the image, pixel coordinates as
//! `GridSample` with `align_corners = 1`) at every kernel tap moved by its offset, scales
//! each sample by the mask, and contracts the samples with `W` as a grouped matrix product.
//! The host reads the offsets only to find each sample's integer corner; the fractional
//! parts are recomputed on the device as `offset + (base - corner)`, so the output is
//! differentiable in `X` (gathered with a row `select`), `W`, the offsets, the mask and `B`.

use burn::tensor::{Tensor, TensorData};
use ndarray::Array2;

use super::{Inputs, OpContext, OpOutput};
use crate::error::OpResult;
use crate::op_bail;
use crate::value::{FloatValue, PhysTensor, Value, int_tensor_1d, padded};

/// A box as `(y_min, x_min, y_max, x_max)` in f32, from either box format.
fn corners(b: &[f32], center_point_box: bool) -> (f32, f32, f32, f32) {
    if center_point_box {
        let (hw, hh) = (b[2] / 2.0, b[3] / 2.0);
        (b[1] - hh, b[0] - hw, b[1] + hh, b[0] + hw)
    } else {
        (
            b[0].min(b[2]),
            b[1].min(b[3]),
            b[0].max(b[2]),
            b[1].max(b[3]),
        )
    }
}

/// Does box `a` suppress box `b` (IoU above the threshold)?
fn suppresses(a: (f32, f32, f32, f32), b: (f32, f32, f32, f32), iou_threshold: f32) -> bool {
    let (iy0, ix0) = (a.0.max(b.0), a.1.max(b.1));
    let (iy1, ix1) = (a.2.min(b.2), a.3.min(b.3));
    if ix1 <= ix0 || iy1 <= iy0 {
        return false;
    }
    let inter = (ix1 - ix0) * (iy1 - iy0);
    let area_a = (a.3 - a.1) * (a.2 - a.0);
    let area_b = (b.3 - b.1) * (b.2 - b.0);
    let union = area_a + area_b - inter;
    if inter <= 0.0 || area_a <= 0.0 || area_b <= 0.0 || union <= 0.0 {
        return false;
    }
    inter / union > iou_threshold
}

/// `NonMaxSuppression(boxes [B, N, 4], scores [B, C, N], max_output_boxes_per_class,
/// iou_threshold, score_threshold)` (`center_point_box` 0: corners `[y1, x1, y2, x2]`,
/// 1: `[x_center, y_center, width, height]`): the selected `[batch, class, box]` triples.
pub fn non_max_suppression(ctx: &OpContext, mut inputs: Inputs) -> OpResult<OpOutput> {
    let boxes = inputs.take(0, "boxes")?.into_float(ctx.device)?;
    let scores = inputs.take(1, "scores")?.into_float(ctx.device)?;
    let max_out = match inputs.int_list(2, "max_output_boxes_per_class")? {
        Some(v) if !v.is_empty() => v[0].max(0) as usize,
        _ => 0,
    };
    let iou_threshold = match inputs.opt(3) {
        Some(v) => v.scalar_f32("iou_threshold")?,
        None => 0.0,
    };
    let score_threshold = match inputs.opt(4) {
        Some(v) => Some(v.scalar_f32("score_threshold")?),
        None => None,
    };
    let center = match ctx.attrs.int("center_point_box", 0)? {
        0 => false,
        1 => true,
        other => op_bail!("center_point_box must be 0 or 1, got {other}"),
    };
    let (bs, ss) = (boxes.shape(), scores.shape());
    if bs.len() != 3 || bs[2] != 4 || ss.len() != 3 || ss[0] != bs[0] || ss[2] != bs[1] {
        op_bail!("boxes must be [B, N, 4] and scores [B, C, N], got {bs:?} and {ss:?}");
    }
    let (nb, nc, n) = (bs[0], ss[1], bs[1]);
    let boxes = boxes.to_array()?;
    let boxes: Vec<f32> = boxes.iter().copied().collect();
    let scores = scores.to_array()?;
    let scores: Vec<f32> = scores.iter().copied().collect();
    let mut selected: Vec<i64> = Vec::new();
    for b in 0..nb {
        let bx: Vec<_> = (0..n)
            .map(|i| corners(&boxes[(b * n + i) * 4..(b * n + i) * 4 + 4], center))
            .collect();
        for c in 0..nc {
            let sc = &scores[(b * nc + c) * n..(b * nc + c + 1) * n];
            let mut candidates: Vec<usize> = (0..n)
                .filter(|&i| score_threshold.is_none_or(|t| sc[i] > t))
                .collect();
            // Highest score first, ties by the lower box index (a stable sort).
            candidates.sort_by(|&i, &j| sc[j].total_cmp(&sc[i]));
            let mut kept: Vec<usize> = Vec::new();
            for i in candidates {
                if kept.len() >= max_out {
                    break;
                }
                if kept
                    .iter()
                    .all(|&k| !suppresses(bx[i], bx[k], iou_threshold))
                {
                    kept.push(i);
                    selected.extend([b as i64, c as i64, i as i64]);
                }
            }
        }
    }
    let rows = selected.len() / 3;
    let out = Array2::from_shape_vec((rows, 3), selected)?.into_dyn();
    Ok(Value::Int(out).into())
}

/// A 2-D deformable-convolution geometry, from the attributes and shapes.
struct Geometry {
    n: usize,
    c: usize,
    h: usize,
    w: usize,
    oc: usize,
    kh: usize,
    kw: usize,
    oh: usize,
    ow: usize,
    group: usize,
    offset_group: usize,
    strides: [usize; 2],
    dilations: [usize; 2],
    pads: [usize; 4],
}

fn pair(ctx: &OpContext, name: &str, default: usize) -> OpResult<[usize; 2]> {
    match ctx.attrs.ints(name)? {
        None => Ok([default; 2]),
        Some(v) if v.len() == 2 && v.iter().all(|&x| x >= 1) => Ok([v[0] as usize, v[1] as usize]),
        Some(v) => op_bail!("attribute `{name}` must be two positive integers, got {v:?}"),
    }
}

/// `DeformConv(X [N, C, H, W], W [OC, C/group, kH, kW], offset [N, G*kH*kW*2, oH, oW],
/// B?, mask? [N, G*kH*kW, oH, oW])` (`dilations`, `group`, `kernel_shape`,
/// `offset_group` G, `pads`, `strides`): `[N, OC, oH, oW]`.
pub fn deform_conv(ctx: &OpContext, mut inputs: Inputs) -> OpResult<OpOutput> {
    let x = inputs.float(0, "X", ctx.device)?;
    let wt = inputs.float(1, "W", ctx.device)?;
    let offset = inputs.float(2, "offset", ctx.device)?;
    let bias = inputs
        .opt(3)
        .map(|v| v.into_float(ctx.device))
        .transpose()?;
    let mask = inputs
        .opt(4)
        .map(|v| v.into_float(ctx.device))
        .transpose()?;
    let (xs, ws, os) = (x.shape(), wt.shape(), offset.shape());
    if xs.len() != 4 || ws.len() != 4 || os.len() != 4 {
        op_bail!(
            "only 2-D DeformConv is supported: X {xs:?}, W {ws:?} and offset {os:?} must be rank 4"
        );
    }
    let group = ctx.attrs.int("group", 1)?;
    let offset_group = ctx.attrs.int("offset_group", 1)?;
    if group < 1 || offset_group < 1 {
        op_bail!("group ({group}) and offset_group ({offset_group}) must be positive");
    }
    let (group, offset_group) = (group as usize, offset_group as usize);
    let pads = match ctx.attrs.ints("pads")? {
        None => [0; 4],
        Some(v) if v.len() == 4 && v.iter().all(|&p| p >= 0) => {
            [v[0] as usize, v[1] as usize, v[2] as usize, v[3] as usize]
        }
        Some(v) => op_bail!("attribute `pads` must be four non-negative integers, got {v:?}"),
    };
    let kernel = match ctx.attrs.ints("kernel_shape")? {
        None => [ws[2], ws[3]],
        Some(v) if v.len() == 2 && v[0] as usize == ws[2] && v[1] as usize == ws[3] => {
            [ws[2], ws[3]]
        }
        Some(v) => op_bail!("kernel_shape {v:?} does not match W {ws:?}"),
    };
    let g = Geometry {
        n: xs[0],
        c: xs[1],
        h: xs[2],
        w: xs[3],
        oc: ws[0],
        kh: kernel[0],
        kw: kernel[1],
        oh: os[2],
        ow: os[3],
        group,
        offset_group,
        strides: pair(ctx, "strides", 1)?,
        dilations: pair(ctx, "dilations", 1)?,
        pads,
    };
    let k = g.kh * g.kw;
    if g.c != ws[1] * g.group || g.oc % g.group != 0 {
        op_bail!("X {xs:?} and W {ws:?} do not agree with group {}", g.group);
    }
    if g.c % g.offset_group != 0 || os[0] != g.n || os[1] != g.offset_group * k * 2 {
        op_bail!(
            "offset {os:?} must be [{}, {}, oH, oW] and C divisible by offset_group {}",
            g.n,
            g.offset_group * k * 2,
            g.offset_group
        );
    }
    let span = |len: usize, i: usize| -> i64 {
        let ext = (if i == 0 { g.kh } else { g.kw } - 1) * g.dilations[i] + 1;
        (len + g.pads[i] + g.pads[i + 2]) as i64 - ext as i64
    };
    let (eh, ew) = (span(g.h, 0), span(g.w, 1));
    if eh < 0
        || ew < 0
        || g.oh != eh as usize / g.strides[0] + 1
        || g.ow != ew as usize / g.strides[1] + 1
    {
        op_bail!(
            "offset's output size {}x{} does not match X {xs:?}, the kernel, pads, strides \
             and dilations",
            g.oh,
            g.ow
        );
    }
    if let Some(m) = &mask
        && m.shape() != [g.n, g.offset_group * k, g.oh, g.ow]
    {
        op_bail!(
            "mask must be [{}, {}, {}, {}], got {:?}",
            g.n,
            g.offset_group * k,
            g.oh,
            g.ow,
            m.shape()
        );
    }
    if let Some(b) = &bias
        && b.shape() != [g.oc]
    {
        op_bail!("B must be [{}], got {:?}", g.oc, b.shape());
    }
    let out_shape = [g.n, g.oc, g.oh, g.ow];
    let p = g.oh * g.ow;
    if g.n * g.oc * p == 0 || g.c * k == 0 {
        let z = PhysTensor::zeros(padded(&out_shape)?, ctx.device);
        return Ok(Value::Float(FloatValue::new(z, 4)).into());
    }
    Ok(Value::Float(FloatValue::from_rank(sample_and_contract(
        ctx, &g, x, wt, offset, bias, mask,
    )?)?)
    .into())
}

fn sample_and_contract(
    ctx: &OpContext,
    g: &Geometry,
    x: FloatValue,
    wt: FloatValue,
    offset: FloatValue,
    bias: Option<FloatValue>,
    mask: Option<FloatValue>,
) -> OpResult<Tensor<4>> {
    let dev = ctx.device;
    let (n, og, k, p) = (g.n, g.offset_group, g.kh * g.kw, g.oh * g.ow);
    let cg = g.c / og;
    let hw = g.h * g.w;
    // Offsets as [N, G, K, 2, P]: (dy, dx) of tap k at output point p.
    let off_host: Vec<f32> = offset.to_array()?.iter().copied().collect();
    // Per (n, g, k, p): fractional parts t = offset + b, and the 4 corners' rows and masks.
    let m = n * og * k * p;
    let mut b_y = vec![0f32; m];
    let mut b_x = vec![0f32; m];
    let mut rows = Vec::with_capacity(m * 4);
    let mut valid = Vec::with_capacity(m * 4);
    for ni in 0..n {
        for gi in 0..og {
            for ki in 0..k {
                let (ky, kx) = (ki / g.kw, ki % g.kw);
                for pi in 0..p {
                    let (oy, ox) = (pi / g.ow, pi % g.ow);
                    let base_y =
                        (oy * g.strides[0] + ky * g.dilations[0]) as f64 - g.pads[0] as f64;
                    let base_x =
                        (ox * g.strides[1] + kx * g.dilations[1]) as f64 - g.pads[1] as f64;
                    let o = (((ni * og + gi) * k + ki) * 2) * p + pi;
                    let y = base_y + f64::from(off_host[o]);
                    let xx = base_x + f64::from(off_host[o + p]);
                    let (y0, x0) = (y.floor(), xx.floor());
                    let idx = ((ni * og + gi) * k + ki) * p + pi;
                    b_y[idx] = (base_y - y0) as f32;
                    b_x[idx] = (base_x - x0) as f32;
                    for (dy, dx) in [(0, 0), (0, 1), (1, 0), (1, 1)] {
                        let (cy, cx) = (y0 as i64 + dy, x0 as i64 + dx);
                        let ok = (0..g.h as i64).contains(&cy) && (0..g.w as i64).contains(&cx);
                        let pix = if ok {
                            cy as usize * g.w + cx as usize
                        } else {
                            0
                        };
                        rows.push(((ni * og + gi) * hw + pix) as i64);
                        valid.push(if ok { 1f32 } else { 0.0 });
                    }
                }
            }
        }
    }
    // Bilinear weights on the device, differentiable in the offsets.
    let off = offset.reshape(&[n * og * k, 2, p])?.into_rank::<3>()?;
    let off_y = off.clone().narrow(1, 0, 1).reshape([m, 1]);
    let off_x = off.narrow(1, 1, 1).reshape([m, 1]);
    let ty = off_y.add(Tensor::<2>::from_data(
        TensorData::new(b_y, vec![m, 1]),
        dev,
    ));
    let tx = off_x.add(Tensor::<2>::from_data(
        TensorData::new(b_x, vec![m, 1]),
        dev,
    ));
    let (uy, ux) = (
        ty.clone().neg().add_scalar(1.0),
        tx.clone().neg().add_scalar(1.0),
    );
    let weights = Tensor::cat(
        vec![
            uy.clone().mul(ux.clone()),
            uy.mul(tx.clone()),
            ty.clone().mul(ux),
            ty.mul(tx),
        ],
        1,
    )
    .mul(Tensor::<2>::from_data(
        TensorData::new(valid, vec![m, 4]),
        dev,
    ));
    let weights = match mask {
        Some(mk) => weights.mul(mk.reshape(&[m, 1])?.into_rank::<2>()?),
        None => weights,
    };
    // X as rows [(n, g, pixel), cg], gathered per corner: [m, 4, cg] -> [m, cg].
    let table = x
        .reshape(&[n * og, cg, hw])?
        .into_rank::<3>()?
        .swap_dims(1, 2)
        .reshape([n * og * hw, cg]);
    let sampled = table
        .select(0, int_tensor_1d(rows, dev))
        .reshape([m, 4, cg])
        .mul(weights.reshape([m, 4, 1]))
        .sum_dim(1)
        .reshape([n, og, k, p, cg]);
    // Columns [N, C * K, P] with C ordered (offset group, channel in group).
    let cols = sampled
        .permute([0, 1, 4, 2, 3])
        .reshape([n, g.group, (g.c / g.group) * k, p]);
    let ocg = g.oc / g.group;
    let w = wt
        .reshape(&[1, g.group, ocg, (g.c / g.group) * k])?
        .into_rank::<4>()?
        .expand([n, g.group, ocg, (g.c / g.group) * k]);
    let mut y = w.matmul(cols).reshape([n, g.oc, g.oh, g.ow]);
    if let Some(b) = bias {
        y = y.add(b.reshape(&[1, g.oc, 1, 1])?.into_rank::<4>()?);
    }
    Ok(y)
}
