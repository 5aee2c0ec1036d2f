//! Megatron's sequence parallelism as differentiable ops on the tensor-parallel group:
//! outside the blocks each rank holds its slice of the tokens ([`AxisSplit`] of the
//! sequence axis), so the `f`/`g` all-reduces of [`super::megatron`] become
//! - a reduce-scatter after a row-parallel projection (backward: all-gather),
//! - an all-gather where a block reads the sequence slices (backward: reduce-scatter),
//! and two more moves join the slices to the replicated rest of the graph:
//! - an all-gather where an op that needs whole sequences reads them (backward: this
//!   rank's slice of the gradient, which every rank holds whole),
//! - a slice of a replicated value a sliced op reads whole (a position table's rows;
//!   backward: all-gather, so the replicated side gets the whole gradient again).
//!
//! Each is one [`Move`] forward and another backward; the data stays on a GPU whose group
//! moves device tensors (NCCL) and goes through host memory elsewhere, as the other
//! collectives do. A block's projection of the gathered sequence is one op
//! ([`sequence_matmul`], Megatron's way): the gathered input is not kept for the weight's
//! gradient but gathered again in backward, so no rank holds a whole sequence's activation
//! between the passes. A group of one with a split planned for more ranks (the
//! memory plan's probe of one rank) only reproduces the shapes: gathers repeat this rank's
//! slice and reduce-scatters keep it.

#[cfg(any(feature = "wgpu", feature = "cuda"))]
use burn::backend::Cube;
use burn::backend::autodiff::Autodiff;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::flex::Flex;
use burn::backend::tensor::FloatTensor;
use burn::backend::{AutodiffBackend, Backend, TensorMetadata, backend_extension};
use burn::tensor::Shape;
use burn_ort_dist::ReduceOp;

use super::axis_split::AxisSplit;
#[cfg(any(feature = "wgpu", feature = "cuda"))]
use super::on_device::on_device;
use super::{CollectiveGroup, HostCopy};
use crate::value::PhysTensor;
use crate::value::unary_op::unary;

/// One direction of a sequence-parallel transfer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Move {
    /// Sum the ranks' whole tensors and keep this rank's slice.
    ReduceScatter,
    /// Join the ranks' slices into the whole tensor.
    AllGather,
    /// Keep this rank's slice of a tensor every rank holds whole.
    Slice,
}

/// A sequence-parallel op: its split (on the physical axis), its forward and backward
/// moves and the group it runs on.
#[derive(Debug, Clone)]
pub struct SequenceStep {
    /// The split of the sequence axis, on the physical (padded) tensor.
    pub split: AxisSplit,
    /// The rank count the split was planned for.
    pub parts: usize,
    /// The move of the forward pass.
    pub forward: Move,
    /// The move of the backward pass (on the output's gradient).
    pub backward: Move,
    /// The tensor-parallel group.
    pub group: CollectiveGroup,
}

impl SequenceStep {
    /// `x` moved by `m` on the host.
    fn host<B: Backend>(&self, x: FloatTensor<B>, m: Move) -> FloatTensor<B> {
        let mut host = HostCopy::<B>::of(x, "sequence-parallel transfer");
        let mut shape = host.shape.clone();
        let values = self
            .moved(std::mem::take(&mut host.values), &mut shape, m)
            .unwrap_or_else(|e| panic!("sequence-parallel {m:?} failed: {e}"));
        host.make(values, shape)
    }

    /// The values of a tensor of `shape` moved by `m`; `shape` becomes the result's.
    fn moved(&self, values: Vec<f32>, shape: &mut [usize], m: Move) -> Result<Vec<f32>, String> {
        let (g, tp, s) = (&self.group.0, self.parts, self.split);
        let alone = g.world_size() == 1 && tp > 1;
        if !alone && g.world_size() != tp {
            return Err(format!(
                "planned for {tp} ranks, the group has {}",
                g.world_size()
            ));
        }
        let rank = if alone { 0 } else { g.rank() };
        let whole = match m {
            Move::AllGather => shape[s.axis] * tp,
            Move::ReduceScatter | Move::Slice => shape[s.axis],
        };
        if whole % s.period != 0 || s.period % tp != 0 {
            return Err(format!(
                "an axis of {whole} does not split in blocks of {} over {tp} ranks (sequence parallelism needs the sequence length it was planned for, or a multiple of it)",
                s.period
            ));
        }
        let local = shape.to_vec();
        let out = match m {
            Move::Slice => s.slice_flat(&values, shape, rank, tp),
            Move::AllGather if alone => s.assemble_flat(&vec![&values[..]; tp], &local),
            Move::AllGather => {
                let mut recv = vec![0f32; values.len() * tp];
                g.all_gather(&values, &mut recv)
                    .map_err(|e| e.to_string())?;
                let parts: Vec<&[f32]> = recv.chunks(values.len()).collect();
                s.assemble_flat(&parts, &local)
            }
            Move::ReduceScatter if alone => s.slice_flat(&values, shape, 0, tp),
            Move::ReduceScatter => {
                let send: Vec<f32> = (0..tp)
                    .flat_map(|r| s.slice_flat(&values, shape, r, tp))
                    .collect();
                let mut recv = vec![0f32; send.len() / tp];
                g.reduce_scatter(&send, &mut recv, ReduceOp::Sum)
                    .map_err(|e| e.to_string())?;
                recv
            }
        };
        match m {
            Move::AllGather => shape[s.axis] *= tp,
            Move::ReduceScatter | Move::Slice => shape[s.axis] /= tp,
        }
        Ok(out)
    }
}

