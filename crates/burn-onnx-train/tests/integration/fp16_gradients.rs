//! `allreduce_in_fp16`: gpt2_tiny, 10 SGD updates (momentum, no clipping: the update is
//! proportional to the gradient, so a gradient off by any factor shows) on 2 thread ranks,
//! the gradients crossing as f16 at ZeRO stages 0 (all-reduce), 2 (reduce-scatter) and 3
//! (reduce-scatter in backward), against the same run in f32: the losses agree within
//! 1e-3 and every tensor's update within 0.2% (f16 rounds to 0.05%), the weights moved, and
//! they are not bit-identical to the f32 run's (the f16 path ran).

use super::common;

use std::path::Path;

use burn_onnx_train::train::TrainingConfig;
use burn_onnx_train::train::config::{LrConfig, OptimizerConfig, OptimizerKind};
use burn_onnx_train::train::process::launch::launch;
use common::*;

fn config(out: &Path, stage: usize, fp16: bool) -> TrainingConfig {
    let mut c = gpt2_config(out);
    c.train.num_train_steps = 10;
    c.data.batch_size = 2;
    c.parallel.data_parallel_size = 2;
    c.parallel.zero_stage = stage;
    c.train.max_grad_norm = 0.0;
    c.optimizer = OptimizerConfig {
        kind: OptimizerKind::Sgd,
        momentum: 0.9,
        ..Default::default()
    };
    c.lr = LrConfig {
        initial_lr: 0.1,
        ..Default::default()
    };
    c.parallel.allreduce_in_fp16 = fp16;
    c
}

#[test]
fn f16_gradients_at_stages_0_2_and_3_follow_the_f32_run() {
    let base = tempdir("fp16-grads-f32");
    let want = launch(config(&base, 0, false), gpt2_tokens(), None).unwrap();
    let file = "gpt2_tiny_trained.onnx";
    for stage in [0, 2, 3] {
        let out = tempdir(&format!("fp16-grads-{stage}"));
        let got = launch(config(&out, stage, true), gpt2_tokens(), None).unwrap();
        for ((step, g), (_, w)) in got.losses.iter().zip(&want.losses) {
            assert!(
                (g - w).abs() <= 1e-3 * w.abs(),
                "stage {stage}, update {step}: loss {g} with f16 gradients, {w} in f32"
            );
        }
        let initial = onnx_params(refkit("models/gpt2_tiny.onnx"));
        let mut largest = 0.0f32;
        for (((name, a), (_, b)), (_, p)) in onnx_params(out.join(file))
            .iter()
            .zip(onnx_params(base.join(file)))
            .zip(&initial)
        {
            let rel = relative_update_error(p, a, &b);
            assert!(
                rel <= 2e-3,
                "stage {stage}: {name}: the update differs from the f32 run's by {rel:.2e} (relative L2)"
            );
            largest = largest.max(max_abs_diff(a, &b));
        }
        assert!(
            largest > 0.0,
            "stage {stage}: bit-identical to f32: was f16 used?"
        );
        assert_moved(&refkit("models/gpt2_tiny.onnx"), &out.join(file), 1e-3);
    }
}

#[test]
fn f16_gradients_with_adasum_are_a_config_error() {
    let c = {
        let mut c = config(&tempdir("fp16-adasum"), 0, true);
        c.parallel.enable_adasum = true;
        c
    };
    let err = c.validate(2).unwrap_err().to_string();
    assert!(err.contains("config.parallel.allreduce_in_fp16"), "{err}");
}
