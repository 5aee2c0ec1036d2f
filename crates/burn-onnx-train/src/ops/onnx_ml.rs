//! Ops of the `ai.onnx.ml` domain that preprocessing heads of exported pipelines use:
//! `Binarizer`, `ArrayFeatureExtractor` and `LabelEncoder`.

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

/// Keys or values of a `LabelEncoder`, from its `*_strings`, `*_int64s`, `*_floats` or
/// `*_tensor` attribute.
#[derive(Debug)]
enum Labels {
    Str(Vec<String>),
    Int(Vec<i64>),
    Float(Vec<f32>),
}

impl Labels {
    fn of(ctx: &OpContext, prefix: &str) -> OpResult<Option<Labels>> {
        use crate::graph::attributes::Attr;
        use crate::value::host_tensor::HostTensor;
        let get = |suffix: &str| ctx.attrs.get(&format!("{prefix}_{suffix}"));
        Ok(
            match (get("strings"), get("int64s"), get("floats"), get("tensor")) {
                (Some(Attr::Strings(s)), ..) => Some(Labels::Str(s.clone())),
                (_, Some(Attr::Ints(i)), ..) => Some(Labels::Int(i.clone())),
                (_, _, Some(Attr::Floats(f)), _) => Some(Labels::Float(f.clone())),
                (.., Some(Attr::StringTensor(s))) => Some(Labels::Str(s.iter().cloned().collect())),
                (.., Some(Attr::Tensor(HostTensor::Int(i)))) => {
                    Some(Labels::Int(i.iter().copied().collect()))
                }
                (.., Some(Attr::Tensor(HostTensor::Float(f)))) => {
                    Some(Labels::Float(f.iter().copied().collect()))
                }
                (None, None, None, None) => None,
                other => op_bail!("{prefix}: unsupported label attribute {other:?}"),
            },
        )
    }

    fn len(&self) -> usize {
        match self {
            Labels::Str(v) => v.len(),
            Labels::Int(v) => v.len(),
            Labels::Float(v) => v.len(),
        }
    }
}

/// `LabelEncoder` (ai.onnx.ml): each element of `X` found among the keys becomes the value
/// at the same position, any other the default (`default_*`; ONNX's -1, "_Unused", -0.0
/// when absent).
pub fn label_encoder(ctx: &OpContext, mut inputs: Inputs) -> OpResult<OpOutput> {
    let (Some(keys), Some(values)) = (Labels::of(ctx, "keys")?, Labels::of(ctx, "values")?) else {
        op_bail!("LabelEncoder needs keys_* and values_* attributes")
    };
    if keys.len() != values.len() {
        op_bail!("{} keys but {} values", keys.len(), values.len());
    }
    let x = inputs.take(0, "X")?;
    // Position of each element of X among the keys.
    let found: Vec<Option<usize>> = match (&keys, &x) {
        (Labels::Str(k), Value::Str(a)) => {
            a.iter().map(|s| k.iter().position(|c| c == s)).collect()
        }
        (Labels::Int(k), Value::Int(a)) => {
            a.iter().map(|v| k.iter().position(|c| c == v)).collect()
        }
        (Labels::Float(k), x) => x
            .clone()
            .into_float(ctx.device)?
            .to_array()?
            .iter()
            .map(|v| k.iter().position(|c| c == v))
            .collect(),
        (k, x) => op_bail!("keys {k:?} do not match X of {}", x.kind()),
    };
    let shape = IxDyn(&x.shape());
    let default = Labels::of(ctx, "default")?;
    Ok(match values {
        Labels::Str(v) => {
            let d = match default {
                Some(Labels::Str(d)) => d.into_iter().next().unwrap_or_default(),
                _ => ctx.attrs.string("default_string", "_Unused")?,
            };
            let out = found.iter().map(|f| f.map_or(d.clone(), |i| v[i].clone()));
            Value::Str(ndarray::ArrayD::from_shape_vec(shape, out.collect())?)
        }
        Labels::Int(v) => {
            let d = match default {
                Some(Labels::Int(d)) => d.first().copied().unwrap_or(-1),
                _ => ctx.attrs.int("default_int64", -1)?,
            };
            let out = found.iter().map(|f| f.map_or(d, |i| v[i]));
            Value::Int(ndarray::ArrayD::from_shape_vec(shape, out.collect())?)
        }
        Labels::Float(v) => {
            let d = match default {
                Some(Labels::Float(d)) => d.first().copied().unwrap_or(-0.0),
                _ => ctx.attrs.float("default_float", -0.0)?,
            };
            let out = found.iter().map(|f| f.map_or(d, |i| v[i]));
            let a = ndarray::ArrayD::from_shape_vec(shape, out.collect())?;
            Value::Float(FloatValue::from_array(&a, ctx.device)?)
        }
    }
    .into())
}
