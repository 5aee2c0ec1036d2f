//! Mixed precision: the arithmetic precision of forward and backward ([`Precision`]) and
//! the loss scaling that keeps small f16 gradients from flushing to zero ([`LossScaler`],
//! PyTorch's `GradScaler` and ORT's dynamic loss scale).
//!
//! Parameters, optimizer state and updates stay in f32 (master weights). Under f16/bf16 the
//! interpreter casts the operands of MatMul, Gemm, Conv and ConvTranspose to the low
//! precision and their results back to f32 (the autocast list); every other op, the loss
//! and the gradients of the parameters are f32. The loss is multiplied by the scale before
//! backward; the gradients are divided by it before they are combined across ranks. When
//! any gradient on any rank is inf or NaN, every rank skips the update (weights and
//! optimizer state untouched) and a dynamic scale halves; after
//! `loss_scale_growth_interval` finite updates in a row it doubles.

use burn::module::{Module, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::tensor::{FloatDType, Tensor};
use burn_ort_dist::{Communicator, ReduceOp, ScaledUpdate, UpdateReport, UpdateStrategy};
use serde::{Deserialize, Serialize};

use crate::error::{OnnxError, Result};
use crate::kernels::{NonFiniteFlag, unscale_and_check};
use crate::model::OnnxModel;

/// Arithmetic precision of the weighted ops (config `precision`, `--precision`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "cli", derive(clap::ValueEnum))]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    /// Everything in f32.
    #[default]
    F32,
    /// IEEE half precision for MatMul/Gemm/Conv (ORT's `use_mixed_precision`); dynamic loss
    /// scaling by default.
    F16,
    /// bfloat16 for MatMul/Gemm/Conv (ORT's `use_bfloat16`): f32's range, so no loss
    /// scaling by default.
    Bf16,
}

impl Precision {
    /// The dtype the autocast list runs in (`None`: f32 throughout).
    pub fn autocast(self) -> Option<FloatDType> {
        match self {
            Precision::F32 => None,
            Precision::F16 => Some(FloatDType::F16),
            Precision::Bf16 => Some(FloatDType::BF16),
        }
    }
}

/// The first dynamic scale (PyTorch's and ORT's).
pub const INITIAL_DYNAMIC_SCALE: f64 = 65536.0;

/// The scaler's state, saved in checkpoints so that a resumed run scales exactly as the
/// uninterrupted one would.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct ScalerState {
    /// The current scale.
    pub scale: f64,
    /// Finite updates since the scale last changed.
    pub good_steps: usize,
}

/// Loss scaling: static, dynamic, or off (a static scale of 1).
#[derive(Debug, Clone, PartialEq)]
pub struct LossScaler {
    state: ScalerState,
    dynamic: bool,
    growth_interval: usize,
}

impl LossScaler {
    /// The scaler of config `precision`, `loss_scale` and `loss_scale_growth_interval`:
    /// `loss_scale` absent means dynamic under f16 and off otherwise; 0 dynamic; a positive
    /// value static.
    pub fn new(precision: Precision, loss_scale: Option<f64>, growth_interval: usize) -> Self {
        let dynamic = match loss_scale {
            None => precision == Precision::F16,
            Some(s) => s == 0.0,
        };
        let scale = if dynamic {
            INITIAL_DYNAMIC_SCALE
        } else {
            loss_scale.unwrap_or(1.0)
        };
        LossScaler {
            state: ScalerState {
                scale,
                good_steps: 0,
            },
            dynamic,
            growth_interval,
        }
    }

    /// The scale the next backward multiplies the loss by.
    pub fn scale(&self) -> f64 {
        self.state.scale
    }

    /// What a checkpoint keeps (`None` when the scale never changes).
    pub fn state(&self) -> Option<ScalerState> {
        self.dynamic.then_some(self.state)
    }

    /// Continue from a checkpoint's state.
    pub fn restore(&mut self, saved: Option<ScalerState>) {
        if let (true, Some(s)) = (self.dynamic, saved) {
            self.state = s;
        }
    }

