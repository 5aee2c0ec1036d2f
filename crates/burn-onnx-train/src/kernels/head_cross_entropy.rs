//! The head's product and the softmax cross-entropy over it, a block of rows at a time, so
//! the `[rows, vocabulary]` logits never exist whole (Liger-Kernel's fused linear
//! cross-entropy). For GPT-2 124M at 16 x 1024 tokens the logits are 1.65 GB in bf16,
//! kept from the head's product until the loss's backward: the largest tensor of the
//! update, at its peak, and on a GPU the size every page of CubeCL's pool takes.
//!
//! Per block of rows, with nothing recorded for autodiff: the logits (the product in the
//! compute precision, written so from its f32 accumulators), the rows' loss and its
//! gradient over the logits (written over them, `cross_entropy_rows_gradient`), then the
//! two products of the head's backward with that gradient: the hidden rows' gradient
//! (`g W^T`) and the block's part of the table's (`h^T g`, summed over blocks), both
//! written in f32. The block's logits are dropped there. The value is tied to both
//! gradients (`given_gradients.rs`), which the backward scales by the loss's own gradient
//! (the loss scale, the accumulation's and the mean's divisors) and writes in each
//! tensor's precision. The products are the ones the head and its backward ran before;
//! what is added is one sum of the table's gradient per block after the first, one copy of
//! the hidden rows' gradient into place, and its cast when the hidden rows are in a low
//! precision.
//!
//! In a low precision the logits' gradient is computed [`LOW_PRECISION_SCALE`] times too
//! large and the backward divides it out in f32: the loss's gradient is not known yet, and
//! the softmax's small probabilities (~2e-5 over GPT-2's vocabulary) would otherwise be
//! written as f16 subnormals, the precision that the loss scale upstream exists to keep.

use burn::tensor::{DType, Device, FloatDType, Int, Tensor};

use super::cross_entropy::{cross_entropy_rows_gradient, cross_entropy_rows_within};
use super::given_gradients::with_gradients;
use super::matmul::matmul_autocast;
use super::{TRANSIENT_BYTES, largest_allocation};
use crate::value::{MAX_RANK, PhysTensor, padded};

/// The factor the logits' gradient is computed at in a low precision: `|softmax - onehot|
/// <= 1`, so at most 2^14 (f16 holds 65504), and ~2e-5 becomes ~0.3, a normal f16 value.
pub const LOW_PRECISION_SCALE: f32 = 16384.0;

/// Rows per block for logits `columns` wide in `dtype` on `device`: within
/// [`TRANSIENT_BYTES`] (GPT-2's 50304 columns in bf16 give blocks of 2668 rows: 8 x 256
/// tokens are one block, 16 x 1024 seven) and the largest buffer the device allocates at
/// once (lavapipe's 128 MiB); at least 1.
pub fn block_rows(columns: usize, dtype: FloatDType, device: &Device) -> usize {
    let bytes = DType::from(dtype).size();
    let budget =
        largest_allocation(device).map_or(TRANSIENT_BYTES, |cap| TRANSIENT_BYTES.min(cap as usize));
    (budget / (columns.max(1) * bytes)).max(1)
}

