//! Gradient norms and clipping (`torch.nn.utils.clip_grad_norm_`): the sums of squares
//! every update strategy measures the global norm from (f64 on the host, on the device for
//! gradients on a GPU), the clip factor they scale by, and the norm an update reports
//! ([`GradNorm`]: read, or left on the device until a report shows it).

use burn::module::{Module, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::Tensor;

use crate::error::{DistResult, state_error};

/// The global gradient norm an update measured: read already, or its sum of squares still
/// on the device (a fused optimizer that clips on the device), so that the update never
/// waits for the device to read it; [`GradNorm::value`] reads it when a report shows it.
#[derive(Debug, Clone)]
pub enum GradNorm {
    /// The norm, on the host.
    Read(f32),
    /// `[sum of squares, ..]` on the device: the norm is its first value's square root.
    OnDevice(Tensor<1>),
}

impl GradNorm {
    /// The norm (a device read for [`GradNorm::OnDevice`]).
    pub fn value(&self) -> DistResult<f32> {
        match self {
            GradNorm::Read(norm) => Ok(*norm),
            GradNorm::OnDevice(buffer) => Ok(Self::of_squares(Self::read(buffer)?[0])),
        }
    }

    /// A device buffer `[sum of squares, ..]` read to the host.
    pub fn read(buffer: &Tensor<1>) -> DistResult<Vec<f32>> {
        buffer
            .clone()
            .try_into_data()
            .map_err(|e| {
                state_error(format!(
                    "the device could not compute the gradient norm: {e:?}"
                ))
            })?
            .convert::<f32>()
            .try_to_vec::<f32>()
            .map_err(|e| state_error(format!("cannot read the gradient norm: {e:?}")))
    }

    /// The norm of a sum of squares.
    pub fn of_squares(squares: f32) -> f32 {
        f64::from(squares).max(0.0).sqrt() as f32
    }
}

impl Default for GradNorm {
    fn default() -> Self {
        GradNorm::Read(0.0)
    }
}

impl From<f32> for GradNorm {
    fn from(norm: f32) -> Self {
        GradNorm::Read(norm)
    }
}

/// Sum of squares in f64: every strategy measures gradient norms with it, so that
/// replicated and sharded runs clip by the same factor. Eight independent accumulators,
/// which the compiler vectorizes (one f64 chain waits ~4 cycles per element).
pub fn sum_squares(values: &[f32]) -> f64 {
    let mut lanes = [0f64; 8];
    let mut chunks = values.chunks_exact(8);
    for c in &mut chunks {
        for (l, &x) in lanes.iter_mut().zip(c) {
            *l += f64::from(x) * f64::from(x);
        }
    }
    let tail: f64 = chunks
        .remainder()
        .iter()
        .map(|&x| f64::from(x) * f64::from(x))
        .sum();
    lanes.iter().sum::<f64>() + tail
}

/// [`sum_squares`] of a gradient on the host: read in place when it is a contiguous f32
/// Flex tensor (no copy), otherwise from its values.
fn host_sum_squares<const D: usize>(g: Tensor<D>) -> Result<f64, String> {
    if let Ok(t) = g
        .clone()
        .inner()
        .try_into_primitive::<burn::backend::flex::Flex>()
        && let Some(values) = t.as_slice::<f32>()
    {
        return Ok(sum_squares(values));
    }
    g.into_data()
        .convert::<f32>()
        .try_into_vec::<f32>()
        .map(|v| sum_squares(&v))
        .map_err(|e| format!("{e:?}"))
}

/// The global L2 norm from per-tensor sums of squares.
pub fn total_norm(squares: impl Iterator<Item = f64>) -> f32 {
    squares.sum::<f64>().sqrt() as f32
}

/// Sum of squares of every parameter's gradient. On the host (Flex) from the values, in
/// f64 (as the sharded strategies sum); on a device, each gradient's sum on the device and
/// all of them read back at once, so that gradients never leave the GPU.
pub(crate) fn grad_squares<M: Module>(
    module: &M,
    grads: &GradientsParams,
) -> DistResult<Vec<(ParamId, f64)>> {
    struct Squares<'a> {
        grads: &'a GradientsParams,
        on_host: bool,
        host: Vec<(ParamId, f64)>,
        device: Vec<(ParamId, Tensor<1>)>,
        error: Option<String>,
    }
    impl ModuleVisitor for Squares<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let Some(g) = self.grads.get::<D>(param.id) else {
                return;
            };
            if !self.on_host {
                self.device.push((param.id, g.square().sum()));
                return;
            }
            match host_sum_squares(g) {
                Ok(s) => self.host.push((param.id, s)),
                Err(e) => self.error = Some(e),
            }
        }
    }
    let device = module.devices().into_iter().next().unwrap_or_default();
    let mut n = Squares {
        grads,
        on_host: matches!(
            device.inner().as_dispatch(),
            burn::backend::DispatchDevice::Flex(_)
        ),
        host: Vec::new(),
        device: Vec::new(),
        error: None,
    };
    module.visit(&mut n);
    if let Some(e) = n.error {
        return Err(state_error(format!("cannot read a gradient: {e}")));
    }
    if n.device.is_empty() {
        return Ok(n.host);
    }
    let (ids, sums): (Vec<ParamId>, Vec<Tensor<1>>) = n.device.into_iter().unzip();
    let values = crate::collective_host_values(Tensor::cat(sums, 0))
        .map_err(|e| state_error(format!("cannot read the gradient norms: {e}")))?;
    Ok(ids
        .into_iter()
        .zip(values.into_iter().map(f64::from))
        .collect())
}

/// Clip gradients to a global L2 norm (`torch.nn.utils.clip_grad_norm_`): when `norm`
/// exceeds `max_norm` (> 0), every gradient is scaled by `max_norm / (norm + 1e-6)`.
pub(crate) fn clip<M: Module>(module: &M, grads: &mut GradientsParams, norm: f32, max_norm: f32) {
    let scale = clip_scale(norm, max_norm);
    if scale == 1.0 {
        return;
    }
    struct Scale<'a>(&'a mut GradientsParams, f32);
    impl ModuleVisitor for Scale<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if let Some(g) = self.0.remove::<D>(param.id) {
                self.0.register(param.id, g.mul_scalar(self.1));
            }
        }
    }
    module.visit(&mut Scale(grads, scale));
}

/// The factor `clip_grad_norm_` scales by: `max_norm / (norm + 1e-6)` when the norm
/// exceeds `max_norm` (> 0), else 1.
pub fn clip_scale(norm: f32, max_norm: f32) -> f32 {
    if max_norm > 0.0 && norm > max_norm {
        max_norm / (norm + 1e-6)
    } else {
        1.0
    }
}

/// Clip `grads` of `module` to global L2 norm `max_norm` (0: only measure); returns the norm
/// before clipping.
pub fn clip_grad_norm<M: Module>(
    module: &M,
    grads: &mut GradientsParams,
    max_norm: f32,
) -> DistResult<f32> {
    let norm = total_norm(grad_squares(module, grads)?.into_iter().map(|(_, s)| s));
    clip(module, grads, norm, max_norm);
    Ok(norm)
}
