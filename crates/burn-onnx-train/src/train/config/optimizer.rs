//! `[optimizer]` and `[lr]`: which optimizer with which attributes (ORT's
//! `training_optimizer_name` and `optimizer_attributes`) and the learning-rate schedule
//! (ORT's `lr_params`), each checked here.

use serde::{Deserialize, Serialize};

use super::invalid;
use crate::error::Result;

/// Optimizer choice (ORT: `training_optimizer_name`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "cli", derive(clap::ValueEnum))]
#[serde(rename_all = "lowercase")]
pub enum OptimizerKind {
    /// SGD with optional momentum.
    Sgd,
    /// Adam (L2 weight decay added to the gradient).
    Adam,
    /// AdamW (decoupled weight decay).
    Adamw,
    /// LAMB (layer-wise adaptive moments).
    Lamb,
}

/// Optimizer attributes (ORT: `optimizer_attributes`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct OptimizerConfig {
    /// Which optimizer.
    pub kind: OptimizerKind,
    /// Momentum for SGD (0 disables it).
    pub momentum: f64,
    /// Adam/AdamW/LAMB beta1.
    pub beta1: f32,
    /// Adam/AdamW/LAMB beta2.
    pub beta2: f32,
    /// Adam/AdamW/LAMB epsilon.
    pub epsilon: f32,
    /// Weight decay.
    pub weight_decay: f32,
    /// Initializer-name substrings excluded from weight decay (ORT's GPT-2 runner: biases
    /// and LayerNorm weights).
    pub no_weight_decay: Vec<String>,
}

impl Default for OptimizerConfig {
    fn default() -> Self {
        OptimizerConfig {
            kind: OptimizerKind::Adamw,
            momentum: 0.0,
            beta1: 0.9,
            beta2: 0.999,
            epsilon: 1e-8,
            weight_decay: 0.01,
            no_weight_decay: vec![
                "bias".into(),
                "ln_".into(),
                "LayerNorm".into(),
                "layer_norm".into(),
                "norm".into(),
            ],
        }
    }
}

/// Learning-rate schedule after warm-up (ORT: `lr_params.warmup_mode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "cli", derive(clap::ValueEnum))]
#[serde(rename_all = "lowercase")]
pub enum ScheduleKind {
    /// No warm-up, constant rate.
    None,
    /// Linear warm-up, then constant.
    Constant,
    /// Linear warm-up, then linear decay to 0 at the last step.
    Linear,
    /// Linear warm-up, then half-cosine decay to 0.
    Cosine,
    /// Linear warm-up, then polynomial decay (power `poly_power`) to `end_lr`.
    Poly,
}

/// Learning-rate parameters.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LrConfig {
    /// Peak learning rate.
    pub initial_lr: f64,
    /// Fraction of the update steps spent warming up, in [0, 1).
    pub warmup_ratio: f64,
    /// Schedule.
    pub mode: ScheduleKind,
    /// Poly: exponent.
    pub poly_power: f64,
    /// Poly: final rate.
    pub end_lr: f64,
}

impl Default for LrConfig {
    fn default() -> Self {
        LrConfig {
            initial_lr: 1e-3,
            warmup_ratio: 0.0,
            mode: ScheduleKind::None,
            poly_power: 1.0,
            end_lr: 0.0,
        }
    }
}

impl OptimizerConfig {
    /// The attributes' ranges (betas and momentum in [0, 1), epsilon positive, decay >= 0).
    pub fn validate(&self) -> Result<()> {
        for (field, beta) in [
            ("optimizer.beta1", self.beta1),
            ("optimizer.beta2", self.beta2),
        ] {
            if !(0.0..1.0).contains(&beta) {
                return Err(invalid(field, format!("{beta} is outside [0, 1)")));
            }
        }
        if self.epsilon <= 0.0 {
            return Err(invalid("optimizer.epsilon", "must be positive"));
        }
        if self.weight_decay < 0.0 {
            return Err(invalid("optimizer.weight_decay", "must be >= 0"));
        }
        if !(0.0..1.0).contains(&self.momentum) {
            return Err(invalid(
                "optimizer.momentum",
                format!("{} is outside [0, 1)", self.momentum),
            ));
        }
        Ok(())
    }
}

impl LrConfig {
    /// A positive peak rate, and a warm-up fraction in [0, 1) that the mode uses.
    pub fn validate(&self) -> Result<()> {
        if !(0.0..1.0).contains(&self.warmup_ratio) {
            return Err(invalid(
                "lr.warmup_ratio",
                format!("{} is outside [0, 1)", self.warmup_ratio),
            ));
        }
        if self.warmup_ratio > 0.0 && self.mode == ScheduleKind::None {
            return Err(invalid(
                "lr.warmup_ratio",
                format!(
                    "{} has no effect with lr.mode = \"none\" (no warm-up); use mode \"constant\" for warm-up then a constant rate",
                    self.warmup_ratio
                ),
            ));
        }
        if !(self.initial_lr > 0.0 && self.initial_lr.is_finite()) {
            return Err(invalid(
                "lr.initial_lr",
                format!("{} must be a positive number", self.initial_lr),
            ));
        }
        Ok(())
    }
}
