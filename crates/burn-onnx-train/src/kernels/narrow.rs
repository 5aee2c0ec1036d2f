//! A slice along one axis (`Split`'s pieces) whose backward writes the input's gradient
//! once for all the pieces on CubeCL devices: the first piece whose gradient arrives writes
//! the whole input's gradient (its part, zeros elsewhere: one launch), each later piece adds
//! its part into that gradient in place (one launch over the piece). Burn's slice backward
//! filled a zero tensor of the input's size and assigned the piece into it, two launches a
//! piece, and autodiff then summed the whole-size gradients (a fused QKV projection's
//! Split: eight launches a layer and ten passes over `[batch, seq, 3 x width]`; now three
//! launches and under two passes). The forward is Burn's slice, a view.
//!
//! Its converse, [`pad_end`], widens one axis with zeros (a head's weight padded to an
//! aligned vocabulary, `model::padded_head`): one launch that keeps the input's layout (a
//! transposed view stays one), and a backward that is a slice of the gradient, a view.

use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use crate::value::PhysTensor;

/// The pieces cut from one input ([`narrow`]): whether one of them has written the input's
/// gradient yet, so the others add theirs into it.
#[derive(Debug, Default)]
pub struct SplitPieces {
    #[cfg_attr(not(any(feature = "wgpu", feature = "cuda")), allow(dead_code))]
    written: AtomicBool,
}

#[cfg(any(feature = "wgpu", feature = "cuda"))]
impl SplitPieces {
    /// Whether a piece wrote the input's gradient before; marks it written.
    fn written_before(&self) -> bool {
        self.written.swap(true, std::sync::atomic::Ordering::AcqRel)
    }
}

/// Elements `start..start + len` (`len` > 0) along physical axis `dim` of `x`, one of the
/// `pieces` cut from it: on CubeCL devices with the shared backward, elsewhere Burn's
/// `narrow`.
pub fn narrow(
    x: PhysTensor,
    dim: usize,
    start: usize,
    len: usize,
    pieces: &Arc<SplitPieces>,
) -> PhysTensor {
    #[cfg(any(feature = "wgpu", feature = "cuda"))]
    if super::runs_cubecl(&x.device()) && x.dtype() == burn::tensor::DType::F32 {
        use cube::NarrowOps;
        return PhysTensor::from_dispatch(<burn::backend::Dispatch as NarrowOps>::narrow_padded(
            x.into_dispatch(),
            dim,
            start,
            len,
            pieces.clone(),
        ));
    }
    let _ = pieces;
    x.narrow(dim, start, len)
}

/// `x` with physical axis `dim` widened to `to` (>= its length), zeros in the new places;
/// the gradient of `x` is the first part of the result's.
pub fn pad_end(x: PhysTensor, dim: usize, to: usize) -> PhysTensor {
    let shape = x.dims();
    if to == shape[dim] {
        return x;
    }
    #[cfg(any(feature = "wgpu", feature = "cuda"))]
    if super::runs_cubecl(&x.device()) && x.dtype() == burn::tensor::DType::F32 {
        use cube::NarrowOps;
        return PhysTensor::from_dispatch(<burn::backend::Dispatch as NarrowOps>::pad_end(
            x.into_dispatch(),
            dim,
            to,
        ));
    }
    let mut zeros = shape.clone();
    zeros[dim] = to - shape[dim];
    let zeros = PhysTensor::zeros(zeros, (&x.device(), x.dtype()));
    PhysTensor::cat(vec![x, zeros], dim)
}

#[cfg(any(feature = "wgpu", feature = "cuda"))]
mod cube {
    use burn::backend::Cube;
    use burn::backend::autodiff::Autodiff;
    use burn::backend::autodiff::checkpoint::base::Checkpointer;
    use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
    use burn::backend::autodiff::grads::Gradients;
    use burn::backend::autodiff::ops::{Backward, Ops};
    use burn::backend::ops::FloatTensorOps;
    use burn::backend::tensor::FloatTensor;
    use burn::backend::{AutodiffBackend, Backend, Shape, TensorMetadata, backend_extension};
    use burn::tensor::Slice;
    use burn_cubecl::kernel::into_contiguous;
    use burn_cubecl::kernel::untile;
    use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
    use cubecl::prelude::*;
    use std::sync::Arc;

    use super::SplitPieces;
    use crate::kernels::cube::elementwise_grid;
    use crate::value::unary_op::unary;

