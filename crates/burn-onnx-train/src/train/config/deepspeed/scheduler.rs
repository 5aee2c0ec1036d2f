//! `scheduler`: DeepSpeed's three schedulers this trainer runs, their defaults, and how
//! type, warm-up and total steps become the run's learning-rate schedule.

use super::key::{Key, find};
use super::kind::{COUNT, Given, NUMBER, TEXT};
use super::reader::Ds;
use crate::train::config::ScheduleKind;

/// One of DeepSpeed's schedulers this trainer runs: its name, its mode here, the params it
/// takes.
struct Scheduler {
    name: &'static str,
    mode: ScheduleKind,
    params: &'static [&'static str],
}

const SCHEDULERS: [Scheduler; 3] = [
    Scheduler {
        name: "WarmupLR",
        mode: ScheduleKind::Constant,
        params: &[
            "warmup_min_lr",
            "warmup_max_lr",
            "warmup_num_steps",
            "warmup_type",
        ],
    },
    Scheduler {
        name: "WarmupDecayLR",
        mode: ScheduleKind::Linear,
        params: &[
            "warmup_min_lr",
            "warmup_max_lr",
            "warmup_num_steps",
            "warmup_type",
            "total_num_steps",
        ],
    },
    Scheduler {
        name: "WarmupCosineLR",
        mode: ScheduleKind::Cosine,
        params: &[
            "warmup_min_ratio",
            "warmup_num_steps",
            "warmup_type",
            "total_num_steps",
            "cos_min_ratio",
        ],
    },
];

/// DeepSpeed's `warmup_num_steps` and `warmup_max_lr` where a scheduler leaves them out.
const DEEPSPEED_WARMUP_STEPS: usize = 1000;
const DEEPSPEED_WARMUP_MAX_LR: f64 = 0.001;

impl Ds {
    /// `scheduler`: the mode, the peak rate, the warm-up as a fraction of the updates and the
    /// updates; DeepSpeed's defaults for what its params leave out, where this trainer can
    /// honour them.
    pub(super) fn scheduler(&mut self, key: &Key) {
        let keys = self.entries(key);
        let mut params = Vec::new();
        for k in &keys {
            match k.name {
                "type" => {}
                "params" => params = self.entries(k),
                _ => self.other(k),
            }
        }
        let Some(s) = self.scheduler_type(key, &keys) else {
            return;
        };
        let mut warmup = Given::Absent;
        for k in &params {
            match k.name {
                name if !s.params.contains(&name) => self.other(k),
                "warmup_num_steps" => warmup = self.optional(k, &COUNT).unwrap_or(Given::Auto),
                "warmup_max_lr" => {
                    if let Some(lr) =
                        self.given_or_auto(k, &NUMBER, "lr.initial_lr", self.c.lr.initial_lr)
                    {
                        self.c.lr.initial_lr = lr;
                    }
                }
                "total_num_steps" => self.total_num_steps(k),
                "warmup_type" => self.warmup_type(k),
                "warmup_min_lr" => self.zero_only(k, true, "the warm-up here starts from 0"),
                "warmup_min_ratio" => self.zero_only(k, false, "the warm-up here starts from 0"),
                "cos_min_ratio" => self.zero_only(k, false, "the schedules here decay to 0"),
                _ => self.other(k),
            }
        }
        let params_path = format!("{}.params", key.path);
        if s.params.contains(&"warmup_max_lr") && find(&params, "warmup_max_lr").is_none() {
            let path = format!("{params_path}.warmup_max_lr (left out: DeepSpeed's default)");
            self.mapped(&path, "lr.initial_lr", DEEPSPEED_WARMUP_MAX_LR);
            self.c.lr.initial_lr = DEEPSPEED_WARMUP_MAX_LR;
        }
        self.warmup(&params_path, warmup);
        self.unhonoured_defaults(s, &params_path, &params);
        self.c.lr.mode = s.mode;
    }

