//! `Einsum` with explicit subscripts (`"bhid,bhjd->bhij"`; implicit output allowed, and
//! `...` for leading or middle axes, right-aligned across operands, with equal sizes).
//! A letter repeated within one operand (`"ii->i"`) takes that diagonal first: an
//! identity mask multiply and a sum, so it stays differentiable. One operand: sum the
//! letters that are not kept, then transpose. Two or more: folded left to right, each
//! pair as one batched matrix product (batch letters, kept letters of each side,
//! contracted letters), so it costs what a hand-written MatMul would and stays
//! differentiable.

use burn::tensor::{Device, Tensor, TensorData};

use super::{Inputs, OpContext, OpOutput};
use crate::error::OpResult;
use crate::op_bail;
use crate::value::{FloatValue, MAX_RANK, Value};

/// The stand-in letter for the `k`-th axis covered by `...` (outside the ASCII letters).
fn ellipsis_letter(k: usize) -> char {
    char::from_u32(0xE000 + k as u32).unwrap_or('\u{E000}')
}

/// An operand with one letter per axis.
struct Term {
    value: FloatValue,
    letters: Vec<char>,
}

/// Subscripts of one term: the letters before and after `...` (if any).
type Subscripts = (Vec<char>, Option<Vec<char>>);

fn split_term(equation: &str, term: &str) -> OpResult<Subscripts> {
    let (before, after) = match term.split_once("...") {
        Some((b, a)) => (b, Some(a)),
        None => (term, None),
    };
    let ok = |t: &str| t.chars().all(|c| c.is_ascii_alphabetic());
    if !ok(before) || !after.is_none_or(ok) {
        op_bail!("equation {equation:?} has a term {term:?} with other than letters and one `...`");
    }
    Ok((before.chars().collect(), after.map(|a| a.chars().collect())))
}

fn parse(equation: &str, n: usize) -> OpResult<(Vec<Subscripts>, Option<Subscripts>)> {
    let eq: String = equation.chars().filter(|c| !c.is_whitespace()).collect();
    let (lhs, rhs) = match eq.split_once("->") {
        Some((l, r)) => (l, Some(r)),
        None => (eq.as_str(), None),
    };
    let terms = lhs
        .split(',')
        .map(|t| split_term(equation, t))
        .collect::<OpResult<Vec<_>>>()?;
    if terms.len() != n {
        op_bail!("equation {equation:?} does not describe {n} operand(s)");
    }
    Ok((terms, rhs.map(|r| split_term(equation, r)).transpose()?))
}

/// Expand `...` into `count` stand-in letters, the last `count` of `total`.
fn expand(sub: Subscripts, count: usize, total: usize) -> Vec<char> {
    let (mut letters, after) = sub;
    if let Some(after) = after {
        letters.extend((total - count..total).map(ellipsis_letter));
        letters.extend(after);
    }
    letters
}

/// Take the diagonal of every letter repeated within the term (`"ii"` -> `"i"`).
fn diagonals(t: Term, device: &Device) -> OpResult<Term> {
    let Term {
        mut value,
        mut letters,
    } = t;
    while let Some((i, j)) = (0..letters.len()).find_map(|i| {
        (i + 1..letters.len())
            .find(|&j| letters[j] == letters[i])
            .map(|j| (i, j))
    }) {
        let mut shape = value.shape();
        let n = shape[i];
        if shape[j] != n {
            op_bail!("repeated subscript axes have sizes {} and {}", n, shape[j]);
        }
        let (pi, pj) = (value.axis(i as i64)?, value.axis(j as i64)?);
        let mut mshape = [1usize; MAX_RANK];
        mshape[pi] = n;
        mshape[pj] = n;
        let eye: Vec<f32> = (0..n * n)
            .map(|k| if k / n == k % n { 1.0 } else { 0.0 })
            .collect();
        let mask: Tensor<MAX_RANK> =
            Tensor::from_data(TensorData::new(eye, mshape.to_vec()), device);
        let summed = (value.tensor * mask).sum_dim(pj);
        shape.remove(j);
        value = FloatValue::new(summed, value.rank).reshape(&shape)?;
        letters.remove(j);
    }
    Ok(Term { value, letters })
}

/// Sum away the axes whose letters are not in `keep`.
fn sum_out(t: Term, keep: &[char]) -> OpResult<Term> {
    let Term {
        mut value,
        mut letters,
    } = t;
    let mut i = letters.len();
    while i > 0 {
        i -= 1;
        if !keep.contains(&letters[i]) {
            let d = value.axis(i as i64)?;
            let mut shape = value.shape();
            shape.remove(i);
            value = FloatValue::new(value.tensor.sum_dim(d), value.rank).reshape(&shape)?;
            letters.remove(i);
        }
    }
    Ok(Term { value, letters })
}

fn permute(t: Term, order: &[char]) -> OpResult<FloatValue> {
    let rank = t.letters.len();
    let offset = MAX_RANK - rank;
    let mut phys = [0usize; MAX_RANK];
    for (i, p) in phys.iter_mut().enumerate() {
        *p = if i < offset {
            i
        } else {
            offset
                + t.letters
                    .iter()
                    .position(|c| *c == order[i - offset])
                    .ok_or("einsum: letter missing")?
        };
    }
    Ok(FloatValue::new(t.value.tensor.permute(phys), rank))
}

fn dims_of(t: &Term, letters: &[char]) -> Vec<usize> {
    let shape = t.value.shape();
    letters
        .iter()
        .map(|c| shape[t.letters.iter().position(|x| x == c).unwrap_or(0)])
        .collect()
}

