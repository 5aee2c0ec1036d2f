//! The fused kernels on the CPU against f64 closed forms and the plain Burn compositions
//! they replace: softmax cross-entropy forward and backward (`common::fused_checks`, which
//! `gpu.rs` runs on the GPU), tanh, GELU (tanh form), softmax, layer normalisation and the
//! masked fill (`Where` with a scalar branch) forward and backward.

use super::common;

use burn::tensor::{Device, FloatDType, TensorData};
use burn_onnx_train::kernels::{masked_fill, softmax};
use burn_onnx_train::value::{MAX_RANK, PhysTensor, padded};
use common::activation_checks::*;
use common::fused_checks::{check_cross_entropy, check_head_cross_entropy};
use common::*;

#[test]
fn fused_cross_entropy_on_the_cpu_matches_the_closed_form_and_the_plain_composition() {
    check_cross_entropy(&Device::flex());
}

#[test]
fn head_product_and_cross_entropy_by_blocks_on_the_cpu_match_the_closed_form() {
    check_head_cross_entropy(&Device::flex(), FloatDType::F32, 1e-5);
}

#[test]
fn tanh_forward_and_backward_match_the_f64_closed_form() {
    check_tanh(&Device::flex().autodiff(), 1.0);
}

#[test]
fn gelu_tanh_forward_and_backward_match_the_f64_closed_form() {
    check_gelu_tanh(&Device::flex().autodiff(), 1.0);
    // The bias's composition on the CPU (the fused op is the GPU's).
    check_gelu_tanh_biased(&Device::flex().autodiff(), 1.0);
}

#[test]
fn bias_and_residual_composition_matches_the_f64_sums() {
    // The two additions on the CPU (the fused op is the GPU's).
    check_add_bias_residual(&Device::flex().autodiff());
}

#[test]
fn softmax_forward_and_backward_match_the_f64_closed_form() {
    check_softmax(
        &Device::flex().autodiff(),
        1.0,
        &[(37, 1000), (5, 2), (3, 50257)],
    );
}

#[test]
fn softmax_on_another_axis_is_burns() {
    let (x, _) = activation_problem(6, 8);
    let t = PhysTensor::from_data(
        TensorData::new(x, padded(&[6, 8]).unwrap().to_vec()),
        &Device::flex(),
    );
    let got = softmax(t.clone(), MAX_RANK - 2)
        .into_data()
        .try_to_vec::<f32>()
        .unwrap();
    let want = burn::tensor::activation::softmax(t, MAX_RANK - 2)
        .into_data()
        .try_to_vec::<f32>()
        .unwrap();
    assert_eq!(got, want);
}

#[test]
fn layer_norm_forward_and_backward_match_the_f64_closed_form() {
    // Rows that are not a whole number of backward blocks; an offset mean, a tiny-variance
    // row (eps matters there).
    check_layer_norm(
        &Device::flex().autodiff(),
        1.0,
        &[(77, 128), (3, 1000), (1, 5)],
    );
}

#[test]
fn masked_fill_forward_and_backward_match_the_closed_form() {
    let device = Device::flex().autodiff();
    // Periods shorter than a parallel chunk (2^14 values), whole chunks, and a prime one
    // longer than a chunk (no divisor to split it by).
    for (period, periods) in [(12, 5), (1, 7), (2 * 16384, 3), (16411, 2)] {
        let n = period * periods;
        let mut next = lcg(period as u64);
        let keep: Vec<bool> = (0..period).map(|_| next() % 3 != 0).collect();
        let x: Vec<f32> = (0..n)
            .map(|_| (next() % 2000) as f32 / 500.0 - 2.0)
            .collect();
        let w: Vec<f32> = (0..n)
            .map(|_| (next() % 2000) as f32 / 500.0 - 2.0)
            .collect();
        let shape = padded(&[periods, period]).unwrap();
        let xt = PhysTensor::from_data(TensorData::new(x.clone(), shape), &device).require_grad();
        let wt = PhysTensor::from_data(TensorData::new(w.clone(), shape), &device);
        let what = format!("period {period} x {periods}");

        let y = masked_fill(xt.clone().detach(), keep.clone().into(), f32::NEG_INFINITY);
        let y = y.into_data().try_to_vec::<f32>().unwrap();
        for (i, (&y, &x)) in y.iter().zip(&x).enumerate() {
            let want = if keep[i % period] {
                x
            } else {
                f32::NEG_INFINITY
            };
            assert_eq!(y, want, "{what}: value {i}");
        }

        let y = masked_fill(xt.clone(), keep.clone().into(), 2.5);
        let grads = (y * wt).sum().backward();
        let dx = xt
            .grad(&grads)
            .unwrap()
            .into_data()
            .try_to_vec::<f32>()
            .unwrap();
        for (i, (&d, &w)) in dx.iter().zip(&w).enumerate() {
            let want = if keep[i % period] { w } else { 0.0 };
            assert_eq!(d, want, "{what}: gradient {i}");
        }
    }
}
