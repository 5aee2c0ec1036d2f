//! The attention softmax with its scaling, masking and additive bias, `softmax(where(keep,
//! x * scale, fill) + bias)` over the last axis, as one kernel forward and one back on CubeCL devices (the
//! graph's Mul, Where and Softmax folded into the Softmax node by
//! `onnx::fusion::fuse_masked_softmax`). The composition launched five kernels over the
//! scores each step (the scaling, the masking, the softmax, and back the softmax's, the
//! masking's and the scaling's gradients, plus a fill of zeros): five passes over the
//! largest activations of a transformer, `[batch, heads, seq, seq]`.
//!
//! The mask travels as an f32 tensor at its own shape (1 keeps, 0 fills), and so does the
//! bias, each broadcast to the scores' by stride-0 dimensions and read through its
//! strides; the bias is not differentiated (a mask or a constant). The backward is
//! `dx = keep ? scale * y (g - sum(g y)) : 0` from the output `y`, which the forward
//! keeps (as the plain softmax's does). Other devices and dtypes keep the composition
//! (`ops::softmax`), which is also the reference the tests hold this to.

use burn::tensor::DType;

use super::runs_cubecl;
use crate::value::PhysTensor;

/// Whether the fused kernels serve `x`: f32 on a CubeCL device.
pub fn masked_softmax_fused_here(x: &PhysTensor) -> bool {
    x.dtype() == DType::F32 && runs_cubecl(&x.device())
}

/// `softmax(where(keep != 0, x * scale, fill) + bias)` along the last physical axis;
/// `keep` and `bias` are broadcastable to `x` (stride 0 where they repeat), `bias` not
/// tracked. Only where [`masked_softmax_fused_here`].
pub fn masked_softmax(
    x: PhysTensor,
    keep: PhysTensor,
    bias: PhysTensor,
    scale: f32,
    fill: f32,
) -> PhysTensor {
    let (keep, bias) = (keep.expand(x.dims()), bias.expand(x.dims()));
    #[cfg(any(feature = "wgpu", feature = "cuda"))]
    {
        use cube::MaskedSoftmaxOps;
        PhysTensor::from_dispatch(
            <burn::backend::Dispatch as MaskedSoftmaxOps>::masked_softmax_rows(
                x.into_dispatch(),
                keep.into_dispatch(),
                bias.into_dispatch(),
                scale,
                fill,
            ),
        )
    }
    #[cfg(not(any(feature = "wgpu", feature = "cuda")))]
    unreachable!(
        "no CubeCL device in this build ({:?}, {:?}, {scale}, {fill})",
        keep.dims(),
        bias.dims()
    )
}

#[cfg(any(feature = "wgpu", feature = "cuda"))]
pub(super) mod cube {
    use burn::backend::Cube;
    use burn::backend::autodiff::Autodiff;
    use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
    use burn::backend::cubecl::dtype_to_storage_type;
    use burn::backend::tensor::FloatTensor;
    use burn::backend::{
        AutodiffBackend, Backend, DType, Shape, TensorMetadata, backend_extension,
    };
    use burn_cubecl::kernel::into_contiguous;
    use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
    use burn_cubecl::tensor::CubeTensor;
    use cubecl::prelude::*;

    use crate::kernels::cube::reduce_shared;
    use crate::kernels::cube_rows::{cube_row, cube_sum, row_cubes};
    use crate::value::unary_op::unary;

    /// Threads per cube (a power of two: the tree reductions halve it).
    const ROW_THREADS: u32 = 256;

    /// The op as a backend extension (CubeCL, and Autodiff over it).
    #[backend_extension(Cube, Autodiff)]
    pub trait MaskedSoftmaxOps: Backend {
        /// See [`super::masked_softmax`]; `keep` and `bias` have `x`'s shape (broadcast
        /// strides).
        fn masked_softmax_rows(
            x: FloatTensor<Self>,
            keep: FloatTensor<Self>,
            bias: FloatTensor<Self>,
            scale: f32,
            fill: f32,
        ) -> FloatTensor<Self>;
        /// `keep ? scale * y (g - sum(g y)) : 0` per row.
        fn masked_softmax_rows_backward(
            y: FloatTensor<Self>,
            g: FloatTensor<Self>,
            keep: FloatTensor<Self>,
            scale: f32,
        ) -> FloatTensor<Self>;
    }

