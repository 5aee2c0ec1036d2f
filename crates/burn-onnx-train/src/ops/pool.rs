//! Pooling: `MaxPool` (on [`crate::kernels::max_pool2d`]), `AveragePool`,
//! `GlobalAveragePool`, `GlobalMaxPool` on 1-D and 2-D inputs; 3-D and higher inputs,
//! dilated average pooling and `MaxPool`'s `Indices` output go to [`super::pool_nd`].

use burn::tensor::module::avg_pool2d;
use burn::tensor::ops::{AvgPoolOptions, MaxPoolOptions};

use super::window::Window2d;
use super::{Inputs, OpContext, OpOutput};
use crate::error::OpResult;
use crate::kernels::max_pool2d;
use crate::op_bail;
use crate::value::{FloatValue, Value};

/// Run a 2-D pooling function on a 1-D or 2-D input (`[N, C, L]` or `[N, C, H, W]`).
fn pool2d(
    x: FloatValue,
    f: impl FnOnce(burn::tensor::Tensor<4>) -> burn::tensor::Tensor<4>,
) -> OpResult<FloatValue> {
    let s = x.shape();
    let one_d = s.len() == 3;
    let x4 = if one_d {
        x.reshape(&[s[0], s[1], 1, s[2]])?
    } else {
        x
    };
    let y = FloatValue::from_rank(f(x4.into_rank::<4>()?))?;
    if one_d {
        let ys = y.shape();
        y.reshape(&[ys[0], ys[1], ys[3]])
    } else {
        Ok(y)
    }
}

fn window(ctx: &OpContext, x: &FloatValue) -> OpResult<Window2d> {
    let s = x.shape();
    if !(3..=4).contains(&s.len()) {
        op_bail!("pooling supports [N, C, L] and [N, C, H, W] inputs, got {s:?}");
    }
    let Some(kernel) = ctx.attrs.ints("kernel_shape")? else {
        op_bail!("attribute `kernel_shape` is required")
    };
    let kernel: Vec<usize> = kernel.iter().map(|&k| k.max(1) as usize).collect();
    Window2d::from_attrs(ctx.attrs, &s[2..], &kernel)
}

/// Whether the 2-D kernels take this input (1 or 2 spatial dims).
fn planar(inputs: &Inputs) -> bool {
    inputs
        .0
        .first()
        .and_then(Option::as_ref)
        .is_some_and(|x| (3..=4).contains(&x.rank()))
}

/// `MaxPool`
pub fn max_pool(ctx: &OpContext, mut inputs: Inputs) -> OpResult<OpOutput> {
    if ctx.num_outputs > 1 || !planar(&inputs) {
        return super::pool_nd::max_pool_nd(ctx, inputs);
    }
    let x = inputs.float(0, "X", ctx.device)?;
    let w = window(ctx, &x)?;
    let options = MaxPoolOptions {
        kernel_size: w.kernel,
        stride: w.strides,
        padding: w.pads,
        dilation: w.dilations,
        ceil_mode: ctx.attrs.int("ceil_mode", 0)? != 0,
    };
    Ok(Value::Float(pool2d(x, |t| max_pool2d(t, options))?).into())
}

/// `AveragePool`
pub fn average_pool(ctx: &OpContext, mut inputs: Inputs) -> OpResult<OpOutput> {
    let dilated = ctx
        .attrs
        .ints("dilations")?
        .is_some_and(|d| d.iter().any(|&v| v != 1));
    if dilated || !planar(&inputs) {
        return super::pool_nd::average_pool_nd(ctx, inputs);
    }
    let x = inputs.float(0, "X", ctx.device)?;
    let w = window(ctx, &x)?;
    let options = AvgPoolOptions {
        kernel_size: w.kernel,
        stride: w.strides,
        padding: w.pads,
        count_include_pad: ctx.attrs.int("count_include_pad", 0)? != 0,
        ceil_mode: ctx.attrs.int("ceil_mode", 0)? != 0,
    };
    Ok(Value::Float(pool2d(x, |t| avg_pool2d(t, options))?).into())
}

fn global(ctx: &OpContext, mut inputs: Inputs, max: bool) -> OpResult<OpOutput> {
    let x = inputs.float(0, "X", ctx.device)?;
    let s = x.shape();
    if s.len() < 3 {
        op_bail!("global pooling needs [N, C, spatial..], got {s:?}");
    }
    let spatial: usize = s[2..].iter().product();
    let flat = x.reshape(&[s[0], s[1], spatial])?.into_rank::<3>()?;
    let pooled = if max {
        flat.max_dim(2)
    } else {
        flat.mean_dim(2)
    };
    let mut out_shape = s[..2].to_vec();
    out_shape.extend(std::iter::repeat_n(1, s.len() - 2));
    Ok(Value::Float(FloatValue::from_rank(pooled)?.reshape(&out_shape)?).into())
}

/// `GlobalAveragePool`
pub fn global_average_pool(ctx: &OpContext, inputs: Inputs) -> OpResult<OpOutput> {
    global(ctx, inputs, false)
}

/// `GlobalMaxPool`
pub fn global_max_pool(ctx: &OpContext, inputs: Inputs) -> OpResult<OpOutput> {
    global(ctx, inputs, true)
}
