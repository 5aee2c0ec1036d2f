//! 2-D convolution (one group, f32) on the CPU as im2col + GEMM per image, with its own
//! backward: the output of image `b` is `W [Cout, K] x col_b [K, OH*OW]` written straight
//! into NCHW (no layout changes), the bias (and a following ReLU) added in one pass over
//! the image's output while it is in cache; the weight gradient is `sum_b dY_b x col_b^T`
//! (`col_b^T` copied row-major first where the GEMM would read it along its inner
//! dimension), the input gradient `col2im(W^T x dY_b)`. A 1x1 convolution with stride 1
//! and no padding uses the image itself as `col_b`. The ReLU's gradient mask comes from the
//! saved output. Images run in parallel, each GEMM on one core; with fewer images than
//! cores the GEMMs split instead. Other group counts, dtypes and CubeCL devices use Burn's
//! `conv2d`, which is also the reference the tests hold this to.

use std::mem::MaybeUninit;

use burn::backend::autodiff::Autodiff;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::flex::{Flex, FlexTensor};
use burn::backend::tensor::FloatTensor;
use burn::backend::{AutodiffBackend, Backend, TensorMetadata, backend_extension};
use burn::tensor::activation;
use burn::tensor::module::conv2d as burn_conv2d;
use burn::tensor::ops::ConvOptions;
use burn::tensor::{DType, Tensor, TensorData};
use gemm::Parallelism;
use rayon::prelude::*;

use super::runs_cubecl;
use super::simd::{self, Kernel};
use super::transpose::transpose;

/// `conv2d(x, weight) + bias` (`x` `[N, Cin, H, W]`, `weight` `[Cout, Cin / groups, KH, KW]`),
/// then `relu` if asked.
pub fn conv2d(
    x: Tensor<4>,
    weight: Tensor<4>,
    bias: Option<Tensor<1>>,
    options: ConvOptions<2>,
    relu: bool,
) -> Tensor<4> {
    let fused = x.dtype() == DType::F32
        && weight.dtype() == DType::F32
        && bias.as_ref().is_none_or(|b| b.dtype() == DType::F32)
        && options.groups == 1
        && !runs_cubecl(&x.device());
    if !fused {
        let y = burn_conv2d(x, weight, bias, options);
        return if relu { activation::relu(y) } else { y };
    }
    let bias = bias.unwrap_or_else(|| Tensor::zeros([weight.dims()[0]], &weight.device()));
    Tensor::from_dispatch(<burn::backend::Dispatch as ConvOps>::conv2d_gemm(
        x.into_dispatch(),
        weight.into_dispatch(),
        bias.into_dispatch(),
        options,
        relu,
    ))
}

/// The convolution as a backend extension (Flex, and Autodiff over it).
#[backend_extension(Flex, Autodiff)]
pub trait ConvOps: Backend {
    /// `conv2d(x, weight) + bias`, one group, then `relu` if asked.
    fn conv2d_gemm(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        options: ConvOptions<2>,
        relu: bool,
    ) -> FloatTensor<Self>;
    /// The gradient of `x` (whose shape `x` gives) from the output's gradient `grad`.
    fn conv2d_gemm_x_grad(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        options: ConvOptions<2>,
    ) -> FloatTensor<Self>;
    /// The gradient of `weight` from the output's gradient `grad`.
    fn conv2d_gemm_weight_grad(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        options: ConvOptions<2>,
    ) -> FloatTensor<Self>;
    /// The gradient of the bias: `grad` summed over images and pixels.
    fn conv2d_gemm_bias_grad(grad: FloatTensor<Self>) -> FloatTensor<Self>;
}

/// The sizes of one convolution.
#[derive(Debug, Clone, Copy)]
struct Geometry {
    n: usize,
    cin: usize,
    h: usize,
    w: usize,
    cout: usize,
    kh: usize,
    kw: usize,
    oh: usize,
    ow: usize,
    stride: [usize; 2],
    pad: [usize; 2],
    dilation: [usize; 2],
}

