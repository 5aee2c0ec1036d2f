//! The string ops on host string tensors ([`Value::Str`]): `StringConcat`, `StringSplit`,
//! `RegexFullMatch` and `StringNormalizer` (`Equal` of strings is in `compare.rs`,
//! `LabelEncoder` in `onnx_ml.rs`).

use ndarray::{ArrayD, Axis, IxDyn};

use super::broadcast::host_binary;
use super::{Inputs, OpContext, OpOutput};
use crate::error::OpResult;
use crate::graph::attributes::Attr;
use crate::op_bail;
use crate::value::Value;

/// String input `i`, or an error naming it.
fn strings(inputs: &mut Inputs, i: usize, what: &str) -> OpResult<ArrayD<String>> {
    match inputs.take(i, what)? {
        Value::Str(a) => Ok(a),
        other => op_bail!("{what} must hold strings, got a {} tensor", other.kind()),
    }
}

/// A `strings` attribute (empty when absent).
fn string_list(ctx: &OpContext, name: &str) -> OpResult<Vec<String>> {
    match ctx.attrs.get(name) {
        None => Ok(Vec::new()),
        Some(Attr::Strings(s)) => Ok(s.clone()),
        Some(other) => op_bail!("attribute {name} must be a list of strings, got {other:?}"),
    }
}

/// `StringConcat(X, Y)`: element-wise concatenation, broadcast.
pub fn string_concat(_ctx: &OpContext, mut inputs: Inputs) -> OpResult<OpOutput> {
    let x = strings(&mut inputs, 0, "X")?;
    let y = strings(&mut inputs, 1, "Y")?;
    Ok(Value::Str(host_binary(&x, &y, |a, b| format!("{a}{b}"))?).into())
}

/// One string split as Python's `str.split(delimiter, maxsplit)`: on the delimiter
/// (consecutive ones give empty pieces), or without one on runs of whitespace (no empty
/// pieces); at most `maxsplit` splits when given.
fn split_one(s: &str, delimiter: Option<&str>, maxsplit: Option<usize>) -> Vec<String> {
    let limit = maxsplit.map_or(usize::MAX, |m| m + 1);
    match delimiter {
        Some(d) => s.splitn(limit, d).map(str::to_string).collect(),
        None => {
            let mut pieces = Vec::new();
            let mut rest = s.trim_start();
            while !rest.is_empty() {
                if pieces.len() + 1 == limit {
                    pieces.push(rest.to_string());
                    break;
                }
                let end = rest.find(char::is_whitespace).unwrap_or(rest.len());
                pieces.push(rest[..end].to_string());
                rest = rest[end..].trim_start();
            }
            pieces
        }
    }
}

/// `StringSplit(X)` (`delimiter`, `maxsplit`): `Y`, each string's pieces along a new last
/// axis as long as the most pieces (padded with empty strings), and `Z`, the piece counts.
pub fn string_split(ctx: &OpContext, mut inputs: Inputs) -> OpResult<OpOutput> {
    let x = strings(&mut inputs, 0, "X")?;
    let delimiter = ctx.attrs.string("delimiter", "")?;
    let delimiter = (!delimiter.is_empty()).then_some(delimiter.as_str());
    let maxsplit = match ctx.attrs.int("maxsplit", -1)? {
        m if m < 0 => None,
        m => Some(m as usize),
    };
    let pieces: Vec<Vec<String>> = x
        .iter()
        .map(|s| split_one(s, delimiter, maxsplit))
        .collect();
    let width = pieces.iter().map(Vec::len).max().unwrap_or(0);
    let mut shape = x.shape().to_vec();
    let counts = ArrayD::from_shape_vec(
        IxDyn(&shape),
        pieces.iter().map(|p| p.len() as i64).collect(),
    )?;
    shape.push(width);
    let flat = pieces
        .into_iter()
        .flat_map(|mut p| {
            p.resize(width, String::new());
            p
        })
        .collect();
    let y = ArrayD::from_shape_vec(IxDyn(&shape), flat)?;
    Ok(vec![Value::Str(y), Value::Int(counts)].into())
}

/// `RegexFullMatch(X)` (`pattern`, RE2 syntax): whether each string matches the whole
/// pattern.
pub fn regex_full_match(ctx: &OpContext, mut inputs: Inputs) -> OpResult<OpOutput> {
    let x = strings(&mut inputs, 0, "X")?;
    let pattern = ctx.attrs.string("pattern", "")?;
    let re = regex::Regex::new(&format!("^(?:{pattern})$"))
        .map_err(|e| crate::error::OpError(format!("pattern {pattern:?}: {e}")))?;
    Ok(Value::Bool(x.mapv(|s| re.is_match(&s))).into())
}

/// `StringNormalizer(X)` (`stopwords`, `is_case_sensitive`, `case_change_action` NONE,
/// LOWER or UPPER): `X` (`[C]` or `[1, C]`) without its stop words, then case-changed; when
/// every string is a stop word, one empty string.
pub fn string_normalizer(ctx: &OpContext, mut inputs: Inputs) -> OpResult<OpOutput> {
    let x = strings(&mut inputs, 0, "X")?;
    let sensitive = ctx.attrs.int("is_case_sensitive", 0)? != 0;
    let fold = |s: &str| {
        if sensitive {
            s.to_string()
        } else {
            s.to_lowercase()
        }
    };
    let stop: std::collections::HashSet<String> = string_list(ctx, "stopwords")?
        .iter()
        .map(|s| fold(s))
        .collect();
    let change = ctx.attrs.string("case_change_action", "NONE")?;
    let rows = match x.shape() {
        [_] => false,
        [1, _] => true,
        s => op_bail!("X must be [C] or [1, C], got {s:?}"),
    };
    let mut kept: Vec<String> = x
        .iter()
        .filter(|s| !stop.contains(&fold(s)))
        .map(|s| match change.as_str() {
            "LOWER" => Ok(s.to_lowercase()),
            "UPPER" => Ok(s.to_uppercase()),
            "NONE" => Ok(s.clone()),
            other => op_bail!("case_change_action {other:?} is not NONE, LOWER or UPPER"),
        })
        .collect::<OpResult<_>>()?;
    if kept.is_empty() {
        kept.push(String::new());
    }
    let n = kept.len();
    let y = ArrayD::from_shape_vec(IxDyn(&[n]), kept)?;
    Ok(Value::Str(if rows { y.insert_axis(Axis(0)) } else { y }).into())
}
