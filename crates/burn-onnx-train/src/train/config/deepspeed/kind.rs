//! The kinds of JSON value a DeepSpeed key holds (counts, numbers, flags, text, betas), how
//! each is parsed, and [`Given`]: a key left out, `"auto"` or given.

use serde_json::Value;

/// How one kind of value is read from JSON, and what an error says was expected.
pub(super) struct Kind<T> {
    pub(super) parse: fn(&Value) -> Option<T>,
    pub(super) expected: &'static [&'static str],
}

pub(super) const COUNT: Kind<usize> = Kind {
    parse: as_count,
    expected: &["a non-negative integer"],
};
pub(super) const NUMBER: Kind<f64> = Kind {
    parse: Value::as_f64,
    expected: &["a number"],
};
pub(super) const FLOAT: Kind<f32> = Kind {
    parse: |v| v.as_f64().map(|x| x as f32),
    expected: &["a number"],
};
pub(super) const FLAG: Kind<bool> = Kind {
    parse: Value::as_bool,
    expected: &["true", "false"],
};
pub(super) const TEXT: Kind<String> = Kind {
    parse: |v| v.as_str().map(str::to_string),
    expected: &["a string"],
};
pub(super) const BETAS: Kind<[f32; 2]> = Kind {
    parse: as_betas,
    expected: &["[beta1, beta2]"],
};

/// A non-negative integer, also written as a float (`2e8`).
fn as_count(v: &Value) -> Option<usize> {
    let n = v.as_u64().or_else(|| {
        v.as_f64()
            .filter(|f| f.fract() == 0.0 && (0.0..=9.0e15).contains(f))
            .map(|f| f as u64)
    })?;
    usize::try_from(n).ok()
}

/// Two numbers.
fn as_betas(v: &Value) -> Option<[f32; 2]> {
    match v.as_array()?.as_slice() {
        [b1, b2] => Some([b1.as_f64()? as f32, b2.as_f64()? as f32]),
        _ => None,
    }
}

/// A key the file may leave out, give, or leave to `"auto"`.
#[derive(Clone, Copy)]
pub(super) enum Given<T> {
    /// Left out.
    Absent,
    /// `"auto"`: the run's own value.
    Auto,
    /// Given.
    Value(T),
}
