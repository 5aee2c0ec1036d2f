//! 2-D max pooling (f32) on the CPU with its own backward: planes in parallel, each
//! window's valid rows and columns worked out once per call instead of per element, and
//! no index tensor: the backward finds each window's maximum again (the first one in scan
//! order, NaN winning, as PyTorch and Burn pick it) and adds the gradient there. Other
//! dtypes and CubeCL devices use Burn's `max_pool2d`, the reference the tests hold this to.

use burn::backend::autodiff::Autodiff;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::flex::{Flex, FlexTensor};
use burn::backend::tensor::FloatTensor;
use burn::backend::{AutodiffBackend, Backend, TensorMetadata, backend_extension};
use burn::tensor::module::max_pool2d as burn_max_pool2d;
use burn::tensor::ops::MaxPoolOptions;
use burn::tensor::{DType, Tensor, TensorData};
use rayon::prelude::*;

use super::runs_cubecl;
use crate::unary_op::unary;

/// Max pooling of `x` `[N, C, H, W]`.
pub fn max_pool2d(x: Tensor<4>, options: MaxPoolOptions<2>) -> Tensor<4> {
    if x.dtype() != DType::F32 || runs_cubecl(&x.device()) {
        return burn_max_pool2d(x, options);
    }
    Tensor::from_dispatch(<burn::backend::Dispatch as PoolOps>::max_pool2d_fused(
        x.into_dispatch(),
        options,
    ))
}

/// The pooling as a backend extension (Flex, and Autodiff over it).
#[backend_extension(Flex, Autodiff)]
pub trait PoolOps: Backend {
    /// Max pooling.
    fn max_pool2d_fused(x: FloatTensor<Self>, options: MaxPoolOptions<2>) -> FloatTensor<Self>;
    /// The gradient of `x` from the output's gradient `grad`.
    fn max_pool2d_fused_backward(
        x: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        options: MaxPoolOptions<2>,
    ) -> FloatTensor<Self>;
}

/// The input rows (or columns) each output row (column) reads along one axis.
struct Axis {
    /// Per output position: the first input index and how many valid taps it reads.
    windows: Vec<(usize, usize)>,
    dilation: usize,
}

impl Axis {
    /// Output size as ONNX and PyTorch define it: with `ceil_mode` a last partial window
    /// is kept unless it would start in the end padding.
    fn new(
        input: usize,
        kernel: usize,
        pad: (usize, usize),
        stride: usize,
        dilation: usize,
        ceil: bool,
    ) -> Self {
        let span = dilation * (kernel - 1) + 1;
        let padded = input + pad.0 + pad.1;
        let out = if padded < span {
            0
        } else if ceil {
            let out = (padded - span).div_ceil(stride) + 1;
            if (out - 1) * stride >= input + pad.0 {
                out - 1
            } else {
                out
            }
        } else {
            (padded - span) / stride + 1
        };
        let windows = (0..out)
            .map(|o| {
                // Taps t with 0 <= o * stride + t * dilation - pad.0 < input.
                let origin = o * stride;
                let first = pad.0.saturating_sub(origin).div_ceil(dilation).min(kernel);
                let end = (input + pad.0)
                    .saturating_sub(origin)
                    .div_ceil(dilation)
                    .clamp(first, kernel);
                let start = (origin + first * dilation).saturating_sub(pad.0);
                (start, end - first)
            })
            .collect();
        Axis { windows, dilation }
    }

    fn len(&self) -> usize {
        self.windows.len()
    }
}

/// The output geometry of one pooling call.
struct Pooling {
    rows: Axis,
    cols: Axis,
    /// Input plane height and width.
    plane: [usize; 2],
}

impl Pooling {
    fn new(shape: &[usize], o: &MaxPoolOptions<2>) -> Self {
        let axis = |i: usize| {
            Axis::new(
                shape[2 + i],
                o.kernel_size[i],
                o.padding[i],
                o.stride[i],
                o.dilation[i],
                o.ceil_mode,
            )
        };
        Pooling {
            rows: axis(0),
            cols: axis(1),
            plane: [shape[2], shape[3]],
        }
    }

