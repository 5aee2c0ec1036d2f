//! The path a run takes, config -> `build_optimizer` -> (global clipping) -> update, against
//! PyTorch for SGD (momentum, L2 decay, `clip_grad_norm_`), Adam (L2 decay), AdamW and LAMB
//! (a float64 reference written in torch), each with the default no-decay group for biases.
//! References: `tests/data/optim/`, made by `tools/gen_train_refs.py`.

use super::common;

use std::collections::HashMap;

use burn::optim::GradientsParams;
use burn_onnx_train::model::loss::cross_entropy;
use burn_onnx_train::train::config::{OptimizerConfig, OptimizerKind};
use burn_onnx_train::train::optimizer::{build_optimizer, clip_global_norm};
use burn_onnx_train::{Mode, OnnxModel, Value};
use common::*;

fn refs() -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(data("optim/refs.json")).unwrap()).unwrap()
}

fn check(case: &str, kind: OptimizerKind) {
    let r = &refs()[case];
    let f = |k: &str| {
        r[k].as_f64()
            .unwrap_or_else(|| panic!("{case}: refs.json has no {k}"))
    };
    let config = OptimizerConfig {
        kind,
        momentum: r["momentum"].as_f64().unwrap_or(0.0),
        beta1: r["betas"][0].as_f64().unwrap_or(0.9) as f32,
        beta2: r["betas"][1].as_f64().unwrap_or(0.999) as f32,
        epsilon: r["eps"].as_f64().unwrap_or(1e-8) as f32,
        weight_decay: f("weight_decay") as f32,
        ..Default::default()
    };
    assert!(
        config.no_weight_decay.iter().any(|s| s == "bias"),
        "the default no-decay group covers biases"
    );
    let (lr, max_norm) = (f("lr"), r["max_grad_norm"].as_f64().unwrap_or(0.0) as f32);
    let device = train_device();
    let mut model = OnnxModel::load(data("optim/mlp_small.onnx"), &device).unwrap();
    let mut optim = build_optimizer(&config, &model);
    let batch = npz(data("optim/batch.npz"));
    let want_losses: Vec<f64> = r["losses"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_f64().unwrap())
        .collect();
    assert_eq!(want_losses.len(), 10);
    let grads0 = npz(data("optim/grads0.npz"));
    for (step, want) in want_losses.iter().enumerate() {
        let x = Value::from_host(&batch["input"], &device).unwrap();
        let out = model
            .forward(vec![("input".into(), x)], Mode::Train)
            .unwrap();
        let Some(Value::Float(logits)) = out.first().cloned() else {
            panic!()
        };
        let loss = cross_entropy(logits, int(&batch["target"])).unwrap();
        let got = loss.clone().into_scalar::<f32>() as f64;
        assert!(
            (got - want).abs() < 1e-5,
            "{case} step {step}: loss {got} vs {want}"
        );
        let mut grads = GradientsParams::from_grads(loss.backward(), &model);
        clip_global_norm(&mut grads, &model, max_norm).unwrap();
        model = optim.step(lr, model, grads);
        if step == 0 {
            compare(case, &model, "step1", &grads0);
        }
    }
    compare(case, &model, "step10", &grads0);
}

fn compare(
    case: &str,
    model: &OnnxModel,
    at: &str,
    grads0: &HashMap<String, burn_onnx_train::value::host_tensor::HostTensor>,
) {
    let want = npz(data(&format!("optim/{case}_{at}.npz")));
    assert_eq!(want.len(), model.param_infos().len());
    let atol = if case == "sgd" { 1e-6 } else { 1e-5 };
    for (name, w) in &want {
        let got = model.param_by_name(name).unwrap().to_array().unwrap();
        assert_close_where_grad(
            &format!("{case} {at}: {name}"),
            &got,
            float(w),
            float(&grads0[name]),
            atol,
        );
    }
}

#[test]
fn sgd_momentum_l2_decay_and_global_clipping_match_pytorch() {
    check("sgd", OptimizerKind::Sgd);
}

#[test]
fn adam_with_l2_decay_matches_pytorch() {
    check("adam", OptimizerKind::Adam);
}

#[test]
fn adamw_matches_pytorch() {
    check("adamw", OptimizerKind::Adamw);
}

#[test]
fn lamb_matches_the_float64_torch_reference() {
    check("lamb", OptimizerKind::Lamb);
}
