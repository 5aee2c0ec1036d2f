//! The fused kernels' and optimizers' checks, shared by the CPU tests (`kernels.rs`,
//! `fused_optimizer.rs`) and the GPU tests (`gpu.rs`): softmax cross-entropy against its
//! f64 closed form and the plain composition, and the fused multi-tensor Adam/AdamW/LAMB
//! against Burn's optimizers with interchangeable records.

use std::collections::HashMap;

use burn::module::{Module, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::{DType, Device, FloatDType, Int, Tensor, TensorData};
use burn_onnx_train::OnnxModel;
use burn_onnx_train::kernels::{
    FusedAdam, cross_entropy_rows, cross_entropy_rows_reference, cross_entropy_rows_within,
    device_place, head_cross_entropy_sum, head_cross_entropy_value,
};
use burn_onnx_train::train::config::{OptimizerConfig, OptimizerKind};
use burn_onnx_train::train::optimizer::{build_optimizer, flat_rule, weight_decays};
use burn_onnx_train::value::MAX_RANK;
use burn_ort_dist::ReplicaOptimizer;
use ndarray::{ArrayD, Axis, IxDyn};

use super::{assert_close, lcg, refkit};

pub fn host(t: Tensor<1>) -> ArrayD<f32> {
    let v = t
        .into_data()
        .convert::<f32>()
        .try_into_vec::<f32>()
        .unwrap();
    ArrayD::from_shape_vec(IxDyn(&[v.len()]), v).unwrap()
}

pub fn host2(t: Tensor<2>) -> ArrayD<f32> {
    let dims = t.dims();
    let v = t
        .into_data()
        .convert::<f32>()
        .try_into_vec::<f32>()
        .unwrap();
    ArrayD::from_shape_vec(IxDyn(&dims), v).unwrap()
}

/// Logits spread over +-8 (so softmax is far from uniform) for `rows` x `classes`, targets,
/// and per-row weights for a non-trivial upstream gradient.
pub fn problem(rows: usize, classes: usize) -> (Vec<f32>, Vec<i64>, Vec<f32>) {
    let mut next = lcg(7);
    let logits = (0..rows * classes)
        .map(|_| (next() % 16001) as f32 / 1000.0 - 8.0)
        .collect();
    let targets = (0..rows)
        .map(|_| (next() % classes as u64) as i64)
        .collect();
    let weights = (0..rows)
        .map(|_| (next() % 1000) as f32 / 500.0 - 1.0)
        .collect();
    (logits, targets, weights)
}

/// Loss per row and the gradient of `sum(w * loss)` with respect to the logits.
pub fn loss_and_grad(
    device: &Device,
    rows: usize,
    classes: usize,
    fused: bool,
) -> (ArrayD<f32>, ArrayD<f32>) {
    let (logits, targets, weights) = problem(rows, classes);
    weighted_loss_and_grad(
        device,
        (logits, classes),
        targets,
        weights,
        DType::F32,
        |x, t| match fused {
            true => cross_entropy_rows(x, t),
            false => cross_entropy_rows_reference(x, t),
        },
    )
}

/// `loss(x, targets)` per row of `logits` (`(values, width)`, stored in `dtype`) and the
/// gradient of `sum(weights * loss)` with respect to them, on `device` with autodiff.
fn weighted_loss_and_grad(
    device: &Device,
    (logits, width): (Vec<f32>, usize),
    targets: Vec<i64>,
    weights: Vec<f32>,
    dtype: DType,
    loss: impl Fn(Tensor<2>, Tensor<1, Int>) -> Tensor<1>,
) -> (ArrayD<f32>, ArrayD<f32>) {
    let rows = targets.len();
    let device = device.clone().autodiff();
    let x = Tensor::<2>::from_data(TensorData::new(logits, vec![rows, width]), &device)
        .cast(FloatDType::try_from(dtype).unwrap())
        .detach()
        .require_grad();
    assert_eq!(x.dtype(), dtype);
    let t = Tensor::<1, Int>::from_data(TensorData::new(targets, vec![rows]), &device);
    let w = Tensor::<1>::from_data(TensorData::new(weights, vec![rows]), &device);
    let loss = loss(x.clone(), t);
    assert_eq!(loss.dtype(), DType::F32, "the loss's precision");
    let grads = (loss.clone() * w).sum().backward();
    let g = x.grad(&grads).unwrap();
    assert_eq!(g.dtype(), dtype, "the logits' gradient's precision");
    (host(loss.inner()), host2(g))
}

/// The closed form in f64 on the host: per-row loss and the gradient of `sum(w * loss)`.
pub fn exact(rows: usize, classes: usize) -> (ArrayD<f32>, ArrayD<f32>) {
    exact_of(problem(rows, classes), rows, classes)
}

/// [`exact`] for the problem's logits as given (rounded to a low precision, say).
fn exact_of(
    (logits, targets, weights): (Vec<f32>, Vec<i64>, Vec<f32>),
    rows: usize,
    classes: usize,
) -> (ArrayD<f32>, ArrayD<f32>) {
    let (mut loss, mut grad) = (Vec::new(), Vec::new());
    for r in 0..rows {
        let x = &logits[r * classes..(r + 1) * classes];
        let max = x.iter().fold(f64::MIN, |m, &v| m.max(v as f64));
        let sum: f64 = x.iter().map(|&v| (v as f64 - max).exp()).sum();
        let t = targets[r] as usize;
        loss.push((max + sum.ln() - x[t] as f64) as f32);
        for (j, &v) in x.iter().enumerate() {
            let p = (v as f64 - max).exp() / sum;
            grad.push(((p - if j == t { 1.0 } else { 0.0 }) * weights[r] as f64) as f32);
        }
    }
    (
        ArrayD::from_shape_vec(IxDyn(&[rows]), loss).unwrap(),
        ArrayD::from_shape_vec(IxDyn(&[rows, classes]), grad).unwrap(),
    )
}

/// The fused op on `device` against the closed form (1e-6 relative) and against
/// `log_softmax` + `gather` on `device` and on the CPU (f32 summation noise).
pub fn check_cross_entropy(device: &Device) {
    // 1000 classes: four strides of a 256-thread cube and a ragged tail; 50257: GPT-2's
    // vocabulary; 2: fewer classes than threads.
    for (rows, classes) in [(37, 1000), (3, 50257), (5, 2)] {
        let (loss, grad) = loss_and_grad(device, rows, classes, true);
        let (want_loss, want_grad) = exact(rows, classes);
        assert_close(
            &format!("{rows}x{classes} loss vs f64"),
            &loss,
            &want_loss,
            1e-6,
            1e-6,
        );
        assert_close(
            &format!("{rows}x{classes} gradient vs f64"),
            &grad,
            &want_grad,
            1e-7,
            1e-6,
        );
        for reference in [device.clone(), Device::flex()] {
            let (ref_loss, ref_grad) = loss_and_grad(&reference, rows, classes, false);
            assert_close(
                &format!("{rows}x{classes} loss vs log_softmax+gather"),
                &loss,
                &ref_loss,
                1e-6,
                1e-5,
            );
            assert_close(
                &format!("{rows}x{classes} gradient vs log_softmax+gather"),
                &grad,
                &ref_grad,
                1e-7,
                1e-5,
            );
        }
        assert!(
            grad.iter().any(|g| g.abs() > 1e-3),
            "the gradient is not trivially zero"
        );
    }
    // Rows wider than their classes (a padded head): the columns past the classes hold
    // values that would dominate the softmax if read; the loss is the closed form of the
    // classes, their gradient zero. Logits only the loss holds get their gradient written
    // over them on CubeCL devices: the same values.
    for (rows, classes, width) in [(37, 1000, 1024), (3, 50257, 50304), (5, 2, 3)] {
        for owned in [false, true] {
            let (loss, grad) = wider_loss_and_grad(device, rows, classes, width, owned);
            let (want_loss, want_grad) = exact(rows, classes);
            let what = format!("{rows}x{classes} in rows of {width} (owned {owned})");
            assert_close(&format!("{what}: loss"), &loss, &want_loss, 1e-6, 1e-6);
            let read = grad.slice_axis(Axis(1), (0..classes).into()).to_owned();
            assert_close(&format!("{what}: gradient"), &read, &want_grad, 1e-7, 1e-6);
            let rest = grad.slice_axis(Axis(1), (classes..width).into());
            assert!(
                rest.iter().all(|&g| g == 0.0),
                "{what}: the padding's gradient is not zero"
            );
        }
    }
}

/// The logits a loss reads: `x` itself, which the caller holds too, or (`owned`) the
/// result of an op on it, which only the loss holds by its backward, as the head's
/// product in training: the gradient may then be written over the logits.
fn logits_as(x: Tensor<2>, owned: bool) -> Tensor<2> {
    match owned {
        true => x.mul_scalar(1.0),
        false => x,
    }
}

/// [`loss_and_grad`]'s problem with each row widened to `width` by columns of 30.0, the
/// fused loss told to read the first `classes` of the logits [`logits_as`] gives.
fn wider_loss_and_grad(
    device: &Device,
    rows: usize,
    classes: usize,
    width: usize,
    owned: bool,
) -> (ArrayD<f32>, ArrayD<f32>) {
    let (logits, targets, weights) = problem(rows, classes);
    let pad = std::iter::repeat_n(30.0, width - classes);
    let wide: Vec<f32> = logits
        .chunks(classes)
        .flat_map(|row| row.iter().copied().chain(pad.clone()))
        .collect();
    weighted_loss_and_grad(
        device,
        (wide, width),
        targets,
        weights,
        DType::F32,
        |x, t| cross_entropy_rows_within(logits_as(x, owned), t, classes),
    )
}

/// The fused op on f16 logits (the head's under autocast on a CubeCL device): the loss in
/// f32 within f32 summation noise of the f64 closed form of the f16-rounded logits, their
/// gradient in f16 within f16's rounding of it (half a unit in the last place: 2^-11 of a
/// normal value, 2^-25 absolute below them), the rows wider than their classes too.
pub fn check_f16_cross_entropy(device: &Device) {
    for (rows, classes, width) in [(37, 1000, 1000), (3, 50257, 50304), (5, 2, 3)] {
        let (logits, targets, weights) = problem(rows, classes);
        let rounded: Vec<f32> = TensorData::new(logits, vec![rows * classes])
            .convert_dtype(DType::F16)
            .convert::<f32>()
            .try_into_vec::<f32>()
            .unwrap();
        let (want_loss, want_grad) = exact_of(
            (rounded.clone(), targets.clone(), weights.clone()),
            rows,
            classes,
        );
        let pad = std::iter::repeat_n(30.0, width - classes);
        let wide: Vec<f32> = rounded
            .chunks(classes)
            .flat_map(|row| row.iter().copied().chain(pad.clone()))
            .collect();
        for owned in [false, true] {
            let (loss, grad) = weighted_loss_and_grad(
                device,
                (wide.clone(), width),
                targets.clone(),
                weights.clone(),
                DType::F16,
                |x, t| cross_entropy_rows_within(logits_as(x, owned), t, classes),
            );
            let what = format!("f16 {rows}x{classes} in rows of {width} (owned {owned})");
            assert_close(&format!("{what}: loss"), &loss, &want_loss, 1e-6, 1e-6);
            let read = grad.slice_axis(Axis(1), (0..classes).into()).to_owned();
            assert_close(
                &format!("{what}: gradient"),
                &read,
                &want_grad,
                3.5e-8,
                4.9e-4,
            );
            let rest = grad.slice_axis(Axis(1), (classes..width).into());
            assert!(
                rest.iter().all(|&g| g == 0.0),
                "{what}: the padding's gradient is not zero"
            );
        }
    }
}

pub fn config(kind: OptimizerKind) -> OptimizerConfig {
    OptimizerConfig {
        kind,
        weight_decay: 0.05,
        no_weight_decay: vec!["bias".into()],
        ..Default::default()
    }
}

/// Random gradients (uniform in [-0.5, 0.5), scaled per step) for every trainable
/// parameter.
pub struct RandomGrads {
    next: Box<dyn FnMut() -> u64>,
    scale: f32,
    device: Device,
    grads: GradientsParams,
    /// Make the first value of the first gradient infinite.
    poison: bool,
}

impl ModuleVisitor for RandomGrads {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        let t = param.val();
        if !t.is_require_grad() {
            return;
        }
        let dims = t.dims();
        let n: usize = dims.iter().product();
        let mut values: Vec<f32> = (0..n)
            .map(|_| ((self.next)() % 10_000) as f32 / 10_000.0 - 0.5)
            .map(|v| v * self.scale)
            .collect();
        if std::mem::take(&mut self.poison) {
            values[0] = f32::INFINITY;
        }
        let g = Tensor::<D>::from_data(TensorData::new(values, dims), &self.device);
        self.grads.register(param.id, g);
    }
}

