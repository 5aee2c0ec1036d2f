//! The whole path on Burn's wgpu backend (feature `wgpu`; on these GPU-less machines Mesa's
//! software Vulkan driver, lavapipe, runs the same CubeCL kernels a GPU would): the kit's
//! forward passes against onnxruntime, forward+backward and 10 AdamW steps against
//! PyTorch, and the runner end to end (evaluation, checkpoints, export, and the fused
//! multi-tensor AdamW it uses there) against the same run on the CPU, with checkpoints
//! resuming across the two. Without a Vulkan driver these tests fail; they never pass silently.
#![cfg(feature = "wgpu")]

mod common;

use std::path::Path;

use burn::tensor::Device;
use burn_onnx_train::train::config::{LrConfig, ScheduleKind};
use burn_onnx_train::train::launch::launch;
use burn_onnx_train::train::{DeviceSpec, RunSummary, TrainingConfig};
use common::refkit_train::*;
use common::*;

fn wgpu() -> Device {
    DeviceSpec::Wgpu(None).device(0).unwrap()
}

#[test]
fn forward_passes_match_onnxruntime_on_wgpu() {
    let device = wgpu();
    check_inference(&device, "mlp", "input.npy", "output_ort_legacy.npy");
    check_inference(&device, "lenet_bn", "input.npy", "output_ort_legacy.npy");
    check_inference(
        &device,
        "squeezenet1_1_dynbatch",
        "input_other_shape.npy",
        "output_torch_other_shape.npy",
    );
    check_inference(&device, "gpt2_tiny", "input.npy", "output_ort_legacy.npy");
}

#[test]
fn mlp_gradients_match_pytorch_on_wgpu() {
    check_gradients(Case::new("mlp", "mlp"), &wgpu(), 1e-4, 1e-4);
}

#[test]
fn gpt2_tiny_gradients_match_pytorch_on_wgpu() {
    check_gradients(Case::new("gpt2_tiny", "gpt2_tiny"), &wgpu(), 1e-4, 1e-4);
}

#[test]
fn gpt2_tiny_adamw_10_steps_match_pytorch_on_wgpu() {
    check_trajectory(
        Case::new("gpt2_tiny", "gpt2_tiny"),
        &wgpu(),
        adamw(),
        1e-3,
        "adamw",
        1e-4,
        1e-4,
    );
}

/// 10 AdamW updates of gpt2_tiny with clipping, a warm-up schedule, evaluation every 5
/// updates and a checkpoint at 5, on `device`.
fn run_on(device: DeviceSpec, out: &Path) -> RunSummary {
    let c = TrainingConfig {
        device,
        num_train_steps: 10,
        evaluation_period: 5,
        checkpoint_period: 5,
        lr: LrConfig {
            warmup_ratio: 0.2,
            mode: ScheduleKind::Constant,
            ..Default::default()
        },
        ..gpt2_config(out)
    };
    launch(c, gpt2_tokens(), Some(gpt2_tokens())).unwrap()
}