    /// The op as a backend extension (CubeCL, and Autodiff over it).
    #[backend_extension(Cube, Autodiff)]
    pub trait NarrowOps: Backend {
        /// See [`super::narrow`].
        fn narrow_padded(
            x: FloatTensor<Self>,
            dim: usize,
            start: usize,
            len: usize,
            pieces: Arc<SplitPieces>,
        ) -> FloatTensor<Self>;
        /// The gradient of `x` from its piece's: `g` at `start..start + len` along `dim`
        /// of a `shape` tensor, zeros elsewhere.
        fn narrow_padded_backward(
            g: FloatTensor<Self>,
            shape: Shape,
            dim: usize,
            start: usize,
        ) -> FloatTensor<Self>;
        /// See [`super::pad_end`].
        fn pad_end(x: FloatTensor<Self>, dim: usize, to: usize) -> FloatTensor<Self>;
        /// `whole` with `g` added to its elements at `start..` along `dim` (in place when
        /// `whole` is the only holder of its buffer).
        fn add_into_part(
            whole: FloatTensor<Self>,
            g: FloatTensor<Self>,
            dim: usize,
            start: usize,
        ) -> FloatTensor<Self>;
        /// The elements `0..len` along `dim` of `x`, every other axis whole: a view, even
        /// where the part cut off is not a multiple of the memory alignment (Burn's slice
        /// copies then).
        fn first_part(x: FloatTensor<Self>, dim: usize, len: usize) -> FloatTensor<Self>;
    }

    /// `out[i] = g[the same place in the piece]` inside the piece (`start..` along `dim`),
    /// 0 outside; `g` read through its strides (a gradient arriving as a transposed view
    /// is not copied first).
    #[cube(launch)]
    fn pad_kernel(g: &Tensor<f32>, out: &mut Tensor<f32>, dim: usize, start: usize) {
        let i = ABSOLUTE_POS;
        if i < out.len() {
            let mut rest = i;
            let mut at = 0usize;
            let mut inside = true;
            let mut d = out.rank();
            while d > 0 {
                d -= 1;
                let extent = out.shape(d);
                let mut c = rest % extent;
                rest /= extent;
                if d == dim {
                    if c >= start && c < start + g.shape(d) {
                        c -= start;
                    } else {
                        inside = false;
                        c = 0;
                    }
                }
                at += c * g.stride(d);
            }
            let mut v = f32::new(0.0);
            if inside {
                v = g[at];
            }
            out[i] = v;
        }
    }

    /// `whole[the place of g's element i, shifted by start along dim] += g[i]`, both read
    /// and written through their strides; `n` is `g`'s element count.
    #[cube(launch)]
    fn add_part_kernel(
        g: &Tensor<f32>,
        whole: &mut Tensor<f32>,
        n: usize,
        dim: usize,
        start: usize,
    ) {
        let i = ABSOLUTE_POS;
        if i < n {
            let mut rest = i;
            let mut at_g = 0usize;
            let mut at_whole = 0usize;
            let mut d = g.rank();
            while d > 0 {
                d -= 1;
                let extent = g.shape(d);
                let c = rest % extent;
                rest /= extent;
                at_g += c * g.stride(d);
                let mut cw = c;
                if d == dim {
                    cw += start;
                }
                at_whole += cw * whole.stride(d);
            }
            whole[at_whole] += g[at_g];
        }
    }

    impl NarrowOps for Cube {
        fn narrow_padded(
            x: FloatTensor<Self>,
            dim: usize,
            start: usize,
            len: usize,
            _pieces: Arc<SplitPieces>,
        ) -> FloatTensor<Self> {
            let slices: Vec<Slice> = (0..x.shape().num_dims())
                .map(|d| match d == dim {
                    true => Slice::from(start..start + len),
                    false => Slice::full(),
                })
                .collect();
            Self::float_slice(x, &slices)
        }

        fn narrow_padded_backward(
            g: FloatTensor<Self>,
            shape: Shape,
            dim: usize,
            start: usize,
        ) -> FloatTensor<Self> {
            let client = g.client.clone();
            let out =
                empty_device_contiguous_dtype(client.clone(), g.device.clone(), shape, g.dtype);
            let n = out.shape().num_elements();
            let (count, cube_dim) = elementwise_grid(&client, n);
            pad_kernel::launch(
                &client,
                count,
                cube_dim,
                g.into_tensor_arg(),
                out.clone().into_tensor_arg(),
                dim,
                start,
            );
            out
        }

        fn pad_end(x: FloatTensor<Self>, dim: usize, to: usize) -> FloatTensor<Self> {
            // The axes from the largest stride to the smallest: `x` permuted into that
            // order is contiguous when it is a permuted view of a contiguous tensor, the
            // padded copy is written in that order and permuted back.
            let mut order: Vec<usize> = (0..x.shape().num_dims()).collect();
            let strides = x.meta.strides().to_vec();
            order.sort_by_key(|&d| std::cmp::Reverse(strides[d]));
            let mut back = vec![0; order.len()];
            for (at, &d) in order.iter().enumerate() {
                back[d] = at;
            }
            let x = Self::float_permute(x, &order);
            let mut shape = x.shape();
            shape[back[dim]] = to;
            let padded = Self::narrow_padded_backward(x, shape, back[dim], 0);
            Self::float_permute(padded, &back)
        }

