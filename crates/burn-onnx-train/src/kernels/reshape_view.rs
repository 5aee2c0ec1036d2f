//! Reshape as a view wherever the strides allow it (NumPy's no-copy reshape rule), on
//! CubeCL devices. Burn's CubeCL reshape copies a non-contiguous tensor unless the reshape
//! only adds leading dimensions or splits ones, judged rank against rank; our values all
//! have rank `MAX_RANK`, so every reshape of a strided view copied: the head split of each
//! attention projection (`[b, t, h * d]` cut out of the fused `[b, t, 3 h d]` one,
//! reshaped to `[b, t, h, d]`) cost a copy of Q, K and V every forward, before the
//! product copied them again into its own layout. The backward reshapes the gradient back
//! the same way (a view when it can be one, a copy otherwise).

use burn::backend::Cube;
use burn::backend::autodiff::Autodiff;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::ops::FloatTensorOps;
use burn::backend::tensor::FloatTensor;
use burn::backend::{Backend, Shape, TensorMetadata, backend_extension};
use burn_cubecl::kernel::untile;

use crate::value::unary_op::unary;

/// The op as a backend extension (CubeCL, and Autodiff over it).
#[backend_extension(Cube, Autodiff)]
pub trait ReshapeViewOps: Backend {
    /// `x` with shape `shape` (the same element count), a view when the strides allow.
    fn reshape_view(x: FloatTensor<Self>, shape: Shape) -> FloatTensor<Self>;
}

/// The strides that show the elements of a `shape`/`strides` tensor, in row-major order,
/// as a `new_shape` tensor without moving them; `None` when no strides can (the reshape
/// merges dimensions that are not laid out one inside the other). Unit dimensions take
/// the stride they would have in a contiguous run, so a layout check never mistakes them
/// for permuted ones.
pub(crate) fn view_strides(
    shape: &[usize],
    strides: &[usize],
    new_shape: &[usize],
) -> Option<Vec<usize>> {
    if shape.contains(&0) || new_shape.contains(&0) {
        return None;
    }
    let (dims, dim_strides): (Vec<usize>, Vec<usize>) = shape
        .iter()
        .zip(strides)
        .filter(|&(&d, _)| d != 1)
        .map(|(&d, &s)| (d, s))
        .unzip();
    let mut out = vec![1; new_shape.len()];
    // Old dims [oi, oj) hold the same elements as new dims [ni, nj).
    let (mut oi, mut ni) = (0, 0);
    while ni < new_shape.len() && oi < dims.len() {
        let (mut oj, mut nj) = (oi + 1, ni + 1);
        let (mut old_size, mut new_size) = (dims[oi], new_shape[ni]);
        while old_size != new_size {
            if new_size < old_size {
                new_size *= *new_shape.get(nj)?;
                nj += 1;
            } else {
                old_size *= *dims.get(oj)?;
                oj += 1;
            }
        }
        // The old dims of the group must nest: each steps over the next one's whole run.
        if (oi..oj - 1).any(|k| dim_strides[k] != dims[k + 1] * dim_strides[k + 1]) {
            return None;
        }
        out[nj - 1] = dim_strides[oj - 1];
        for k in (ni + 1..nj).rev() {
            out[k - 1] = out[k] * new_shape[k];
        }
        (oi, ni) = (oj, nj);
    }
    // Trailing unit dims (all that can be left) step like the last real one.
    let last = if ni > 0 { out[ni - 1] } else { 1 };
    out[ni..].iter_mut().for_each(|s| *s = last);
    Some(out)
}

impl ReshapeViewOps for Cube {
    fn reshape_view(x: FloatTensor<Self>, shape: Shape) -> FloatTensor<Self> {
        let mut x = untile(x);
        match view_strides(x.meta.shape(), x.meta.strides(), &shape) {
            Some(strides) => {
                *x.meta.shape_mut() = shape;
                *x.meta.strides_mut() = strides.into();
                x
            }
            None => Self::float_reshape(x, shape),
        }
    }
}

impl<B: Backend + ReshapeViewOps, C: CheckpointStrategy> ReshapeViewOps for Autodiff<B, C> {
    fn reshape_view(x: FloatTensor<Self>, shape: Shape) -> FloatTensor<Self> {
        unary::<B, C, Shape>(
            x,
            move |x| B::reshape_view(x, shape),
            |input, _| input.shape(),
            |old, g| B::reshape_view(g, old),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::view_strides;

    /// Row-major offsets of every element of a `shape`/`strides` tensor.
    fn offsets(shape: &[usize], strides: &[usize]) -> Vec<usize> {
        let n: usize = shape.iter().product();
        (0..n)
            .map(|mut i| {
                let mut at = 0;
                for (&d, &s) in shape.iter().zip(strides).rev() {
                    at += (i % d) * s;
                    i /= d;
                }
                at
            })
            .collect()
    }

    /// A view is returned exactly when one exists: its offsets are the old tensor's, in
    /// order; and when `None`, no view could be (checked by the offsets' pattern).
    fn check(shape: &[usize], strides: &[usize], new_shape: &[usize], view_exists: bool) {
        let got = view_strides(shape, strides, new_shape);
        assert_eq!(
            got.is_some(),
            view_exists,
            "{shape:?} {strides:?} -> {new_shape:?}"
        );
        if let Some(new_strides) = got {
            assert_eq!(
                offsets(new_shape, &new_strides),
                offsets(shape, strides),
                "{shape:?} {strides:?} -> {new_shape:?} as {new_strides:?}"
            );
        }
    }

    #[test]
    fn reshapes_that_keep_the_elements_in_place_are_views() {
        // A third of the last axis of [2, 5, 12] (the Q of a fused QKV), split into heads.
        check(&[1, 2, 5, 4], &[60, 60, 12, 1], &[2, 5, 2, 2], true);
        // The same with unit padding on both sides.
        check(
            &[1, 1, 2, 5, 4],
            &[1, 60, 60, 12, 1],
            &[1, 2, 5, 2, 2, 1],
            true,
        );
        // Contiguous: any reshape.
        check(&[6, 4], &[4, 1], &[2, 3, 2, 2], true);
        check(&[2, 3, 4], &[12, 4, 1], &[24], true);
        // A transposed matrix split along a dimension.
        check(&[4, 6], &[1, 4], &[2, 2, 6], true);
        // Merging two dims that nest, inside a strided tensor.
        check(&[3, 2, 5], &[100, 5, 1], &[3, 10], true);
        // A broadcast (stride 0) dim merged with another broadcast one.
        check(&[3, 4, 5], &[0, 0, 1], &[12, 5], true);
        // All unit.
        check(&[1, 1], &[7, 3], &[1, 1, 1], true);
    }

    #[test]
    fn reshapes_that_would_move_elements_are_refused() {
        // Heads merged back after a transpose ([b, t, h, d] viewed from [b, h, t, d]).
        check(&[2, 5, 3, 4], &[60, 4, 20, 1], &[2, 5, 12], false);
        // A transposed matrix flattened.
        check(&[4, 6], &[1, 4], &[24], false);
        // A slice's rows merged across the gap.
        check(&[2, 5, 4], &[60, 12, 1], &[2, 20], false);
        // Zero-size tensors go to Burn.
        check(&[0, 3], &[3, 1], &[3, 0], false);
    }
}
