//! `DepthToSpace` (DCR and CRD modes) and `SpaceToDepth`: a reshape to six axes, a
//! permutation and a reshape back, all differentiable.

use super::{Inputs, OpContext, OpOutput};
use crate::error::OpResult;
use crate::op_bail;
use crate::value::{FloatValue, MAX_RANK, Value};

/// `[N, C, H, W]` and the block size, checked.
fn nchw(x: &FloatValue, block: i64) -> OpResult<([usize; 4], usize)> {
    let shape = x.shape();
    let [n, c, h, w] = shape[..] else {
        op_bail!("input must be 4-D [N, C, H, W], got {shape:?}");
    };
    if block < 1 {
        op_bail!("blocksize must be positive, got {block}");
    }
    Ok(([n, c, h, w], block as usize))
}

fn rearrange(x: FloatValue, six: [usize; 6], perm: [usize; 6], out: [usize; 4]) -> OpResult<Value> {
    // The six logical axes are the last six physical ones.
    let lead = MAX_RANK - 6;
    let perm: [usize; MAX_RANK] =
        std::array::from_fn(|i| if i < lead { i } else { lead + perm[i - lead] });
    let t = x.reshape(&six)?.tensor.permute(perm);
    Ok(Value::Float(FloatValue::new(t, 6).reshape(&out)?))
}

/// `DepthToSpace` (`blocksize`, `mode` DCR or CRD)
pub fn depth_to_space(ctx: &OpContext, mut inputs: Inputs) -> OpResult<OpOutput> {
    let x = inputs.float(0, "input", ctx.device)?;
    let ([n, c, h, w], b) = nchw(&x, ctx.attrs.int("blocksize", 0)?)?;
    if c % (b * b) != 0 {
        op_bail!("channels {c} are not a multiple of blocksize^2 = {}", b * b);
    }
    let cb = c / (b * b);
    let out = [n, cb, h * b, w * b];
    Ok(match ctx.attrs.string("mode", "DCR")?.as_str() {
        "DCR" => rearrange(x, [n, b, b, cb, h, w], [0, 3, 4, 1, 5, 2], out)?,
        "CRD" => rearrange(x, [n, cb, b, b, h, w], [0, 1, 4, 2, 5, 3], out)?,
        other => op_bail!("attribute `mode` must be DCR or CRD, got {other:?}"),
    }
    .into())
}

/// `SpaceToDepth` (`blocksize`)
pub fn space_to_depth(ctx: &OpContext, mut inputs: Inputs) -> OpResult<OpOutput> {
    let x = inputs.float(0, "input", ctx.device)?;
    let ([n, c, h, w], b) = nchw(&x, ctx.attrs.int("blocksize", 0)?)?;
    if h % b != 0 || w % b != 0 {
        op_bail!("spatial size {h}x{w} is not a multiple of blocksize {b}");
    }
    let out = [n, c * b * b, h / b, w / b];
    Ok(rearrange(x, [n, c, h / b, b, w / b, b], [0, 3, 5, 1, 2, 4], out)?.into())
}
