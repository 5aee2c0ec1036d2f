//! Layer normalisation of the rows of a `[rows, cols]` f32 tensor as one op with its own
//! backward: `y = (x - mean) * rstd * scale + bias` per row. On the CPU's Flex backend one
//! pass for the statistics (f64 lane sums) and one for the output; backward in one sweep
//! over row blocks giving `dx`, and per-block partial sums of `dscale` and `dbias`. On
//! CubeCL devices one launch forward, and back one for `dx`, one for the partial sums and
//! one sum of both (`cube_rows.rs`). Burn's composition (mean, subtract, square, mean, add,
//! sqrt, divide, multiply, add, each broadcast at rank 6, and ~20 ops back) took ~0.15 ms
//! forward per LayerNormalization of gpt2_tiny on the CPU, and ~30 launches a layer norm
//! on a GPU; the forward saves only `x` and each row's `(mean, rstd)`. Other dtypes keep
//! Burn's composition (`ops/normalization.rs`), which is also the reference the tests hold
//! this one to.

#[cfg(any(feature = "wgpu", feature = "cuda"))]
use burn::backend::Cube;
use burn::backend::autodiff::Autodiff;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::flex::{Flex, FlexTensor};
use burn::backend::ops::FloatTensorOps;
use burn::backend::tensor::FloatTensor;
use burn::backend::{AutodiffBackend, Backend, TensorMetadata, backend_extension};
use burn::tensor::{DType, FloatDType, Tensor, TensorData};
use rayon::prelude::*;

#[cfg(any(feature = "wgpu", feature = "cuda"))]
use super::cube_rows;
use super::simd::{self, Kernel};

/// Rows per parallel block of the backward (each block sums its own `dscale`, `dbias`).
const BLOCK_ROWS: usize = 32;

/// Whether the fused op serves `x`: f32 (on the CPU or a CubeCL device).
pub fn layer_norm_fused_here(x: &Tensor<2>) -> bool {
    x.dtype() == DType::F32
}

/// `(x - mean) / sqrt(var + eps) * scale + bias` over each row of `x` (`scale` and `bias`
/// of the row length).
pub fn layer_norm(x: Tensor<2>, scale: Tensor<1>, bias: Tensor<1>, eps: f32) -> Tensor<2> {
    layer_norm_in(x, scale, bias, eps, FloatDType::F32)
}

/// [`layer_norm`] with the output written in `out` (f32, or a low precision whose readers
/// take it so: the products after a norm, `crate::model::activation_precision`); the
/// statistics and the gradients of `x`, `scale` and `bias` stay f32.
pub fn layer_norm_in(
    x: Tensor<2>,
    scale: Tensor<1>,
    bias: Tensor<1>,
    eps: f32,
    out: FloatDType,
) -> Tensor<2> {
    Tensor::from_dispatch(<burn::backend::Dispatch as LayerNormOps>::layer_norm_rows(
        x.into_dispatch(),
        scale.into_dispatch(),
        bias.into_dispatch(),
        eps,
        out,
    ))
}

/// The op as a backend extension (CubeCL, Flex, and Autodiff over them).
#[backend_extension(Cube: cfg(any(feature = "wgpu", feature = "cuda")), Flex, Autodiff)]
pub trait LayerNormOps: Backend {
    /// The normalised rows, in `out`.
    fn layer_norm_rows(
        x: FloatTensor<Self>,
        scale: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        eps: f32,
        out: FloatDType,
    ) -> FloatTensor<Self>;
    /// The normalised rows (in `out`) and each row's `[mean, rstd]` (`[rows, 2]`, f32).
    fn layer_norm_rows_with_stats(
        x: FloatTensor<Self>,
        scale: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        eps: f32,
        out: FloatDType,
    ) -> (FloatTensor<Self>, FloatTensor<Self>);
    /// `(dx, dscale, dbias)` (f32) for output gradient `g` (in the output's precision).
    fn layer_norm_rows_backward(
        x: FloatTensor<Self>,
        scale: FloatTensor<Self>,
        stats: FloatTensor<Self>,
        g: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>);
}

/// A contiguous copy (or view) of `t`.
fn host(t: &FlexTensor) -> FlexTensor {
    t.to_contiguous()
}

fn values(t: &FlexTensor) -> &[f32] {
    t.as_slice().expect("contiguous f32")
}

fn output(values: Vec<f32>, shape: Vec<usize>) -> FlexTensor {
    FlexTensor::from_data(TensorData::new(values, shape))
}

/// One row forward; returns `(mean, rstd)`.
struct NormRow<'a> {
    y: &'a mut [f32],
    x: &'a [f32],
    scale: &'a [f32],
    bias: &'a [f32],
    eps: f32,
}