pub fn grads(model: &OnnxModel, step: u64) -> GradientsParams {
    scaled_grads(model, step, 1.0, false)
}

/// [`grads`] multiplied by `loss_scale` (a power of two: exactly), with an infinite value
/// when `poison`.
fn scaled_grads(model: &OnnxModel, step: u64, loss_scale: f32, poison: bool) -> GradientsParams {
    let mut r = RandomGrads {
        next: Box::new(lcg(step + 11)),
        scale: loss_scale / (step as f32 + 1.0),
        device: model.device().inner(),
        grads: GradientsParams::new(),
        poison,
    };
    model.visit(&mut r);
    r.grads
}

pub struct Values(HashMap<ParamId, Vec<f32>>);

impl ModuleVisitor for Values {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        let v = param.val().into_data().convert::<f32>().try_to_vec::<f32>();
        self.0.insert(param.id, v.unwrap());
    }
}

pub fn values(model: &OnnxModel) -> HashMap<ParamId, Vec<f32>> {
    let mut v = Values(HashMap::new());
    model.visit(&mut v);
    v.0
}

pub fn assert_same(what: &str, got: &OnnxModel, want: &OnnxModel, initial: &OnnxModel) {
    assert_within(what, got, want, initial, 1e-6);
}

/// [`assert_same`] to within `rtol` of each parameter's magnitude.
fn assert_within(what: &str, got: &OnnxModel, want: &OnnxModel, initial: &OnnxModel, rtol: f32) {
    let (got, want, initial) = (values(got), values(want), values(initial));
    let mut moved = 0.0f32;
    for (id, w) in &want {
        let g = &got[id];
        for (i, ((a, b), p)) in g.iter().zip(w).zip(&initial[id]).enumerate() {
            // Relative to the parameter's magnitude (an update can cancel it to ~0).
            assert!(
                (a - b).abs() <= rtol * b.abs().max(p.abs()) + 1e-9,
                "{what}: parameter {id} [{i}]: fused {a}, Burn {b} (initially {p})"
            );
        }
        for (a, b) in w.iter().zip(&initial[id]) {
            moved = moved.max((a - b).abs());
        }
    }
    assert!(
        moved > 1e-4,
        "{what}: the parameters did not move ({moved})"
    );
}

