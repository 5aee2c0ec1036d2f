//! Matrix product of f32 tensors on the CPU's Flex backend, forward and backward, written
//! by the GEMM straight into an uninitialised buffer. Burn's Flex matmul allocates each
//! product zeroed as bytes and then copies it into an aligned buffer before the GEMM
//! overwrites it (a memset and a memcpy per product, ~5% of a gpt2_tiny step by perf).
//! Operands are read through their strides (a transposed view costs nothing), so the
//! backward `dA = g B^T`, `dB = A^T g` are the same kernel on swapped strides. Batched
//! operands must have the same batch dimensions (broadcasting is left to Burn's matmul,
//! which is also the reference the tests hold this one to). On CubeCL devices the f32 and
//! autocast products go to `cube_matmul.rs` instead.

use burn::backend::autodiff::Autodiff;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::flex::{Flex, FlexTensor};
use burn::backend::ops::FloatTensorOps;
use burn::backend::tensor::FloatTensor;
use burn::backend::{AutodiffBackend, Backend, TensorMetadata, backend_extension};
use burn::tensor::{DType, FloatDType, TensorData};
use gemm::Parallelism;
use rayon::prelude::*;

use super::runs_cubecl;
use super::transpose::transpose;
use crate::value::PhysTensor;

/// `a [.., m, k] x b [.., k, n]`, the batch dimensions equal or either side's all 1.
pub fn matmul(a: PhysTensor, b: PhysTensor) -> PhysTensor {
    let (sa, sb) = (a.dims(), b.dims());
    let r = sa.len();
    let fused = a.dtype() == DType::F32 && b.dtype() == DType::F32 && sa[..r - 2] == sb[..r - 2];
    if !fused {
        return a.matmul(b);
    }
    if runs_cubecl(&a.device()) {
        return cube_matmul(a, b, FloatDType::F32, FloatDType::F32);
    }
    PhysTensor::from_dispatch(<burn::backend::Dispatch as MatmulOps>::matmul_fused(
        a.into_dispatch(),
        b.into_dispatch(),
    ))
}

/// `a x b` computed in the low precision `low` with its result in `result` (autocast: f32,
/// or `low` itself for a result whose readers take it so): on CubeCL devices one product
/// reading the operands' low-precision casts and writing `result`, its backward likewise
/// (`cube_matmul.rs`); elsewhere the operands cast down, [`matmul`], and the result cast to
/// `result`, each cast differentiable.
pub fn matmul_autocast(
    a: PhysTensor,
    b: PhysTensor,
    low: FloatDType,
    result: FloatDType,
) -> PhysTensor {
    // An operand in f32 or already in the low precision (an activation written so).
    let readable = |t: &PhysTensor| t.dtype() == DType::F32 || t.dtype() == DType::from(low);
    if readable(&a) && readable(&b) && runs_cubecl(&a.device()) {
        return cube_matmul(a, b, low, result);
    }
    matmul(a.cast(low), b.cast(low)).cast(result)
}

/// The CubeCL product of f32 operands read in `compute`, written in `out`
/// (`cube_matmul.rs`).
fn cube_matmul(a: PhysTensor, b: PhysTensor, compute: FloatDType, out: FloatDType) -> PhysTensor {
    #[cfg(any(feature = "wgpu", feature = "cuda"))]
    {
        use super::cube_matmul::CubeMatmulOps;
        PhysTensor::from_dispatch(<burn::backend::Dispatch as CubeMatmulOps>::matmul_in(
            a.into_dispatch(),
            b.into_dispatch(),
            compute,
            out,
        ))
    }
    #[cfg(not(any(feature = "wgpu", feature = "cuda")))]
    unreachable!(
        "no CubeCL device in this build ({:?} x {:?} in {compute:?} to {out:?})",
        a.dims(),
        b.dims()
    )
}

/// The product as a backend extension (Flex, and Autodiff over it).
#[backend_extension(Flex, Autodiff)]
pub trait MatmulOps: Backend {
    /// `a [.., m, k] x b [.., k, n]` with equal batch dimensions.
    fn matmul_fused(a: FloatTensor<Self>, b: FloatTensor<Self>) -> FloatTensor<Self>;
    /// `a x b` and `c x d` (a backward's two products, of equal cost): two single large
    /// products run side by side, each GEMM on one core, instead of one after the other
    /// each split across the cores.
    fn matmul_fused_pair(
        a: FloatTensor<Self>,
        b: FloatTensor<Self>,
        c: FloatTensor<Self>,
        d: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>);
    /// The last two dimensions swapped (a view where the backend allows).
    fn transpose_last(x: FloatTensor<Self>) -> FloatTensor<Self>;
}

/// Products at least this big (multiply-adds) use every core inside the GEMM.
const PARALLEL_GEMM: usize = 192 * 192 * 192;
/// A batch of products at least this big in all runs its products in parallel instead.
const PARALLEL_BATCH: usize = 128 * 128 * 128;
/// A right-hand side stored along `k` with at least this many values is copied row-major.
const MIN_B_COPY: usize = 64 * 64;
/// Copies of at least this many values use every core.
const PARALLEL_COPY: usize = 1 << 16;

