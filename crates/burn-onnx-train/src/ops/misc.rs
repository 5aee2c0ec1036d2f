//! `Unique`, `ReverseSequence` and `Det`.
//!
//! `Unique` runs on the host (its outputs are a selection and integer bookkeeping, with no
//! useful gradient). `ReverseSequence` moves float rows on the device with a `select` whose
//! row numbers the host computes, so gradients flow through it. `Det` finds the partial
//! pivoting order of each matrix on the host, then eliminates on the device with
//! differentiable ops: the determinant is the signed product of the pivots.

use std::cmp::Ordering;

use burn::tensor::{Tensor, TensorData};
use ndarray::{ArrayD, Axis, IxDyn};

use super::{Inputs, OpContext, OpOutput};
use crate::error::OpResult;
use crate::op_bail;
use crate::value::{FloatValue, Value, int_tensor_1d, norm_axis};

/// The unique slices of `slices` (each a `Vec` of elements, compared lexicographically
/// with `cmp`): for each unique slice in output order, the index of its first occurrence;
/// for each input slice, its unique index; and the counts.
fn unique_slices<T>(
    slices: &[Vec<T>],
    cmp: impl Fn(&T, &T) -> Ordering,
    sorted: bool,
) -> (Vec<usize>, Vec<i64>, Vec<i64>) {
    let lex = |a: &Vec<T>, b: &Vec<T>| {
        a.iter()
            .zip(b)
            .map(|(x, y)| cmp(x, y))
            .find(|o| o.is_ne())
            .unwrap_or(Ordering::Equal)
    };
    // Stable sort keeps the first occurrence first within each group of equal slices.
    let mut order: Vec<usize> = (0..slices.len()).collect();
    order.sort_by(|&a, &b| lex(&slices[a], &slices[b]));
    let mut firsts: Vec<usize> = Vec::new();
    let mut group_of = vec![0usize; slices.len()];
    for (pos, &i) in order.iter().enumerate() {
        if pos == 0 || lex(&slices[order[pos - 1]], &slices[i]).is_ne() {
            firsts.push(i);
        }
        group_of[i] = firsts.len() - 1;
    }
    // Output order: sorted groups, or groups by first occurrence.
    let mut out_order: Vec<usize> = (0..firsts.len()).collect();
    if !sorted {
        out_order.sort_by_key(|&g| firsts[g]);
    }
    let mut rank_of_group = vec![0usize; firsts.len()];
    for (r, &g) in out_order.iter().enumerate() {
        rank_of_group[g] = r;
    }
    let mut counts = vec![0i64; firsts.len()];
    let inverse: Vec<i64> = group_of
        .iter()
        .map(|&g| {
            let r = rank_of_group[g];
            counts[r] += 1;
            r as i64
        })
        .collect();
    let first_out = out_order.iter().map(|&g| firsts[g]).collect();
    (first_out, inverse, counts)
}

/// Split `a` into its slices along `axis` (or its elements when `axis` is `None`).
fn slices_of<T: Clone>(a: &ArrayD<T>, axis: Option<usize>) -> Vec<Vec<T>> {
    match axis {
        None => a.iter().map(|v| vec![v.clone()]).collect(),
        Some(ax) => a
            .axis_iter(Axis(ax))
            .map(|s| s.iter().cloned().collect())
            .collect(),
    }
}

/// Pick slices `picks` of `a` along `axis` (or elements of the flattened `a`).
fn pick<T: Clone>(a: &ArrayD<T>, axis: Option<usize>, picks: &[usize]) -> OpResult<ArrayD<T>> {
    Ok(match axis {
        None => {
            let flat: Vec<T> = a.iter().cloned().collect();
            ArrayD::from_shape_vec(
                IxDyn(&[picks.len()]),
                picks.iter().map(|&i| flat[i].clone()).collect(),
            )?
        }
        Some(ax) => a.select(Axis(ax), picks),
    })
}

