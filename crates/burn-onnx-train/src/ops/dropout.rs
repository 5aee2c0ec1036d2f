//! `Dropout`: identity in evaluation, inverted dropout (`x * mask / (1 - ratio)`) in
//! training mode. Training mode comes from the runner, or from the node's own
//! `training_mode` input when the exporter set it. The mask is drawn on the host from the
//! node's seed (ChaCha8), so it is the same on every device and launcher. On a sequence
//! slice (sequence parallelism) the mask of the whole sequence is drawn and this rank's
//! slice of it kept, so the slices' masks are those of one process.

use burn::tensor::{Tensor, TensorData};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::sequence_marks::marked;
use super::{Inputs, OpContext, OpOutput};
use crate::error::OpResult;
use crate::op_bail;
use crate::value::{FloatValue, Value};

/// `Dropout`
pub fn dropout(ctx: &OpContext, mut inputs: Inputs) -> OpResult<OpOutput> {
    let x = inputs.float(0, "data", ctx.device)?;
    let ratio = if ctx.opset >= 12 {
        inputs
            .opt(1)
            .map(|v| v.scalar_f32("ratio"))
            .transpose()?
            .unwrap_or(0.5)
    } else {
        ctx.attrs.float("ratio", 0.5)?
    };
    let node_training = inputs
        .opt(2)
        .map(|v| v.scalar_f32("training_mode"))
        .transpose()?
        .unwrap_or(0.0)
        != 0.0;
    if !(0.0..1.0).contains(&ratio) {
        op_bail!("ratio must be in [0, 1), got {ratio}");
    }
    let shape = x.shape();
    if !(ctx.train || node_training) || ratio == 0.0 {
        if ctx.num_outputs < 2 {
            return Ok(Value::Float(x).into());
        }
        let mask = ndarray::ArrayD::from_elem(ndarray::IxDyn(&shape), true);
        return Ok(vec![Value::Float(x), Value::Bool(mask)].into());
    }
    let mask = draw_mask(ctx, &shape, ratio)?;
    let keep: Tensor<{ crate::value::MAX_RANK }> =
        Tensor::from_data(TensorData::new(mask, x.tensor.shape()), ctx.device);
    let y = x.tensor * keep.clone().mul_scalar(1.0 / (1.0 - ratio));
    let y = Value::Float(FloatValue::new(y, shape.len()));
    if ctx.num_outputs < 2 {
        return Ok(y.into());
    }
    let mask = FloatValue::new(keep, shape.len())
        .to_array()?
        .mapv(|v| v != 0.0);
    Ok(vec![y, Value::Bool(mask)].into())
}

/// Keep (1) / drop (0) for every element of a `shape` input: drawn for the whole sequence
/// and sliced when the node runs on a sequence slice.
fn draw_mask(ctx: &OpContext, shape: &[usize], ratio: f32) -> OpResult<Vec<f32>> {
    let mut whole = shape.to_vec();
    let slice = marked(&ctx.attrs)?;
    if let Some((split, parts)) = slice {
        whole[split.axis] *= parts;
    }
    let mut rng = ChaCha8Rng::seed_from_u64(ctx.seed);
    let mask: Vec<f32> = (0..whole.iter().product::<usize>())
        .map(|_| {
            if rng.random::<f32>() >= ratio {
                1.0
            } else {
                0.0
            }
        })
        .collect();
    let Some((split, parts)) = slice else {
        return Ok(mask);
    };
    let rank = ctx
        .collectives
        .tensor_parallel
        .as_ref()
        .map_or(0, |g| g.0.rank() % parts);
    let full = ndarray::ArrayD::from_shape_vec(ndarray::IxDyn(&whole), mask)?;
    Ok(split.slice(&full, rank, parts).into_iter().collect())
}