/// How the fused optimizer of a check cuts its flat buffers on a CubeCL device.
#[derive(Clone, Copy, Debug)]
pub enum Groups {
    /// Its default (gpt2_tiny's parameters in one group).
    Default,
    /// Groups of at most this many bytes (gpt2_tiny's in many).
    Bytes(usize),
}

/// The fused form of `c`'s optimizer for `initial`, its buffers cut as `groups` says.
fn fused_optimizer(c: &OptimizerConfig, initial: &OnnxModel, groups: Groups) -> FusedAdam {
    let fused = FusedAdam::new(flat_rule(c), weight_decays(c, initial)).unwrap();
    match groups {
        Groups::Default => fused,
        Groups::Bytes(bytes) => fused.with_group_bytes(bytes),
    }
}

pub fn check(kind: OptimizerKind, device: Device, groups: Groups) {
    let c = config(kind);
    let initial = OnnxModel::load(refkit("models/gpt2_tiny.onnx"), &device).unwrap();
    let fused_new = || fused_optimizer(&c, &initial, groups);
    let (mut fused, mut burn) = (fused_new(), build_optimizer(&c, &initial));
    let (mut a, mut b) = (initial.clone(), initial.clone());
    let lrs = [1e-2, 5e-3, 2e-3, 1e-3];
    for (step, lr) in lrs.iter().take(3).enumerate() {
        a = fused.step(*lr, a, grads(&initial, step as u64)).unwrap();
        b = ReplicaOptimizer::step(&mut burn, *lr, b, grads(&initial, step as u64)).unwrap();
    }
    assert_same(&format!("{kind:?}, 3 updates"), &a, &b, &initial);

    // The fused optimizer's record continues under Burn's, and Burn's under a fresh fused
    // one; each fourth update agrees with the uninterrupted one.
    let (fused_record, burn_record) = (fused.record_bytes().unwrap(), burn.record_bytes().unwrap());
    let mut burn_from_fused = build_optimizer(&c, &initial);
    burn_from_fused.load_record_bytes(fused_record).unwrap();
    let mut fused_from_burn = fused_new();
    fused_from_burn.load_record_bytes(burn_record).unwrap();
    let g = || grads(&initial, 3);
    let lr = lrs[3];
    let c1 = ReplicaOptimizer::step(&mut burn_from_fused, lr, a.clone(), g()).unwrap();
    let c2 = fused_from_burn.step(lr, b.clone(), g()).unwrap();
    let a4 = fused.step(lr, a, g()).unwrap();
    let b4 = ReplicaOptimizer::step(&mut burn, lr, b, g()).unwrap();
    assert_same(&format!("{kind:?}, 4 updates"), &a4, &b4, &initial);
    assert_same(
        &format!("{kind:?}: Burn resumed from the fused record"),
        &c1,
        &b4,
        &initial,
    );
    assert_same(
        &format!("{kind:?}: fused resumed from Burn's record"),
        &c2,
        &b4,
        &initial,
    );
}

