//! `Einsum` with explicit subscripts (`"bhid,bhjd->bhij"`; implicit output allowed,
//! ellipsis not). One operand: sum the letters that are not kept, then transpose. Two or
//! more: folded left to right, each pair as one batched matrix product (batch letters,
//! kept letters of each side, contracted letters), so it costs what a hand-written MatMul
//! would and stays differentiable.

use super::{Inputs, OpContext, OpOutput};
use crate::error::OpResult;
use crate::op_bail;
use crate::value::{FloatValue, MAX_RANK, Value};

/// An operand with one letter per axis.
struct Term {
    value: FloatValue,
    letters: Vec<char>,
}

fn parse(equation: &str, n: usize) -> OpResult<(Vec<Vec<char>>, Option<Vec<char>>)> {
    let eq: String = equation.chars().filter(|c| !c.is_whitespace()).collect();
    if eq.contains("...") {
        op_bail!("ellipsis in einsum equation {equation:?} is not supported");
    }
    let (lhs, rhs) = match eq.split_once("->") {
        Some((l, r)) => (l, Some(r.chars().collect::<Vec<_>>())),
        None => (eq.as_str(), None),
    };
    let terms: Vec<Vec<char>> = lhs.split(',').map(|t| t.chars().collect()).collect();
    if terms.len() != n
        || terms
            .iter()
            .flatten()
            .chain(rhs.iter().flatten())
            .any(|c| !c.is_ascii_alphabetic())
    {
        op_bail!("equation {equation:?} does not describe {n} operand(s) with letters only");
    }
    Ok((terms, rhs))
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
    let mut operands = Vec::with_capacity(values.len());
    for (v, letters) in values.into_iter().zip(terms) {
        let value = v.into_float(ctx.device)?;
        if value.rank != letters.len() {
            op_bail!(
                "operand of shape {:?} does not match subscripts {:?}",
                value.shape(),
                letters.iter().collect::<String>()
            );
        }
        let mut seen = letters.clone();
        seen.sort_unstable();
        seen.dedup();
        if seen.len() != letters.len() {
            op_bail!("repeated letters within one operand (diagonals) are not supported");
        }
        operands.push(Term { value, letters });
    }
    let output = output.unwrap_or_else(|| {
        // Implicit output: letters that appear exactly once, in alphabetical order.
        let all: Vec<char> = operands.iter().flat_map(|t| t.letters.clone()).collect();
        let mut once: Vec<char> = all
            .iter()
            .copied()
            .filter(|c| all.iter().filter(|x| *x == c).count() == 1)
            .collect();
        once.sort_unstable();
        once
    });
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
