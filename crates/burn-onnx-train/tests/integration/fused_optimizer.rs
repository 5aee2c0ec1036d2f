//! The fused multi-tensor Adam, AdamW and LAMB against Burn's own optimizers on the CPU
//! (the host loop; `common::fused_checks`, which `gpu.rs` runs on the GPU's CubeCL kernels):
//! gpt2_tiny's parameters (tensors of 64 to 32k values, so one to many chunks each), weight
//! decay on all but the biases, three updates with the same random gradients, within 1e-6
//! relative to each parameter's magnitude. The record either one writes continues under
//! the other for a fourth update.

use super::common;

use std::collections::HashMap;

use burn::tensor::Device;
use burn_onnx_train::kernels::FusedAdam;
use burn_onnx_train::train::DeviceSpec;
use burn_onnx_train::train::config::OptimizerKind;
use burn_onnx_train::train::optimizer::flat_rule;
use common::fused_checks::{Groups, check, check_clipped_with_a_replaced_value, config};

fn cpu() -> Device {
    DeviceSpec::Cpu.device(0).unwrap().autodiff()
}

#[test]
fn cpu_fused_adamw_matches_burns_adamw_and_their_records_interchange() {
    check(OptimizerKind::Adamw, cpu(), Groups::Default);
}

#[test]
fn cpu_fused_adam_matches_burns_adam_and_their_records_interchange() {
    check(OptimizerKind::Adam, cpu(), Groups::Default);
}

#[test]
fn cpu_fused_lamb_matches_burns_lamb_and_their_records_interchange() {
    check(OptimizerKind::Lamb, cpu(), Groups::Default);
}

#[test]
fn cpu_fused_clipped_step_matches_burns_and_takes_a_replaced_value() {
    check_clipped_with_a_replaced_value(OptimizerKind::Adamw, cpu(), Groups::Default);
}

#[test]
fn sgd_has_no_fused_form() {
    let c = config(OptimizerKind::Sgd);
    assert!(FusedAdam::new(flat_rule(&c), HashMap::new()).is_none());
}
