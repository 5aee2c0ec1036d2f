//! Ops of the `ai.onnx.ml` domain that preprocessing heads of exported pipelines use:
//! `Binarizer` and `ArrayFeatureExtractor`.

use ndarray::{Axis, IxDyn};

use super::{Inputs, OpContext, OpOutput};
use crate::error::OpResult;
use crate::op_bail;
use crate::value::{FloatValue, Value, int_tensor_1d};

/// `Binarizer`: 1 where `X > threshold`, else 0, in `X`'s element type.
pub fn binarizer(ctx: &OpContext, mut inputs: Inputs) -> OpResult<OpOutput> {
    let threshold = ctx.attrs.float("threshold", 0.0)?;
    Ok(match inputs.take(0, "X")? {
        Value::Float(f) => {
            let ones = f.tensor.greater_elem(threshold).float();
            Value::Float(FloatValue::new(ones, f.rank))
        }
        Value::Int(a) => Value::Int(a.mapv(|v| i64::from(v as f32 > threshold))),
        other => op_bail!("X must be a number tensor, got {}", other.kind()),
    }
    .into())
}

/// `ArrayFeatureExtractor`: the elements of `X` at indices `Y` along its last axis; the
/// result is `[..., len(Y)]`, `[1, len(Y)]` for a 1-D `X`.
pub fn array_feature_extractor(ctx: &OpContext, mut inputs: Inputs) -> OpResult<OpOutput> {
    let x = inputs.take(0, "X")?;
    let indices: Vec<i64> = inputs.take(1, "Y")?.into_int()?.iter().copied().collect();
    let shape = x.shape();
    let Some(&last) = shape.last() else {
        op_bail!("X must have rank >= 1");
    };
    let picked: Vec<usize> = indices
        .iter()
        .map(|&i| {
            usize::try_from(i)
                .ok()
                .filter(|&j| j < last)
                .ok_or_else(|| format!("index {i} is outside the last axis of size {last}").into())
        })
        .collect::<OpResult<_>>()?;
    let mut out_shape = if shape.len() == 1 {
        vec![1]
    } else {
        shape[..shape.len() - 1].to_vec()
    };
    out_shape.push(picked.len());
    let axis = shape.len() - 1;
    Ok(match x {
        Value::Float(f) => {
            let phys = f.axis(-1)?;
            let idx = int_tensor_1d(picked.iter().map(|&j| j as i64).collect(), ctx.device);
            Value::Float(FloatValue::new(f.tensor.select(phys, idx), f.rank).reshape(&out_shape)?)
        }
        Value::Int(a) => Value::Int(
            a.select(Axis(axis), &picked)
                .into_shape_with_order(IxDyn(&out_shape))?,
        ),
        other => op_bail!("X must be a number tensor, got {}", other.kind()),
    }
    .into())
}