        fn add_into_part(
            whole: FloatTensor<Self>,
            g: FloatTensor<Self>,
            dim: usize,
            start: usize,
        ) -> FloatTensor<Self> {
            // In place only into a buffer nothing else holds, each element stored once (a
            // broadcast view's stride 0 would add twice into one place).
            let unique = whole.can_mut() && whole.meta.strides().iter().all(|&s| s > 0);
            let whole = match unique {
                true => whole,
                false => into_contiguous(whole).copy(),
            };
            let client = whole.client.clone();
            let n = g.shape().num_elements();
            let (count, cube_dim) = elementwise_grid(&client, n);
            add_part_kernel::launch(
                &client,
                count,
                cube_dim,
                g.into_tensor_arg(),
                whole.clone().into_tensor_arg(),
                n,
                dim,
                start,
            );
            whole
        }

        fn first_part(x: FloatTensor<Self>, dim: usize, len: usize) -> FloatTensor<Self> {
            // The same buffer and strides, a shorter extent along `dim`.
            let mut x = untile(x);
            let mut shape = x.shape();
            shape[dim] = len;
            *x.meta.shape_mut() = shape;
            x
        }
    }

    /// The backward of one piece of a split input of `shape`: the input's whole gradient
    /// from the first piece to arrive, an in-place addition into it from the others.
    #[derive(Debug)]
    struct PieceBackward {
        shape: Shape,
        dim: usize,
        start: usize,
        pieces: Arc<SplitPieces>,
    }

    impl<B: Backend + NarrowOps> Backward<B, 1> for PieceBackward {
        type State = ();

        fn backward(self, ops: Ops<(), 1>, grads: &mut Gradients, _: &mut Checkpointer) {
            let [parent] = ops.parents;
            let g = grads.consume::<B>(&ops.node);
            let Some(node) = parent else {
                return;
            };
            // A leaf's gradient stays where it is consumed (a later register adds to it), so
            // only an op's output (a node with parents) has its gradient taken and added into.
            let taken = !node.parents.is_empty();
            let whole = match taken && self.pieces.written_before() {
                true => B::add_into_part(grads.consume::<B>(&node), g, self.dim, self.start),
                false => B::narrow_padded_backward(g, self.shape, self.dim, self.start),
            };
            grads.register::<B>(node.id, whole);
        }
    }

    impl<B: Backend + NarrowOps, C: CheckpointStrategy> NarrowOps for Autodiff<B, C> {
        fn narrow_padded(
            x: FloatTensor<Self>,
            dim: usize,
            start: usize,
            len: usize,
            pieces: Arc<SplitPieces>,
        ) -> FloatTensor<Self> {
            let backward = PieceBackward {
                shape: x.primitive().shape(),
                dim,
                start,
                pieces: pieces.clone(),
            };
            let out = B::narrow_padded(x.primitive().clone(), dim, start, len, pieces);
            backward
                .prepare::<C>([x.node()])
                .compute_bound()
                .stateless(out)
        }

        fn add_into_part(
            whole: FloatTensor<Self>,
            g: FloatTensor<Self>,
            dim: usize,
            start: usize,
        ) -> FloatTensor<Self> {
            // Used inside the backward only (first-order autodiff).
            Self::from_inner(B::add_into_part(
                whole.into_primitive(),
                g.into_primitive(),
                dim,
                start,
            ))
        }

        fn narrow_padded_backward(
            g: FloatTensor<Self>,
            shape: Shape,
            dim: usize,
            start: usize,
        ) -> FloatTensor<Self> {
            // Used inside the backward only (first-order autodiff).
            Self::from_inner(B::narrow_padded_backward(
                g.into_primitive(),
                shape,
                dim,
                start,
            ))
        }

        fn pad_end(x: FloatTensor<Self>, dim: usize, to: usize) -> FloatTensor<Self> {
            unary::<B, C, usize>(
                x,
                move |x| B::pad_end(x, dim, to),
                move |input, _| input.shape()[dim],
                move |len, g| B::first_part(g, dim, len),
            )
        }

        fn first_part(x: FloatTensor<Self>, dim: usize, len: usize) -> FloatTensor<Self> {
            // Used inside the backward only (first-order autodiff).
            Self::from_inner(B::first_part(x.into_primitive(), dim, len))
        }
    }
}