    /// The offset in `of` (`x`'s shape, its own strides) of the first column of row `row`
    /// of the contiguous `x`.
    #[cube]
    pub(crate) fn row_offset(of: &Tensor<f32>, x: &Tensor<f32>, row: usize) -> usize {
        let mut rest = row;
        let mut at = 0usize;
        let mut d = x.rank() - 1;
        while d > 0 {
            d -= 1;
            let extent = x.shape(d);
            at += (rest % extent) * of.stride(d);
            rest /= extent;
        }
        at
    }

    /// The score softmax reads: `x * scale` where kept, `fill` elsewhere, plus the bias.
    #[cube]
    pub(crate) fn masked_score(x: f32, keep: f32, bias: f32, scale: f32, fill: f32) -> f32 {
        let mut z = fill;
        if keep != 0.0 {
            z = x * scale;
        }
        z + bias
    }

    /// The score at `x[i]` (its mask at `keep[k]`, its bias at `bias[b]`):
    /// [`masked_score`], or `x[i]` itself when not `masked` (the plain softmax, which reads
    /// no mask or bias).
    #[cube]
    #[allow(clippy::too_many_arguments)]
    fn score(
        x: &Tensor<f32>,
        keep: &Tensor<f32>,
        bias: &Tensor<f32>,
        i: usize,
        k: usize,
        b: usize,
        scale: f32,
        fill: f32,
        #[comptime] masked: bool,
    ) -> f32 {
        let mut z = x[i];
        if comptime![masked] {
            z = masked_score(z, keep[k], bias[b], scale, fill);
        }
        z
    }

    /// One cube per row of the contiguous `x`: `y = softmax(masked_score(x))` (of `x`
    /// when not `masked`) in `y`'s precision, computed in f32; with `with_lse`, the row's
    /// `max + ln(sum(exp(z - max)))` in `lse[row]`.
    #[cube(launch)]
    #[allow(clippy::too_many_arguments)]
    fn masked_softmax_forward_kernel<O: Float>(
        x: &Tensor<f32>,
        keep: &Tensor<f32>,
        bias: &Tensor<f32>,
        y: &mut Tensor<O>,
        lse: &mut Tensor<f32>,
        scale: f32,
        fill: f32,
        #[comptime] masked: bool,
        #[comptime] with_lse: bool,
        #[comptime] threads: u32,
        #[define(O)] _dtype: ElemType,
    ) {
        let cols = x.shape(x.rank() - 1);
        let rows = x.len() / cols;
        let row = cube_row();
        if row < rows {
            let base = row * cols;
            // Unmasked, `keep` and `bias` are `x` itself: offsets computed, never read.
            let (kbase, bbase) = (row_offset(keep, x, row), row_offset(bias, x, row));
            let (kstep, bstep) = (keep.stride(x.rank() - 1), bias.stride(x.rank() - 1));
            let unit = UNIT_POS_X as usize;
            let step = CUBE_DIM_X as usize;
            let mut shared = Shared::new_slice(threads as usize + 1);
            // Each thread starts from the row's first score (WGSL has no -inf literal).
            let mut local = score(x, keep, bias, base, kbase, bbase, scale, fill, masked);
            let mut j = unit;
            while j < cols {
                let (i, k, b) = (base + j, kbase + j * kstep, bbase + j * bstep);
                local = f32::max(local, score(x, keep, bias, i, k, b, scale, fill, masked));
                j += step;
            }
            shared[unit] = local;
            sync_cube();
            reduce_shared::<f32>(&mut shared, true);
            if unit == 0 {
                let m = shared[0];
                shared[threads as usize] = m;
            }
            sync_cube();
            let row_max = shared[threads as usize];
            let mut sum = f32::new(0.0);
            j = unit;
            while j < cols {
                let (i, k, b) = (base + j, kbase + j * kstep, bbase + j * bstep);
                sum += f32::exp(score(x, keep, bias, i, k, b, scale, fill, masked) - row_max);
                j += step;
            }
            let total = cube_sum(&mut shared, sum);
            if comptime![with_lse] {
                if unit == 0 {
                    lse[row] = row_max + f32::ln(total);
                }
            }
            j = unit;
            while j < cols {
                let (i, k, b) = (base + j, kbase + j * kstep, bbase + j * bstep);
                let z = score(x, keep, bias, i, k, b, scale, fill, masked);
                y[i] = O::cast_from(f32::exp(z - row_max) / total);
                j += step;
            }
        }
    }

