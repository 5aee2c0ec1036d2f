//! `Where` with one constant scalar branch (the exporters' attention mask: `Where(mask,
//! scores, -inf)` or `Where(not_mask, -inf, scores)`) as one pass with its own backward, on
//! the CPU's Flex backend: the tensor's value where the mask keeps it, the scalar
//! elsewhere, and a gradient that is the output's where kept and zero elsewhere. The mask
//! repeats every `keep.len()` elements (a causal mask broadcast over batch and heads), so
//! it is never materialised at the tensor's size. Other dtypes and CubeCL devices use
//! Burn's `mask_where`, which is also the reference the tests hold this to.

use std::sync::Arc;

use burn::backend::autodiff::Autodiff;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::flex::{Flex, FlexTensor};
use burn::backend::tensor::FloatTensor;
use burn::backend::{Backend, TensorMetadata, backend_extension};
use burn::tensor::{DType, TensorData};
use rayon::prelude::*;

use super::runs_cubecl;
use super::simd::{self, Kernel};
use crate::value::PhysTensor;
use crate::value::unary_op::unary;

/// Elements per parallel chunk when the mask's period is short.
const CHUNK: usize = 1 << 14;

/// Whether the fused op serves `x`: f32 on the CPU.
pub fn masked_fill_fused_here(x: &PhysTensor) -> bool {
    x.dtype() == DType::F32 && !runs_cubecl(&x.device())
}

/// `x[i]` where `keep[i % keep.len()]`, `fill` elsewhere; the gradient flows to `x` where
/// kept. `x`'s element count must be a multiple of `keep.len()`.
pub fn masked_fill(x: PhysTensor, keep: Arc<[bool]>, fill: f32) -> PhysTensor {
    PhysTensor::from_dispatch(
        <burn::backend::Dispatch as MaskedFillOps>::masked_fill_periodic(
            x.into_dispatch(),
            keep,
            fill,
        ),
    )
}

/// The op as a backend extension (Flex, and Autodiff over it).
#[backend_extension(Flex, Autodiff)]
pub trait MaskedFillOps: Backend {
    /// `x` where the periodic mask keeps it, `fill` elsewhere.
    fn masked_fill_periodic(
        x: FloatTensor<Self>,
        keep: Arc<[bool]>,
        fill: f32,
    ) -> FloatTensor<Self>;
}

/// `out[i] = if keep[i] { x[i] } else { fill }` over one period (or a part of one).
struct FillChunk<'a>(&'a mut [f32], &'a [f32], &'a [bool], f32);

impl Kernel for FillChunk<'_> {
    type Output = ();
    #[inline(always)]
    fn run(self) {
        let FillChunk(out, x, keep, fill) = self;
        for ((o, &x), &k) in out.iter_mut().zip(x).zip(keep) {
            *o = if k { x } else { fill };
        }
    }
}

impl MaskedFillOps for Flex {
    fn masked_fill_periodic(
        x: FloatTensor<Self>,
        keep: Arc<[bool]>,
        fill: f32,
    ) -> FloatTensor<Self> {
        let shape = x.shape().to_vec();
        let x: FlexTensor = x.to_contiguous();
        let x: &[f32] = x.as_slice().expect("contiguous f32");
        let period = keep.len();
        assert!(
            period > 0 && x.len() % period == 0,
            "masked_fill: {} elements are not whole periods of the {period}-element mask",
            x.len()
        );
        let mut out = vec![0f32; x.len()];
        // Parallel pieces: whole periods, or aligned parts of one when it is long.
        let piece = if period >= CHUNK {
            (CHUNK..=period.min(4 * CHUNK))
                .find(|c| period % c == 0)
                .unwrap_or(period)
        } else {
            period * (CHUNK / period)
        };
        out.par_chunks_mut(piece)
            .zip(x.par_chunks(piece))
            .enumerate()
            .for_each(|(i, (out, x))| {
                let start = i * piece % period;
                for (j, (out, x)) in out.chunks_mut(period).zip(x.chunks(period)).enumerate() {
                    let from = if j == 0 { start } else { 0 };
                    let keep = &keep[from..from + out.len()];
                    simd::vectorized(FillChunk(out, x, keep, fill));
                }
            });
        FlexTensor::from_data(TensorData::new(out, shape))
    }
}

impl<B: Backend + MaskedFillOps, C: CheckpointStrategy> MaskedFillOps for Autodiff<B, C> {
    fn masked_fill_periodic(
        x: FloatTensor<Self>,
        keep: Arc<[bool]>,
        fill: f32,
    ) -> FloatTensor<Self> {
        let kept = keep.clone();
        unary::<B, C, ()>(
            x,
            move |x| B::masked_fill_periodic(x, kept, fill),
            |_, _| (),
            move |(), g| B::masked_fill_periodic(g, keep, 0.0),
        )
    }
}
