//! The precision sections `fp16` and `bf16` (`"auto"` included), fp16's loss scaling, and
//! `communication_data_type`.

use serde::Serialize;

use super::key::{Key, find};
use super::kind::{COUNT, FLAG, Kind, NUMBER};
use super::reader::{Ds, shown};
use crate::train::precision::Precision;

/// A precision section whose `enabled` is on: its path, whether by `"auto"`, what it sets.
struct Enabled {
    path: String,
    auto: bool,
    dtype: Precision,
}

impl Ds {
    /// `fp16` and `bf16` together: at most one on, which sets `precision.dtype` (`"auto"`:
    /// on when the run already computes in it); fp16's loss scaling applies when fp16 is on.
    pub(super) fn precision(&mut self, fp16: Option<&Key>, bf16: Option<&Key>) {
        let fp16 = fp16.map(|k| self.entries(k)).unwrap_or_default();
        let bf16 = bf16.map(|k| self.entries(k)).unwrap_or_default();
        let half = self.enabled(&fp16, Precision::F16);
        let brain = self.enabled(&bf16, Precision::Bf16);
        match (&half, &brain) {
            (Some(f), Some(b)) => {
                let message = conflict(f, b);
                self.fail(message);
            }
            (Some(on), None) | (None, Some(on)) => self.dtype(on),
            (None, None) => {}
        }
        self.loss_scaling(&fp16, half.is_some() && brain.is_none());
        for k in bf16.iter().filter(|k| k.name != "enabled") {
            self.other(k);
        }
    }

    /// The `enabled` of a precision section (`keys`) when it is on; `"auto"` is on when the
    /// run already computes in `dtype`.
    fn enabled(&mut self, keys: &[Key], dtype: Precision) -> Option<Enabled> {
        let key = find(keys, "enabled")?;
        let given = self.ok(key.read_or_auto(&FLAG))?;
        let on = given.unwrap_or(self.c.precision.dtype == dtype);
        on.then(|| Enabled {
            path: key.path.clone(),
            auto: given.is_none(),
            dtype,
        })
    }

    /// `precision.dtype` from the section that is on.
    fn dtype(&mut self, on: &Enabled) {
        if on.auto {
            self.kept(&on.path, "precision.dtype", on.dtype);
        } else {
            self.mapped(&format!("{} = true", on.path), "precision.dtype", on.dtype);
            self.c.precision.dtype = on.dtype;
        }
    }

    /// The keys of `fp16` besides `enabled`: loss scaling applied when fp16 is `on`, every
    /// key checked either way.
    fn loss_scaling(&mut self, keys: &[Key], on: bool) {
        for k in keys {
            match k.name {
                "enabled" => {}
                "loss_scale" => {
                    if let Some(s) = self.read_if(on, k, &NUMBER, "precision.loss_scale") {
                        self.c.precision.loss_scale = Some(s);
                    }
                }
                "loss_scale_window" => {
                    let field = "precision.loss_scale_growth_interval";
                    if let Some(n) = self.read_if(on, k, &COUNT, field) {
                        self.c.precision.loss_scale_growth_interval = n;
                    }
                }
                "initial_scale_power" => {
                    if self.ok(k.read(&COUNT)).is_some_and(|p| on && p != 16) {
                        self.fail(format!(
                            "{}: the dynamic loss scale starts at 2^16 here; only 16 is honoured",
                            k.path
                        ));
                    }
                }
                _ => self.other(k),
            }
        }
    }

    /// `key` read as `kind`: logged as setting `field` and returned when `on`, only checked
    /// otherwise.
    fn read_if<T: Serialize + Copy>(
        &mut self,
        on: bool,
        key: &Key,
        kind: &Kind<T>,
        field: &str,
    ) -> Option<T> {
        if on {
            return self.given(key, kind, field);
        }
        self.ok(key.read(kind));
        None
    }

    /// `communication_data_type`: "fp16" or "fp32" reduction of the gradients.
    pub(super) fn communication(&mut self, key: &Key) {
        let fp16 = match key.value.as_str() {
            Some("fp16") => true,
            Some("fp32") => false,
            _ if key.value.is_null() => return self.other(key),
            _ => {
                let message = key.expected(&["\"fp16\"", "\"fp32\"", "null"]);
                return self.fail(format!("{message} (no bf16 reduction here)"));
            }
        };
        self.mapped(&key.shown(), "parallel.allreduce_in_fp16", fp16);
        self.c.parallel.allreduce_in_fp16 = fp16;
    }
}

/// The error for fp16 and bf16 both on, naming both keys and which came from `"auto"`.
fn conflict(fp16: &Enabled, bf16: &Enabled) -> String {
    let auto: Vec<String> = [fp16, bf16]
        .iter()
        .filter(|e| e.auto)
        .map(|e| {
            format!(
                " ({} is \"auto\" and the run computes in {})",
                e.path,
                shown(e.dtype)
            )
        })
        .collect();
    format!(
        "{} and {} are both on{}: DeepSpeed refuses fp16 and bf16 together; enable one",
        fp16.path,
        bf16.path,
        auto.concat()
    )
}
