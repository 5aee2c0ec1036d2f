//! The interpreter ops a tensor-parallel rewrite adds or adapts: `f` and `g` (see
//! [`crate::collective::megatron`]), Reshape and Split on a split axis, whose sizes in the
//! file are the full model's and shrink by the rank count here, and the embedding lookup
//! in a table split along the vocabulary; and sequence parallelism's transfers between
//! token slices and whole sequences, with `Shape` of a slice reporting the whole shape.

use burn::tensor::{Tensor, TensorData};
use ndarray::ArrayD;

use crate::collective::CollectiveGroup;
use crate::collective::axis_split::AxisSplit;
use crate::collective::megatron::{tp_copy, tp_reduce};
use crate::collective::sequence_parallel::{
    Move, SequenceStep, sequence_matmul, sequence_transfer,
};
use crate::error::OpResult;
use crate::op_bail;
use crate::ops::sequence_marks::marked;
use crate::ops::{Inputs, OpContext, OpOutput, lookup};
use crate::value::{FloatValue, MAX_RANK, Value, int_tensor_1d};

/// Attribute of an adapted node: the rank count.
pub const PARTS: &str = "burn.tp.parts";
/// Attribute of an adapted Reshape: the output axis that is split.
pub const AXIS: &str = "burn.tp.axis";
/// Attribute of an adapted Reshape: that axis's full size.
pub const FULL: &str = "burn.tp.full";
/// Attribute of a sequence-parallel transfer: which one ([`Transfer`] as an integer).
pub const TRANSFER: &str = "burn.sp.transfer";

/// The four sequence-parallel transfers, as a node names them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transfer {
    /// After a row-parallel projection: reduce-scatter (Megatron's `g` with sequence
    /// parallelism).
    Scatter = 0,
    /// Into a block: all-gather, its gradient reduce-scattered (`g`'s conjugate).
    IntoBlock = 1,
    /// Into an op that needs whole sequences: all-gather, its gradient sliced.
    Gather = 2,
    /// A replicated value read with sliced ones: slice, its gradient all-gathered.
    Slice = 3,
}

impl Transfer {
    /// The forward and backward moves.
    fn moves(self) -> (Move, Move) {
        match self {
            Transfer::Scatter => (Move::ReduceScatter, Move::AllGather),
            Transfer::IntoBlock => (Move::AllGather, Move::ReduceScatter),
            Transfer::Gather => (Move::AllGather, Move::Slice),
            Transfer::Slice => (Move::Slice, Move::AllGather),
        }
    }

    fn from_attr(n: i64) -> Option<Transfer> {
        [
            Transfer::Scatter,
            Transfer::IntoBlock,
            Transfer::Gather,
            Transfer::Slice,
        ]
        .into_iter()
        .find(|t| *t as i64 == n)
    }
}

/// The split a sequence-parallel node carries ([`marked`]) and its rank count.
fn sequence_split(ctx: &OpContext, op: &str) -> OpResult<(AxisSplit, usize)> {
    match marked(&ctx.attrs)? {
        Some(s) => Ok(s),
        None => op_bail!("{op}: a sequence-parallel node without its split"),
    }
}

/// The float input of a collective node and the tensor-parallel group it runs on.
fn float_input<'a>(
    ctx: &OpContext<'a>,
    inputs: &mut Inputs,
    op: &str,
) -> OpResult<(FloatValue, &'a CollectiveGroup)> {
    let Some(group) = &ctx.collectives.tensor_parallel else {
        op_bail!(
            "{op} runs only inside a tensor-parallel run (the model has no tensor-parallel group: OnnxModel::with_collectives)"
        );
    };
    match inputs.take(0, "input")? {
        Value::Float(f) => Ok((f, group)),
        other => op_bail!("{op} takes a float tensor, got {}", other.kind()),
    }
}

/// Megatron's `f`: identity forward, gradient all-reduced over the group.
pub fn copy(ctx: &OpContext, mut inputs: Inputs) -> OpResult<OpOutput> {
    let (x, group) = float_input(ctx, &mut inputs, "TensorParallelCopy")?;
    Ok(vec![Value::Float(FloatValue::new(
        tp_copy(x.tensor, group),
        x.rank,
    ))]
    .into())
}