impl Geometry {
    fn new(x: &[usize], weight: &[usize], o: &ConvOptions<2>) -> Self {
        let out = |i: usize, size: usize, k: usize| {
            let span = o.dilation[i] * (k - 1) + 1;
            (size + o.padding[i].0 + o.padding[i].1 - span) / o.stride[i] + 1
        };
        Geometry {
            n: x[0],
            cin: x[1],
            h: x[2],
            w: x[3],
            cout: weight[0],
            kh: weight[2],
            kw: weight[3],
            oh: out(0, x[2], weight[2]),
            ow: out(1, x[3], weight[3]),
            stride: o.stride,
            pad: [o.padding[0].0, o.padding[1].0],
            dilation: o.dilation,
        }
    }

    /// Rows of `col`: one per input channel and kernel position.
    fn k(&self) -> usize {
        self.cin * self.kh * self.kw
    }

    /// Columns of `col`: output pixels of one image.
    fn pixels(&self) -> usize {
        self.oh * self.ow
    }

    /// Whether an image is its own `col` (1x1 kernel, stride 1, no padding).
    fn pointwise(&self) -> bool {
        self.kh == 1 && self.kw == 1 && self.stride == [1, 1] && self.pad == [0, 0]
    }

    /// Outputs `o` in `lo..hi` read input `o * stride + offset - pad` inside `0..size`.
    fn valid(out: usize, size: usize, stride: usize, offset: usize, pad: usize) -> (usize, usize) {
        let lo = pad.saturating_sub(offset).div_ceil(stride).min(out);
        let hi = (size + pad)
            .saturating_sub(offset)
            .div_ceil(stride)
            .clamp(lo, out);
        (lo, hi)
    }

    /// Visit every `col` row segment of one image: `f(cols, Some((start, step)))` where
    /// `col` positions `cols` read the input from `start` by `step`, `f(cols, None)` where
    /// they fall in the padding.
    fn for_each_segment(&self, mut f: impl FnMut(std::ops::Range<usize>, Option<(usize, usize)>)) {
        let [sh, sw] = self.stride;
        let [dh, dw] = self.dilation;
        let p = self.pixels();
        for c in 0..self.cin {
            for ki in 0..self.kh {
                let (ylo, yhi) = Self::valid(self.oh, self.h, sh, ki * dh, self.pad[0]);
                for kj in 0..self.kw {
                    let row = ((c * self.kh + ki) * self.kw + kj) * p;
                    let (xlo, xhi) = Self::valid(self.ow, self.w, sw, kj * dw, self.pad[1]);
                    f(row..row + ylo * self.ow, None);
                    f(row + yhi * self.ow..row + p, None);
                    for oy in ylo..yhi {
                        let seg = row + oy * self.ow;
                        let iy = oy * sh + ki * dh - self.pad[0];
                        f(seg..seg + xlo, None);
                        f(seg + xhi..seg + self.ow, None);
                        if xlo < xhi {
                            let ix = xlo * sw + kj * dw - self.pad[1];
                            f(
                                seg + xlo..seg + xhi,
                                Some(((c * self.h + iy) * self.w + ix, sw)),
                            );
                        }
                    }
                }
            }
        }
    }

    /// `col` `[K, OH*OW]` of one image `x` `[Cin, H, W]`.
    fn im2col(&self, x: &[f32], col: &mut [f32]) {
        self.for_each_segment(|cols, source| {
            let out = &mut col[cols];
            match source {
                None => out.fill(0.0),
                Some((start, 1)) => out.copy_from_slice(&x[start..start + out.len()]),
                Some((start, step)) => {
                    for (j, o) in out.iter_mut().enumerate() {
                        *o = x[start + j * step];
                    }
                }
            }
        });
    }

    /// Add `col` `[K, OH*OW]` back onto the image gradient `dx` `[Cin, H, W]`.
    fn col2im(&self, col: &[f32], dx: &mut [f32]) {
        self.for_each_segment(|cols, source| {
            if let Some((start, step)) = source {
                for (j, v) in col[cols].iter().enumerate() {
                    dx[start + j * step] += *v;
                }
            }
        });
    }
}

/// A matrix operand: values, row stride, column stride.
type Operand<'a> = (&'a [f32], isize, isize);

/// `dst [m, n] (+)= a [m, k] x b [k, n]` (row-major `dst`; added to when `accumulate`).
fn matmul(
    dims: [usize; 3],
    dst: &mut [f32],
    accumulate: bool,
    a: Operand,
    b: Operand,
    parallelism: Parallelism,
) {
    gemm_into(dims, uninit(dst), accumulate, a, b, parallelism);
}

