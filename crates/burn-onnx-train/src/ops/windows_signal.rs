//! Signal windows: `HannWindow`, `HammingWindow` and `BlackmanWindow`, computed on the host
//! in f64 from the scalar `size` input (they have no float input, so no gradient).

use std::f64::consts::PI;

use ndarray::{ArrayD, IxDyn};

use super::{Inputs, OpContext, OpOutput};
use crate::error::OpResult;
use crate::op_bail;
use crate::value::host_tensor::dtype;
use crate::value::{FloatValue, Value};

/// A window of `size` points from `f(n, denominator)` (`periodic`: denominator `size`,
/// else `size - 1`), in the element type `output_datatype` (float by default).
fn window(ctx: &OpContext, mut inputs: Inputs, f: impl Fn(f64, f64) -> f64) -> OpResult<OpOutput> {
    let size = match inputs.take(0, "size")?.int_list("size")?[..] {
        [s] if s >= 0 => s as usize,
        ref other => op_bail!("size must be one non-negative integer, got {other:?}"),
    };
    let periodic = ctx.attrs.int("periodic", 1)? != 0;
    let denominator = if periodic {
        size
    } else {
        size.saturating_sub(1)
    } as f64;
    let values: Vec<f64> = (0..size)
        .map(|n| {
            if denominator == 0.0 {
                1.0
            } else {
                f(n as f64, denominator)
            }
        })
        .collect();
    let to = ctx.attrs.int("output_datatype", i64::from(dtype::FLOAT))? as i32;
    Ok(if dtype::is_float(to) {
        let a = ArrayD::from_shape_vec(IxDyn(&[size]), values.iter().map(|&v| v as f32).collect())?;
        Value::Float(FloatValue::from_array(&a, ctx.device)?)
    } else if dtype::is_int(to) {
        Value::Int(ArrayD::from_shape_vec(
            IxDyn(&[size]),
            values.iter().map(|&v| v as i64).collect(),
        )?)
    } else {
        op_bail!("output_datatype {to} is not a numeric type")
    }
    .into())
}

/// `HannWindow` (`periodic`, `output_datatype`): `sin^2(pi n / N)`.
pub fn hann_window(ctx: &OpContext, inputs: Inputs) -> OpResult<OpOutput> {
    window(ctx, inputs, |n, d| (PI * n / d).sin().powi(2))
}

/// `HammingWindow` (`periodic`, `output_datatype`): `a - (1 - a) cos(2 pi n / N)`,
/// `a = 25/46`.
pub fn hamming_window(ctx: &OpContext, inputs: Inputs) -> OpResult<OpOutput> {
    let alpha = 25.0 / 46.0;
    window(ctx, inputs, move |n, d| {
        alpha - (1.0 - alpha) * (2.0 * PI * n / d).cos()
    })
}

/// `BlackmanWindow` (`periodic`, `output_datatype`):
/// `0.42 - 0.5 cos(2 pi n / N) + 0.08 cos(4 pi n / N)`.
pub fn blackman_window(ctx: &OpContext, inputs: Inputs) -> OpResult<OpOutput> {
    window(ctx, inputs, |n, d| {
        0.42 - 0.5 * (2.0 * PI * n / d).cos() + 0.08 * (4.0 * PI * n / d).cos()
    })
}
