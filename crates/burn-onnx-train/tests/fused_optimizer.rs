//! The fused multi-tensor Adam, AdamW and LAMB against Burn's own optimizers on the same
//! device, on the CPU (the host loop) and on wgpu (the CubeCL kernels; lavapipe here):
//! gpt2_tiny's parameters (tensors of 64 to 32k values, so one to many chunks each), weight
//! decay on all but the biases, three updates with the same random gradients, within 1e-6
//! relative to each parameter's magnitude. The record either one writes continues under
//! the other for a fourth update. Without a Vulkan driver the wgpu tests fail; they never
//! pass silently.

mod common;

use std::collections::HashMap;

use burn::module::{Module, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::{Device, Tensor, TensorData};
use burn_onnx_train::OnnxModel;
use burn_onnx_train::kernels::FusedAdam;
use burn_onnx_train::train::DeviceSpec;
use burn_onnx_train::train::config::{OptimizerConfig, OptimizerKind};
use burn_onnx_train::train::optimizer::{build_optimizer, flat_rule, weight_decays};
use burn_ort_dist::ReplicaOptimizer;
use common::*;

fn cpu() -> Device {
    DeviceSpec::Cpu.device(0).unwrap().autodiff()
}

#[cfg(feature = "wgpu")]
fn wgpu() -> Device {
    DeviceSpec::Wgpu(None).device(0).unwrap().autodiff()
}

fn config(kind: OptimizerKind) -> OptimizerConfig {
    OptimizerConfig {
        kind,
        weight_decay: 0.05,
        no_weight_decay: vec!["bias".into()],
        ..Default::default()
    }
}

/// Random gradients (uniform in [-0.5, 0.5), scaled per step) for every trainable
/// parameter.
struct RandomGrads {
    next: Box<dyn FnMut() -> u64>,
    scale: f32,
    device: Device,
    grads: GradientsParams,
}

impl ModuleVisitor for RandomGrads {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        let t = param.val();
        if !t.is_require_grad() {
            return;
        }
        let dims = t.dims();
        let n: usize = dims.iter().product();
        let values: Vec<f32> = (0..n)
            .map(|_| ((self.next)() % 10_000) as f32 / 10_000.0 - 0.5)
            .map(|v| v * self.scale)
            .collect();
        let g = Tensor::<D>::from_data(TensorData::new(values, dims), &self.device);
        self.grads.register(param.id, g);
    }
}

fn grads(model: &OnnxModel, step: u64) -> GradientsParams {
    let mut r = RandomGrads {
        next: Box::new(lcg(step + 11)),
        scale: 1.0 / (step as f32 + 1.0),
        device: model.device().inner(),
        grads: GradientsParams::new(),
    };
    model.visit(&mut r);
    r.grads
}

struct Values(HashMap<ParamId, Vec<f32>>);

impl ModuleVisitor for Values {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        let v = param.val().into_data().convert::<f32>().try_to_vec::<f32>();
        self.0.insert(param.id, v.unwrap());
    }
}

fn values(model: &OnnxModel) -> HashMap<ParamId, Vec<f32>> {
    let mut v = Values(HashMap::new());
    model.visit(&mut v);
    v.0
}

fn assert_same(what: &str, got: &OnnxModel, want: &OnnxModel, initial: &OnnxModel) {
    let (got, want, initial) = (values(got), values(want), values(initial));
    let mut moved = 0.0f32;
    for (id, w) in &want {
        let g = &got[id];
        for (i, ((a, b), p)) in g.iter().zip(w).zip(&initial[id]).enumerate() {
            // Relative to the parameter's magnitude (an update can cancel it to ~0).
            assert!(
                (a - b).abs() <= 1e-6 * b.abs().max(p.abs()) + 1e-9,
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

fn check(kind: OptimizerKind, device: Device) {
    let c = config(kind);
    let initial = OnnxModel::load(refkit("models/gpt2_tiny.onnx"), &device).unwrap();
    let fused_new = || FusedAdam::new(flat_rule(&c), weight_decays(&c, &initial)).unwrap();
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

#[test]
fn cpu_fused_adamw_matches_burns_adamw_and_their_records_interchange() {
    check(OptimizerKind::Adamw, cpu());
}

#[test]
fn cpu_fused_adam_matches_burns_adam_and_their_records_interchange() {
    check(OptimizerKind::Adam, cpu());
}

#[test]
fn cpu_fused_lamb_matches_burns_lamb_and_their_records_interchange() {
    check(OptimizerKind::Lamb, cpu());
}

#[cfg(feature = "wgpu")]
#[test]
fn wgpu_fused_adamw_matches_burns_adamw_and_their_records_interchange() {
    check(OptimizerKind::Adamw, wgpu());
}

#[cfg(feature = "wgpu")]
#[test]
fn wgpu_fused_adam_matches_burns_adam_and_their_records_interchange() {
    check(OptimizerKind::Adam, wgpu());
}

#[cfg(feature = "wgpu")]
#[test]
fn wgpu_fused_lamb_matches_burns_lamb_and_their_records_interchange() {
    check(OptimizerKind::Lamb, wgpu());
}

#[test]
fn sgd_has_no_fused_form() {
    let c = config(OptimizerKind::Sgd);
    assert!(FusedAdam::new(flat_rule(&c), HashMap::new()).is_none());
}
