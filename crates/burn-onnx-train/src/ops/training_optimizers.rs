//! The optimizer ops of the `ai.onnx.preview.training` domain, as ONNX Runtime Training's
//! graphs carried them: `Adagrad`, `Momentum` (standard and Nesterov) and `Adam`. Each
//! takes the learning rate `R` and the update count `T` (scalars), then its tensors in
//! groups (`X1..Xn, G1..Gn, V1..Vn, ...`), and returns the updated groups in that order.

use super::{Inputs, OpContext, OpOutput};
use crate::error::OpResult;
use crate::op_bail;
use crate::value::{FloatValue, PhysTensor, Value};

/// `R`, `T` and the `groups` tensor groups (each `n` tensors of one shape per index).
struct Operands {
    rate: f32,
    count: i64,
    /// `groups[k][i]`: the `i`-th tensor of group `k` (X, G, then the states).
    groups: Vec<Vec<PhysTensor>>,
    ranks: Vec<usize>,
}

fn operands(ctx: &OpContext, mut inputs: Inputs, groups: usize) -> OpResult<Operands> {
    let rate = inputs.take(0, "R")?.scalar_f32("R")?;
    let count = match inputs.take(1, "T")?.int_list("T")?[..] {
        [t] => t,
        ref v => op_bail!("T must hold one update count, got {} values", v.len()),
    };
    let tensors = inputs.0.len().saturating_sub(2);
    if tensors == 0 || tensors % groups != 0 {
        op_bail!("expected R, T and {groups} groups of equal size, got {tensors} tensors");
    }
    let n = tensors / groups;
    let mut values: Vec<FloatValue> = Vec::with_capacity(tensors);
    for i in 0..tensors {
        values.push(inputs.float(2 + i, "optimizer tensor", ctx.device)?);
    }
    for i in 0..n {
        let shape = values[i].shape();
        for k in 1..groups {
            if values[k * n + i].shape() != shape {
                op_bail!(
                    "tensor {} of group {k} has shape {:?}, its X has {shape:?}",
                    i + 1,
                    values[k * n + i].shape()
                );
            }
        }
    }
    let ranks = values[..n].iter().map(|v| v.rank).collect();
    let mut iter = values.into_iter().map(|v| v.tensor);
    let groups = (0..groups)
        .map(|_| iter.by_ref().take(n).collect())
        .collect();
    Ok(Operands {
        rate,
        count,
        groups,
        ranks,
    })
}

/// The updated groups as the node's outputs, group after group.
fn outputs(groups: Vec<Vec<PhysTensor>>, ranks: &[usize]) -> OpOutput {
    groups
        .into_iter()
        .flat_map(|g| {
            g.into_iter()
                .zip(ranks)
                .map(|(t, &r)| Value::Float(FloatValue::new(t, r)))
                .collect::<Vec<_>>()
        })
        .collect::<Vec<_>>()
        .into()
}

/// `norm_coefficient * X + G`: the gradient with the L2 term.
fn regularized(x: &PhysTensor, g: &PhysTensor, norm: f32) -> PhysTensor {
    x.clone().mul_scalar(norm) + g.clone()
}

/// `Adagrad`: `r = R / (1 + T decay_factor)`, `H' = H + g^2`, `X' = X - r g / (sqrt(H') + eps)`.
pub fn adagrad(ctx: &OpContext, inputs: Inputs) -> OpResult<OpOutput> {
    let decay = ctx.attrs.float("decay_factor", 0.0)?;
    let eps = ctx.attrs.float("epsilon", 0.0)?;
    let norm = ctx.attrs.float("norm_coefficient", 0.0)?;
    let o = operands(ctx, inputs, 3)?;
    let r = o.rate / (1.0 + o.count as f32 * decay);
    let (mut xs, mut hs) = (Vec::new(), Vec::new());
    for ((x, g), h) in o.groups[0].iter().zip(&o.groups[1]).zip(&o.groups[2]) {
        let g = regularized(x, g, norm);
        let h = h.clone() + g.clone() * g.clone();
        xs.push(x.clone() - g.mul_scalar(r) / h.clone().sqrt().add_scalar(eps));
        hs.push(h);
    }
    Ok(outputs(vec![xs, hs], &o.ranks))
}

/// `Momentum`: `V' = alpha V + beta' g` (beta' = 1 at T = 0), then `X' = X - R V'`
/// (`standard`) or `X' = X - R (g + alpha V')` (`nesterov`).
pub fn momentum(ctx: &OpContext, inputs: Inputs) -> OpResult<OpOutput> {
    let alpha = ctx.attrs.float("alpha", 0.0)?;
    let beta = ctx.attrs.float("beta", 0.0)?;
    let norm = ctx.attrs.float("norm_coefficient", 0.0)?;
    let nesterov = match ctx.attrs.string("mode", "standard")?.as_str() {
        "standard" => false,
        "nesterov" => true,
        other => op_bail!("attribute `mode` must be standard or nesterov, got {other:?}"),
    };
    let o = operands(ctx, inputs, 3)?;
    let beta = if o.count > 0 { beta } else { 1.0 };
    let (mut xs, mut vs) = (Vec::new(), Vec::new());
    for ((x, g), v) in o.groups[0].iter().zip(&o.groups[1]).zip(&o.groups[2]) {
        let g = regularized(x, g, norm);
        let v = v.clone().mul_scalar(alpha) + g.clone().mul_scalar(beta);
        let step = if nesterov {
            g + v.clone().mul_scalar(alpha)
        } else {
            v.clone()
        };
        xs.push(x.clone() - step.mul_scalar(o.rate));
        vs.push(v);
    }
    Ok(outputs(vec![xs, vs], &o.ranks))
}

/// `Adam`: `V' = alpha V + (1 - alpha) g`, `H' = beta H + (1 - beta) g^2`, the rate
/// bias-corrected for T > 0, `X' = (1 - norm_coefficient_post) (X - r V' / (sqrt(H') + eps))`.
pub fn adam(ctx: &OpContext, inputs: Inputs) -> OpResult<OpOutput> {
    let alpha = ctx.attrs.float("alpha", 0.9)?;
    let beta = ctx.attrs.float("beta", 0.999)?;
    let eps = ctx.attrs.float("epsilon", 0.0)?;
    let norm = ctx.attrs.float("norm_coefficient", 0.0)?;
    let post = ctx.attrs.float("norm_coefficient_post", 0.0)?;
    let o = operands(ctx, inputs, 4)?;
    let r = if o.count > 0 {
        let t = o.count as f64;
        (o.rate as f64 * (1.0 - (beta as f64).powf(t)).sqrt() / (1.0 - (alpha as f64).powf(t)))
            as f32
    } else {
        o.rate
    };
    let (mut xs, mut vs, mut hs) = (Vec::new(), Vec::new(), Vec::new());
    for (((x, g), v), h) in o.groups[0]
        .iter()
        .zip(&o.groups[1])
        .zip(&o.groups[2])
        .zip(&o.groups[3])
    {
        let g = regularized(x, g, norm);
        let v = v.clone().mul_scalar(alpha) + g.clone().mul_scalar(1.0 - alpha);
        let h = h.clone().mul_scalar(beta) + (g.clone() * g).mul_scalar(1.0 - beta);
        let x = x.clone() - v.clone().mul_scalar(r) / h.clone().sqrt().add_scalar(eps);
        xs.push(x.mul_scalar(1.0 - post));
        vs.push(v);
        hs.push(h);
    }
    Ok(outputs(vec![xs, vs, hs], &o.ranks))
}