impl Kernel for NormRow<'_> {
    type Output = (f32, f32);
    #[inline(always)]
    fn run(self) -> (f32, f32) {
        let NormRow {
            y,
            x,
            scale,
            bias,
            eps,
        } = self;
        let n = x.len().max(1) as f64;
        let mean = (simd::sum_f64(x) / n) as f32;
        let var = simd::sum_map_f64(x, |v| (v - mean) * (v - mean)) / n;
        let rstd = (1.0 / (var + f64::from(eps)).sqrt()) as f32;
        for (((y, &x), &s), &b) in y.iter_mut().zip(x).zip(scale).zip(bias) {
            *y = (x - mean) * rstd * s + b;
        }
        (mean, rstd)
    }
}

/// One row backward: `dx` into `dx`, `g * xhat` and `g` added to `dscale`, `dbias` (f64);
/// `h` is scratch of the row length.
struct NormRowBackward<'a> {
    dx: &'a mut [f32],
    dscale: &'a mut [f64],
    dbias: &'a mut [f64],
    h: &'a mut [f32],
    x: &'a [f32],
    g: &'a [f32],
    scale: &'a [f32],
    mean: f32,
    rstd: f32,
}

impl Kernel for NormRowBackward<'_> {
    type Output = ();
    #[inline(always)]
    fn run(self) {
        let NormRowBackward {
            dx,
            dscale,
            dbias,
            h,
            x,
            g,
            scale,
            mean,
            rstd,
        } = self;
        // xhat into dx, dxhat = g * scale into h, the parameter gradients accumulated.
        for (((((xh, h), ds), db), &x), (&g, &s)) in dx
            .iter_mut()
            .zip(h.iter_mut())
            .zip(dscale.iter_mut())
            .zip(dbias.iter_mut())
            .zip(x)
            .zip(g.iter().zip(scale))
        {
            *xh = (x - mean) * rstd;
            *h = g * s;
            *ds += f64::from(g * *xh);
            *db += f64::from(g);
        }
        let n = dx.len().max(1) as f64;
        let a = (simd::sum_f64(h) / n) as f32;
        let b = (simd::dot_f64(h, dx) / n) as f32;
        for (dx, &h) in dx.iter_mut().zip(h.iter()) {
            *dx = rstd * (h - a - *dx * b);
        }
    }
}

impl LayerNormOps for Flex {
    fn layer_norm_rows(
        x: FloatTensor<Self>,
        scale: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        eps: f32,
        out: FloatDType,
    ) -> FloatTensor<Self> {
        Self::layer_norm_rows_with_stats(x, scale, bias, eps, out).0
    }

    fn layer_norm_rows_with_stats(
        x: FloatTensor<Self>,
        scale: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        eps: f32,
        out: FloatDType,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let shape = x.shape().to_vec();
        let (x, scale, bias) = (host(&x), host(&scale), host(&bias));
        let (xs, s, b) = (values(&x), values(&scale), values(&bias));
        let cols = shape[1].max(1);
        let mut y = vec![0f32; xs.len()];
        let mut stats = vec![0f32; 2 * shape[0]];
        y.par_chunks_mut(cols)
            .zip(xs.par_chunks(cols))
            .zip(stats.par_chunks_mut(2))
            .for_each(|((y, x), st)| {
                let (mean, rstd) = simd::vectorized(NormRow {
                    y,
                    x,
                    scale: s,
                    bias: b,
                    eps,
                });
                st.copy_from_slice(&[mean, rstd]);
            });
        let mut y = output(y, shape.clone());
        if out != FloatDType::F32 {
            y = Flex::float_cast(y, out);
        }
        (y, output(stats, vec![shape[0], 2]))
    }

    fn layer_norm_rows_backward(
        x: FloatTensor<Self>,
        scale: FloatTensor<Self>,
        stats: FloatTensor<Self>,
        g: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        let shape = x.shape().to_vec();
        let g = match g.dtype() {
            DType::F32 => g,
            _ => Flex::float_cast(g, FloatDType::F32),
        };
        let (x, scale, stats, g) = (host(&x), host(&scale), host(&stats), host(&g));
        let (xs, s, st, gs) = (values(&x), values(&scale), values(&stats), values(&g));
        let cols = shape[1].max(1);
        let block = BLOCK_ROWS * cols;
        let mut dx = vec![0f32; xs.len()];
        let zeros = || (vec![0f64; cols], vec![0f64; cols]);
        let (dscale, dbias) = dx
            .par_chunks_mut(block)
            .zip(xs.par_chunks(block).zip(gs.par_chunks(block)))
            .zip(st.par_chunks(2 * BLOCK_ROWS))
            .map(|((dx, (x, g)), st)| {
                let (mut ds, mut db) = zeros();
                let mut h = vec![0f32; cols];
                let rows = dx
                    .chunks_mut(cols)
                    .zip(x.chunks(cols).zip(g.chunks(cols)))
                    .zip(st.chunks(2));
                for ((dx, (x, g)), st) in rows {
                    simd::vectorized(NormRowBackward {
                        dx,
                        dscale: &mut ds,
                        dbias: &mut db,
                        h: &mut h,
                        x,
                        g,
                        scale: s,
                        mean: st[0],
                        rstd: st[1],
                    });
                }
                (ds, db)
            })
            .reduce(zeros, |(mut a, mut b), (c, d)| {
                a.iter_mut().zip(c).for_each(|(a, c)| *a += c);
                b.iter_mut().zip(d).for_each(|(b, d)| *b += d);
                (a, b)
            });
        let narrow = |v: Vec<f64>| v.into_iter().map(|v| v as f32).collect();
        (
            output(dx, shape),
            output(narrow(dscale), vec![cols]),
            output(narrow(dbias), vec![cols]),
        )
    }
}