/// Megatron's `g`: the ranks' partial sums added up.
pub fn reduce(ctx: &OpContext, mut inputs: Inputs) -> OpResult<OpOutput> {
    let (x, group) = float_input(ctx, &mut inputs, "TensorParallelReduce")?;
    Ok(vec![Value::Float(FloatValue::new(
        tp_reduce(x.tensor, group),
        x.rank,
    ))]
    .into())
}

/// A sequence-parallel transfer (`TRANSFER`) of the input along `AXIS`.
pub fn sequence(ctx: &OpContext, mut inputs: Inputs) -> OpResult<OpOutput> {
    let (x, group) = float_input(ctx, &mut inputs, "SequenceParallel")?;
    let Some(transfer) = Transfer::from_attr(ctx.attrs.int(TRANSFER, -1)?) else {
        op_bail!(
            "SequenceParallel: unknown transfer {:?}",
            ctx.attrs.get(TRANSFER)
        );
    };
    let (split, parts) = sequence_split(ctx, "SequenceParallel")?;
    if split.axis >= x.rank {
        op_bail!(
            "SequenceParallel: axis {} of a rank-{} tensor",
            split.axis,
            x.rank
        );
    }
    let (forward, backward) = transfer.moves();
    let step = SequenceStep {
        split: split.on(split.axis + MAX_RANK - x.rank),
        parts,
        forward,
        backward,
        group: group.clone(),
    };
    Ok(vec![Value::Float(FloatValue::new(
        sequence_transfer(x.tensor, step),
        x.rank,
    ))]
    .into())
}

/// A block's first projections of sequence slices (`A`, split along `AXIS`): the
/// all-gather of `A` times each weight `B_k` (a MatMul's, or a Gemm's with its `transB`;
/// the bias is another node), one output each. The gather runs once for all of them (the
/// weights side by side in one product), and the gathered `A` is not kept for backward
/// (gathered again there).
pub fn sequence_product(ctx: &OpContext, mut inputs: Inputs) -> OpResult<OpOutput> {
    let (x, group) = float_input(ctx, &mut inputs, "SequenceParallelMatMul")?;
    let (split, parts) = sequence_split(ctx, "SequenceParallelMatMul")?;
    let trans = ctx.attrs.int("transB", 0)? != 0;
    let mut weights = Vec::new();
    for k in 1..inputs.0.len() {
        let w = inputs.float(k, "B", ctx.device)?;
        if w.rank != 2 || x.rank < 2 || split.axis + 1 >= x.rank {
            op_bail!(
                "SequenceParallelMatMul: A {:?} split on axis {} by 2-D weights, got B {:?}",
                x.shape(),
                split.axis,
                w.shape()
            );
        }
        let w = w.into_rank::<2>()?;
        weights.push(if trans { w.transpose() } else { w });
    }
    let widths: Vec<usize> = weights.iter().map(|w| w.dims()[1]).collect();
    let w = match weights.len() {
        0 => op_bail!("SequenceParallelMatMul: no weight"),
        1 => weights.pop().expect("one weight"),
        _ => Tensor::cat(weights, 1),
    };
    let step = SequenceStep {
        split: split.on(split.axis + MAX_RANK - x.rank),
        parts,
        forward: Move::AllGather,
        backward: Move::ReduceScatter,
        group: group.clone(),
    };
    let rank = x.rank;
    let y = ctx.autocast([x, FloatValue::from_rank(w)?], |[x, w]| {
        Ok(FloatValue::new(
            sequence_matmul(x.tensor, w.tensor, step),
            rank,
        ))
    })?;
    if widths.len() == 1 {
        return Ok(vec![Value::Float(y)].into());
    }
    let mut start = 0;
    let mut outputs = Vec::with_capacity(widths.len());
    for n in widths {
        outputs.push(Value::Float(y.clone().narrow(MAX_RANK - 1, start, n)));
        start += n;
    }
    Ok(outputs.into())
}

/// `Shape` of a sequence slice: the whole tensor's shape (the split axis times `PARTS`).
pub fn sequence_shape(ctx: &OpContext, mut inputs: Inputs) -> OpResult<OpOutput> {
    let (split, parts) = sequence_split(ctx, "Shape")?;
    let mut shape = inputs.take(0, "data")?.shape();
    if split.axis >= shape.len() {
        op_bail!(
            "Shape of a sequence slice: axis {} of {shape:?}",
            split.axis
        );
    }
    shape[split.axis] *= parts;
    crate::ops::generators::shape_of(ctx, &shape)
}