/// Halves the first parameter whose id is `self.0`: a new value, in a new allocation.
struct Halve(ParamId);

impl burn::module::ModuleMapper for Halve {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        if param.id != self.0 {
            return param;
        }
        param.map(|t| {
            let require = t.is_require_grad();
            Tensor::from_inner(t.inner() * 0.5).set_require_grad(require)
        })
    }
}

/// The fused optimizer's clipped step (on a GPU: the norm and the clip over the flat
/// gradient buffer, the parameters kept laid out between steps) against Burn's optimizer
/// after the per-parameter clip, with gradients whose norm exceeds the limit; then one
/// parameter replaced by a new value between steps (the laid-out buffer is stale, and the
/// fused step must notice), and two more steps.
pub fn check_clipped_with_a_replaced_value(kind: OptimizerKind, device: Device, groups: Groups) {
    let c = config(kind);
    let initial = OnnxModel::load(refkit("models/gpt2_tiny.onnx"), &device).unwrap();
    let mut fused = fused_optimizer(&c, &initial, groups);
    let mut burn = build_optimizer(&c, &initial);
    let (mut a, mut b) = (initial.clone(), initial.clone());
    let max_norm = 0.5;
    let mut first = None;
    for step in 0..4u64 {
        if step == 2 {
            let id = *first.get_or_insert_with(|| *values(&initial).keys().min().unwrap());
            a = a.map(&mut Halve(id));
            b = b.map(&mut Halve(id));
        }
        let lr = 1e-2 / (step as f64 + 1.0);
        let (na, norm_a) = fused
            .step_clipped(lr, a, grads(&initial, step), max_norm)
            .unwrap();
        let (nb, norm_b) = burn
            .step_clipped(lr, b, grads(&initial, step), max_norm)
            .unwrap();
        let (norm_a, norm_b) = (norm_a.value().unwrap(), norm_b.value().unwrap());
        assert!(
            norm_b > max_norm && (norm_a - norm_b).abs() <= 1e-5 * norm_b,
            "{kind:?} step {step}: fused norm {norm_a}, per-parameter norm {norm_b} (limit {max_norm})"
        );
        (a, b) = (na, nb);
        // The two clip factors differ in the last bits (one f32 sum of squares against
        // per-parameter sums), and so do the updates; a stale value is off by its size.
        let what = format!("{kind:?}, clipped, step {step}");
        assert_within(&what, &a, &b, &initial, 1e-5);
    }
}

