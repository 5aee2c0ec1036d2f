//! Single-op models (opsets 11-20, including the opset 18+ forms of Split, ReduceMean and
//! friends, LayerNormalization, Gelu, training-mode BatchNormalization and Dropout) against
//! what onnxruntime computed on the same inputs; the exporters' 8-node tanh GELU becomes one
//! fused Gelu node and a Conv's Relu folds into the Conv where nothing else reads their
//! intermediates. Fixtures:
//! `tools/gen_op_fixtures.py`.

use super::common;

use burn_onnx_train::value::host_tensor::HostTensor;
use burn_onnx_train::{Mode, OnnxModel, Value};
use common::*;

fn run_case(case: &str) -> Vec<String> {
    let device = eval_device();
    let model = OnnxModel::load(data(&format!("ops/{case}.onnx")), &device)
        .unwrap_or_else(|e| panic!("{case}: {e}"));
    let arrays = npz(data(&format!("ops/{case}.npz")));
    let inputs = arrays
        .iter()
        .filter_map(|(k, v)| {
            k.strip_prefix("in_")
                .map(|n| (n.to_string(), Value::from_host(v, &device).unwrap()))
        })
        .collect();
    let out = model
        .forward(inputs, Mode::Eval)
        .unwrap_or_else(|e| panic!("{case}: {e}"));
    let mut checked = Vec::new();
    for (name, got) in &out.outputs {
        let Some(want) = arrays.get(&format!("out_{name}")) else {
            continue;
        };
        let what = format!("{case}: output {name}");
        match (got, want) {
            (Value::Float(g), HostTensor::Float(w)) => {
                assert_close(&what, &g.to_array().unwrap(), w, 1e-5, 1e-5)
            }
            (Value::Int(g), HostTensor::Int(w)) => assert_eq!(g, w, "{what}"),
            (Value::Bool(g), HostTensor::Bool(w)) => assert_eq!(g, w, "{what}"),
            (g, w) => panic!(
                "{what}: got {} value, onnxruntime gave {}",
                g.kind(),
                w.kind()
            ),
        }
        checked.push(name.clone());
    }
    checked
}

#[test]
fn every_op_fixture_matches_onnxruntime() {
    let mut cases: Vec<String> = std::fs::read_dir(data("ops"))
        .unwrap()
        .filter_map(|e| {
            e.ok()?
                .file_name()
                .to_str()?
                .strip_suffix(".onnx")
                .map(str::to_string)
        })
        .collect();
    cases.sort();
    assert!(cases.len() >= 30, "fixtures missing: {cases:?}");
    let mut failures = Vec::new();
    for case in &cases {
        if case.starts_with("dropout_training") {
            continue;
        }
        match std::panic::catch_unwind(|| run_case(case)) {
            Ok(checked) if checked.is_empty() => {
                failures.push(format!("{case}: no output checked"))
            }
            Ok(_) => {}
            Err(e) => failures.push(
                e.downcast_ref::<String>()
                    .cloned()
                    .unwrap_or_else(|| case.clone()),
            ),
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} cases failed:\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n")
    );
}

#[test]
fn training_dropout_drops_at_the_ratio_and_rescales() {
    let device = eval_device();
    let model = OnnxModel::load(data("ops/dropout_training_13.onnx"), &device).unwrap();
    let x = npz(data("ops/dropout_training_13.npz"))["in_x"].clone();
    let out = model
        .forward(
            vec![("x".into(), Value::from_host(&x, &device).unwrap())],
            Mode::Eval,
        )
        .unwrap();
    let (Some(Value::Float(y)), Some(Value::Bool(mask))) = (out.get("y"), out.get("mask")) else {
        panic!("outputs")
    };
    let y = y.to_array().unwrap();
    let kept = mask.iter().filter(|&&m| m).count() as f64 / mask.len() as f64;
    // 4096 Bernoulli(0.75) draws: the kept fraction is within 0.75 +- 0.04 with overwhelming probability.
    assert!((kept - 0.75).abs() < 0.04, "kept fraction {kept}");
    for (v, m) in y.iter().zip(mask.iter()) {
        let want = if *m { 1.0 / 0.75 } else { 0.0 };
        assert!((v - want).abs() < 1e-6, "y {v} with mask {m}");
    }
}

#[test]
fn float_settings_are_constants_not_parameters() {
    let device = eval_device();
    for case in [
        "resize_linear_align_corners_13",
        "clip_13",
        "pad_constant_18",
        "dropout_inference_13",
    ] {
        let model = OnnxModel::load(data(&format!("ops/{case}.onnx")), &device).unwrap();
        assert!(
            model.param_infos().is_empty(),
            "{case}: {:?}",
            model.param_infos()
        );
    }
    // Weights next to settings are still parameters.
    let model = OnnxModel::load(data("ops/prelu_13.onnx"), &device).unwrap();
    assert_eq!(
        model
            .param_infos()
            .iter()
            .map(|p| p.name.as_str())
            .collect::<Vec<_>>(),
        vec!["slope"]
    );
}

