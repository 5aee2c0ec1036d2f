//! One key of a DeepSpeed file (its path, name and value) and how it is read as a kind of
//! value, `"auto"` refused or allowed.

use serde_json::Value;

use super::Step;
use super::kind::Kind;

/// One key of the file: its full dotted path, its own name and its value.
pub(super) struct Key<'v> {
    pub(super) path: String,
    pub(super) name: &'v str,
    pub(super) value: &'v Value,
}

/// What `"auto"` on a key the Trainer does not fill is told.
const AUTO_ONLY: &str = "\"auto\" is resolved only where Hugging Face's Trainer fills it (the batch sizes, gradient_accumulation_steps, gradient_clipping, optimizer.params lr/betas/eps/weight_decay, scheduler.params warm-up and total steps, fp16/bf16 enabled); give a value";

impl<'v> Key<'v> {
    /// The key `name` inside this one.
    pub(super) fn child(&self, name: &'v str, value: &'v Value) -> Key<'v> {
        Key {
            path: format!("{}.{name}", self.path),
            name,
            value,
        }
    }

    /// `path = value`, as the log shows what the file said.
    pub(super) fn shown(&self) -> String {
        format!("{} = {}", self.path, self.value)
    }

    /// Hugging Face's placeholder.
    pub(super) fn is_auto(&self) -> bool {
        self.value.as_str() == Some("auto")
    }

    /// The value as `kind`; `"auto"` refused.
    pub(super) fn read<T>(&self, kind: &Kind<T>) -> Step<T> {
        if self.is_auto() {
            return Err(format!("{}: {AUTO_ONLY}", self.path));
        }
        (kind.parse)(self.value).ok_or_else(|| self.expected(kind.expected))
    }

    /// The value as `kind`, or `None` for `"auto"`.
    pub(super) fn read_or_auto<T>(&self, kind: &Kind<T>) -> Step<Option<T>> {
        if self.is_auto() {
            return Ok(None);
        }
        match (kind.parse)(self.value) {
            Some(v) => Ok(Some(v)),
            None => Err(self.expected(&[kind.expected, &["\"auto\""]].concat())),
        }
    }

    /// `path: expected a, b or c, got value`.
    pub(super) fn expected(&self, what: &[&str]) -> String {
        let what = match what {
            [rest @ .., last] if !rest.is_empty() => format!("{} or {last}", rest.join(", ")),
            _ => what.concat(),
        };
        format!("{}: expected {what}, got {}", self.path, self.value)
    }
}

/// The key called `name` among `keys`.
pub(super) fn find<'k, 'v>(keys: &'k [Key<'v>], name: &str) -> Option<&'k Key<'v>> {
    keys.iter().find(|k| k.name == name)
}