    /// One cube per row: `dx = keep ? scale * y (g - sum(g y)) : 0` (`y (g - sum(g y))`
    /// when not `masked`).
    #[cube(launch)]
    fn masked_softmax_backward_kernel(
        y: &Tensor<f32>,
        g: &Tensor<f32>,
        keep: &Tensor<f32>,
        dx: &mut Tensor<f32>,
        scale: f32,
        #[comptime] masked: bool,
        #[comptime] threads: u32,
    ) {
        let cols = y.shape(y.rank() - 1);
        let rows = y.len() / cols;
        let row = cube_row();
        if row < rows {
            let base = row * cols;
            let kbase = row_offset(keep, y, row);
            let kstep = keep.stride(y.rank() - 1);
            let mut shared = Shared::new_slice(threads as usize);
            let mut dot = f32::new(0.0);
            let mut j = UNIT_POS_X as usize;
            while j < cols {
                dot += g[base + j] * y[base + j];
                j += CUBE_DIM_X as usize;
            }
            let dot = cube_sum(&mut shared, dot);
            j = UNIT_POS_X as usize;
            while j < cols {
                let mut d = y[base + j] * (g[base + j] - dot);
                if comptime![masked] {
                    d = scale * d;
                    if keep[kbase + j * kstep] == 0.0 {
                        d = f32::new(0.0);
                    }
                }
                dx[base + j] = d;
                j += CUBE_DIM_X as usize;
            }
        }
    }

    pub(crate) fn rows(x: &CubeTensor) -> usize {
        let shape = x.shape();
        let cols = shape.as_slice().last().copied().unwrap_or(1).max(1);
        shape.num_elements() / cols
    }

    fn empty_like(like: &CubeTensor) -> CubeTensor {
        empty_device_contiguous_dtype(
            like.client.clone(),
            like.device.clone(),
            like.shape(),
            like.dtype,
        )
    }

    /// The mask (1 keeps, 0 fills) and bias, each with the scores' shape (broadcast
    /// strides), the scale and the fill.
    pub(crate) struct Masking {
        pub keep: CubeTensor,
        pub bias: CubeTensor,
        pub scale: f32,
        pub fill: f32,
    }

    /// Softmax over the last axis of `x`, of its masked scores when `masking` is given.
    pub(crate) fn softmax_forward(x: CubeTensor, masking: Option<Masking>) -> CubeTensor {
        let dtype = x.dtype;
        softmax_forward_in(x, masking, dtype, false).0
    }

