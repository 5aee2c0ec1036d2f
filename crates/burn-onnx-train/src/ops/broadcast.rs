//! NumPy-style broadcasting: shape rules, and binary ops on host arrays and device tensors.

use ndarray::{ArrayD, IxDyn, Zip};

use crate::error::OpResult;
use crate::op_bail;
use crate::value::{FloatValue, PhysTensor};

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
pub fn float_binary(
    a: FloatValue,
    b: FloatValue,
    f: impl FnOnce(PhysTensor, PhysTensor) -> PhysTensor,
) -> OpResult<FloatValue> {
    let shape = broadcast_shapes(&a.shape(), &b.shape())?;
    Ok(FloatValue::new(f(a.tensor, b.tensor), shape.len()))
}