    /// One optimizer update through `strategy`: `grads` (of the scaled loss) are divided by
    /// the scale first (inside the update, where the strategy can:
    /// [`UpdateStrategy::update_scaled`]); when any gradient on any rank of `world` is inf
    /// or NaN every rank skips the update (the model comes back unchanged, the reported norm
    /// is inf) and a dynamic scale halves. Without scaling this is `strategy.update`,
    /// nothing added.
    #[allow(clippy::too_many_arguments)]
    pub fn step(
        &mut self,
        strategy: &mut dyn UpdateStrategy<OnnxModel>,
        world: &dyn Communicator,
        lr: f64,
        model: OnnxModel,
        grads: GradientsParams,
        max_norm: f32,
        tensor_norms: bool,
    ) -> Result<(OnnxModel, UpdateReport)> {
        if !self.dynamic && self.state.scale == 1.0 {
            return Ok(strategy.update(lr, model, grads, max_norm, tensor_norms)?);
        }
        // A fused optimizer on a GPU divides the gradients in its own update and skips it
        // on overflow: no pass of its own over every gradient.
        let (model, mut grads) = match strategy.update_scaled(
            lr,
            model,
            grads,
            (max_norm, tensor_norms),
            (self.state.scale, world.world_size()),
        )? {
            ScaledUpdate::Done {
                module,
                report,
                overflow,
            } => {
                if overflow {
                    tracing::warn!(
                        scale = self.state.scale,
                        "inf/NaN gradients: update skipped"
                    );
                }
                self.update(overflow);
                return Ok((module, report));
            }
            ScaledUpdate::Declined(model, grads) => (model, grads),
        };
        let overflow = self.unscale(&model, &mut grads, world)?;
        let result = if overflow {
            tracing::warn!(
                scale = self.state.scale,
                "inf/NaN gradients: update skipped"
            );
            (
                model,
                UpdateReport {
                    grad_norm: f32::INFINITY.into(),
                    tensor_grad_norms: Vec::new(),
                },
            )
        } else {
            strategy.update(lr, model, grads, max_norm, tensor_norms)?
        };
        self.update(overflow);
        Ok(result)
    }

    /// Divide `grads` of `model` by the scale and report whether any gradient on any rank
    /// of `world` is inf or NaN (a collective: every rank gets the same answer).
    fn unscale(
        &self,
        model: &OnnxModel,
        grads: &mut GradientsParams,
        world: &dyn Communicator,
    ) -> Result<bool> {
        let mut unscale = Unscale {
            grads,
            factor: (1.0 / self.state.scale) as f32,
            flag: NonFiniteFlag::new(&model.device()),
        };
        model.visit(&mut unscale);
        let raised = unscale.flag.raised().map_err(|e| {
            OnnxError::field("precision", format!("reading the overflow flag: {e}"))
        })?;
        let mut flag = [if raised { 1.0f32 } else { 0.0 }];
        world.all_reduce(&mut flag, ReduceOp::Sum)?;
        Ok(flag[0] > 0.0)
    }

    /// After an update that was skipped (`overflow`) or applied: halve a dynamic scale on
    /// overflow, double it after `growth_interval` finite updates in a row.
    fn update(&mut self, overflow: bool) {
        if !self.dynamic {
            return;
        }
        if overflow {
            self.state = ScalerState {
                scale: (self.state.scale / 2.0).max(f64::MIN_POSITIVE),
                good_steps: 0,
            };
        } else {
            self.state.good_steps += 1;
            if self.state.good_steps >= self.growth_interval {
                self.state = ScalerState {
                    scale: self.state.scale * 2.0,
                    good_steps: 0,
                };
            }
        }
    }
}

/// Divides every gradient by the scale and notes non-finite values (one fused pass per
/// gradient on CubeCL devices).
struct Unscale<'a> {
    grads: &'a mut GradientsParams,
    factor: f32,
    flag: NonFiniteFlag,
}

impl ModuleVisitor for Unscale<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        if let Some(g) = self.grads.remove::<D>(param.id) {
            let g = unscale_and_check(g, self.factor, &mut self.flag);
            self.grads.register(param.id, g);
        }
    }
}

/// A clear error for a scale that cannot work.
pub fn check_loss_scale(scale: Option<f64>) -> Result<()> {
    match scale {
        Some(s) if !(s.is_finite() && s >= 0.0) => Err(OnnxError::field(
            "config.precision.loss_scale",
            format!("{s}: use 0 (dynamic) or a positive scale"),
        )),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scaler(loss_scale: Option<f64>, precision: Precision, interval: usize) -> LossScaler {
        LossScaler::new(precision, loss_scale, interval)
    }

    #[test]
    fn dynamic_scale_halves_on_overflow_and_doubles_after_the_interval() {
        let mut s = scaler(None, Precision::F16, 3);
        assert_eq!(s.scale(), 65536.0);
        s.update(true);
        assert_eq!(s.scale(), 32768.0);
        for _ in 0..2 {
            s.update(false);
        }
        assert_eq!(s.scale(), 32768.0, "two finite updates are not yet three");
        s.update(false);
        assert_eq!(s.scale(), 65536.0);
        s.update(false);
        s.update(true);
        assert_eq!(
            s.state(),
            Some(ScalerState {
                scale: 32768.0,
                good_steps: 0
            }),
            "an overflow restarts the count"
        );
    }

    #[test]
    fn static_and_off_scales_never_change() {
        for mut s in [
            scaler(Some(1024.0), Precision::F16, 1),
            scaler(None, Precision::Bf16, 1),
            scaler(None, Precision::F32, 1),
        ] {
            let before = s.scale();
            s.update(true);
            s.update(false);
            assert_eq!(s.scale(), before);
            assert_eq!(s.state(), None);
        }
        assert_eq!(
            scaler(Some(0.0), Precision::F32, 1).scale(),
            65536.0,
            "0 asks for a dynamic scale in any precision"
        );
    }
}
