//! A slice along one axis (`Split`'s pieces) whose backward writes the whole input's
//! gradient in one pass on CubeCL devices: the piece's gradient where the piece was, zeros
//! elsewhere. Burn's slice backward filled a zero tensor of the input's size and then
//! assigned the piece into it, two launches per piece (a fused QKV projection's Split: six
//! a layer, before the three gradients are summed). The forward is Burn's slice, a view.
//!
//! Its converse, [`pad_end`], widens one axis with zeros (a head's weight padded to an
//! aligned vocabulary, `model::padded_head`): one launch that keeps the input's layout (a
//! transposed view stays one), and a backward that is a slice of the gradient, a view.

use crate::value::PhysTensor;

/// Elements `start..start + len` (`len` > 0) along physical axis `dim` of `x`: on CubeCL
/// devices with the one-pass backward, elsewhere Burn's `narrow`.
pub fn narrow(x: PhysTensor, dim: usize, start: usize, len: usize) -> PhysTensor {
    #[cfg(any(feature = "wgpu", feature = "cuda"))]
    if super::runs_cubecl(&x.device()) && x.dtype() == burn::tensor::DType::F32 {
        use cube::NarrowOps;
        return PhysTensor::from_dispatch(<burn::backend::Dispatch as NarrowOps>::narrow_padded(
            x.into_dispatch(),
            dim,
            start,
            len,
        ));
    }
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
    use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
    use burn::backend::ops::FloatTensorOps;
    use burn::backend::tensor::FloatTensor;
    use burn::backend::{AutodiffBackend, Backend, Shape, TensorMetadata, backend_extension};
    use burn::tensor::Slice;
    use burn_cubecl::kernel::untile;
    use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
    use cubecl::calculate_cube_count_elemwise;
    use cubecl::prelude::*;

    use crate::value::unary_op::unary;

    /// Threads per cube.
    const THREADS: u32 = 256;

    /// The op as a backend extension (CubeCL, and Autodiff over it).
    #[backend_extension(Cube, Autodiff)]
    pub trait NarrowOps: Backend {
        /// See [`super::narrow`].
        fn narrow_padded(
            x: FloatTensor<Self>,
            dim: usize,
            start: usize,
            len: usize,
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

    impl NarrowOps for Cube {
        fn narrow_padded(
            x: FloatTensor<Self>,
            dim: usize,
            start: usize,
            len: usize,
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
            let cube_dim = CubeDim::new_1d(THREADS);
            let count = calculate_cube_count_elemwise(&client, n, cube_dim);
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

        fn first_part(x: FloatTensor<Self>, dim: usize, len: usize) -> FloatTensor<Self> {
            // The same buffer and strides, a shorter extent along `dim`.
            let mut x = untile(x);
            let mut shape = x.shape();
            shape[dim] = len;
            *x.meta.shape_mut() = shape;
            x
        }
    }

    impl<B: Backend + NarrowOps, C: CheckpointStrategy> NarrowOps for Autodiff<B, C> {
        fn narrow_padded(
            x: FloatTensor<Self>,
            dim: usize,
            start: usize,
            len: usize,
        ) -> FloatTensor<Self> {
            unary::<B, C, Shape>(
                x,
                move |x| B::narrow_padded(x, dim, start, len),
                |input, _| input.shape(),
                move |shape, g| B::narrow_padded_backward(g, shape, dim, start),
            )
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