#[test]
fn the_runner_on_wgpu_matches_the_cpu_run_and_its_checkpoint_resumes_on_the_cpu() {
    let (gpu_out, cpu_out) = (tempdir("wgpu-run"), tempdir("wgpu-cpu-run"));
    let gpu = run_on(DeviceSpec::Wgpu(None), &gpu_out);
    let cpu = run_on(DeviceSpec::Cpu, &cpu_out);
    assert_eq!(gpu.losses.len(), 10);
    for ((step, g), (_, c)) in gpu.losses.iter().zip(&cpu.losses) {
        assert!(
            (g - c).abs() < 1e-4,
            "update {step}: loss {g} on wgpu, {c} on the CPU"
        );
    }
    assert_eq!(gpu.evals.len(), 2);
    for (g, c) in gpu.evals.iter().zip(&cpu.evals) {
        assert!(
            (g.loss - c.loss).abs() < 1e-4,
            "evaluation at {}: {} on wgpu, {} on the CPU",
            g.step,
            g.loss,
            c.loss
        );
    }
    let (gpu_model, cpu_model) = (
        gpu_out.join("gpt2_tiny_trained.onnx"),
        cpu_out.join("gpt2_tiny_trained.onnx"),
    );
    assert_moved(&refkit("models/gpt2_tiny.onnx"), &gpu_model, 1e-3);
    for ((name, g), (_, c)) in onnx_params(gpu_model)
        .iter()
        .zip(onnx_params(cpu_model.clone()))
    {
        assert_close(
            &format!("wgpu vs CPU after 10 updates: {name}"),
            g,
            &c,
            1e-4,
            0.0,
        );
    }

    // The wgpu run's step-5 checkpoint (weights and AdamW moments) resumes on the CPU and
    // ends where the CPU run ends.
    let resumed = tempdir("wgpu-resumed-on-cpu");
    let ckpt = gpu_out.join("checkpoints/ckpt-000000005");
    let c = TrainingConfig {
        num_train_steps: 10,
        evaluation_period: 5,
        lr: LrConfig {
            warmup_ratio: 0.2,
            mode: ScheduleKind::Constant,
            ..Default::default()
        },
        checkpoint_to_load_path: Some(ckpt),
        ..gpt2_config(&resumed)
    };
    let again = launch(c, gpt2_tokens(), None).unwrap();
    assert_eq!(again.start_step, 5);
    for ((name, r), (_, c)) in onnx_params(resumed.join("gpt2_tiny_trained.onnx"))
        .iter()
        .zip(onnx_params(cpu_model.clone()))
    {
        assert_close(
            &format!("resumed on the CPU from wgpu's checkpoint: {name}"),
            r,
            &c,
            1e-4,
            0.0,
        );
    }

    // And the converse: the CPU run's checkpoint (Burn's AdamW record) resumes under the
    // fused update on wgpu.
    let resumed = tempdir("cpu-resumed-on-wgpu");
    let c = TrainingConfig {
        device: DeviceSpec::Wgpu(None),
        num_train_steps: 10,
        evaluation_period: 5,
        lr: LrConfig {
            warmup_ratio: 0.2,
            mode: ScheduleKind::Constant,
            ..Default::default()
        },
        checkpoint_to_load_path: Some(cpu_out.join("checkpoints/ckpt-000000005")),
        ..gpt2_config(&resumed)
    };
    let again = launch(c, gpt2_tokens(), None).unwrap();
    assert_eq!(again.start_step, 5);
    for ((name, r), (_, c)) in onnx_params(resumed.join("gpt2_tiny_trained.onnx"))
        .iter()
        .zip(onnx_params(cpu_model))
    {
        assert_close(
            &format!("resumed on wgpu from the CPU's checkpoint: {name}"),
            r,
            &c,
            1e-4,
            0.0,
        );
    }
}

#[test]
fn zero_3_on_wgpu_matches_the_replicated_cpu_run() {
    // The parameter gather and its reduce-scatter as CubeCL-backend ops, 2 thread ranks
    // on the wgpu device.
    let run = |device: DeviceSpec, zero_stage: usize, out: &Path| {
        let c = TrainingConfig {
            device,
            data_parallel_size: 2,
            batch_size: 2,
            zero_stage,
            num_train_steps: 10,
            ..gpt2_config(out)
        };
        launch(c, gpt2_tokens(), None).unwrap()
    };
    let (gpu_out, cpu_out) = (tempdir("wgpu-zero3"), tempdir("wgpu-zero3-cpu"));
    let gpu = run(DeviceSpec::Wgpu(None), 3, &gpu_out);
    let cpu = run(DeviceSpec::Cpu, 0, &cpu_out);
    for ((step, g), (_, c)) in gpu.losses.iter().zip(&cpu.losses) {
        assert!(
            (g - c).abs() < 1e-4,
            "update {step}: loss {g} on wgpu at ZeRO-3, {c} on the CPU"
        );
    }
    let file = "gpt2_tiny_trained.onnx";
    assert_moved(&refkit("models/gpt2_tiny.onnx"), &gpu_out.join(file), 1e-3);
    for ((name, g), (_, c)) in onnx_params(gpu_out.join(file))
        .iter()
        .zip(onnx_params(cpu_out.join(file)))
    {
        assert_close(&format!("wgpu ZeRO-3 vs CPU: {name}"), g, &c, 1e-4, 1e-4);
    }
}