/// Contract two terms, keeping the letters in `keep` (output letters plus those needed later).
fn contract(a: Term, b: Term, keep: &[char]) -> OpResult<Term> {
    // Letters used by one side only and not kept can be summed away first.
    let (a_letters, b_letters) = (a.letters.clone(), b.letters.clone());
    let a_keep: Vec<char> = a_letters
        .iter()
        .copied()
        .filter(|c| keep.contains(c) || b_letters.contains(c))
        .collect();
    let b_keep: Vec<char> = b_letters
        .iter()
        .copied()
        .filter(|c| keep.contains(c) || a_letters.contains(c))
        .collect();
    let a = sum_out(a, &a_keep)?;
    let b = sum_out(b, &b_keep)?;
    let batch: Vec<char> = a
        .letters
        .iter()
        .copied()
        .filter(|c| b.letters.contains(c) && keep.contains(c))
        .collect();
    let summed: Vec<char> = a
        .letters
        .iter()
        .copied()
        .filter(|c| b.letters.contains(c) && !keep.contains(c))
        .collect();
    let left: Vec<char> = a
        .letters
        .iter()
        .copied()
        .filter(|c| !b.letters.contains(c))
        .collect();
    let right: Vec<char> = b
        .letters
        .iter()
        .copied()
        .filter(|c| !a.letters.contains(c))
        .collect();
    let (bd, ld, sd, rd) = (
        dims_of(&a, &batch),
        dims_of(&a, &left),
        dims_of(&a, &summed),
        dims_of(&b, &right),
    );
    if dims_of(&b, &batch) != bd || dims_of(&b, &summed) != sd {
        op_bail!("einsum operands disagree on the sizes of shared letters");
    }
    let prod = |v: &[usize]| v.iter().product::<usize>();
    let a_order: Vec<char> = batch.iter().chain(&left).chain(&summed).copied().collect();
    let b_order: Vec<char> = batch.iter().chain(&summed).chain(&right).copied().collect();
    let a3 = permute(a, &a_order)?.reshape(&[prod(&bd), prod(&ld), prod(&sd)])?;
    let b3 = permute(b, &b_order)?.reshape(&[prod(&bd), prod(&sd), prod(&rd)])?;
    let out = FloatValue::new(a3.tensor.matmul(b3.tensor), 3);
    let shape: Vec<usize> = bd.iter().chain(&ld).chain(&rd).copied().collect();
    Ok(Term {
        value: out.reshape(&shape)?,
        letters: batch.into_iter().chain(left).chain(right).collect(),
    })
}

/// `Einsum`
pub fn einsum(ctx: &OpContext, inputs: Inputs) -> OpResult<OpOutput> {
    let values: Vec<Value> = inputs.0.into_iter().flatten().collect();
    let equation = ctx.attrs.string("equation", "")?;
    let (terms, output) = parse(&equation, values.len())?;
    let mut spans = Vec::with_capacity(values.len());
    for (v, t) in values.iter().zip(&terms) {
        let named = t.0.len() + t.1.as_ref().map_or(0, Vec::len);
        let rank = v.rank();
        if rank < named || (t.1.is_none() && rank != named) {
            op_bail!(
                "operand of shape {:?} does not match the subscripts of {equation:?}",
                v.shape()
            );
        }
        spans.push(rank - named);
    }
    let total = spans.iter().copied().max().unwrap_or(0);
    let mut operands = Vec::with_capacity(values.len());
    for ((v, sub), span) in values.into_iter().zip(terms).zip(spans) {
        let value = v.into_float(ctx.device)?;
        let letters = expand(sub, span, total);
        operands.push(diagonals(Term { value, letters }, ctx.device)?);
    }
    let output = match output {
        // `...` axes left out of an explicit output are summed, as NumPy does.
        Some(sub) => expand(sub, total, total),
        None => {
            // Implicit output: the `...` axes, then the letters that appear exactly once,
            // in alphabetical order.
            let all: Vec<char> = operands
                .iter()
                .flat_map(|t| t.letters.clone())
                .filter(|c| c.is_ascii_alphabetic())
                .collect();
            let mut once: Vec<char> = all
                .iter()
                .copied()
                .filter(|c| all.iter().filter(|x| *x == c).count() == 1)
                .collect();
            once.sort_unstable();
            (0..total).map(ellipsis_letter).chain(once).collect()
        }
    };
    let mut seen = output.clone();
    seen.sort_unstable();
    seen.dedup();
    if seen.len() != output.len() {
        op_bail!("output subscripts of {equation:?} repeat a letter");
    }
    let mut rest = operands.into_iter();
    let Some(mut acc) = rest.next() else {
        op_bail!("Einsum needs at least one operand")
    };
    let later: Vec<Term> = rest.collect();
    for (k, next) in later.iter().enumerate() {
        let mut keep = output.clone();
        keep.extend(
            later[k + 1..]
                .iter()
                .flat_map(|t| t.letters.iter().copied()),
        );
        let next = Term {
            value: next.value.clone(),
            letters: next.letters.clone(),
        };
        acc = contract(acc, next, &keep)?;
    }
    let acc = sum_out(acc, &output)?;
    if acc.letters.len() != output.len() {
        op_bail!(
            "output subscripts {:?} name letters no operand has",
            output.iter().collect::<String>()
        );
    }
    Ok(Value::Float(permute(acc, &output)?).into())
}
