//! Ties an exporter broke or made (`initializer_ties`), on the models of
//! `tools/gen_tie_fixtures.py`, with every expectation in closed form or by finite
//! differences of the forward pass:
//! - a transposed copy of an embedding trains as the embedding (GPT-2's folded `lm_head`),
//!   by default, and is exported as an initializer of its own again, holding the trained
//!   embedding transposed;
//! - two LayerNorms sharing an all-ones scale and all-zeros bias get one each;
//! - two BatchNorms sharing running statistics (through `Identity`) update one each;
//! - an attention mask the exporter folded into an initializer is a constant.

mod common;

use std::collections::HashMap;

use burn::tensor::{Device, Tensor, TensorData};
use burn_onnx_train::initializer_ties::TieOptions;
use burn_onnx_train::value::{FloatValue, MAX_RANK, padded};
use burn_onnx_train::{Graph, Mode, OnnxModel, Value};
use common::*;
use onnx_ir::Message;

fn load(name: &str, device: &Device, ties: TieOptions) -> OnnxModel {
    let graph = Graph::load_with(data(&format!("ties/{name}.onnx")), ties).unwrap();
    OnnxModel::from_graph(graph, device).unwrap()
}

fn names(model: &OnnxModel) -> Vec<String> {
    model.param_infos().iter().map(|p| p.name.clone()).collect()
}

/// Fixed pseudo-random weights of the objective `sum(y * g)`.
fn g(i: usize) -> f64 {
    ((i * 7919 % 113) as f64 / 113.0) - 0.5
}

fn objective(y: &FloatValue, device: &Device) -> Tensor<1> {
    let w: Vec<f32> = (0..y.numel()).map(|i| g(i) as f32).collect();
    let w: Tensor<MAX_RANK> = Tensor::from_data(
        TensorData::new(w, padded(&y.shape()).unwrap().to_vec()),
        device,
    );
    (y.tensor.clone() * w).sum()
}

fn float_out(model: &OnnxModel, feeds: Vec<(String, Value)>, mode: Mode) -> Vec<FloatValue> {
    let out = model.forward(feeds, mode).unwrap();
    out.outputs
        .into_iter()
        .map(|(_, v)| match v {
            Value::Float(f) => f,
            other => panic!("float output, got {}", other.kind()),
        })
        .collect()
}

fn values(v: &FloatValue) -> Vec<f64> {
    v.to_array()
        .unwrap()
        .iter()
        .map(|&x| f64::from(x))
        .collect()
}

#[test]
fn a_transposed_copy_of_the_embedding_trains_as_the_embedding() {
    let ids = vec![1i64, 4, 1, 5];
    let feeds = || {
        vec![(
            "ids".to_string(),
            Value::Int(ndarray::arr1(&ids).into_dyn()),
        )]
    };
    let device = train_device();
    let model = load("tied_lm_head", &device, TieOptions::default());
    assert_eq!(
        names(&model),
        ["E"],
        "W is read from E, not a parameter of its own"
    );
    let e = values(&model.param_by_name("E").unwrap());
    let (v, d) = (32, 16);
    let y = float_out(&model, feeds(), Mode::Eval).remove(0);
    let grads = objective(&y, &device).backward();
    let grad = values(&model.param_grads(&grads).remove(0).1);

    // Closed form: h = E[ids], y = h E^T; with G = dL/dy, dE = scatter(ids, G E) + G^T h.
    let h: Vec<f64> = ids
        .iter()
        .flat_map(|&i| e[i as usize * d..][..d].to_vec())
        .collect();
    let gy = |r: usize, c: usize| g(r * v + c);
    let mut want = vec![0.0; v * d];
    for (r, &i) in ids.iter().enumerate() {
        for k in 0..d {
            want[i as usize * d + k] += (0..v).map(|c| gy(r, c) * e[c * d + k]).sum::<f64>();
        }
    }
    for c in 0..v {
        for k in 0..d {
            want[c * d + k] += (0..ids.len()).map(|r| gy(r, c) * h[r * d + k]).sum::<f64>();
        }
    }
    let y = values(&y);
    for r in 0..ids.len() {
        for c in 0..v {
            let dot: f64 = (0..d).map(|k| h[r * d + k] * e[c * d + k]).sum();
            assert!((y[r * v + c] - dot).abs() < 1e-5, "y[{r}, {c}]");
        }
    }
    for (i, (got, want)) in grad.iter().zip(&want).enumerate() {
        assert!(
            (got - want).abs() < 1e-4 * (1.0 + want.abs()),
            "dE[{i}]: {got} vs {want}"
        );
    }

    // With `tie_duplicates` off the duplicate is only reported: W is a parameter of its own.
    let report_only = TieOptions {
        tie_duplicates: false,
        ..TieOptions::default()
    };
    let untied = load("tied_lm_head", &device, report_only);
    assert_eq!(names(&untied), ["E", "W"]);
    let reported: Vec<String> = untied.graph().ties.iter().map(|t| t.to_string()).collect();
    assert!(
        reported
            .iter()
            .any(|t| t.starts_with("duplicate: 'W' equals 'E' transposed")),
        "{reported:?}"
    );
}