/// `dst [m, n] (+)= a [m, k] x b [k, n]` into storage that is read only when `accumulate`
/// (then it must hold values), and holds the product afterwards.
fn gemm_into(
    dims: [usize; 3],
    dst: &mut [MaybeUninit<f32>],
    accumulate: bool,
    a: Operand,
    b: Operand,
    parallelism: Parallelism,
) {
    let [m, n, k] = dims;
    assert!(dst.len() >= m * n, "matmul destination too small");
    // SAFETY: every operand's extent was sized by the caller for these strides; `dst` is
    // exclusively borrowed and holds `m * n` values in rows of `n`, read only when
    // `accumulate` (when the caller initialised them).
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr().cast(),
            1,
            n as isize,
            accumulate,
            a.0.as_ptr(),
            a.2,
            a.1,
            b.0.as_ptr(),
            b.2,
            b.1,
            1.0,
            1.0,
            false,
            false,
            false,
            parallelism,
        );
    }
}

/// `y += bias` per channel row, then `relu` when asked, in one vectorized pass.
struct BiasRelu<'a> {
    y: &'a mut [f32],
    bias: &'a [f32],
    relu: bool,
}

impl Kernel for BiasRelu<'_> {
    type Output = ();
    #[inline(always)]
    fn run(self) {
        let p = self.y.len() / self.bias.len().max(1);
        for (row, &b) in self.y.chunks_mut(p.max(1)).zip(self.bias) {
            if self.relu {
                // `< 0` rather than `max`: NaN stays NaN, as in Burn's `relu`.
                row.iter_mut().for_each(|v| {
                    let s = *v + b;
                    *v = if s < 0.0 { 0.0 } else { s };
                });
            } else {
                row.iter_mut().for_each(|v| *v += b);
            }
        }
    }
}

/// Images run in parallel with one core per GEMM when there are enough of them; otherwise
/// each GEMM uses every core.
fn gemm_parallelism(images: usize) -> Parallelism {
    if images >= rayon::current_num_threads() {
        Parallelism::None
    } else {
        Parallelism::Rayon(0)
    }
}

/// A scratch buffer of `len` values, reused by the thread (taken out while in use, so a
/// task stolen during a nested parallel GEMM gets a fresh one).
fn with_scratch<R>(len: usize, f: impl FnOnce(&mut [f32]) -> R) -> R {
    thread_local! {
        static SCRATCH: std::cell::Cell<Vec<f32>> = const { std::cell::Cell::new(Vec::new()) };
    }
    let mut buf = SCRATCH.take();
    if buf.len() < len {
        buf = vec![0.0; len];
    }
    let out = f(&mut buf[..len]);
    SCRATCH.set(buf);
    out
}

/// `buf` as storage to be overwritten (or read and updated) in place.
fn uninit(buf: &mut [f32]) -> &mut [MaybeUninit<f32>] {
    // SAFETY: `f32` and `MaybeUninit<f32>` have one layout, and only `f32` values are
    // written through the result, so `buf` stays initialised.
    unsafe { &mut *(buf as *mut [f32] as *mut [MaybeUninit<f32>]) }
}

fn values(t: &FlexTensor) -> (FlexTensor, Vec<usize>) {
    (t.to_contiguous(), t.shape().to_vec())
}

fn slice(t: &FlexTensor) -> &[f32] {
    t.as_slice().expect("contiguous f32")
}

fn tensor(values: Vec<f32>, shape: Vec<usize>) -> FlexTensor {
    FlexTensor::from_data(TensorData::new(values, shape))
}

