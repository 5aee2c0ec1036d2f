//! The reader [`Ds`]: the config being set, the problems, the log lines and the keys without
//! effect; its helpers that read a key for a field (with `"auto"` kept or refused), and the
//! top level, which hands each section to its own file and notes which batch keys the file
//! has ([`BatchKeys`]).

use std::path::PathBuf;

use serde::Serialize;
use serde_json::{Map, Value};

use super::Step;
use super::key::Key;
use super::kind::{COUNT, FLOAT, Given, Kind};
use super::no_ops::NO_OPS;
use crate::train::config::TrainingConfig;

/// A value as the log shows it (JSON).
pub(super) fn shown(value: impl Serialize) -> String {
    serde_json::to_string(&value).unwrap_or_else(|e| e.to_string())
}

/// Which of the three batch keys the file has (`"auto"` counts: it stands for the run's
/// value), and `train_batch_size` itself.
pub(super) struct BatchKeys {
    /// `train_micro_batch_size_per_gpu` is there.
    pub(super) micro: bool,
    /// `gradient_accumulation_steps` is there.
    pub(super) accum: bool,
    /// `train_batch_size`.
    pub(super) total: Given<usize>,
}

/// The reader: the config being set, and what it found on the way.
pub(super) struct Ds {
    pub(super) c: TrainingConfig,
    pub(super) errors: Vec<String>,
    pub(super) mapped: Vec<String>,
    pub(super) no_ops: Vec<(String, &'static str)>,
    /// The first `nvme_path` read (its key and directory): the one offload directory.
    pub(super) nvme_path: Option<(String, PathBuf)>,
}

impl Ds {
    /// Note a problem; reading goes on.
    pub(super) fn fail(&mut self, message: String) {
        self.errors.push(message);
    }

    /// The value of `step`, its error noted.
    pub(super) fn ok<T>(&mut self, step: Step<T>) -> Option<T> {
        step.map_err(|e| self.fail(e)).ok()
    }

    /// Log that `source` (a key and its value, or a rule) set our `field` to `value`.
    pub(super) fn mapped(&mut self, source: &str, field: &str, value: impl Serialize) {
        self.mapped
            .push(format!("{source} → {field} = {}", shown(value)));
    }

    /// Log that `path`'s `"auto"` kept our `field` at `value`.
    pub(super) fn kept(&mut self, path: &str, field: &str, value: impl Serialize) {
        self.mapped.push(format!(
            "{path} = \"auto\" → {field} kept = {}",
            shown(value)
        ));
    }

    /// `key` read as `kind` (`"auto"` refused), logged as setting `field`; `None` with the
    /// error noted.
    pub(super) fn given<T: Serialize + Copy>(
        &mut self,
        key: &Key,
        kind: &Kind<T>,
        field: &str,
    ) -> Option<T> {
        let v = self.ok(key.read(kind))?;
        self.mapped(&key.shown(), field, v);
        Some(v)
    }

    /// `key` read as `kind` for our `field`: `Some` to set (logged), `None` for `"auto"`
    /// (the run's `current` value kept, logged) or a wrong value (noted).
    pub(super) fn given_or_auto<T: Serialize + Copy>(
        &mut self,
        key: &Key,
        kind: &Kind<T>,
        field: &str,
        current: impl Serialize,
    ) -> Option<T> {
        match self.ok(key.read_or_auto(kind))? {
            Some(v) => {
                self.mapped(&key.shown(), field, v);
                Some(v)
            }
            None => {
                self.kept(&key.path, field, current);
                None
            }
        }
    }

    /// `key` read as `kind`, `"auto"` allowed; `None` where its value is wrong (noted).
    pub(super) fn optional<T>(&mut self, key: &Key, kind: &Kind<T>) -> Option<Given<T>> {
        Some(match self.ok(key.read_or_auto(kind))? {
            Some(v) => Given::Value(v),
            None => Given::Auto,
        })
    }

    /// The keys of section `key`; an error noted when it is not an object.
    pub(super) fn entries<'v>(&mut self, key: &Key<'v>) -> Vec<Key<'v>> {
        match key.value.as_object() {
            Some(map) => map.iter().map(|(name, v)| key.child(name, v)).collect(),
            None => {
                self.fail(key.expected(&["an object"]));
                Vec::new()
            }
        }
    }

    /// A key without a mapping: noted as without effect where [`NO_OPS`] says so for its
    /// value, refused by path otherwise.
    pub(super) fn other(&mut self, key: &Key) {
        match NO_OPS.iter().find(|n| n.names(key)) {
            Some(n) if n.harmless(key.value) => self.no_ops.push((key.path.clone(), n.why)),
            Some(n) => self.fail(format!(
                "{} = {}: not available here; only {} is ({})",
                key.path,
                key.value,
                n.only.unwrap_or_default(),
                n.why
            )),
            None => self.fail(format!(
                "{}: not supported by this trainer (no equivalent here, or a misspelt key)",
                key.path
            )),
        }
    }

    /// The top level; the precision sections, the batch check and the scheduler go last,
    /// as they read what the other keys set.
    pub(super) fn root(&mut self, root: &Map<String, Value>) {
        let keys: Vec<Key> = root
            .iter()
            .map(|(name, value)| Key {
                path: name.clone(),
                name,
                value,
            })
            .collect();
        let mut batch = BatchKeys {
            micro: false,
            accum: false,
            total: Given::Absent,
        };
        let (mut fp16, mut bf16, mut scheduler) = (None, None, None);
        for key in &keys {
            match key.name {
                "train_micro_batch_size_per_gpu" => {
                    batch.micro = true;
                    self.micro_batch(key);
                }
                "gradient_accumulation_steps" => {
                    batch.accum = true;
                    let current = self.c.train.gradient_accumulation_steps;
                    let field = "train.gradient_accumulation_steps";
                    if let Some(n) = self.given_or_auto(key, &COUNT, field, current) {
                        self.c.train.gradient_accumulation_steps = n;
                    }
                }
                "train_batch_size" => {
                    batch.total = self.optional(key, &COUNT).unwrap_or(Given::Absent);
                }
                "gradient_clipping" => {
                    let current = self.c.train.max_grad_norm;
                    if let Some(v) = self.given_or_auto(key, &FLOAT, "train.max_grad_norm", current)
                    {
                        self.c.train.max_grad_norm = v;
                    }
                }
                "steps_per_print" => {
                    if let Some(n) = self.given(key, &COUNT, "logging.display_loss_steps") {
                        self.c.logging.display_loss_steps = n;
                    }
                }
                "fp16" => fp16 = Some(key),
                "bf16" | "bfloat16" if bf16.is_some() => self.fail(format!(
                    "{}: bf16 and bfloat16 (its older name) are the same section; give one",
                    key.path
                )),
                "bf16" | "bfloat16" => bf16 = Some(key),
                "communication_data_type" => self.communication(key),
                "zero_optimization" => self.zero(key),
                "optimizer" => self.optimizer(key),
                "scheduler" => scheduler = Some(key),
                "tensorboard" => self.tensorboard(key),
                _ => self.other(key),
            }
        }
        self.precision(fp16, bf16);
        self.batch(batch);
        if let Some(s) = scheduler {
            self.scheduler(s);
        }
    }
}