/// `gathered [.., K] x w [K, N]` (`w` padded with leading ones) as one GEMM over the rows.
fn product<B: Backend>(gathered: FloatTensor<B>, w: FloatTensor<B>) -> FloatTensor<B> {
    let dims = gathered.shape().to_vec();
    let (wd, r) = (w.shape().to_vec(), dims.len());
    let (k, n) = (wd[wd.len() - 2], wd[wd.len() - 1]);
    let rows = dims[..r - 1].iter().product::<usize>();
    let y = B::float_matmul(
        B::float_reshape(gathered, Shape::from(vec![rows, k])),
        B::float_reshape(w, Shape::from(vec![k, n])),
    );
    let mut out = dims;
    out[r - 1] = n;
    B::float_reshape(y, Shape::from(out))
}

/// The product of the gathered sequence by a replicated weight: `dW = x^T g` with the
/// input gathered again, `dx` the reduce-scatter of `g W^T`.
#[derive(Debug)]
struct GatheredProductBackward;

impl<B: Backend + SequenceParallelOps> Backward<B, 2> for GatheredProductBackward {
    type State = (FloatTensor<B>, FloatTensor<B>, SequenceStep);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [x_node, w_node] = ops.parents;
        let g = grads.consume::<B>(&ops.node);
        let (x, w, step) = ops.state;
        let (gd, wd) = (g.shape().to_vec(), w.shape().to_vec());
        let (k, n) = (wd[wd.len() - 2], wd[wd.len() - 1]);
        let rows = gd[..gd.len() - 1].iter().product::<usize>();
        let g2 = B::float_reshape(g, Shape::from(vec![rows, n]));
        if let Some(node) = w_node {
            let gathered = B::sequence_move(x, step.clone(), Move::AllGather);
            let x2 = B::float_reshape(gathered, Shape::from(vec![rows, k]));
            let dw = B::float_matmul(B::float_transpose(x2), g2.clone());
            grads.register::<B>(node.id, B::float_reshape(dw, Shape::from(wd.clone())));
        }
        if let Some(node) = x_node {
            let w2 = B::float_reshape(w, Shape::from(vec![k, n]));
            let dx = B::float_matmul(g2, B::float_transpose(w2));
            let mut whole = gd;
            let last = whole.len() - 1;
            whole[last] = k;
            let dx = B::float_reshape(dx, Shape::from(whole));
            grads.register::<B>(node.id, B::sequence_move(dx, step, Move::ReduceScatter));
        }
    }
}

/// The transfer as a backend extension.
#[backend_extension(Cube: cfg(any(feature = "wgpu", feature = "cuda")), Flex, Autodiff)]
pub trait SequenceParallelOps: Backend {
    /// `step.forward` on `x` (its gradient: `step.backward` on the output's).
    fn sequence_transfer(x: FloatTensor<Self>, step: SequenceStep) -> FloatTensor<Self>;
    /// `m` on `x` over `step`'s group and split (no gradient: the backward's moves).
    fn sequence_move(x: FloatTensor<Self>, step: SequenceStep, m: Move) -> FloatTensor<Self>;
    /// The all-gather of `x` (slices, split by `step`) times `w` (`[K, N]` padded with
    /// leading ones); the gathered input is not kept for backward.
    fn sequence_matmul(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        step: SequenceStep,
    ) -> FloatTensor<Self>;
}

/// The inner backends' ops, made of their moves (`$moving`).
macro_rules! made_of_moves {
    ($backend:ty, $moving:expr) => {
        impl SequenceParallelOps for $backend {
            fn sequence_transfer(x: FloatTensor<Self>, step: SequenceStep) -> FloatTensor<Self> {
                let m = step.forward;
                Self::sequence_move(x, step, m)
            }

            fn sequence_matmul(
                x: FloatTensor<Self>,
                w: FloatTensor<Self>,
                step: SequenceStep,
            ) -> FloatTensor<Self> {
                product::<Self>(Self::sequence_move(x, step, Move::AllGather), w)
            }

            fn sequence_move(
                x: FloatTensor<Self>,
                step: SequenceStep,
                m: Move,
            ) -> FloatTensor<Self> {
                $moving(&step, x, m)
            }
        }
    };
}