/// The fused optimizer dividing loss-scaled gradients in its own update (a GPU's path: the
/// division folded into the clip factor, the update skipped on the device on overflow)
/// against Burn's optimizer stepping the divided gradients after the per-parameter clip,
/// over four steps of which the second holds an infinite gradient: that step reports the
/// overflow and an infinite norm and leaves every parameter as it was, and the next ones
/// match Burn's optimizer that never saw it (the skipped step is not counted in Adam's
/// bias correction).
pub fn check_scaled_update_skips_on_overflow(kind: OptimizerKind, device: Device, groups: Groups) {
    let c = config(kind);
    let initial = OnnxModel::load(refkit("models/gpt2_tiny.onnx"), &device).unwrap();
    let mut fused = fused_optimizer(&c, &initial, groups);
    let mut burn = build_optimizer(&c, &initial);
    assert!(
        fused.steps_scaled(&initial),
        "{kind:?}: the GPU path divides in the update"
    );
    let (mut a, mut b) = (initial.clone(), initial.clone());
    let (max_norm, loss_scale) = (0.5, 1024.0);
    for step in 0..4u64 {
        let lr = 1e-2 / (step as f64 + 1.0);
        let overflows = step == 1;
        let scaled = scaled_grads(&initial, step, loss_scale, overflows);
        let before = values(&a);
        let (na, norm, overflow) = fused
            .step_scaled(lr, a, scaled, max_norm, loss_scale)
            .unwrap();
        let norm = norm.value().unwrap();
        a = na;
        assert_eq!(
            overflow, overflows,
            "{kind:?} step {step}: overflow reported"
        );
        if overflows {
            assert_eq!(norm, f32::INFINITY, "{kind:?}: a skipped step reports inf");
            assert!(
                values(&a) == before,
                "{kind:?}: the skipped step moved a parameter"
            );
            continue;
        }
        let (nb, norm_b) = burn
            .step_clipped(lr, b, grads(&initial, step), max_norm)
            .unwrap();
        b = nb;
        let norm_b = norm_b.value().unwrap();
        assert!(
            norm_b > max_norm && (norm - norm_b).abs() <= 1e-5 * norm_b,
            "{kind:?} step {step}: fused norm {norm}, per-parameter norm {norm_b} (limit {max_norm})"
        );
        assert_within(
            &format!("{kind:?}, loss-scaled, step {step}"),
            &a,
            &b,
            &initial,
            1e-5,
        );
    }
}

