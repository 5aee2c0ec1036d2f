//! A GPT-2 with a tied embedding exported by PyTorch's dynamo exporter (opset 18), whose
//! graph constants (attention scale, GELU coefficients, mask values) are scalar
//! initializers and whose Linear weights are pre-transposed copies (`val_N`): the default
//! rule trains exactly the initializers that hold PyTorch's parameters, and 10 AdamW steps
//! through the runner's optimizer match PyTorch's trajectory (losses 1e-5; parameters 1e-5
//! where the step-0 gradient exceeds 1e-6). Fixture: `tools/gen_train_refs.py`.

use super::common;

use std::collections::HashSet;

use burn::optim::GradientsParams;
use burn_onnx_train::train::config::{OptimizerConfig, OptimizerKind};
use burn_onnx_train::train::optimizer::build_optimizer;
use burn_onnx_train::{OnnxModel, ParamRole};
use common::*;

fn path(file: &str) -> std::path::PathBuf {
    data(&format!("dynamo_gpt2/{file}"))
}

fn mapping() -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(path("mapping.json")).unwrap()).unwrap()
}

#[test]
fn the_default_rule_trains_exactly_pytorchs_parameters() {
    let model = OnnxModel::load(path("gpt2_tied.onnx"), &eval_device()).unwrap();
    let m = mapping();
    let want: HashSet<String> = m["parameters"]
        .as_object()
        .unwrap()
        .keys()
        .cloned()
        .collect();
    let got: HashSet<String> = model
        .param_infos()
        .iter()
        .filter(|p| p.role == ParamRole::Trainable)
        .map(|p| p.name.clone())
        .collect();
    assert_eq!(got, want, "trainable initializers vs PyTorch parameters");
    let constants: Vec<&str> = m["constants"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap())
        .collect();
    assert!(
        !constants.is_empty(),
        "the fixture must hold graph constants as initializers"
    );
    let scalars = model
        .param_infos()
        .iter()
        .filter(|p| p.role == ParamRole::Constant && p.reason.contains("scalar"))
        .count();
    assert!(
        scalars > 0,
        "scalar initializers are constants: {:?}",
        model.param_infos()
    );
    for c in constants {
        let role = model
            .param_infos()
            .iter()
            .find(|p| p.name == c)
            .map(|p| p.role);
        assert!(
            role != Some(ParamRole::Trainable),
            "{c} is a graph constant but would be trained"
        );
    }
}

#[test]
fn inspect_shows_each_initializers_role_and_reason() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_onnx-train"))
        .args(["inspect", path("gpt2_tied.onnx").to_str().unwrap()])
        .output()
        .unwrap();
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(out.status.success());
    assert!(
        text.contains("constant: scalar or one-element tensor"),
        "{text}"
    );
    assert!(
        text.contains("lm_head.weight") && text.contains("trainable: weight"),
        "{text}"
    );
}

#[test]
fn ten_adamw_steps_match_pytorch() {
    let device = train_device();
    let mut model = OnnxModel::load(path("gpt2_tied.onnx"), &device).unwrap();
    let ids = int(&npz(path("batch.npz"))["input_ids"]).clone();
    let refs: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path("losses.json")).unwrap()).unwrap();
    // PyTorch decays every parameter here: no exclusion group.
    let config = OptimizerConfig {
        kind: OptimizerKind::Adamw,
        weight_decay: 0.01,
        epsilon: 1e-8,
        no_weight_decay: vec![],
        ..Default::default()
    };
    let mut optim = build_optimizer(&config, &model);
    let grads0 = npz(path("grads.npz"));
    let want_losses: Vec<f64> = refs["adamw_losses"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_f64().unwrap())
        .collect();
    assert_eq!(want_losses.len(), 10);
    for (step, want) in want_losses.iter().enumerate() {
        let l = lm_loss(&model, &ids);
        let got = l.clone().into_scalar::<f32>() as f64;
        assert!(
            (got - want).abs() < 1e-5,
            "step {step}: loss {got} vs PyTorch {want}"
        );
        let grads = l.backward();
        if step == 0 {
            for (name, g) in model.param_grads(&grads) {
                let w = float(
                    grads0
                        .get(&name)
                        .unwrap_or_else(|| panic!("no PyTorch gradient for {name}")),
                );
                assert_close(
                    &format!("grad {name}"),
                    &g.to_array().unwrap(),
                    w,
                    1e-6,
                    1e-4,
                );
            }
        }
        let grads = GradientsParams::from_grads(grads, &model);
        model = optim.step(1e-3, model, grads);
    }
    let want = npz(path("adamw_step10.npz"));
    let init = npz(path("params_init.npz"));
    for (name, w) in &want {
        let got = model.param_by_name(name).unwrap().to_array().unwrap();
        assert_close_where_grad(
            &format!("step 10: {name}"),
            &got,
            float(w),
            float(&grads0[name]),
            1e-5,
        );
        assert!(
            max_abs_diff(&got, float(&init[name])) > 0.0,
            "{name} did not move"
        );
    }
    // The graph constants did not move.
    let fresh = OnnxModel::load(path("gpt2_tied.onnx"), &eval_device()).unwrap();
    for (i, p) in fresh
        .param_infos()
        .iter()
        .enumerate()
        .filter(|(_, p)| p.role == ParamRole::Constant)
    {
        assert_eq!(
            model.param_by_name(&p.name).unwrap().to_array().unwrap(),
            fresh.param_value(i).unwrap().to_array().unwrap(),
            "{} moved",
            p.name
        );
    }
}

#[test]
fn masks_cut_by_the_sequence_length_are_made_once_per_shape() {
    // Each layer cuts its causal mask from its own constant buffer by the input's length
    // (Shape, Slice, Slice, Not): those nodes fold, made by the first pass of a shape and
    // reused after. A pass of another length must make its own (a stale mask would be the
    // wrong size or the wrong values); each pass is checked against a fresh model's.
    let model = OnnxModel::load(path("gpt2_tied.onnx"), &train_device()).unwrap();
    assert!(
        model.shape_folded_nodes() >= 2 * 3,
        "{} nodes fold",
        model.shape_folded_nodes()
    );
    let ids = int(&npz(path("batch.npz"))["input_ids"]).clone();
    let cut = |t: usize| ids.slice(ndarray::s![.., ..t]).to_owned().into_dyn();
    let full = ids.shape()[1];
    for t in [full, full / 2, full, full / 2] {
        let ids = cut(t);
        let got = lm_logits(&model, &ids)
            .value
            .written()
            .unwrap()
            .to_array()
            .unwrap();
        let fresh = OnnxModel::load(path("gpt2_tied.onnx"), &train_device()).unwrap();
        let want = lm_logits(&fresh, &ids)
            .value
            .written()
            .unwrap()
            .to_array()
            .unwrap();
        assert_eq!(got.shape(), want.shape());
        assert_eq!(max_abs_diff(&got, &want), 0.0, "{t} tokens");
    }
}
