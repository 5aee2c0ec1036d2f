//! `TfIdfVectorizer` (opset 9) over integer token ids (`pool_int64s`); string pools
//! (`pool_strings`) are refused, as this interpreter has no string tensors.
//!
//! The pool's n-grams (sizes `min_gram_length..=max_gram_length`) are kept in a map from the
//! n-gram to its id, with every prefix of a kept n-gram in a second set: walking a row with
//! a given skip distance stops as soon as the items read so far are no prefix, as the
//! reference implementation's trie does. The output holds counts (`TF`), indicators
//! (`IDF`) or weighted counts (`TFIDF`); it is not differentiable (its input is integer).

use std::collections::{HashMap, HashSet};

use ndarray::{ArrayD, IxDyn};

use super::{Inputs, OpContext, OpOutput};
use crate::error::OpResult;
use crate::graph::attributes::Attr;
use crate::op_bail;
use crate::value::{FloatValue, Value};

/// The n-grams to count: n-gram to its 0-based id (an index into `ngram_indexes`), and
/// every prefix of them.
struct Pool {
    grams: HashMap<Vec<i64>, usize>,
    prefixes: HashSet<Vec<i64>>,
}

/// Decode `pool_int64s` by `ngram_counts` (the start of each n-gram size's run).
fn build_pool(pool: &[i64], counts: &[i64], min_len: usize, max_len: usize) -> OpResult<Pool> {
    let mut grams = HashMap::new();
    let mut prefixes = HashSet::new();
    let mut id = 0usize;
    for (i, &start) in counts.iter().enumerate() {
        let size = i + 1;
        let end = counts.get(i + 1).copied().unwrap_or(pool.len() as i64);
        if start < 0 || end < start || end as usize > pool.len() {
            op_bail!(
                "ngram_counts {counts:?} does not split a pool of {} items",
                pool.len()
            );
        }
        let items = &pool[start as usize..end as usize];
        let n = items.len() / size;
        if (min_len..=max_len).contains(&size) {
            for gram in items.chunks_exact(size) {
                for p in 1..=size {
                    prefixes.insert(gram[..p].to_vec());
                }
                grams.insert(gram.to_vec(), id);
                id += 1;
            }
        } else {
            id += n;
        }
    }
    Ok(Pool { grams, prefixes })
}

/// Count the pool's n-grams in `row` into `freq` (indexed by output column).
fn count_row(
    row: &[i64],
    pool: &Pool,
    indexes: &[usize],
    min_len: usize,
    max_len: usize,
    max_skip: usize,
    freq: &mut [i64],
) {
    let mut start_size = min_len;
    for skip in 1..=max_skip + 1 {
        for start in 0..row.len() {
            if start + skip * start_size.saturating_sub(1) >= row.len() {
                break;
            }
            let mut gram = Vec::new();
            let mut item = start;
            while gram.len() < max_len && item < row.len() {
                gram.push(row[item]);
                if !pool.prefixes.contains(&gram) {
                    break;
                }
                if gram.len() >= start_size
                    && let Some(&id) = pool.grams.get(&gram)
                {
                    freq[indexes[id]] += 1;
                }
                item += skip;
            }
        }
        // Unigrams are counted once: they do not depend on the skip distance.
        if start_size == 1 {
            start_size = 2;
            if start_size > max_len {
                break;
            }
        }
    }
}