    /// [`softmax_forward`] written in `dtype` (computed in f32), and with `with_lse` each
    /// row's log-sum-exp (`[rows]`, f32).
    pub(crate) fn softmax_forward_in(
        x: CubeTensor,
        masking: Option<Masking>,
        dtype: DType,
        with_lse: bool,
    ) -> (CubeTensor, Option<CubeTensor>) {
        let x = into_contiguous(x);
        let y = empty_device_contiguous_dtype(x.client.clone(), x.device.clone(), x.shape(), dtype);
        let lse = with_lse.then(|| {
            let rows = Shape::new([rows(&x)]);
            empty_device_contiguous_dtype(x.client.clone(), x.device.clone(), rows, x.dtype)
        });
        let masked = masking.is_some();
        // Unmasked, the kernel reads no mask or bias: `x` stands in for both.
        let m = masking.unwrap_or_else(|| Masking {
            keep: x.clone(),
            bias: x.clone(),
            scale: 1.0,
            fill: 0.0,
        });
        // Without `with_lse`, `x` stands in for the log-sum-exps: never written.
        let lse_arg = lse.clone().unwrap_or_else(|| x.clone());
        masked_softmax_forward_kernel::launch(
            &x.client.clone(),
            row_cubes(rows(&x)),
            CubeDim::new_1d(ROW_THREADS),
            x.into_tensor_arg(),
            m.keep.into_tensor_arg(),
            m.bias.into_tensor_arg(),
            y.clone().into_tensor_arg(),
            lse_arg.into_tensor_arg(),
            m.scale,
            m.fill,
            masked,
            with_lse,
            ROW_THREADS,
            dtype_to_storage_type(dtype),
        );
        (y, lse)
    }

    /// The backward of [`softmax_forward`] from its output `y`; `keep` and `scale` those
    /// of the masking, if any.
    pub(crate) fn softmax_backward(
        y: CubeTensor,
        g: CubeTensor,
        masking: Option<(CubeTensor, f32)>,
    ) -> CubeTensor {
        let (y, g) = (into_contiguous(y), into_contiguous(g));
        let dx = empty_like(&y);
        let masked = masking.is_some();
        let (keep, scale) = masking.unwrap_or_else(|| (y.clone(), 1.0));
        masked_softmax_backward_kernel::launch(
            &y.client.clone(),
            row_cubes(rows(&y)),
            CubeDim::new_1d(ROW_THREADS),
            y.into_tensor_arg(),
            g.into_tensor_arg(),
            keep.into_tensor_arg(),
            dx.clone().into_tensor_arg(),
            scale,
            masked,
            ROW_THREADS,
        );
        dx
    }

    impl MaskedSoftmaxOps for Cube {
        fn masked_softmax_rows(
            x: FloatTensor<Self>,
            keep: FloatTensor<Self>,
            bias: FloatTensor<Self>,
            scale: f32,
            fill: f32,
        ) -> FloatTensor<Self> {
            let masking = Masking {
                keep,
                bias,
                scale,
                fill,
            };
            softmax_forward(x, Some(masking))
        }

        fn masked_softmax_rows_backward(
            y: FloatTensor<Self>,
            g: FloatTensor<Self>,
            keep: FloatTensor<Self>,
            scale: f32,
        ) -> FloatTensor<Self> {
            softmax_backward(y, g, Some((keep, scale)))
        }
    }

    impl<B: Backend + MaskedSoftmaxOps, C: CheckpointStrategy> MaskedSoftmaxOps for Autodiff<B, C> {
        fn masked_softmax_rows(
            x: FloatTensor<Self>,
            keep: FloatTensor<Self>,
            bias: FloatTensor<Self>,
            scale: f32,
            fill: f32,
        ) -> FloatTensor<Self> {
            let (keep, bias) = (keep.into_primitive(), bias.into_primitive());
            let kept = keep.clone();
            unary::<B, C, (FloatTensor<B>, FloatTensor<B>)>(
                x,
                move |x| B::masked_softmax_rows(x, keep, bias, scale, fill),
                move |_, y| (y.clone(), kept),
                move |(y, keep), g| B::masked_softmax_rows_backward(y, g, keep, scale),
            )
        }

        fn masked_softmax_rows_backward(
            y: FloatTensor<Self>,
            g: FloatTensor<Self>,
            keep: FloatTensor<Self>,
            scale: f32,
        ) -> FloatTensor<Self> {
            // Used inside the backward only (first-order autodiff).
            Self::from_inner(B::masked_softmax_rows_backward(
                y.into_primitive(),
                g.into_primitive(),
                keep.into_primitive(),
                scale,
            ))
        }
    }
}
