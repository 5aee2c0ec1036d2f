//! The random generators: `RandomUniform`, `RandomNormal`, their `*Like` forms, `Bernoulli`
//! and `Multinomial` (a VAE's `randn_like`, dropout written out by hand, sampling heads).
//!
//! Values are drawn on the host (ChaCha8, as Dropout's masks) from the node's seed, a pure
//! function of the forward pass's seed and the node's position, mixed with the `seed`
//! attribute when the graph has one. So every pass draws fresh values (as onnxruntime's
//! generator advances between runs), a run is reproducible and a resumed run draws what the
//! uninterrupted one would. No gradient flows through a draw.

use ndarray::{ArrayD, IxDyn};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::generators::cast_to;
use super::{Inputs, OpContext, OpOutput};
use crate::error::OpResult;
use crate::op_bail;
use crate::util::seeds::mix_seed;
use crate::value::host_tensor::dtype;
use crate::value::{FloatValue, Value};

/// The node's random stream.
fn rng(ctx: &OpContext) -> OpResult<ChaCha8Rng> {
    let seed = if ctx.attrs.has("seed") {
        mix_seed(ctx.seed, u64::from(ctx.attrs.float("seed", 0.0)?.to_bits()))
    } else {
        ctx.seed
    };
    Ok(ChaCha8Rng::seed_from_u64(seed))
}

