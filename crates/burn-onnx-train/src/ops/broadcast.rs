//! NumPy-style broadcasting: shape rules, and binary ops on host arrays and device tensors.

use ndarray::{ArrayD, IxDyn, Zip};

use crate::error::OpResult;
use crate::op_bail;
use crate::value::{FloatValue, PhysTensor, padded};

/// The broadcast of two shapes, or an error naming both.
pub fn broadcast_shapes(a: &[usize], b: &[usize]) -> OpResult<Vec<usize>> {
    let rank = a.len().max(b.len());
    let mut out = vec![0; rank];
    for i in 0..rank {
        let da = if i < rank - a.len() {
            1
        } else {
            a[i - (rank - a.len())]
        };
        let db = if i < rank - b.len() {
            1
        } else {
            b[i - (rank - b.len())]
        };
        out[i] = match (da, db) {
            (x, y) if x == y => x,
            (1, y) => y,
            (x, 1) => x,
            _ => op_bail!("shapes {a:?} and {b:?} do not broadcast"),
        };
    }
    Ok(out)
}

/// Apply `f` element-wise to two host arrays, broadcasting them.
pub fn host_binary<A: Clone, B: Clone, R>(
    a: &ArrayD<A>,
    b: &ArrayD<B>,
    f: impl Fn(&A, &B) -> R,
) -> OpResult<ArrayD<R>> {
    let shape = broadcast_shapes(a.shape(), b.shape())?;
    let (Some(av), Some(bv)) = (a.broadcast(IxDyn(&shape)), b.broadcast(IxDyn(&shape))) else {
        op_bail!(
            "shapes {:?} and {:?} do not broadcast",
            a.shape(),
            b.shape()
        );
    };
    Ok(Zip::from(&av).and(&bv).map_collect(|x, y| f(x, y)))
}

/// Apply a Burn binary op to two float values after checking they broadcast.
///
/// On CubeCL devices a trained operand broadcast over the leading dims of the other (a
/// bias, a normalisation scale: `[C]` against `[R, C]`) meets it as `[G, 1, C]` against
/// `[G, R/G, C]`, G about sqrt(R). Its gradient, the sum of R rows, is then two reductions
/// (G x C outputs of R/G rows, then C outputs of G rows) instead of one that gives each of
/// C outputs a single thread looping over all R rows: 0.39 ms per bias gradient of GPT-2
/// 124M at batch 8 x 256 on an H200, a third of the update's kernel time.
pub fn float_binary(
    a: FloatValue,
    b: FloatValue,
    f: impl FnOnce(PhysTensor, PhysTensor) -> PhysTensor,
) -> OpResult<FloatValue> {
    let shape = broadcast_shapes(&a.shape(), &b.shape())?;
    let rank = shape.len();
    let Some(groups) = bias_groups(&a, &b, &shape) else {
        return Ok(FloatValue::new(f(a.tensor, b.tensor), rank));
    };
    let BiasGroups { groups, rows, cols } = groups;
    let grouped = |v: FloatValue| -> OpResult<PhysTensor> {
        if v.shape() == shape {
            return Ok(v.tensor.reshape(padded(&[groups, rows / groups, cols])?));
        }
        Ok(v.tensor
            .reshape(padded(&[1, 1, cols])?)
            .expand(padded(&[groups, 1, cols])?))
    };
    let out = f(grouped(a)?, grouped(b)?);
    Ok(FloatValue::new(out.reshape(padded(&shape)?), rank))
}

/// How [`float_binary`] groups the rows of a bias-like operand's broadcast.
struct BiasGroups {
    groups: usize,
    rows: usize,
    cols: usize,
}

/// The grouping for `a` op `b` of output `shape`, when one operand has the whole shape and
/// the other, trained and on a CubeCL device, broadcasts over at least 256 leading rows
/// that split into groups of 8 or more.
fn bias_groups(a: &FloatValue, b: &FloatValue, shape: &[usize]) -> Option<BiasGroups> {
    let small = match (a.shape() == shape, b.shape() == shape) {
        (true, false) => b,
        (false, true) => a,
        _ => return None,
    };
    if !small.tensor.is_require_grad() || !crate::kernels::runs_cubecl(&small.tensor.device()) {
        return None;
    }
    let small_shape = small.shape();
    let lead = shape.len() - small_shape.len();
    let padded_small = |d: usize| if d < lead { 1 } else { small_shape[d - lead] };
    // The first dim from which the operand matches the output; ones before it.
    let k = (0..=shape.len()).find(|&k| (k..shape.len()).all(|d| padded_small(d) == shape[d]))?;
    if (0..k).any(|d| padded_small(d) != 1) {
        return None;
    }
    let rows: usize = shape[..k].iter().product();
    let cols: usize = shape[k..].iter().product();
    if rows < 256 || cols == 0 {
        return None;
    }
    // Rows per group: the divisor of `rows` nearest its square root, at least 8.
    let root = (rows as f64).sqrt();
    let per_group = (8..=rows / 8).filter(|d| rows % d == 0).min_by(|x, y| {
        (*x as f64 - root)
            .abs()
            .total_cmp(&(*y as f64 - root).abs())
    })?;
    Some(BiasGroups {
        groups: rows / per_group,
        rows,
        cols,
    })
}
