//! Quantization-aware training through `QuantizeLinear` -> `DequantizeLinear` pairs.
//!
//! The fixtures (`tools/gen_op_fixtures.py`, cases `qdq_*`) quantize a weight initializer
//! `W` (per axis to int8, and per tensor to uint8), dequantize it and multiply an input `x`
//! by it. The forward must equal what onnxruntime computed; the gradient of
//! `sum(y * g)` with respect to `W` must be the straight-through estimator's, as PyTorch's
//! fake quantization: `x^T g` where `round(W / scale) + zero_point` lies inside the integer
//! range, zero where it saturates. The reference here is that closed form in plain loops.
//! Finite differences do not apply: the true derivative of a quantizer is zero almost
//! everywhere.

use super::common;

use std::collections::HashMap;

use burn::tensor::{Tensor, TensorData};
use burn_onnx_train::graph::attributes::Attr;
use burn_onnx_train::ops::ZERO_POINT_TYPE;
use burn_onnx_train::value::host_tensor::{HostTensor, dtype};
use burn_onnx_train::value::{FloatValue, MAX_RANK, padded};
use burn_onnx_train::{Graph, Mode, OnnxModel, Value};
use common::*;
use ndarray::{ArrayD, Ix2};

/// Fixed output weights `g`, so every output element matters.
fn g(i: usize) -> f32 {
    ((i * 7919 % 113) as f32 / 113.0) - 0.5
}

struct Case {
    x: ArrayD<f32>,
    y: ArrayD<f32>,
    w: ArrayD<f32>,
    scale: ArrayD<f32>,
    zp: ArrayD<i64>,
    path: std::path::PathBuf,
}

fn load(case: &str) -> Case {
    let arrays = npz(data(&format!("ops/{case}.npz")));
    let path = data(&format!("ops/{case}.onnx"));
    let graph = Graph::load(&path).unwrap();
    let inits: HashMap<String, HostTensor> = graph
        .initializers
        .iter()
        .map(|(n, t)| (n.clone(), t.clone().into_host()))
        .collect();
    let int = |t: &HostTensor| match t {
        HostTensor::Int(a) => a.clone(),
        other => panic!("expected an int tensor, got {}", other.kind()),
    };
    Case {
        x: float(&arrays["in_x"]).clone(),
        y: float(&arrays["out_y"]).clone(),
        w: float(&inits["W"]).clone(),
        scale: float(&inits["w_scale"]).clone(),
        zp: int(&inits["w_zp"]),
        path,
    }
}

fn forward(model: &OnnxModel, x: &ArrayD<f32>, mode: Mode) -> FloatValue {
    let device = model.device();
    let x = Value::Float(FloatValue::from_array(x, &device).unwrap());
    let out = model.forward(vec![("x".into(), x)], mode).unwrap();
    match out.outputs.into_iter().next() {
        Some((_, Value::Float(y))) => y,
        _ => panic!("expected a float output"),
    }
}

/// The closed-form gradient of `sum(y * g)` w.r.t. `W` under the straight-through estimator,
/// and how many weights saturate.
fn expected_grad(c: &Case, range: (f32, f32)) -> (ArrayD<f32>, usize) {
    let x = c.x.view().into_dimensionality::<Ix2>().unwrap();
    let w = c.w.view().into_dimensionality::<Ix2>().unwrap();
    let (m, k) = x.dim();
    let n = w.dim().1;
    // Per-column scale and zero point, or one for the whole tensor.
    let col = |a: &ArrayD<f32>, j: usize| {
        if a.len() == 1 {
            a.iter().next().copied().unwrap()
        } else {
            a[[j]]
        }
    };
    let zp = |j: usize| {
        if c.zp.len() == 1 {
            *c.zp.iter().next().unwrap() as f32
        } else {
            c.zp[[j]] as f32
        }
    };
    let mut grad = ArrayD::zeros(vec![k, n]);
    let mut saturated = 0;
    for p in 0..k {
        for j in 0..n {
            let code = (w[[p, j]] / col(&c.scale, j)).round_ties_even() + zp(j);
            if code < range.0 || code > range.1 {
                saturated += 1;
                continue;
            }
            grad[[p, j]] = (0..m).map(|i| x[[i, p]] * g(i * n + j)).sum();
        }
    }
    (grad, saturated)
}

fn check(case: &str, zero_point_type: i32, range: (f32, f32)) {
    let c = load(case);

    // The zero point's declared type reaches the QuantizeLinear node.
    let graph = Graph::load(&c.path).unwrap();
    let q = graph
        .nodes
        .iter()
        .find(|n| n.op_type == "QuantizeLinear")
        .unwrap();
    assert_eq!(
        q.attrs.get(ZERO_POINT_TYPE),
        Some(&Attr::Int(i64::from(zero_point_type))),
        "{case}"
    );

    // Forward, evaluation mode, against onnxruntime.
    let model = OnnxModel::load(&c.path, &eval_device()).unwrap();
    let y = forward(&model, &c.x, Mode::Eval).to_array().unwrap();
    assert_close(&format!("{case}: y"), &y, &c.y, 1e-5, 1e-5);

    // Gradient w.r.t. W, in both modes (the estimator does not depend on the mode).
    let (want, saturated) = expected_grad(&c, range);
    assert!(
        saturated > 0 && saturated < c.w.len(),
        "{case}: the fixture should saturate some weights, not all ({saturated})"
    );
    let device = train_device();
    let model = OnnxModel::load(&c.path, &device).unwrap();
    for mode in [Mode::Train, Mode::Eval] {
        let y = forward(&model, &c.x, mode);
        assert_close(
            &format!("{case}: y ({mode:?}, autodiff device)"),
            &y.to_array().unwrap(),
            &c.y,
            1e-5,
            1e-5,
        );
        let weights: Vec<f32> = (0..y.numel()).map(g).collect();
        let weights: Tensor<MAX_RANK> = Tensor::from_data(
            TensorData::new(weights, padded(&y.shape()).unwrap().to_vec()),
            &device,
        );
        let grads = (y.tensor * weights).sum().backward();
        let grads = model.param_grads(&grads);
        let got = grads
            .iter()
            .find(|(name, _)| name == "W")
            .unwrap_or_else(|| panic!("{case}: no gradient for W"))
            .1
            .to_array()
            .unwrap();
        assert_close(&format!("{case}: dW ({mode:?})"), &got, &want, 1e-6, 1e-5);
        for (i, (gv, wv)) in got.iter().zip(want.iter()).enumerate() {
            if *wv == 0.0 {
                assert_eq!(
                    *gv, 0.0,
                    "{case}: saturated weight {i} got a gradient ({mode:?})"
                );
            }
        }
    }
}

#[test]
fn per_axis_int8_qdq_trains_with_straight_through_gradients() {
    check("qdq_matmul_per_axis_int8_13", dtype::INT8, (-128.0, 127.0));
}

#[test]
fn per_tensor_uint8_qdq_trains_with_straight_through_gradients() {
    check("qdq_matmul_uint8_10", dtype::UINT8, (0.0, 255.0));
}