impl ConvOps for Flex {
    fn conv2d_gemm(
        x: FlexTensor,
        weight: FlexTensor,
        bias: FlexTensor,
        options: ConvOptions<2>,
        relu: bool,
    ) -> FlexTensor {
        let ((x, xs), (weight, ws), (bias, _)) = (values(&x), values(&weight), values(&bias));
        let g = Geometry::new(&xs, &ws, &options);
        let (x, weight, bias) = (slice(&x), slice(&weight), slice(&bias));
        let (k, p) = (g.k(), g.pixels());
        let par = gemm_parallelism(g.n);
        let len = g.n * g.cout * p;
        let mut y: Vec<f32> = Vec::with_capacity(len);
        y.spare_capacity_mut()[..len]
            .par_chunks_mut(g.cout * p)
            .zip(x.par_chunks(g.cin * g.h * g.w))
            .for_each(|(y, x)| {
                let w = (weight, k as isize, 1);
                if g.pointwise() {
                    gemm_into([g.cout, p, k], y, false, w, (x, p as isize, 1), par);
                } else {
                    with_scratch(k * p, |col| {
                        g.im2col(x, col);
                        gemm_into([g.cout, p, k], y, false, w, (col, p as isize, 1), par);
                    });
                }
                // SAFETY: the GEMM wrote all of this image's values.
                let y = unsafe { &mut *(y as *mut [MaybeUninit<f32>] as *mut [f32]) };
                simd::vectorized(BiasRelu { y, bias, relu });
            });
        // SAFETY: every image's chunk was written above.
        unsafe { y.set_len(len) };
        tensor(y, vec![g.n, g.cout, g.oh, g.ow])
    }

    fn conv2d_gemm_x_grad(
        x: FlexTensor,
        weight: FlexTensor,
        grad: FlexTensor,
        options: ConvOptions<2>,
    ) -> FlexTensor {
        let xs = x.shape().to_vec();
        let ((weight, ws), (grad, _)) = (values(&weight), values(&grad));
        let g = Geometry::new(&xs, &ws, &options);
        let (weight, grad) = (slice(&weight), slice(&grad));
        let (k, p) = (g.k(), g.pixels());
        let par = gemm_parallelism(g.n);
        // W^T [K, Cout]: element (r, c) at weight[c * K + r].
        let wt = (weight, 1, k as isize);
        let mut dx = vec![0f32; g.n * g.cin * g.h * g.w];
        dx.par_chunks_mut(g.cin * g.h * g.w)
            .zip(grad.par_chunks(g.cout * p))
            .for_each(|(dx, dy)| {
                let dy = (dy, p as isize, 1);
                if g.pointwise() {
                    matmul([k, p, g.cout], dx, false, wt, dy, par);
                } else {
                    with_scratch(k * p, |col| {
                        matmul([k, p, g.cout], col, false, wt, dy, par);
                        g.col2im(col, dx);
                    });
                }
            });
        tensor(dx, xs)
    }

    fn conv2d_gemm_weight_grad(
        x: FlexTensor,
        weight: FlexTensor,
        grad: FlexTensor,
        options: ConvOptions<2>,
    ) -> FlexTensor {
        let ws = weight.shape().to_vec();
        let ((x, xs), (grad, _)) = (values(&x), values(&grad));
        let g = Geometry::new(&xs, &ws, &options);
        let (x, grad) = (slice(&x), slice(&grad));
        let (k, p) = (g.k(), g.pixels());
        let par = gemm_parallelism(g.n);
        // One partial sum per group of images, the groups in parallel, then added up.
        let groups = g.n.clamp(1, rayon::current_num_threads());
        let per_group = g.n.div_ceil(groups);
        let dw = (0..groups)
            .into_par_iter()
            .map(|group| {
                let mut dw = vec![0f32; g.cout * k];
                let images = group * per_group..((group + 1) * per_group).min(g.n);
                for (i, b) in images.enumerate() {
                    let dy = (&grad[b * g.cout * p..(b + 1) * g.cout * p], p as isize, 1);
                    let x = &x[b * g.cin * g.h * g.w..(b + 1) * g.cin * g.h * g.w];
                    with_scratch(2 * k * p, |scratch| {
                        let (col, col_t) = scratch.split_at_mut(k * p);
                        let col: &[f32] = if g.pointwise() {
                            x
                        } else {
                            g.im2col(x, col);
                            col
                        };
                        // `col^T [P, K]`: read through strides (element (r, c) at
                        // `col[c * P + r]`), or copied row-major first when the GEMM's
                        // inner dimension P is at least its width K (the GEMM packs a
                        // right-hand side stored along its inner dimension slowly).
                        let col_t: Operand = if p >= k {
                            transpose(col, k, p, p, uninit(col_t), false);
                            (col_t, k as isize, 1)
                        } else {
                            (col, 1, p as isize)
                        };
                        matmul([g.cout, k, p], &mut dw, i > 0, dy, col_t, par);
                    });
                }
                dw
            })
            .reduce_with(|mut a, b| {
                a.iter_mut().zip(&b).for_each(|(a, b)| *a += b);
                a
            })
            .unwrap_or_else(|| vec![0f32; g.cout * k]);
        tensor(dw, ws)
    }