/// Where matrix `i` of a batch starts in `t`'s storage.
fn batch_offset(t: &FlexTensor, i: usize) -> isize {
    let (shape, strides) = (t.layout().shape(), t.layout().strides());
    let mut offset = t.layout().start_offset() as isize;
    let mut rest = i;
    for d in (0..shape.num_dims() - 2).rev() {
        offset += (rest % shape[d]) as isize * strides[d];
        rest /= shape[d];
    }
    offset
}

/// Row and column strides of `t`'s matrices.
fn matrix_strides(t: &FlexTensor) -> (isize, isize) {
    let s = t.layout().strides();
    (s[s.len() - 2], s[s.len() - 1])
}

impl MatmulOps for Flex {
    fn matmul_fused(a: FloatTensor<Self>, b: FloatTensor<Self>) -> FloatTensor<Self> {
        product(a, b, true)
    }

    fn matmul_fused_pair(
        a: FloatTensor<Self>,
        b: FloatTensor<Self>,
        c: FloatTensor<Self>,
        d: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let single_large = |x: &FlexTensor, y: &FlexTensor| {
            let (sx, sy) = (x.shape().to_vec(), y.shape().to_vec());
            let r = sx.len();
            sx[..r - 2].iter().product::<usize>() == 1
                && sx[r - 2] * sx[r - 1] * sy[r - 1] >= PARALLEL_GEMM
        };
        if single_large(&a, &b) && single_large(&c, &d) {
            // Both results are allocated here, not by the core that may take the second
            // product: a block that core allocates and this thread frees goes back to
            // mimalloc's page of that core, which reuses it only when that core allocates
            // again. This thread then took fresh memory for the next step's tensors, and the
            // peak of a run depended on which core took the product (the memory-plan test's
            // GPT-2: 376 or 312 MiB from run to run, now 312 every time).
            let (ab, cd) = (output_buffer(&a, &b), output_buffer(&c, &d));
            rayon::join(
                || product_into(a, b, false, ab),
                || product_into(c, d, false, cd),
            )
        } else {
            (product(a, b, true), product(c, d, true))
        }
    }

    fn transpose_last(x: FloatTensor<Self>) -> FloatTensor<Self> {
        let r = x.shape().num_dims();
        x.transpose(r - 2, r - 1)
    }
}

/// `a x b`; `gemm_threads`: a single large product may split across the cores.
fn product(a: FlexTensor, b: FlexTensor, gemm_threads: bool) -> FlexTensor {
    let out = output_buffer(&a, &b);
    product_into(a, b, gemm_threads, out)
}

/// An empty buffer with room for `a x b`'s values.
fn output_buffer(a: &FlexTensor, b: &FlexTensor) -> Vec<f32> {
    let (sa, sb) = (a.shape().to_vec(), b.shape().to_vec());
    let rows: usize = sa[..sa.len().saturating_sub(1)].iter().product();
    Vec::with_capacity(rows * sb.last().copied().unwrap_or(0))
}