// The CPU's moves go through the host; a GPU's stay on the device where its group moves
// device tensors (NCCL).
made_of_moves!(Flex, SequenceStep::host::<Flex>);
#[cfg(any(feature = "wgpu", feature = "cuda"))]
made_of_moves!(Cube, |step: &SequenceStep, x, m| {
    step.on_device(x, m)
        .unwrap_or_else(|x| step.host::<Cube>(x, m))
});

impl SequenceStep {
    /// `x` moved by `m` through the group's device collectives, as [`Self::moved`] lays
    /// the values out: a rank's part of a whole tensor is the `count` runs of `len` values
    /// at rank offset `step` in each run of `stride = tp * len` ([`AxisSplit`]), so the
    /// parts are the whole seen as `[count, tp, len]`, sliced at the rank; the gather
    /// swaps the ranks' `[tp, count, len]` into it, the reduce-scatter sends it swapped.
    /// `Err(x)` where the group has no device collectives for `x`, or the step does not
    /// fit the group (the host path reports it).
    #[cfg(any(feature = "wgpu", feature = "cuda"))]
    fn on_device(
        &self,
        x: FloatTensor<Cube>,
        m: Move,
    ) -> Result<FloatTensor<Cube>, FloatTensor<Cube>> {
        use burn_ort_dist::DeviceCollectives;
        let (tp, s) = (self.parts, self.split);
        let mut shape = x.shape().to_vec();
        let whole = match m {
            Move::AllGather => shape[s.axis] * tp,
            Move::ReduceScatter | Move::Slice => shape[s.axis],
        };
        let fits = self.group.0.world_size() == tp && s.pad == 0;
        if !fits || whole % s.period != 0 || s.period % tp != 0 {
            return Err(x);
        }
        let mut full = shape.clone();
        full[s.axis] = whole;
        let (count, len, _, _) = s.runs(&full, tp);
        let rank = self.group.0.rank();
        match m {
            Move::AllGather => shape[s.axis] *= tp,
            Move::ReduceScatter | Move::Slice => shape[s.axis] /= tp,
        }
        let what = format!("sequence-parallel {m:?}");
        let parts = |t: burn::tensor::Tensor<1>| t.reshape([count, tp, len]);
        let moving = |d: &dyn DeviceCollectives, t: burn::tensor::Tensor<1>| match m {
            Move::Slice => Ok(parts(t).narrow(1, rank, 1).reshape([count * len])),
            Move::AllGather => {
                let all = d.all_gather(t)?.reshape([tp, count, len]);
                Ok(all.swap_dims(0, 1).reshape([count * tp * len]))
            }
            Move::ReduceScatter => {
                let send = parts(t).swap_dims(0, 1).reshape([tp * count * len]);
                d.reduce_scatter(send, ReduceOp::Sum)
            }
        };
        on_device(x, &self.group, &what, moving, shape)
    }
}

impl<B: Backend + SequenceParallelOps, C: CheckpointStrategy> SequenceParallelOps
    for Autodiff<B, C>
{
    fn sequence_transfer(x: FloatTensor<Self>, step: SequenceStep) -> FloatTensor<Self> {
        let kept = step.clone();
        unary::<B, C, SequenceStep>(
            x,
            |x| B::sequence_transfer(x, step),
            |_, _| kept,
            |step, g| {
                let m = step.backward;
                B::sequence_move(g, step, m)
            },
        )
    }

    fn sequence_matmul(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        step: SequenceStep,
    ) -> FloatTensor<Self> {
        match GatheredProductBackward
            .prepare::<C>([x.node(), w.node()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let (x, w) = (x.into_primitive(), w.into_primitive());
                let out = B::sequence_matmul(x.clone(), w.clone(), step.clone());
                prep.finish((x, w, step), out)
            }
            OpsKind::UnTracked(prep) => prep.finish(B::sequence_matmul(
                x.into_primitive(),
                w.into_primitive(),
                step,
            )),
        }
    }

    fn sequence_move(x: FloatTensor<Self>, step: SequenceStep, m: Move) -> FloatTensor<Self> {
        // Only reached through the backwards above (first-order autodiff).
        Self::from_inner(B::sequence_move(x.into_primitive(), step, m))
    }
}

/// `step` on a tensor.
pub fn sequence_transfer(x: PhysTensor, step: SequenceStep) -> PhysTensor {
    PhysTensor::from_dispatch(
        <burn::backend::Dispatch as SequenceParallelOps>::sequence_transfer(
            x.into_dispatch(),
            step,
        ),
    )
}

/// The all-gather of the slices `x` (split by `step`) times the weight `w` (`[K, N]`),
/// without keeping the gathered input for backward.
pub fn sequence_matmul(x: PhysTensor, w: PhysTensor, step: SequenceStep) -> PhysTensor {
    PhysTensor::from_dispatch(
        <burn::backend::Dispatch as SequenceParallelOps>::sequence_matmul(
            x.into_dispatch(),
            w.into_dispatch(),
            step,
        ),
    )
}
