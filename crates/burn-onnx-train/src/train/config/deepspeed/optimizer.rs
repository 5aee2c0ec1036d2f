//! `optimizer`: its type (Adam, AdamW, Lamb, SGD) and params, `"auto"` keeping the run's.

use super::key::{Key, find};
use super::kind::{BETAS, FLAG, FLOAT, NUMBER, TEXT};
use super::reader::Ds;
use crate::train::config::OptimizerKind;

impl Ds {
    /// `optimizer`: its type and params.
    pub(super) fn optimizer(&mut self, key: &Key) {
        let keys = self.entries(key);
        let mut params = Vec::new();
        for k in &keys {
            match k.name {
                "type" => {}
                "params" => params = self.entries(k),
                _ => self.other(k),
            }
        }
        self.optimizer_kind(key, &keys, &params);
        for k in &params {
            let o = &self.c.optimizer;
            let current = (o.beta1, o.beta2, o.epsilon, o.weight_decay);
            match k.name {
                "lr" => {
                    if let Some(lr) =
                        self.given_or_auto(k, &NUMBER, "lr.initial_lr", self.c.lr.initial_lr)
                    {
                        self.c.lr.initial_lr = lr;
                    }
                }
                "betas" => {
                    let field = "optimizer.beta1, optimizer.beta2";
                    if let Some([b1, b2]) =
                        self.given_or_auto(k, &BETAS, field, [current.0, current.1])
                    {
                        (self.c.optimizer.beta1, self.c.optimizer.beta2) = (b1, b2);
                    }
                }
                "eps" => {
                    if let Some(e) = self.given_or_auto(k, &FLOAT, "optimizer.epsilon", current.2) {
                        self.c.optimizer.epsilon = e;
                    }
                }
                "weight_decay" => {
                    let field = "optimizer.weight_decay";
                    if let Some(w) = self.given_or_auto(k, &FLOAT, field, current.3) {
                        self.c.optimizer.weight_decay = w;
                    }
                }
                "momentum" => {
                    if let Some(m) = self.given(k, &NUMBER, "optimizer.momentum") {
                        self.c.optimizer.momentum = m;
                    }
                }
                "adam_w_mode" => {}
                _ => self.other(k),
            }
        }
    }

    /// `optimizer.type` (with `params.adam_w_mode` for Adam): our optimizer kind.
    fn optimizer_kind(&mut self, section: &Key, keys: &[Key], params: &[Key]) {
        let Some(ty) = find(keys, "type") else {
            return self.fail(format!(
                "{}.type: missing (Adam, AdamW, Lamb or SGD)",
                section.path
            ));
        };
        let adam_w_mode = match find(params, "adam_w_mode") {
            Some(m) => self.ok(m.read(&FLAG)),
            None => Some(true),
        };
        let (Some(name), Some(adam_w_mode)) = (self.ok(ty.read(&TEXT)), adam_w_mode) else {
            return;
        };
        let kind = match name.to_ascii_lowercase().as_str() {
            "adam" if adam_w_mode => OptimizerKind::Adamw,
            "adam" => OptimizerKind::Adam,
            "adamw" => OptimizerKind::Adamw,
            "lamb" => OptimizerKind::Lamb,
            "sgd" => OptimizerKind::Sgd,
            _ => {
                return self.fail(format!(
                    "{}: {name} is not available (Adam, AdamW, Lamb, SGD)",
                    ty.path
                ));
            }
        };
        self.mapped(&ty.shown(), "optimizer.kind", kind);
        self.c.optimizer.kind = kind;
    }
}