    /// `scheduler.type`: which of [`SCHEDULERS`] (logged as our `lr.mode`).
    fn scheduler_type(&mut self, section: &Key, keys: &[Key]) -> Option<&'static Scheduler> {
        let names = "WarmupLR, WarmupDecayLR, WarmupCosineLR";
        let Some(ty) = find(keys, "type") else {
            self.fail(format!("{}.type: missing ({names})", section.path));
            return None;
        };
        let name = self.ok(ty.read(&TEXT))?;
        let Some(s) = SCHEDULERS.iter().find(|s| s.name == name) else {
            self.fail(format!("{}: {name} is not available ({names})", ty.path));
            return None;
        };
        self.mapped(&ty.shown(), "lr.mode", s.mode);
        Some(s)
    }

    /// `scheduler.params.total_num_steps`: the updates, so the micro-steps are that many
    /// times the accumulation (the run counts steps, not epochs).
    fn total_num_steps(&mut self, key: &Key) {
        let accum = self.c.train.gradient_accumulation_steps;
        let field = "train.num_train_steps";
        match self.optional(key, &COUNT) {
            Some(Given::Value(updates)) => match updates.checked_mul(accum) {
                Some(steps) => {
                    self.mapped(&key.shown(), field, steps);
                    (self.c.train.num_train_steps, self.c.train.num_train_epochs) = (steps, 0);
                }
                None => self.fail(format!("{}: {updates} updates is too many", key.path)),
            },
            Some(_) => self.kept(&key.path, field, self.c.train.num_train_steps),
            None => {}
        }
    }

    /// The warm-up, `warmup_num_steps` under `params` (its DeepSpeed default where left
    /// out), as our fraction of the run's updates; `"auto"` keeps the run's fraction.
    fn warmup(&mut self, params: &str, warmup: Given<usize>) {
        let (steps, path) = match warmup {
            Given::Auto => {
                let path = format!("{params}.warmup_num_steps");
                return self.kept(&path, "lr.warmup_ratio", self.c.lr.warmup_ratio);
            }
            Given::Value(n) => (n, format!("{params}.warmup_num_steps")),
            Given::Absent => (
                DEEPSPEED_WARMUP_STEPS,
                format!("{params}.warmup_num_steps (left out: DeepSpeed's default)"),
            ),
        };
        let updates =
            (self.c.train.num_train_steps / self.c.train.gradient_accumulation_steps.max(1)).max(1);
        if steps >= updates {
            return self.fail(format!(
                "{path}: {steps} warm-up updates are not fewer than the run's {updates} updates"
            ));
        }
        let ratio = steps as f64 / updates as f64;
        self.mapped(&format!("{path} = {steps}"), "lr.warmup_ratio", ratio);
        self.c.lr.warmup_ratio = ratio;
    }

    /// DeepSpeed's scheduler defaults this trainer cannot run, refused where `params` (the
    /// keys under `path`) leave them out: the logarithmic warm-up (when there is one), and
    /// WarmupCosineLR's floor of 0.0001 of the peak.
    fn unhonoured_defaults(&mut self, s: &Scheduler, path: &str, params: &[Key]) {
        let warms_up = self.c.lr.warmup_ratio > 0.0;
        if warms_up && find(params, "warmup_type").is_none() {
            self.fail(format!(
                "{path}.warmup_type: DeepSpeed's {} warms up logarithmically by default; the warm-up here is linear: set \"warmup_type\": \"linear\"",
                s.name
            ));
        }
        if s.params.contains(&"cos_min_ratio") && find(params, "cos_min_ratio").is_none() {
            self.fail(format!(
                "{path}.cos_min_ratio: DeepSpeed's {} decays to 0.0001 of the peak by default; the cosine here decays to 0: set \"cos_min_ratio\": 0",
                s.name
            ));
        }
    }

    /// `warmup_type`: only "linear" is honoured.
    fn warmup_type(&mut self, key: &Key) {
        match self.ok(key.read(&TEXT)).as_deref() {
            Some("linear") | None => {}
            Some("log") => self.fail(format!(
                "{}: \"log\" is not honoured: the warm-up here is linear",
                key.path
            )),
            Some(_) => self.fail(key.expected(&["\"linear\"", "\"log\""])),
        }
    }

    /// A scheduler param that must be 0 here (`why`); where the Trainer fills `"auto"`
    /// (`auto_is_zero`), it fills 0.
    fn zero_only(&mut self, key: &Key, auto_is_zero: bool, why: &str) {
        let value = if auto_is_zero {
            self.ok(key.read_or_auto(&NUMBER)).map(|v| v.unwrap_or(0.0))
        } else {
            self.ok(key.read(&NUMBER))
        };
        if value.is_some_and(|v| v != 0.0) {
            self.fail(format!(
                "{} = {}: not honoured ({why})",
                key.path, key.value
            ));
        }
    }
}