    /// `f(output index, input index of the window's maximum)` over one plane; windows with
    /// no valid tap give `None` (and the output -inf).
    fn argmax(&self, x: &[f32], mut f: impl FnMut(usize, Option<usize>)) {
        let w = self.plane[1];
        for (oy, &(y0, ny)) in self.rows.windows.iter().enumerate() {
            for (ox, &(x0, nx)) in self.cols.windows.iter().enumerate() {
                let best = (ny > 0 && nx > 0).then(|| {
                    let (dy, dx) = (self.rows.dilation * w, self.cols.dilation);
                    let (mut at, mut max) = (y0 * w + x0, x[y0 * w + x0]);
                    for ty in 0..ny {
                        let row = (y0 * w + x0) + ty * dy;
                        // A counted loop: `step_by` divides once per row, which cost more
                        // than the comparisons.
                        for tap in 0..nx {
                            let i = row + tap * dx;
                            let v = x[i];
                            // Selects, not a branch: which tap wins is data-dependent and
                            // a mispredicted branch per tap cost more than the compare.
                            let take = v > max || v.is_nan();
                            at = if take { i } else { at };
                            max = if take { v } else { max };
                        }
                    }
                    at
                });
                f(oy * self.cols.len() + ox, best);
            }
        }
    }
}

fn plane_sizes(shape: &[usize], p: &Pooling) -> (usize, usize) {
    (shape[2] * shape[3], p.rows.len() * p.cols.len())
}

impl PoolOps for Flex {
    fn max_pool2d_fused(x: FlexTensor, options: MaxPoolOptions<2>) -> FlexTensor {
        let (x, shape) = (x.to_contiguous(), x.shape().to_vec());
        let p = Pooling::new(&shape, &options);
        let (input_plane, output_plane) = plane_sizes(&shape, &p);
        let x: &[f32] = x.as_slice().expect("contiguous f32");
        let mut y = vec![f32::NEG_INFINITY; shape[0] * shape[1] * output_plane];
        if output_plane > 0 {
            y.par_chunks_mut(output_plane)
                .zip(x.par_chunks(input_plane))
                .for_each(|(y, x)| {
                    p.argmax(x, |o, i| {
                        if let Some(i) = i {
                            y[o] = x[i];
                        }
                    })
                });
        }
        let out = vec![shape[0], shape[1], p.rows.len(), p.cols.len()];
        FlexTensor::from_data(TensorData::new(y, out))
    }

    fn max_pool2d_fused_backward(
        x: FlexTensor,
        grad: FlexTensor,
        options: MaxPoolOptions<2>,
    ) -> FlexTensor {
        let (x, shape) = (x.to_contiguous(), x.shape().to_vec());
        let grad = grad.to_contiguous();
        let p = Pooling::new(&shape, &options);
        let (input_plane, output_plane) = plane_sizes(&shape, &p);
        let (x, g): (&[f32], &[f32]) = (
            x.as_slice().expect("contiguous f32"),
            grad.as_slice().expect("contiguous f32"),
        );
        let mut dx = vec![0f32; x.len()];
        if output_plane > 0 {
            dx.par_chunks_mut(input_plane)
                .zip(x.par_chunks(input_plane).zip(g.par_chunks(output_plane)))
                .for_each(|(dx, (x, g))| {
                    p.argmax(x, |o, i| {
                        if let Some(i) = i {
                            dx[i] += g[o];
                        }
                    })
                });
        }
        FlexTensor::from_data(TensorData::new(dx, shape))
    }
}

impl<B: Backend + PoolOps, C: CheckpointStrategy> PoolOps for Autodiff<B, C> {
    fn max_pool2d_fused(x: FloatTensor<Self>, options: MaxPoolOptions<2>) -> FloatTensor<Self> {
        let forward_options = options.clone();
        unary::<B, C, FloatTensor<B>>(
            x,
            |x| B::max_pool2d_fused(x, forward_options),
            |x, _| x.clone(),
            move |x, g| B::max_pool2d_fused_backward(x, g, options),
        )
    }

    fn max_pool2d_fused_backward(
        x: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        options: MaxPoolOptions<2>,
    ) -> FloatTensor<Self> {
        // Reached through the backward above on the inner backend; as a forward op of its
        // own it is not differentiated again (first-order autodiff).
        Autodiff::<B, C>::from_inner(B::max_pool2d_fused_backward(
            x.into_primitive(),
            grad.into_primitive(),
            options,
        ))
    }
}