fn op_types(path: std::path::PathBuf) -> Vec<String> {
    OnnxModel::load(path, &eval_device())
        .unwrap()
        .graph()
        .nodes
        .iter()
        .map(|n| n.op_type.clone())
        .collect()
}

#[test]
fn the_exporters_tanh_gelu_becomes_one_fused_node() {
    // The pattern alone (its output checked against onnxruntime by the fixture test above).
    assert_eq!(
        op_types(data("ops/gelu_tanh_pattern_13.onnx")),
        vec!["Gelu"]
    );
    // An intermediate read elsewhere (here: a graph output) keeps the nodes as they are.
    assert!(op_types(data("ops/gelu_tanh_escaping_13.onnx")).contains(&"Tanh".to_string()));
    // TorchScript (gpt2_tiny) and dynamo exports of GPT-2: one Gelu per layer, no Tanh left.
    for model in [
        refkit("models/gpt2_tiny.onnx"),
        data("dynamo_gpt2/gpt2_tied.onnx"),
    ] {
        let ops = op_types(model.clone());
        assert_eq!(
            ops.iter().filter(|o| *o == "Gelu").count(),
            2,
            "{}",
            model.display()
        );
        assert!(
            !ops.iter().any(|o| o == "Tanh" || o == "Pow"),
            "{}: {ops:?}",
            model.display()
        );
        // Dynamo's MLP adds its bias after a MatMul: the Add folds into the Gelu ([x, bias]).
        // TorchScript's adds it inside a Gemm, reshaped after: nothing to fold.
        let dynamo = model.to_string_lossy().contains("dynamo");
        let loaded = OnnxModel::load(model.clone(), &eval_device()).unwrap();
        for gelu in loaded.graph().nodes.iter().filter(|n| n.op_type == "Gelu") {
            let folded = gelu.inputs.len() == 2 && gelu.inputs[1].ends_with("mlp.c_fc.bias");
            assert_eq!(folded, dynamo, "{}: {:?}", model.display(), gelu.inputs);
        }
    }
}

#[test]
fn attention_scaling_masking_and_products_fold_into_the_softmax() {
    // TorchScript's GPT-2 (gpt2_tiny: scale by Mul, mask added) and dynamo's (scale by Mul,
    // mask selected by Where): every Softmax scales and masks the scores itself and computes
    // the two products around it (inputs [q, kt, v, mask, bias]). Their outputs are checked
    // against onnxruntime and PyTorch by the refkit tests.
    for (model, mask_slot) in [
        (refkit("models/gpt2_tiny.onnx"), 4),
        (data("dynamo_gpt2/gpt2_tied.onnx"), 3),
    ] {
        let loaded = OnnxModel::load(model.clone(), &eval_device()).unwrap();
        let nodes = &loaded.graph().nodes;
        let softmaxes: Vec<_> = nodes.iter().filter(|n| n.op_type == "Softmax").collect();
        assert_eq!(softmaxes.len(), 2, "{}", model.display());
        for s in &softmaxes {
            let what = format!("{}: {} {:?}", model.display(), s.name, s.inputs);
            assert!(s.attrs.get("__masked_softmax").is_some(), "{what}");
            assert!(s.attrs.get("__attention_core").is_some(), "{what}");
            assert_eq!(s.inputs.len(), 5, "{what}");
            assert!(!s.inputs[mask_slot].is_empty(), "{what}");
        }
        // No product is left reading a softmax's output or writing its input.
        let from_softmax = |v: &String| softmaxes.iter().any(|s| s.outputs.contains(v));
        let into_softmax = |v: &String| softmaxes.iter().any(|s| s.inputs[..3].contains(v));
        for n in nodes.iter().filter(|n| n.op_type == "MatMul") {
            assert!(
                !n.inputs.iter().any(from_softmax) && !n.outputs.iter().any(into_softmax),
                "{}: {} {:?}",
                model.display(),
                n.name,
                n.inputs
            );
        }
    }
}

#[test]
fn a_relu_after_a_conv_folds_into_it() {
    // The pattern alone (its output checked against onnxruntime by the fixture test above).
    assert_eq!(
        op_types(data("ops/conv_relu_pattern_13.onnx")),
        vec!["Conv"]
    );
    // The Conv's output read elsewhere (a graph output) keeps the Relu.
    assert_eq!(
        op_types(data("ops/conv_relu_escaping_13.onnx")),
        vec!["Conv", "Relu"]
    );
    // SqueezeNet 1.1: every one of its 26 Relus follows a Conv read by it alone.
    let ops = op_types(refkit("models/squeezenet1_1_dynbatch.onnx"));
    assert_eq!(ops.iter().filter(|o| *o == "Conv").count(), 26);
    assert!(!ops.iter().any(|o| o == "Relu"), "{ops:?}");
}