/// The summed cross-entropy `sum_i weights[i] * ce(hidden[i] x table, targets[i])` over the
/// first `classes` columns of each row of the product, computed `block` rows at a time
/// (see the module doc), as a `[1]` tensor whose gradients reach `hidden` and `table`.
/// `hidden` is `[.., rows, width]` and `table` `[.., width, columns]` at the physical rank
/// (leading axes 1); the products read both in `compute` and write the logits in it; the
/// gradients come out in each tensor's precision. Targets must be in `0..classes`.
pub fn head_cross_entropy_sum(
    hidden: PhysTensor,
    table: PhysTensor,
    targets: Tensor<1, Int>,
    weights: Tensor<1>,
    classes: usize,
    compute: FloatDType,
    block: usize,
) -> Tensor<1> {
    let [rows, width] = last2(&hidden);
    let [width2, columns] = last2(&table);
    assert_eq!(
        width,
        width2,
        "hidden {:?} x table {:?}",
        hidden.dims(),
        table.dims()
    );
    assert!(
        classes > 0 && classes <= columns,
        "{classes} classes of {columns} columns"
    );
    let (h, w) = (hidden.clone().detach(), table.clone().detach());
    let (scale, scaled_weights) = match compute {
        FloatDType::F32 => (1.0, weights.clone()),
        _ => (
            LOW_PRECISION_SCALE,
            weights.clone().mul_scalar(LOW_PRECISION_SCALE),
        ),
    };
    // The table as the products read it, cast once for every block.
    let w_in = w.cast(compute);
    let w_t = w_in.clone().swap_dims(MAX_RANK - 2, MAX_RANK - 1);
    let mut loss: Option<Tensor<1>> = None;
    let mut d_hidden = Vec::new();
    let mut d_table: Option<PhysTensor> = None;
    for (start, n) in row_blocks(rows, block) {
        // Cast once for both of the block's products (no launch when it is in `compute`).
        let h_block = h.clone().narrow(MAX_RANK - 2, start, n).cast(compute);
        let t = targets.clone().narrow(0, start, n);
        let w_rows = weights.clone().narrow(0, start, n);
        let (logits, part) = block_loss(
            h_block.clone(),
            w_in.clone(),
            t.clone(),
            w_rows,
            classes,
            compute,
        );
        loss = Some(summed(loss, part));
        let g = scaled_weights.clone().narrow(0, start, n);
        let grad = physical(cross_entropy_rows_gradient(logits, t, g, classes));
        let f32 = FloatDType::F32;
        d_hidden.push(matmul_autocast(grad.clone(), w_t.clone(), compute, f32));
        let h_t = h_block.swap_dims(MAX_RANK - 2, MAX_RANK - 1);
        let part = matmul_autocast(h_t, grad, compute, f32);
        d_table = Some(summed(d_table, part));
    }
    let d_hidden = match d_hidden.len() {
        1 => d_hidden.remove(0),
        _ => Tensor::cat(d_hidden, MAX_RANK - 2),
    };
    let (Some(loss), Some(d_table)) = (loss, d_table) else {
        panic!("a cross-entropy over no rows");
    };
    with_gradients(loss, (hidden, d_hidden), (table, d_table), 1.0 / scale)
}

/// [`head_cross_entropy_sum`]'s value alone, for a pass that takes no gradient
/// (evaluation): a block's logits are dropped once its rows' loss is summed.
pub fn head_cross_entropy_value(
    hidden: PhysTensor,
    table: PhysTensor,
    targets: Tensor<1, Int>,
    weights: Tensor<1>,
    classes: usize,
    compute: FloatDType,
    block: usize,
) -> Tensor<1> {
    let [rows, _] = last2(&hidden);
    let (h, w_in) = (hidden.detach(), table.detach().cast(compute));
    row_blocks(rows, block)
        .map(|(start, n)| {
            let h_block = h.clone().narrow(MAX_RANK - 2, start, n);
            let t = targets.clone().narrow(0, start, n);
            let w_rows = weights.clone().narrow(0, start, n);
            block_loss(h_block, w_in.clone(), t, w_rows, classes, compute).1
        })
        .reduce(|a, b| a + b)
        .expect("a cross-entropy over no rows")
}

/// `(start, rows)` of each block of `block` rows (at least 1) among `rows`, the last
/// ragged.
fn row_blocks(rows: usize, block: usize) -> impl Iterator<Item = (usize, usize)> {
    let block = block.max(1);
    (0..rows)
        .step_by(block)
        .map(move |start| (start, block.min(rows - start)))
}

/// `part` added to the sum so far, if there is one.
fn summed<const D: usize>(sum: Option<Tensor<D>>, part: Tensor<D>) -> Tensor<D> {
    match sum {
        None => part,
        Some(sum) => sum + part,
    }
}

/// One block's logits `[n, columns]` (the product of `h_block` and `w_in`, written in
/// `compute`) and its rows' loss summed with `weights`.
fn block_loss(
    h_block: PhysTensor,
    w_in: PhysTensor,
    targets: Tensor<1, Int>,
    weights: Tensor<1>,
    classes: usize,
    compute: FloatDType,
) -> (Tensor<2>, Tensor<1>) {
    let [n, _] = last2(&h_block);
    let [_, columns] = last2(&w_in);
    let logits = matmul_autocast(h_block, w_in, compute, compute).reshape([n, columns]);
    let nll = cross_entropy_rows_within(logits.clone(), targets, classes);
    (logits, (nll * weights).sum())
}

/// A 2-D tensor at the physical rank (leading axes 1).
fn physical(t: Tensor<2>) -> PhysTensor {
    let [r, c] = t.dims();
    t.reshape(padded(&[r, c]).expect("a rank of 2 is within the physical rank"))
}

/// The last two axes of a tensor at the physical rank.
fn last2(t: &PhysTensor) -> [usize; 2] {
    let d = t.dims();
    [d[MAX_RANK - 2], d[MAX_RANK - 1]]
}