/// The head's product and the cross-entropy a block of rows at a time
/// (`head_cross_entropy_sum`) on `device`, products in `compute`, against the f64 closed
/// form of `3 * sum_i w_i ce(h_i W, t_i)` over the first `classes` of the table's columns:
/// the value, `h`'s gradient `3 G W^T` and the table's `3 h^T G` (`G` the weighted
/// `softmax - onehot` rows, zero past the classes), for blocks of one row, a ragged
/// count, all rows, and more than all. Rows weighted 0 are ignored tokens. The closed form
/// reads the operands rounded to `compute`, and the logits rounded to it too when it is a
/// low precision (the products write them so); `rtol` is the products' rounding (relative
/// to each gradient's largest element). The gradients come out in the operands' precisions;
/// the value alone (`head_cross_entropy_value`, evaluation's) meets the same closed form.
pub fn check_head_cross_entropy(device: &Device, compute: FloatDType, rtol: f64) {
    let (rows, width, classes, columns) = (37, 24, 67, 72);
    let mut next = lcg(11);
    let mut uniform = |n: usize, scale: f32| -> Vec<f32> {
        (0..n)
            .map(|_| ((next() % 20001) as f32 / 10000.0 - 1.0) * scale)
            .collect()
    };
    let h = uniform(rows * width, 1.0);
    let mut w = uniform(width * columns, 1.0);
    // The padding columns hold values that would dominate the softmax if read.
    for r in 0..width {
        for c in classes..columns {
            w[r * columns + c] = 3.0;
        }
    }
    let targets: Vec<i64> = (0..rows).map(|i| ((i * 29 + 5) % classes) as i64).collect();
    let weights: Vec<f32> = (0..rows)
        .map(|i| if i % 7 == 3 { 0.0 } else { 1.0 })
        .collect();
    let round = |v: &[f32], dtype: FloatDType| -> Vec<f64> {
        TensorData::new(v.to_vec(), vec![v.len()])
            .convert_dtype(DType::from(dtype))
            .convert::<f32>()
            .try_into_vec::<f32>()
            .unwrap()
            .into_iter()
            .map(f64::from)
            .collect()
    };
    let (hr, wr) = (round(&h, compute), round(&w, compute));
    // The closed form in f64.
    let mut want_loss = 0.0;
    let mut g = vec![0.0f64; rows * columns];
    for i in 0..rows {
        let logits: Vec<f64> = (0..classes)
            .map(|c| {
                (0..width)
                    .map(|k| hr[i * width + k] * wr[k * columns + c])
                    .sum()
            })
            .collect();
        let logits = match compute {
            FloatDType::F32 => logits,
            low => round(&logits.iter().map(|&v| v as f32).collect::<Vec<_>>(), low),
        };
        let max = logits.iter().cloned().fold(f64::MIN, f64::max);
        let sum: f64 = logits.iter().map(|v| (v - max).exp()).sum();
        let t = targets[i] as usize;
        want_loss += weights[i] as f64 * (max + sum.ln() - logits[t]);
        for c in 0..classes {
            let p = (logits[c] - max).exp() / sum;
            g[i * columns + c] = weights[i] as f64 * (p - if c == t { 1.0 } else { 0.0 });
        }
    }
    let want_dh: Vec<f32> = (0..rows * width)
        .map(|x| {
            let (i, k) = (x / width, x % width);
            3.0 * (0..columns)
                .map(|c| g[i * columns + c] * wr[k * columns + c])
                .sum::<f64>() as f32
        })
        .collect();
    let want_dw: Vec<f32> = (0..width * columns)
        .map(|x| {
            let (k, c) = (x / columns, x % columns);
            3.0 * (0..rows)
                .map(|i| hr[i * width + k] * g[i * columns + c])
                .sum::<f64>() as f32
        })
        .collect();
    let want_dh = ArrayD::from_shape_vec(IxDyn(&[rows, width]), want_dh).unwrap();
    let want_dw = ArrayD::from_shape_vec(IxDyn(&[width, columns]), want_dw).unwrap();
    let largest = |a: &ArrayD<f32>| a.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    assert!(largest(&want_dh) > 0.1 && largest(&want_dw) > 0.1);
    let device = device.clone().autodiff();
    for block in [1, 8, rows, 64] {
        let what = format!("{compute:?} blocks of {block} rows");
        let phys = |v: Vec<f32>, r: usize, c: usize| {
            let mut shape = [1; MAX_RANK];
            shape[MAX_RANK - 2] = r;
            shape[MAX_RANK - 1] = c;
            Tensor::<2>::from_data(TensorData::new(v, vec![r, c]), &device)
                .reshape(shape)
                .detach()
                .require_grad()
        };
        let (ht, wt) = (
            phys(h.clone(), rows, width),
            phys(w.clone(), width, columns),
        );
        // An operand already in the low precision keeps its gradient in it.
        let hin = match compute {
            FloatDType::F32 => ht.clone(),
            low => ht.clone().cast(low),
        };
        let loss = head_cross_entropy_sum(
            hin.clone(),
            wt.clone(),
            Tensor::<1, Int>::from_data(TensorData::new(targets.clone(), vec![rows]), &device),
            Tensor::<1>::from_data(TensorData::new(weights.clone(), vec![rows]), &device),
            classes,
            compute,
            block,
        );
        assert_eq!(loss.dtype(), DType::F32, "{what}: the loss's precision");
        // The value alone, as an evaluation pass asks for it.
        let value = head_cross_entropy_value(
            hin.clone(),
            wt.clone(),
            Tensor::<1, Int>::from_data(TensorData::new(targets.clone(), vec![rows]), &device),
            Tensor::<1>::from_data(TensorData::new(weights.clone(), vec![rows]), &device),
            classes,
            compute,
            block,
        );
        let value = host(value)[[0]] as f64;
        assert!(
            (value - want_loss).abs() <= 1e-5 * want_loss.abs() + rtol * rows as f64,
            "{what}: value alone {value}, want {want_loss}"
        );
        let grads = loss.clone().mul_scalar(3.0).backward();
        let got_loss = host(loss.inner())[[0]] as f64;
        assert!(
            (got_loss - want_loss).abs() <= 1e-5 * want_loss.abs() + rtol * rows as f64,
            "{what}: loss {got_loss}, want {want_loss}"
        );
        let dh = ht.grad(&grads).unwrap();
        let dw = wt.grad(&grads).unwrap();
        assert_eq!(
            dw.dtype(),
            DType::F32,
            "{what}: the table's gradient's precision"
        );
        let flat = |t: Tensor<MAX_RANK>, r: usize, c: usize| host2(t.reshape([r, c]));
        let (dh, dw) = (flat(dh, rows, width), flat(dw, width, columns));
        let tol = |a: &ArrayD<f32>| (rtol as f32 * largest(a)).max(1e-6);
        assert_close(
            &format!("{what}: hidden gradient"),
            &dh,
            &want_dh,
            tol(&want_dh),
            0.0,
        );
        assert_close(
            &format!("{what}: table gradient"),
            &dw,
            &want_dw,
            tol(&want_dw),
            0.0,
        );
    }
}

