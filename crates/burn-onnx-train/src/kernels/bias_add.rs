//! `x + bias` with the bias broadcast along the last axis (a linear layer's bias after its
//! MatMul: an exporter's `Add(MatMul(x, W), b)`, and `Gemm`'s `C`) as one vectorized pass
//! over rows, with its own backward: `x` gets the output's gradient as it is and the bias
//! its column sums, one pass (f32 per block of rows, the blocks added in f64). Measured on
//! whole training steps (BENCHMARKS.md): gpt2_tiny 9.80 -> 9.09 ms, a GPT-2 124M-shaped
//! model 645.5 -> 639.0 ms per update (medians). Other shapes, dtypes and CubeCL devices
//! use Burn's `+`, which is also the reference the tests hold this to.

use burn::backend::autodiff::Autodiff;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::flex::{Flex, FlexTensor};
use burn::backend::tensor::FloatTensor;
use burn::backend::{AutodiffBackend, Backend, TensorMetadata, backend_extension};
use burn::tensor::{DType, TensorData};
use rayon::prelude::*;

use super::runs_cubecl;
use super::simd::{self, Kernel};
use crate::value::PhysTensor;

/// Rows per parallel piece (each piece of the backward sums its own partial column sums).
const ROWS: usize = 64;

/// `a + b` (NumPy broadcasting); the fused pass when one side is a row of the other's last
/// dimension, both f32 on the CPU.
pub fn add(a: PhysTensor, b: PhysTensor) -> PhysTensor {
    let row_of = |x: &PhysTensor, bias: &PhysTensor| {
        let (sx, sb) = (x.dims(), bias.dims());
        let n = sx[sx.len() - 1];
        sb[..sb.len() - 1].iter().all(|&d| d == 1)
            && sb[sb.len() - 1] == n
            && sx.iter().product::<usize>() > n
            && x.dtype() == DType::F32
            && bias.dtype() == DType::F32
            && !runs_cubecl(&x.device())
    };
    let (x, bias) = if row_of(&a, &b) {
        (a, b)
    } else if row_of(&b, &a) {
        (b, a)
    } else {
        return a + b;
    };
    PhysTensor::from_dispatch(<burn::backend::Dispatch as BiasAddOps>::add_rows(
        x.into_dispatch(),
        bias.into_dispatch(),
    ))
}

/// The op as a backend extension (Flex, and Autodiff over it).
#[backend_extension(Flex, Autodiff)]
pub trait BiasAddOps: Backend {
    /// `x + bias` for `bias` holding one value per element of `x`'s last dimension.
    fn add_rows(x: FloatTensor<Self>, bias: FloatTensor<Self>) -> FloatTensor<Self>;
    /// The sums of `g`'s columns (its last dimension), shaped like `bias`.
    fn sum_rows(g: FloatTensor<Self>, bias: FloatTensor<Self>) -> FloatTensor<Self>;
}

/// `out = x + bias` row by row.
struct AddRows<'a>(&'a mut [f32], &'a [f32], &'a [f32]);

impl Kernel for AddRows<'_> {
    type Output = ();
    #[inline(always)]
    fn run(self) {
        let AddRows(out, x, bias) = self;
        for (out, x) in out.chunks_mut(bias.len()).zip(x.chunks(bias.len())) {
            for ((o, &x), &b) in out.iter_mut().zip(x).zip(bias) {
                *o = x + b;
            }
        }
    }
}

/// `sums += row` for every row of `g`.
struct SumRows<'a>(&'a mut [f32], &'a [f32]);

impl Kernel for SumRows<'_> {
    type Output = ();
    #[inline(always)]
    fn run(self) {
        let SumRows(sums, g) = self;
        for row in g.chunks(sums.len()) {
            for (s, &v) in sums.iter_mut().zip(row) {
                *s += v;
            }
        }
    }
}

impl BiasAddOps for Flex {
    fn add_rows(x: FlexTensor, bias: FlexTensor) -> FlexTensor {
        let shape = x.shape().to_vec();
        let (x, bias) = (x.to_contiguous(), bias.to_contiguous());
        let (x, bias): (&[f32], &[f32]) = (
            x.as_slice().expect("contiguous f32"),
            bias.as_slice().expect("contiguous f32"),
        );
        let n = bias.len();
        let mut out = vec![0f32; x.len()];
        out.par_chunks_mut(ROWS * n)
            .zip(x.par_chunks(ROWS * n))
            .for_each(|(out, x)| simd::vectorized(AddRows(out, x, bias)));
        FlexTensor::from_data(TensorData::new(out, shape))
    }

    fn sum_rows(g: FlexTensor, bias: FlexTensor) -> FlexTensor {
        let g = g.to_contiguous();
        let g: &[f32] = g.as_slice().expect("contiguous f32");
        let n = bias.shape().num_elements();
        // Each piece's sums in f32, the pieces added up in f64.
        let sums = g
            .par_chunks(ROWS * n)
            .map(|g| {
                let mut sums = vec![0f32; n];
                simd::vectorized(SumRows(&mut sums, g));
                sums.into_iter().map(f64::from).collect::<Vec<f64>>()
            })
            .reduce_with(|mut a, b| {
                a.iter_mut().zip(&b).for_each(|(a, b)| *a += b);
                a
            })
            .unwrap_or_else(|| vec![0.0; n]);
        let sums: Vec<f32> = sums.into_iter().map(|s| s as f32).collect();
        FlexTensor::from_data(TensorData::new(sums, bias.shape().to_vec()))
    }
}

/// `dx = g`, `dbias = sum_rows(g)`.
#[derive(Debug)]
struct AddRowsBackward;

impl<B: Backend + BiasAddOps> Backward<B, 2> for AddRowsBackward {
    /// The bias (for its shape).
    type State = FloatTensor<B>;

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [x_node, bias_node] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        if let Some(node) = bias_node {
            grads.register::<B>(node.id, B::sum_rows(grad.clone(), ops.state));
        }
        if let Some(node) = x_node {
            grads.register::<B>(node.id, grad);
        }
    }
}

impl<B: Backend + BiasAddOps, C: CheckpointStrategy> BiasAddOps for Autodiff<B, C> {
    fn add_rows(x: FloatTensor<Self>, bias: FloatTensor<Self>) -> FloatTensor<Self> {
        match AddRowsBackward
            .prepare::<C>([x.node(), bias.node()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let (x, bias) = (x.into_primitive(), bias.into_primitive());
                let out = B::add_rows(x, bias.clone());
                prep.finish(bias, out)
            }
            OpsKind::UnTracked(prep) => {
                prep.finish(B::add_rows(x.into_primitive(), bias.into_primitive()))
            }
        }
    }

    fn sum_rows(g: FloatTensor<Self>, bias: FloatTensor<Self>) -> FloatTensor<Self> {
        // Reached through the backward above on the inner backend; as a forward op of its
        // own it is not differentiated again (first-order autodiff).
        Self::from_inner(B::sum_rows(g.into_primitive(), bias.into_primitive()))
    }
}