/// `TfIdfVectorizer` (opset 9): n-gram counts of a `[C]` or `[B, C]` integer input over the
/// pool `pool_int64s`, as `[output_size]` or `[B, output_size]` floats, where
/// `output_size` is one more than the largest of `ngram_indexes`.
pub fn tfidf_vectorizer(ctx: &OpContext, mut inputs: Inputs) -> OpResult<OpOutput> {
    let attrs = ctx.attrs;
    if attrs.has("pool_strings") {
        op_bail!(
            "attribute `pool_strings`: string pools are not supported (no string tensors), \
             only `pool_int64s`"
        );
    }
    let Some(pool) = attrs.ints("pool_int64s")? else {
        op_bail!("attribute `pool_int64s` is required (string pools are not supported)")
    };
    let x = match inputs.take(0, "X")? {
        Value::Int(a) => a,
        other => op_bail!("X must be an integer tensor, got {}", other.kind()),
    };
    let mode = attrs.string("mode", "")?;
    let min_len = attrs.int("min_gram_length", 1)?;
    let max_len = attrs.int("max_gram_length", 1)?;
    let max_skip = attrs.int("max_skip_count", 0)?;
    if min_len < 1 || max_len < min_len || max_skip < 0 {
        op_bail!(
            "min_gram_length {min_len}, max_gram_length {max_len} and max_skip_count \
             {max_skip} must satisfy 1 <= min <= max and skip >= 0"
        );
    }
    let (min_len, max_len, max_skip) = (min_len as usize, max_len as usize, max_skip as usize);
    let counts = attrs.ints("ngram_counts")?.unwrap_or_default();
    let indexes = attrs.ints("ngram_indexes")?.unwrap_or_default();
    if let Some(&bad) = indexes.iter().find(|&&i| i < 0) {
        op_bail!("ngram_indexes holds a negative index {bad}");
    }
    let indexes: Vec<usize> = indexes.iter().map(|&i| i as usize).collect();
    let Some(&largest) = indexes.iter().max() else {
        op_bail!("attribute `ngram_indexes` is required and must not be empty")
    };
    let out_size = largest + 1;
    let weights = match attrs.get("weights") {
        None => Vec::new(),
        Some(Attr::Floats(w)) => w.clone(),
        Some(Attr::Float(w)) => vec![*w],
        Some(other) => op_bail!("attribute `weights` should be a list of floats, found {other:?}"),
    };
    let pool = build_pool(&pool, &counts, min_len, max_len)?;
    if pool.grams.values().any(|&id| id >= indexes.len()) {
        op_bail!(
            "the pool holds more n-grams than ngram_indexes has entries ({})",
            indexes.len()
        );
    }
    if !weights.is_empty() && weights.len() < out_size {
        op_bail!(
            "weights has {} entries, the output has {out_size} columns",
            weights.len()
        );
    }

    let shape = x.shape().to_vec();
    let (rows, cols, out_shape) = match shape[..] {
        [] => (1, 1, vec![out_size]),
        [c] => (1, c, vec![out_size]),
        [b, c] if b > 0 => (b, c, vec![b, out_size]),
        _ => op_bail!("X must have shape [C] or [B, C] with B > 0, got {shape:?}"),
    };
    let flat: Vec<i64> = x.iter().copied().collect();
    let mut freq = vec![0i64; rows * out_size];
    if cols > 0 {
        for (r, row) in flat.chunks_exact(cols).enumerate() {
            let f = &mut freq[r * out_size..(r + 1) * out_size];
            count_row(row, &pool, &indexes, min_len, max_len, max_skip, f);
        }
    }
    let y: Vec<f32> = freq
        .iter()
        .enumerate()
        .map(|(p, &f)| {
            let w = weights.get(p % out_size).copied();
            match (mode.as_str(), w) {
                ("TF", _) => Ok(f as f32),
                ("IDF", Some(w)) => Ok(if f > 0 { w } else { 0.0 }),
                ("IDF", None) => Ok(if f > 0 { 1.0 } else { 0.0 }),
                ("TFIDF", Some(w)) => Ok(w * f as f32),
                ("TFIDF", None) => Ok(f as f32),
                _ => op_bail!("mode must be TF, IDF or TFIDF, got {mode:?}"),
            }
        })
        .collect::<OpResult<_>>()?;
    let y = ArrayD::from_shape_vec(IxDyn(&out_shape), y)?;
    Ok(Value::Float(FloatValue::from_array(&y, ctx.device)?).into())
}