/// `Unique` (`axis`, `sorted`): outputs `Y`, `indices` (first occurrences), `inverse_indices`
/// and `counts`. Sorted order is ascending (lexicographic for slices along `axis`); unsorted
/// is the order of first occurrence.
pub fn unique(ctx: &OpContext, mut inputs: Inputs) -> OpResult<OpOutput> {
    let x = inputs.take(0, "X")?;
    let sorted = ctx.attrs.int("sorted", 1)? != 0;
    let axis = match ctx.attrs.get("axis") {
        Some(_) => Some(norm_axis(ctx.attrs.int("axis", 0)?, x.rank())?),
        None => None,
    };
    let (y, firsts, inverse, counts) = match x {
        Value::Str(_) => op_bail!("expected a numeric tensor, got strings"),
        Value::Sequence(_) => op_bail!("expected a tensor, got a sequence"),
        Value::Float(f) => {
            let a = f.to_array()?;
            let (firsts, inv, counts) = unique_slices(
                &slices_of(&a, axis),
                |p, q| p.partial_cmp(q).unwrap_or_else(|| p.total_cmp(q)),
                sorted,
            );
            let y = Value::Float(FloatValue::from_array(
                &pick(&a, axis, &firsts)?,
                ctx.device,
            )?);
            (y, firsts, inv, counts)
        }
        Value::Int(a) => {
            let (firsts, inv, counts) = unique_slices(&slices_of(&a, axis), i64::cmp, sorted);
            (Value::Int(pick(&a, axis, &firsts)?), firsts, inv, counts)
        }
        Value::Bool(a) => {
            let (firsts, inv, counts) = unique_slices(&slices_of(&a, axis), bool::cmp, sorted);
            (Value::Bool(pick(&a, axis, &firsts)?), firsts, inv, counts)
        }
    };
    let list = |v: Vec<i64>| -> OpResult<Value> {
        Ok(Value::Int(ArrayD::from_shape_vec(IxDyn(&[v.len()]), v)?))
    };
    Ok(vec![
        y,
        list(firsts.iter().map(|&i| i as i64).collect())?,
        list(inverse)?,
        list(counts)?,
    ]
    .into())
}

/// `ReverseSequence(input, sequence_lens)` (`batch_axis`, `time_axis`, each 0 or 1): for
/// batch entry `b`, reverses the first `sequence_lens[b]` steps along the time axis.
pub fn reverse_sequence(ctx: &OpContext, mut inputs: Inputs) -> OpResult<OpOutput> {
    let x = inputs.take(0, "input")?;
    let lens = inputs.take(1, "sequence_lens")?.int_list("sequence_lens")?;
    let batch_axis = ctx.attrs.int("batch_axis", 1)?;
    let time_axis = ctx.attrs.int("time_axis", 0)?;
    let shape = x.shape();
    if shape.len() < 2 || !matches!((batch_axis, time_axis), (0, 1) | (1, 0)) {
        op_bail!(
            "input {shape:?} must have rank >= 2 and batch_axis/time_axis be 0 and 1, got {batch_axis}/{time_axis}"
        );
    }
    let (ba, ta) = (batch_axis as usize, time_axis as usize);
    let (nb, nt) = (shape[ba], shape[ta]);
    if lens.len() != nb {
        op_bail!(
            "sequence_lens has {} entries for a batch of {nb}",
            lens.len()
        );
    }
    // Source row of the [shape[0] * shape[1], inner] view for each destination row.
    let mut rows = Vec::with_capacity(nb * nt);
    for i0 in 0..shape[0] {
        for i1 in 0..shape[1] {
            let (b, t) = if ba == 0 { (i0, i1) } else { (i1, i0) };
            let len = lens[b];
            if len < 0 || len as usize > nt {
                op_bail!("sequence length {len} is outside 0..={nt}");
            }
            let src_t = if t < len as usize {
                len as usize - 1 - t
            } else {
                t
            };
            let (s0, s1) = if ba == 0 { (b, src_t) } else { (src_t, b) };
            rows.push((s0 * shape[1] + s1) as i64);
        }
    }
    let outer = shape[0] * shape[1];
    let inner: usize = shape[2..].iter().product();
    Ok(match x {
        Value::Str(_) => op_bail!("expected a numeric tensor, got strings"),
        Value::Sequence(_) => op_bail!("expected a tensor, got a sequence"),
        Value::Float(f) => {
            if outer * inner == 0 {
                return Ok(Value::Float(f).into());
            }
            let t = f.reshape(&[outer, inner])?.into_rank::<2>()?;
            let y = t.select(0, int_tensor_1d(rows, ctx.device));
            Value::Float(FloatValue::from_rank(y)?.reshape(&shape)?)
        }
        Value::Int(a) => Value::Int(host_rows(&a, &rows, inner, &shape)?),
        Value::Bool(a) => Value::Bool(host_rows(&a, &rows, inner, &shape)?),
    }
    .into())
}