#[cfg(any(feature = "wgpu", feature = "cuda"))]
impl LayerNormOps for Cube {
    fn layer_norm_rows(
        x: FloatTensor<Self>,
        scale: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        eps: f32,
        out: FloatDType,
    ) -> FloatTensor<Self> {
        cube_rows::layer_norm_forward(x, scale, bias, eps, out.into()).0
    }

    fn layer_norm_rows_with_stats(
        x: FloatTensor<Self>,
        scale: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        eps: f32,
        out: FloatDType,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        cube_rows::layer_norm_forward(x, scale, bias, eps, out.into())
    }

    fn layer_norm_rows_backward(
        x: FloatTensor<Self>,
        scale: FloatTensor<Self>,
        stats: FloatTensor<Self>,
        g: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        use burn::backend::Shape;
        use burn::backend::ops::FloatTensorOps;
        let cols = x.shape()[1];
        let (dx, partials) = cube_rows::layer_norm_backward(x, scale, stats, g);
        let sums = Cube::float_sum_dim(partials, 0);
        let part = |from: usize| {
            let sum = Cube::float_slice(sums.clone(), &[(0..1).into(), (from..from + cols).into()]);
            Cube::float_reshape(sum, Shape::new([cols]))
        };
        (dx, part(0), part(cols))
    }
}

/// The backward of [`LayerNormOps::layer_norm_rows`]; keeps `x`, `scale` and the row
/// statistics.
#[derive(Debug)]
struct LayerNormBackward;

impl<B: Backend + LayerNormOps> Backward<B, 3> for LayerNormBackward {
    type State = (FloatTensor<B>, FloatTensor<B>, FloatTensor<B>);

    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [x_node, scale_node, bias_node] = ops.parents;
        let g = grads.consume::<B>(&ops.node);
        let (x, scale, stats) = ops.state;
        let (dx, dscale, dbias) = B::layer_norm_rows_backward(x, scale, stats, g);
        for (node, grad) in [(x_node, dx), (scale_node, dscale), (bias_node, dbias)] {
            if let Some(node) = node {
                grads.register::<B>(node.id, grad);
            }
        }
    }
}

impl<B: Backend + LayerNormOps, C: CheckpointStrategy> LayerNormOps for Autodiff<B, C> {
    fn layer_norm_rows(
        x: FloatTensor<Self>,
        scale: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        eps: f32,
        out: FloatDType,
    ) -> FloatTensor<Self> {
        match LayerNormBackward
            .prepare::<C>([x.node(), scale.node(), bias.node()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let (x, scale, bias) = (
                    x.into_primitive(),
                    scale.into_primitive(),
                    bias.into_primitive(),
                );
                let (y, stats) =
                    B::layer_norm_rows_with_stats(x.clone(), scale.clone(), bias, eps, out);
                prep.finish((x, scale, stats), y)
            }
            OpsKind::UnTracked(prep) => prep.finish(B::layer_norm_rows(
                x.into_primitive(),
                scale.into_primitive(),
                bias.into_primitive(),
                eps,
                out,
            )),
        }
    }

    fn layer_norm_rows_with_stats(
        x: FloatTensor<Self>,
        scale: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        eps: f32,
        out: FloatDType,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let (y, stats) = B::layer_norm_rows_with_stats(
            x.into_primitive(),
            scale.into_primitive(),
            bias.into_primitive(),
            eps,
            out,
        );
        (Self::from_inner(y), Self::from_inner(stats))
    }

    fn layer_norm_rows_backward(
        x: FloatTensor<Self>,
        scale: FloatTensor<Self>,
        stats: FloatTensor<Self>,
        g: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        let (dx, ds, db) = B::layer_norm_rows_backward(
            x.into_primitive(),
            scale.into_primitive(),
            stats.into_primitive(),
            g.into_primitive(),
        );
        (
            Self::from_inner(dx),
            Self::from_inner(ds),
            Self::from_inner(db),
        )
    }
}