/// One standard normal draw (Box-Muller, in f64).
fn standard_normal(rng: &mut ChaCha8Rng) -> f64 {
    let u1 = 1.0 - rng.random::<f64>(); // (0, 1]: the logarithm stays finite
    let u2 = rng.random::<f64>();
    (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
}

/// The `dtype` attribute, or `default`; a float type is required.
fn float_dtype(ctx: &OpContext, default: i32) -> OpResult<i32> {
    let to = ctx.attrs.int("dtype", i64::from(default))? as i32;
    if !dtype::is_float(to) {
        op_bail!("dtype must be a float type, got {}", dtype::name(to));
    }
    Ok(to)
}

/// Host values of `shape` as a float value cast to `to` (f16/bf16 rounding).
fn finish(ctx: &OpContext, shape: &[usize], values: Vec<f32>, to: i32) -> OpResult<OpOutput> {
    let a = ArrayD::from_shape_vec(IxDyn(shape), values)?;
    let v = Value::Float(FloatValue::from_array(&a, ctx.device)?);
    Ok(cast_to(ctx, v, to)?.into())
}

/// The `shape` attribute of the non-`Like` generators.
fn shape_attr(ctx: &OpContext) -> OpResult<Vec<usize>> {
    let Some(dims) = ctx.attrs.ints("shape")? else {
        op_bail!("attribute `shape` is required");
    };
    dims.iter()
        .map(|&d| match usize::try_from(d) {
            Ok(d) => Ok(d),
            Err(_) => op_bail!("attribute `shape` has a negative dimension {d}"),
        })
        .collect()
}

/// The shape of the `*Like` input and the output type (`dtype`, else the input's family).
fn like(ctx: &OpContext, inputs: &mut Inputs) -> OpResult<(Vec<usize>, i32)> {
    let x = inputs.take(0, "input")?;
    let default = match x {
        Value::Float(_) => dtype::FLOAT,
        _ if ctx.attrs.has("dtype") => dtype::FLOAT,
        other => op_bail!(
            "the input is a {} tensor: set `dtype` to the float type to draw",
            other.kind()
        ),
    };
    Ok((x.shape(), float_dtype(ctx, default)?))
}

fn uniform(ctx: &OpContext, shape: &[usize], to: i32) -> OpResult<OpOutput> {
    let (low, high) = (ctx.attrs.float("low", 0.0)?, ctx.attrs.float("high", 1.0)?);
    if high < low {
        op_bail!("high ({high}) is below low ({low})");
    }
    let mut rng = rng(ctx)?;
    let n = shape.iter().product();
    let v = (0..n)
        .map(|_| low + (high - low) * rng.random::<f32>())
        .collect();
    finish(ctx, shape, v, to)
}

fn normal(ctx: &OpContext, shape: &[usize], to: i32) -> OpResult<OpOutput> {
    let mean = f64::from(ctx.attrs.float("mean", 0.0)?);
    let scale = f64::from(ctx.attrs.float("scale", 1.0)?);
    let mut rng = rng(ctx)?;
    let n = shape.iter().product();
    let v = (0..n)
        .map(|_| (mean + scale * standard_normal(&mut rng)) as f32)
        .collect();
    finish(ctx, shape, v, to)
}

/// `RandomUniform` (`shape`, `low`, `high`, `dtype`, `seed`)
pub fn random_uniform(ctx: &OpContext, _inputs: Inputs) -> OpResult<OpOutput> {
    uniform(ctx, &shape_attr(ctx)?, float_dtype(ctx, dtype::FLOAT)?)
}

/// `RandomNormal` (`shape`, `mean`, `scale`, `dtype`, `seed`)
pub fn random_normal(ctx: &OpContext, _inputs: Inputs) -> OpResult<OpOutput> {
    normal(ctx, &shape_attr(ctx)?, float_dtype(ctx, dtype::FLOAT)?)
}

/// `RandomUniformLike(input)`: the input's shape.
pub fn random_uniform_like(ctx: &OpContext, mut inputs: Inputs) -> OpResult<OpOutput> {
    let (shape, to) = like(ctx, &mut inputs)?;
    uniform(ctx, &shape, to)
}

/// `RandomNormalLike(input)`: the input's shape.
pub fn random_normal_like(ctx: &OpContext, mut inputs: Inputs) -> OpResult<OpOutput> {
    let (shape, to) = like(ctx, &mut inputs)?;
    normal(ctx, &shape, to)
}

/// `Bernoulli(input)`: 1 with the probability each element of `input` gives, else 0, in
/// `dtype` (any numeric type or bool; default a float).
pub fn bernoulli(ctx: &OpContext, mut inputs: Inputs) -> OpResult<OpOutput> {
    let p = inputs.float(0, "input", ctx.device)?.to_array()?;
    if let Some(bad) = p.iter().find(|v| !(0.0..=1.0).contains(*v)) {
        op_bail!("probabilities must be in [0, 1], got {bad}");
    }
    let mut rng = rng(ctx)?;
    let draws = p.mapv(|p| if rng.random::<f32>() < p { 1.0 } else { 0.0 });
    let v = Value::Float(FloatValue::from_array(&draws, ctx.device)?);
    let to = ctx.attrs.int("dtype", i64::from(dtype::FLOAT))? as i32;
    Ok(cast_to(ctx, v, to)?.into())
}

/// `Multinomial(input)`: `sample_size` class indices per row of `[batch, classes]`
/// unnormalised log-probabilities, as int32 (default) or int64.
pub fn multinomial(ctx: &OpContext, mut inputs: Inputs) -> OpResult<OpOutput> {
    let logits = inputs.float(0, "input", ctx.device)?.to_array()?;
    let &[batch, classes] = logits.shape() else {
        op_bail!(
            "input must be 2-D [batch, classes], got {:?}",
            logits.shape()
        );
    };
    let samples = ctx.attrs.int("sample_size", 1)?;
    let Ok(samples) = usize::try_from(samples) else {
        op_bail!("sample_size must not be negative, got {samples}");
    };
    let to = ctx.attrs.int("dtype", i64::from(dtype::INT32))? as i32;
    if to != dtype::INT32 && to != dtype::INT64 {
        op_bail!("dtype must be int32 or int64, got {}", dtype::name(to));
    }
    if classes == 0 {
        op_bail!("input has no classes to draw from");
    }
    let mut rng = rng(ctx)?;
    let mut out = Vec::with_capacity(batch * samples);
    for row in logits.rows() {
        // Cumulative probabilities of the row's softmax, in f64.
        let max = row
            .iter()
            .fold(f64::NEG_INFINITY, |m, &v| m.max(f64::from(v)));
        let mut cdf: Vec<f64> = row.iter().map(|&v| (f64::from(v) - max).exp()).collect();
        for i in 1..classes {
            cdf[i] += cdf[i - 1];
        }
        let total = cdf[classes - 1];
        if !total.is_finite() || total <= 0.0 {
            op_bail!("a row of the input has no finite probabilities");
        }
        for _ in 0..samples {
            let u = rng.random::<f64>() * total;
            out.push(cdf.partition_point(|&c| c <= u).min(classes - 1) as i64);
        }
    }
    Ok(Value::Int(ArrayD::from_shape_vec(IxDyn(&[batch, samples]), out)?).into())
}