fn host_rows<T: Clone>(
    a: &ArrayD<T>,
    rows: &[i64],
    inner: usize,
    shape: &[usize],
) -> OpResult<ArrayD<T>> {
    let flat: Vec<T> = a.iter().cloned().collect();
    let mut out = Vec::with_capacity(flat.len());
    for &r in rows {
        let r = r as usize;
        out.extend_from_slice(&flat[r * inner..(r + 1) * inner]);
    }
    Ok(ArrayD::from_shape_vec(IxDyn(shape), out)?)
}

/// Partial pivoting of one `m x m` matrix (row-major) in f64: the row order, the sign of
/// that permutation, and which elimination steps met an exactly zero pivot column.
fn pivot_order(a: &[f64], m: usize) -> (Vec<usize>, f64, Vec<bool>) {
    let mut lu = a.to_vec();
    let mut perm: Vec<usize> = (0..m).collect();
    let mut sign = 1.0;
    let mut zero = vec![false; m];
    for k in 0..m {
        let best = (k..m)
            .max_by(|&i, &j| {
                lu[i * m + k]
                    .abs()
                    .total_cmp(&lu[j * m + k].abs())
                    .then(j.cmp(&i))
            })
            .unwrap_or(k);
        if best != k {
            for col in 0..m {
                lu.swap(k * m + col, best * m + col);
            }
            perm.swap(k, best);
            sign = -sign;
        }
        let pivot = lu[k * m + k];
        if pivot == 0.0 {
            zero[k] = true;
            continue;
        }
        for i in k + 1..m {
            let f = lu[i * m + k] / pivot;
            for col in k..m {
                lu[i * m + col] -= f * lu[k * m + col];
            }
        }
    }
    (perm, sign, zero)
}

/// `Det`: determinants of the `[*, M, M]` input's matrices, shape `[*]`.
pub fn det(ctx: &OpContext, mut inputs: Inputs) -> OpResult<OpOutput> {
    let x = inputs.float(0, "X", ctx.device)?;
    let shape = x.shape();
    let r = shape.len();
    if r < 2 || shape[r - 1] != shape[r - 2] {
        op_bail!("input must be [*, M, M], got {shape:?}");
    }
    let m = shape[r - 1];
    let batch_shape = shape[..r - 2].to_vec();
    let b: usize = batch_shape.iter().product();
    if b == 0 || m == 0 {
        let a = ArrayD::from_elem(IxDyn(&batch_shape), 1.0f32);
        let v = FloatValue::from_array(&a, ctx.device)?;
        return Ok(Value::Float(v).into());
    }
    let host: Vec<f64> = x.to_array()?.iter().map(|&v| f64::from(v)).collect();
    let mut rows = Vec::with_capacity(b * m);
    let mut signs = Vec::with_capacity(b);
    let mut zero_pivot = vec![0f32; b * m];
    for bi in 0..b {
        let (perm, sign, zero) = pivot_order(&host[bi * m * m..(bi + 1) * m * m], m);
        rows.extend(perm.iter().map(|&p| (bi * m + p) as i64));
        signs.push(sign as f32);
        for (k, z) in zero.iter().enumerate() {
            if *z {
                zero_pivot[bi * m + k] = 1.0;
            }
        }
    }
    let dev = ctx.device;
    let mut a = x
        .reshape(&[b * m, m])?
        .into_rank::<2>()?
        .select(0, int_tensor_1d(rows, dev))
        .reshape([b, m, m]);
    let guard: Tensor<3> = Tensor::from_data(TensorData::new(zero_pivot, vec![b, m, 1]), dev);
    let mut det: Tensor<3> = Tensor::from_data(TensorData::new(signs, vec![b, 1, 1]), dev);
    for k in 0..m {
        let pivot = a.clone().narrow(1, k, 1).narrow(2, k, 1);
        det = det.mul(pivot.clone());
        if k + 1 == m {
            break;
        }
        // A zero pivot column (exactly singular) divides by 1: its entries below are zero.
        let safe = pivot.add(guard.clone().narrow(1, k, 1));
        let row = a.clone().narrow(1, k, 1);
        let below = a.clone().narrow(1, k + 1, m - k - 1);
        let factors = below.clone().narrow(2, k, 1).div(safe);
        let below = below.sub(factors.mul(row));
        a = Tensor::cat(vec![a.narrow(1, 0, k + 1), below], 1);
    }
    Ok(Value::Float(FloatValue::from_rank(det.reshape([b]))?.reshape(&batch_shape)?).into())
}