/// `a x b` written into `out`, an empty buffer from [`output_buffer`].
fn product_into(a: FlexTensor, b: FlexTensor, gemm_threads: bool, mut out: Vec<f32>) -> FlexTensor {
    let (sa, sb) = (a.shape().to_vec(), b.shape().to_vec());
    let r = sa.len();
    assert!(
        r >= 2 && sb.len() == r,
        "matmul_fused takes two tensors of one rank >= 2"
    );
    assert_eq!(
        sa[..r - 2],
        sb[..r - 2],
        "matmul_fused: batch dimensions differ"
    );
    let (m, k, n) = (sa[r - 2], sa[r - 1], sb[r - 1]);
    assert_eq!(k, sb[r - 2], "matmul_fused: inner dimensions differ");
    let count: usize = sa[..r - 2].iter().product();
    let mut shape = sa[..r - 2].to_vec();
    shape.extend([m, n]);
    if k == 0 {
        out.resize(count * m * n, 0.0);
        return FlexTensor::from_data(TensorData::new(out, shape));
    }
    let (ra, ca) = matrix_strides(&a);
    let (rb, cb) = matrix_strides(&b);
    let (da, db): (&[f32], &[f32]) = (a.storage(), b.storage());
    // The GEMM packs a right-hand side stored along `k` (a transposed view, `g W^T` in
    // backward) slowly: with `k >= n` a row-major copy first pays (BENCHMARKS.md).
    let along_k = rb == 1 && cb > 0 && cb as usize >= k;
    let b_copy = (along_k && k >= n && k * n >= MIN_B_COPY).then(|| {
        let mut t: Vec<f32> = Vec::with_capacity(count * k * n);
        let parallel = gemm_threads && count * k * n >= PARALLEL_COPY;
        for (i, dst) in t.spare_capacity_mut()[..count * k * n]
            .chunks_mut(k * n)
            .enumerate()
        {
            let src = &db[batch_offset(&b, i) as usize..];
            transpose(src, n, k, cb as usize, dst, parallel);
        }
        // SAFETY: `transpose` wrote every value of each matrix.
        unsafe { t.set_len(count * k * n) };
        t
    });
    let (db, rb, cb) = match &b_copy {
        Some(t) => (t.as_slice(), n as isize, 1),
        None => (db, rb, cb),
    };
    let b_offset = |i: usize| match b_copy {
        Some(_) => (i * k * n) as isize,
        None => batch_offset(&b, i),
    };
    out.reserve_exact(count * m * n);
    let product = |dst: *mut f32, i: usize, parallelism: Parallelism| {
        // SAFETY: the offsets and strides are the operands' own layouts (or the row-major
        // copy's), so every read stays inside their storage; `dst` holds `m * n` values in
        // rows of `n`, which the GEMM writes without reading (`read_dst` false).
        unsafe {
            gemm::gemm(
                m,
                n,
                k,
                dst,
                1,
                n as isize,
                false,
                da.as_ptr().offset(batch_offset(&a, i)),
                ca,
                ra,
                db.as_ptr().offset(b_offset(i)),
                cb,
                rb,
                0.0,
                1.0,
                false,
                false,
                false,
                parallelism,
            )
        }
    };
    let ops = m * n * k;
    let spare = &mut out.spare_capacity_mut()[..count * m * n];
    if m * n > 0 {
        if count > 1 && count * ops >= PARALLEL_BATCH {
            spare
                .par_chunks_mut(m * n)
                .enumerate()
                .for_each(|(i, dst)| product(dst.as_mut_ptr().cast(), i, Parallelism::None));
        } else {
            let parallelism = if gemm_threads && ops >= PARALLEL_GEMM {
                Parallelism::Rayon(0)
            } else {
                Parallelism::None
            };
            for (i, dst) in spare.chunks_mut(m * n).enumerate() {
                product(dst.as_mut_ptr().cast(), i, parallelism);
            }
        }
    }
    // SAFETY: the GEMMs above wrote all `count * m * n` values.
    unsafe { out.set_len(count * m * n) };
    FlexTensor::from_data(TensorData::new(out, shape))
}

/// `dA = g B^T`, `dB = A^T g` from the operands the forward kept (each only when the other
/// side needs a gradient).
#[derive(Debug)]
struct MatmulBackward;

impl<B: Backend + MatmulOps> Backward<B, 2> for MatmulBackward {
    type State = (Option<FloatTensor<B>>, Option<FloatTensor<B>>);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [a_node, b_node] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        let (a, b) = ops.state;
        match (a_node, b, b_node, a) {
            (Some(an), Some(b), Some(bn), Some(a)) => {
                let (bt, at) = (B::transpose_last(b), B::transpose_last(a));
                let (da, db) = B::matmul_fused_pair(grad.clone(), bt, at, grad);
                grads.register::<B>(an.id, da);
                grads.register::<B>(bn.id, db);
            }
            (a_node, b, b_node, a) => {
                if let (Some(node), Some(b)) = (a_node, b) {
                    let da = B::matmul_fused(grad.clone(), B::transpose_last(b));
                    grads.register::<B>(node.id, da);
                }
                if let (Some(node), Some(a)) = (b_node, a) {
                    grads.register::<B>(node.id, B::matmul_fused(B::transpose_last(a), grad));
                }
            }
        }
    }
}

impl<B: Backend + MatmulOps, C: CheckpointStrategy> MatmulOps for Autodiff<B, C> {
    fn matmul_fused(a: FloatTensor<Self>, b: FloatTensor<Self>) -> FloatTensor<Self> {
        let (a_tracked, b_tracked) = (a.is_tracked(), b.is_tracked());
        match MatmulBackward
            .prepare::<C>([a.node(), b.node()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let (a, b) = (a.into_primitive(), b.into_primitive());
                let out = B::matmul_fused(a.clone(), b.clone());
                prep.finish((b_tracked.then_some(a), a_tracked.then_some(b)), out)
            }
            OpsKind::UnTracked(prep) => {
                prep.finish(B::matmul_fused(a.into_primitive(), b.into_primitive()))
            }
        }
    }

    fn matmul_fused_pair(
        a: FloatTensor<Self>,
        b: FloatTensor<Self>,
        c: FloatTensor<Self>,
        d: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        // Backward's products: not differentiated again (first-order autodiff).
        let (x, y) = B::matmul_fused_pair(
            a.into_primitive(),
            b.into_primitive(),
            c.into_primitive(),
            d.into_primitive(),
        );
        (Self::from_inner(x), Self::from_inner(y))
    }

    fn transpose_last(x: FloatTensor<Self>) -> FloatTensor<Self> {
        Autodiff::<B, C>::float_transpose(x)
    }
}
