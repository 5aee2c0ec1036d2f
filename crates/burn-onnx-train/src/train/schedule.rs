//! Learning-rate schedules with linear warm-up, with the semantics of Hugging Face's
//! `get_*_schedule_with_warmup` (PyTorch `LambdaLR`): the rate for update `t` (0-based) is
//! `initial_lr * f(t)`, with `W = floor(warmup_ratio * T)` warm-up updates out of `T`.
//!
//! * warm-up (`t < W`): `f = t / W`
//! * `none`: `f = 1` (no warm-up)
//! * `constant`: `f = 1` after warm-up
//! * `linear`: `f = max(0, (T - t) / (T - W))`
//! * `cosine`: `f = max(0, (1 + cos(pi * (t - W) / (T - W))) / 2)`
//! * `poly`: `lr = (initial - end) * (1 - (t - W) / (T - W))^power + end`

use std::f64::consts::PI;

use super::config::{LrConfig, ScheduleKind};

/// A schedule resolved for a run of `total` updates.
#[derive(Debug, Clone, PartialEq)]
pub struct LrSchedule {
    config: LrConfig,
    total: usize,
    warmup: usize,
}

impl LrSchedule {
    /// Resolve `config` for `total` optimizer updates.
    pub fn new(config: &LrConfig, total: usize) -> Self {
        let warmup = if config.mode == ScheduleKind::None {
            0
        } else {
            (config.warmup_ratio * total as f64).floor() as usize
        };
        LrSchedule {
            config: config.clone(),
            total,
            warmup,
        }
    }

    /// Number of warm-up updates.
    pub fn warmup_steps(&self) -> usize {
        self.warmup
    }

    /// Learning rate of update `t` (0-based).
    pub fn lr(&self, t: usize) -> f64 {
        let c = &self.config;
        let (t, w, total) = (t as f64, self.warmup as f64, self.total as f64);
        if t < w {
            return c.initial_lr * t / w;
        }
        let span = (total - w).max(1.0);
        let progress = ((t - w) / span).min(1.0);
        match c.mode {
            ScheduleKind::None | ScheduleKind::Constant => c.initial_lr,
            ScheduleKind::Linear => c.initial_lr * ((total - t) / span).max(0.0),
            ScheduleKind::Cosine => c.initial_lr * (0.5 * (1.0 + (PI * progress).cos())).max(0.0),
            ScheduleKind::Poly => {
                (c.initial_lr - c.end_lr) * (1.0 - progress).powf(c.poly_power) + c.end_lr
            }
        }
    }
}