    fn conv2d_gemm_bias_grad(grad: FlexTensor) -> FlexTensor {
        let (grad, gs) = values(&grad);
        let (n, cout, p) = (gs[0], gs[1], gs[2] * gs[3]);
        let grad = slice(&grad);
        // Channels in parallel; each image's row summed in eight f32 lanes, rows in f64.
        let db: Vec<f32> = (0..cout)
            .into_par_iter()
            .map(|c| {
                let rows = (0..n).map(|b| &grad[(b * cout + c) * p..(b * cout + c + 1) * p]);
                rows.map(|row| {
                    let mut lanes = [0f32; 8];
                    let mut chunks = row.chunks_exact(8);
                    for chunk in &mut chunks {
                        lanes.iter_mut().zip(chunk).for_each(|(l, v)| *l += v);
                    }
                    lanes
                        .iter_mut()
                        .zip(chunks.remainder())
                        .for_each(|(l, v)| *l += v);
                    lanes.iter().map(|&l| f64::from(l)).sum::<f64>()
                })
                .sum::<f64>() as f32
            })
            .collect();
        tensor(db, vec![cout])
    }
}

/// The backward: each tracked parent's gradient from the output's.
#[derive(Debug)]
struct ConvBackward;

impl<B: Backend + ConvOps> Backward<B, 3> for ConvBackward {
    /// Input, weight, options, and the output when a ReLU was applied (its mask).
    type State = (
        FloatTensor<B>,
        FloatTensor<B>,
        ConvOptions<2>,
        Option<FloatTensor<B>>,
    );

    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [x_node, w_node, b_node] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        let (x, weight, options, relu_output) = ops.state;
        let grad = match relu_output {
            Some(y) => B::relu_backward(y, grad),
            None => grad,
        };
        if let Some(node) = x_node {
            let dx =
                B::conv2d_gemm_x_grad(x.clone(), weight.clone(), grad.clone(), options.clone());
            grads.register::<B>(node.id, dx);
        }
        if let Some(node) = w_node {
            let dw = B::conv2d_gemm_weight_grad(x, weight, grad.clone(), options);
            grads.register::<B>(node.id, dw);
        }
        if let Some(node) = b_node {
            grads.register::<B>(node.id, B::conv2d_gemm_bias_grad(grad));
        }
    }
}

impl<B: Backend + ConvOps, C: CheckpointStrategy> ConvOps for Autodiff<B, C> {
    fn conv2d_gemm(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        options: ConvOptions<2>,
        relu: bool,
    ) -> FloatTensor<Self> {
        match ConvBackward
            .prepare::<C>([x.node(), weight.node(), bias.node()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let (xp, wp) = (x.primitive().clone(), weight.primitive().clone());
                let y = B::conv2d_gemm(
                    xp.clone(),
                    wp.clone(),
                    bias.into_primitive(),
                    options.clone(),
                    relu,
                );
                let mask = relu.then(|| y.clone());
                prep.finish((xp, wp, options, mask), y)
            }
            OpsKind::UnTracked(prep) => prep.finish(B::conv2d_gemm(
                x.into_primitive(),
                weight.into_primitive(),
                bias.into_primitive(),
                options,
                relu,
            )),
        }
    }

    // The gradients below run on the inner backend from the backward above; called as
    // forward ops of their own they are not differentiated again (first-order autodiff).

    fn conv2d_gemm_x_grad(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        options: ConvOptions<2>,
    ) -> FloatTensor<Self> {
        Autodiff::<B, C>::from_inner(B::conv2d_gemm_x_grad(
            x.into_primitive(),
            weight.into_primitive(),
            grad.into_primitive(),
            options,
        ))
    }

    fn conv2d_gemm_weight_grad(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        options: ConvOptions<2>,
    ) -> FloatTensor<Self> {
        Autodiff::<B, C>::from_inner(B::conv2d_gemm_weight_grad(
            x.into_primitive(),
            weight.into_primitive(),
            grad.into_primitive(),
            options,
        ))
    }

    fn conv2d_gemm_bias_grad(grad: FloatTensor<Self>) -> FloatTensor<Self> {
        Autodiff::<B, C>::from_inner(B::conv2d_gemm_bias_grad(grad.into_primitive()))
    }
}