#[test]
fn export_writes_a_tied_copy_back_as_the_trained_original_transposed() {
    let device = eval_device();
    let model = load("tied_lm_head", &device, TieOptions::default());
    let e = model.param_by_name("E").unwrap().to_array().unwrap();
    let (v, d) = (e.shape()[0], e.shape()[1]);
    // A "trained" embedding: every element moved.
    let trained = e.mapv(|x| x * 1.5 + 0.25);
    let model = model
        .set_params(&HashMap::from([(
            "E".to_string(),
            FloatValue::from_array(&trained, &device).unwrap(),
        )]))
        .unwrap();
    let bytes = burn_onnx_train::export::export_bytes(&model).unwrap();
    let out = onnx_ir::ModelProto::parse_from_bytes(&bytes).unwrap();
    let source = std::fs::read(data("ties/tied_lm_head.onnx")).unwrap();
    let source = onnx_ir::ModelProto::parse_from_bytes(&source).unwrap();
    let (g, src) = (out.graph.unwrap(), source.graph.unwrap());
    let ops = |g: &onnx_ir::GraphProto| -> Vec<String> {
        g.node.iter().map(|n| n.op_type.clone()).collect()
    };
    assert_eq!(ops(&g), ops(&src), "the source's nodes, no tie node");
    let inits: Vec<&str> = g.initializer.iter().map(|t| t.name.as_str()).collect();
    assert_eq!(inits, ["E", "W"]);
    let w = &g.initializer[1];
    assert_eq!(w.dims, [d as i64, v as i64]);
    let w: Vec<f32> = w
        .raw_data
        .chunks(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect();
    for r in 0..d {
        for c in 0..v {
            assert_eq!(w[r * v + c], trained[[c, r]], "W[{r}, {c}] = E[{c}, {r}]");
        }
    }
}

#[test]
fn layer_norms_sharing_a_constant_filled_scale_and_bias_get_one_each() {
    let device = train_device();
    let model = load("merged_norm", &device, TieOptions::default());
    assert_eq!(names(&model), ["S", "S__1", "B", "B__1", "M"]);
    let x: Vec<f32> = (0..8).map(|i| (i as f32 * 0.37).sin() * 2.0).collect();
    let feeds = || vec![("x".to_string(), float_input(x.clone(), &[2, 4], &device))];
    let y = float_out(&model, feeds(), Mode::Eval).remove(0);
    let grads = model.param_grads(&objective(&y, &device).backward());
    let grad: HashMap<String, Vec<f64>> =
        grads.iter().map(|(n, v)| (n.clone(), values(v))).collect();
    assert_ne!(
        grad["S"], grad["S__1"],
        "each LayerNorm's scale has its own gradient"
    );

    // Finite differences of the forward pass: moving one copy moves only its own node.
    let eval = eval_device();
    let base = load("merged_norm", &eval, TieOptions::default());
    let f = |m: &OnnxModel| -> f64 {
        let x = float_input(x.clone(), &[2, 4], &eval);
        let y = values(&float_out(m, vec![("x".into(), x)], Mode::Eval).remove(0));
        y.iter().enumerate().map(|(i, v)| v * g(i)).sum()
    };
    let eps = 1e-2f32;
    for name in ["S", "S__1", "B", "B__1"] {
        let p0 = base.param_by_name(name).unwrap().to_array().unwrap();
        for k in 0..4 {
            let shifted = |delta: f32| {
                let mut p = p0.clone();
                p[[k]] += delta;
                let v = FloatValue::from_array(&p, &eval).unwrap();
                f(&base
                    .clone()
                    .set_params(&HashMap::from([(name.to_string(), v)]))
                    .unwrap())
            };
            let fd = (shifted(eps) - shifted(-eps)) / (2.0 * f64::from(eps));
            let ad = grad[name][k];
            assert!(
                (fd - ad).abs() < 2e-3 * (1.0 + ad.abs()),
                "d/d {name}[{k}]: {ad} vs {fd}"
            );
        }
    }
}

#[test]
fn batch_norms_sharing_running_statistics_update_one_each() {
    let device = eval_device();
    let model = load("merged_bn_stats", &device, TieOptions::default());
    assert!(names(&model).contains(&"mean__1".to_string()));
    let x1: Vec<f32> = (0..24)
        .map(|i| (i as f32 * 0.61).cos() * 3.0 + 1.0)
        .collect();
    let x2: Vec<f32> = (0..24).map(|i| (i as f32 * 0.23).sin() - 2.0).collect();
    let feeds = vec![
        (
            "x1".to_string(),
            float_input(x1.clone(), &[3, 2, 2, 2], &device),
        ),
        (
            "x2".to_string(),
            float_input(x2.clone(), &[3, 2, 2, 2], &device),
        ),
    ];
    let out = model.forward(feeds, Mode::Train).unwrap();
    let model = model.apply_state(out.state_updates);
    // momentum 0.9 (ONNX's default): running = 0.9 * old + 0.1 * batch, with the batch's
    // unbiased variance (PyTorch's BatchNorm in train()); old mean 0, old var 1.
    for (x, mean, var) in [(&x1, "mean", "var"), (&x2, "mean__1", "var__1")] {
        for c in 0..2 {
            let xs: Vec<f64> = (0..3)
                .flat_map(|n| (0..4).map(move |p| n * 8 + c * 4 + p))
                .map(|i| f64::from(x[i]))
                .collect();
            let m = xs.iter().sum::<f64>() / 12.0;
            let v = xs.iter().map(|a| (a - m).powi(2)).sum::<f64>() / 11.0;
            let got_m = values(&model.param_by_name(mean).unwrap())[c];
            let got_v = values(&model.param_by_name(var).unwrap())[c];
            assert!(
                (got_m - 0.1 * m).abs() < 1e-5,
                "{mean}[{c}]: {got_m} vs {}",
                0.1 * m
            );
            assert!(
                (got_v - (0.9 + 0.1 * v)).abs() < 1e-4,
                "{var}[{c}]: {got_v}"
            );
        }
    }
}

fn float_input(values: Vec<f32>, shape: &[usize], device: &Device) -> Value {
    burn_onnx_train::model::float_input(values, shape, device).unwrap()
}

#[test]
fn a_folded_attention_mask_is_a_constant_not_a_parameter() {
    let model = load("folded_mask", &eval_device(), TieOptions::default());
    let roles: Vec<_> = model
        .param_infos()
        .iter()
        .map(|p| (p.name.as_str(), p.role))
        .collect();
    use burn_onnx_train::ParamRole;
    assert_eq!(
        roles,
        [("W", ParamRole::Trainable), ("mask", ParamRole::Constant)]
    );
}