/// Gather (axis 0) from this rank's rows of a table split along the vocabulary (`FULL`:
/// the whole table's rows): the ids another rank holds give zero rows, which Megatron's
/// `g` after this node fills in.
pub fn vocab_gather(ctx: &OpContext, mut inputs: Inputs) -> OpResult<OpOutput> {
    let Some(group) = &ctx.collectives.tensor_parallel else {
        op_bail!("a vocabulary-parallel Gather runs only inside a tensor-parallel run");
    };
    let full = ctx.attrs.int(FULL, 0)?;
    let Value::Float(table) = inputs.take(0, "data")? else {
        op_bail!("a vocabulary-parallel Gather reads a float table");
    };
    let ids = inputs.take(1, "indices")?.into_int()?;
    let shape = table.shape();
    let local = shape[0] as i64;
    let start = group.0.rank() as i64 * local;
    let mut rows = Vec::with_capacity(ids.len());
    let mut held = Vec::with_capacity(ids.len());
    for &i in &ids {
        let id = if i < 0 { i + full } else { i };
        if !(0..full).contains(&id) {
            op_bail!("index {i} is out of bounds for axis 0 of size {full}");
        }
        let at = id - start;
        let mine = (0..local).contains(&at);
        rows.push(if mine { at } else { 0 });
        held.push(if mine { 1f32 } else { 0.0 });
    }
    let width: usize = shape[1..].iter().product();
    let n = ids.len();
    let picked = table
        .reshape(&[shape[0], width])?
        .into_rank::<2>()?
        .select(0, int_tensor_1d(rows, ctx.device));
    let held: Tensor<2> = Tensor::from_data(TensorData::new(held, vec![n, 1]), ctx.device);
    let mut out_shape = ids.shape().to_vec();
    out_shape.extend_from_slice(&shape[1..]);
    Ok(vec![Value::Float(
        FloatValue::from_rank(picked * held)?.reshape(&out_shape)?,
    )]
    .into())
}

/// Reshape whose target names the full size of the split axis: that entry becomes this
/// rank's size (0 and -1 entries, and an entry already at the local size, are kept).
pub fn reshape(ctx: &OpContext, mut inputs: Inputs) -> OpResult<OpOutput> {
    let (parts, axis, full) = (
        ctx.attrs.int(PARTS, 1)?,
        ctx.attrs.int(AXIS, 0)? as usize,
        ctx.attrs.int(FULL, 0)?,
    );
    let Some(Some(shape)) = inputs.0.get(1).cloned() else {
        op_bail!("Reshape needs its shape input")
    };
    let mut dims = shape.int_list("shape")?;
    if axis >= dims.len() {
        op_bail!("tensor-parallel reshape: split axis {axis} outside the target shape {dims:?}");
    }
    if dims[axis] == full {
        dims[axis] = full / parts;
    }
    let n = dims.len();
    inputs.0[1] = Some(Value::Int(
        ArrayD::from_shape_vec(ndarray::IxDyn(&[n]), dims)
            .map_err(|e| crate::error::OpError(e.to_string()))?,
    ));
    (lookup("Reshape").expect("Reshape is an op"))(ctx, inputs)
}

/// Split cutting the split axis: explicit sizes shrink by the rank count (equal splits
/// need nothing).
pub fn split(ctx: &OpContext, mut inputs: Inputs) -> OpResult<OpOutput> {
    let parts = ctx.attrs.int(PARTS, 1)?;
    if let Some(Some(sizes)) = inputs.0.get(1).cloned() {
        let sizes = sizes.int_list("split")?;
        if sizes.iter().any(|s| s % parts != 0) {
            op_bail!("tensor-parallel split: sizes {sizes:?} are not multiples of {parts} ranks");
        }
        let local: Vec<i64> = sizes.iter().map(|s| s / parts).collect();
        inputs.0[1] = Some(Value::Int(
            ArrayD::from_shape_vec(ndarray::IxDyn(&[local.len()]), local)
                .map_err(|e| crate::error::OpError(e.to_string()))?,
        ));
    }
    (lookup("Split").expect("Split is an op"))(ctx, inputs)
}