/// Where each parameter of `model` lives on the device (`kernels::device_place`).
struct Places(HashMap<ParamId, Option<(usize, u64)>>);

impl ModuleVisitor for Places {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        self.0.insert(param.id, device_place(&param.val()));
    }
}

fn places(model: &OnnxModel) -> HashMap<ParamId, Option<(usize, u64)>> {
    let mut p = Places(HashMap::new());
    model.visit(&mut p);
    p.0
}

/// On a CubeCL device the fused update writes the parameters in place from its second
/// step on (the first lays them out in its flat buffers): each keeps its device place
/// while its values move, which a captured update's replays rely on. A model that
/// something else still holds is not written over: the holder's values stay as they were.
pub fn check_update_writes_in_place(kind: OptimizerKind, device: Device) {
    let c = config(kind);
    let initial = OnnxModel::load(refkit("models/gpt2_tiny.onnx"), &device).unwrap();
    let mut fused = fused_optimizer(&c, &initial, Groups::Default);
    let step = |fused: &mut FusedAdam, model: OnnxModel, step: u64| {
        let lr = 1e-2 / (step as f64 + 1.0);
        fused
            .step_clipped(lr, model, grads(&initial, step), 1e9)
            .unwrap()
            .0
    };
    let mut model = step(&mut fused, initial.clone(), 0);
    let laid = places(&model);
    assert!(
        laid.values().all(|p| p.is_some()),
        "{kind:?}: not on a CubeCL device"
    );
    for s in 1..3 {
        let before = values(&model);
        model = step(&mut fused, model, s);
        let (after, now) = (values(&model), places(&model));
        for (id, place) in &laid {
            assert_eq!(now[id], *place, "{kind:?} step {s}: a parameter moved");
            assert_ne!(
                after[id], before[id],
                "{kind:?} step {s}: a parameter did not change"
            );
        }
    }
    // Held elsewhere: the update writes a copy.
    let held = model.clone();
    let before = values(&held);
    let model = step(&mut fused, model, 3);
    assert_eq!(
        values(&held),
        before,
        "{kind:?}: the held model was written over"
    );
    let moved = places(&model);
    assert!(
        laid.iter().all(|(id, p)| moved[id] != *p),
        "{kind:?}: written in place though held"
    );
}
