//! The fused kernels on the CPU against f64 closed forms and the plain Burn compositions
//! they replace: softmax cross-entropy forward and backward (`common::fused_checks`, which
//! `gpu.rs` runs on the GPU), tanh, GELU (tanh form), softmax, layer normalisation and the
//! masked fill (`Where` with a scalar branch) forward and backward.

use super::common;

use burn::tensor::{Device, Tensor, TensorData};
use burn_onnx_train::kernels::{gelu_tanh, layer_norm, masked_fill, softmax, tanh};
use burn_onnx_train::value::{MAX_RANK, PhysTensor, padded};
use common::fused_checks::check_cross_entropy;
use common::*;

#[test]
fn fused_cross_entropy_on_the_cpu_matches_the_closed_form_and_the_plain_composition() {
    check_cross_entropy(&Device::flex());
}

/// `[rows, cols]` values over +-12 with a few at +-60 (saturated tanh, softmax far from
/// uniform), and upstream-gradient weights.
fn activation_problem(rows: usize, cols: usize) -> (Vec<f32>, Vec<f32>) {
    let mut next = lcg(11);
    let x = (0..rows * cols)
        .map(|i| {
            if i % 97 == 0 {
                60.0 * if i % 2 == 0 { 1.0 } else { -1.0 }
            } else {
                (next() % 24001) as f32 / 1000.0 - 12.0
            }
        })
        .collect();
    let w = (0..rows * cols)
        .map(|_| (next() % 2000) as f32 / 1000.0 - 1.0)
        .collect();
    (x, w)
}

/// `f(x)` and the gradient of `sum(w * f(x))`, on the CPU through the interpreter's kernels.
fn activation_and_grad(
    rows: usize,
    cols: usize,
    f: fn(PhysTensor) -> PhysTensor,
) -> (Vec<f32>, Vec<f32>) {
    let (x, w) = activation_problem(rows, cols);
    let device = Device::flex().autodiff();
    let x = PhysTensor::from_data(
        TensorData::new(x, padded(&[rows, cols]).unwrap().to_vec()),
        &device,
    )
    .require_grad();
    let w = PhysTensor::from_data(
        TensorData::new(w, padded(&[rows, cols]).unwrap().to_vec()),
        &device,
    );
    let y = f(x.clone());
    let grads = (y.clone() * w).sum().backward();
    let g = x.grad(&grads).unwrap();
    (
        y.inner().into_data().try_to_vec::<f32>().unwrap(),
        g.into_data().try_to_vec::<f32>().unwrap(),
    )
}

fn assert_close_rel(what: &str, got: &[f32], want: &[f64], rtol: f64, atol: f64) {
    assert_eq!(got.len(), want.len());
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        assert!(
            (f64::from(g) - w).abs() <= atol + rtol * w.abs(),
            "{what}[{i}]: {g} vs {w}"
        );
    }
}

#[test]
fn tanh_forward_and_backward_match_the_f64_closed_form() {
    let (rows, cols) = (37, 1000);
    let (x, w) = activation_problem(rows, cols);
    let (y, g) = activation_and_grad(rows, cols, tanh);
    let want_y: Vec<f64> = x.iter().map(|&v| f64::from(v).tanh()).collect();
    let want_g: Vec<f64> = want_y
        .iter()
        .zip(&w)
        .map(|(&t, &w)| f64::from(w) * (1.0 - t * t))
        .collect();
    assert_close_rel("tanh", &y, &want_y, 3e-7, 0.0);
    assert_close_rel("tanh gradient", &g, &want_g, 1e-6, 1e-7);
}

#[test]
fn gelu_tanh_forward_and_backward_match_the_f64_closed_form() {
    let (rows, cols) = (37, 1000);
    let (x, w) = activation_problem(rows, cols);
    let (y, g) = activation_and_grad(rows, cols, gelu_tanh);
    let (k, c) = ((2.0 / std::f64::consts::PI).sqrt(), 0.044715);
    let mut want_y = Vec::new();
    let mut want_g = Vec::new();
    for (&x, &w) in x.iter().zip(&w) {
        let x = f64::from(x);
        let t = (k * (x + c * x * x * x)).tanh();
        want_y.push(0.5 * x * (1.0 + t));
        want_g.push(
            f64::from(w)
                * (0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * k * (1.0 + 3.0 * c * x * x)),
        );
    }
    assert_close_rel("gelu", &y, &want_y, 1e-6, 1e-7);
    assert_close_rel("gelu gradient", &g, &want_g, 1e-5, 1e-6);
}

#[test]
fn softmax_forward_and_backward_match_the_f64_closed_form() {
    for (rows, cols) in [(37, 1000), (5, 2), (3, 50257)] {
        let (x, w) = activation_problem(rows, cols);
        let (y, g) = activation_and_grad(rows, cols, |t| softmax(t, MAX_RANK - 1));
        let (mut want_y, mut want_g, mut scale_g) = (Vec::new(), Vec::new(), Vec::new());
        for r in 0..rows {
            let row = &x[r * cols..(r + 1) * cols];
            let max = row.iter().fold(f64::MIN, |m, &v| m.max(f64::from(v)));
            let e: Vec<f64> = row.iter().map(|&v| (f64::from(v) - max).exp()).collect();
            let sum: f64 = e.iter().sum();
            let p: Vec<f64> = e.iter().map(|v| v / sum).collect();
            let wr = &w[r * cols..(r + 1) * cols];
            let dot: f64 = p.iter().zip(wr).map(|(p, &w)| p * f64::from(w)).sum();
            want_g.extend(p.iter().zip(wr).map(|(p, &w)| p * (f64::from(w) - dot)));
            // f32's own limit: y (g - dot) cancels, so its error scales with y (|g| + |dot|).
            scale_g.extend(
                p.iter()
                    .zip(wr)
                    .map(|(p, &w)| p * (f64::from(w).abs() + dot.abs())),
            );
            want_y.extend(p);
        }
        assert_close_rel(&format!("softmax {rows}x{cols}"), &y, &want_y, 1e-6, 1e-12);
        for (i, ((&got, want), scale)) in g.iter().zip(&want_g).zip(&scale_g).enumerate() {
            assert!(
                (f64::from(got) - want).abs() <= 1e-6 * scale + 1e-12,
                "softmax gradient {rows}x{cols}[{i}]: {got} vs {want} (scale {scale})"
            );
        }
    }
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

/// LayerNorm's output and the gradients of `sum(w * y)` for x, scale and bias, in f64.
fn layer_norm_f64(
    x: &[f32],
    scale: &[f32],
    bias: &[f32],
    w: &[f32],
    eps: f64,
) -> (Vec<f64>, Vec<f64>, Vec<f64>, Vec<f64>) {
    let cols = scale.len();
    let (mut y, mut dx) = (Vec::new(), Vec::new());
    let (mut ds, mut db) = (vec![0f64; cols], vec![0f64; cols]);
    for (row, wr) in x.chunks(cols).zip(w.chunks(cols)) {
        let n = cols as f64;
        let mean = row.iter().map(|&v| f64::from(v)).sum::<f64>() / n;
        let var = row
            .iter()
            .map(|&v| (f64::from(v) - mean).powi(2))
            .sum::<f64>()
            / n;
        let rstd = 1.0 / (var + eps).sqrt();
        let xh: Vec<f64> = row.iter().map(|&v| (f64::from(v) - mean) * rstd).collect();
        let h: Vec<f64> = wr
            .iter()
            .zip(scale)
            .map(|(&w, &s)| f64::from(w * s))
            .collect();
        let a = h.iter().sum::<f64>() / n;
        let b = h.iter().zip(&xh).map(|(h, x)| h * x).sum::<f64>() / n;
        for i in 0..cols {
            y.push(xh[i] * f64::from(scale[i]) + f64::from(bias[i]));
            dx.push(rstd * (h[i] - a - xh[i] * b));
            ds[i] += f64::from(wr[i]) * xh[i];
            db[i] += f64::from(wr[i]);
        }
    }
    (y, dx, ds, db)
}

#[test]
fn layer_norm_forward_and_backward_match_the_f64_closed_form() {
    // Rows that are not a whole number of backward blocks; an offset mean, a tiny-variance
    // row (eps matters there).
    for (rows, cols) in [(77, 128), (3, 1000), (1, 5)] {
        let (mut x, w) = activation_problem(rows, cols);
        x.iter_mut()
            .enumerate()
            .for_each(|(i, v)| *v = *v * 0.1 + 3.0 + (i / cols) as f32 * 0.01);
        x[..cols]
            .iter_mut()
            .enumerate()
            .for_each(|(i, v)| *v = 1e-3 * (i % 3) as f32);
        let scale: Vec<f32> = (0..cols).map(|i| 0.5 + (i % 7) as f32 * 0.25).collect();
        let bias: Vec<f32> = (0..cols).map(|i| (i % 5) as f32 * 0.1 - 0.2).collect();
        let eps = 1e-5;
        let device = Device::flex().autodiff();
        let t = |v: &[f32], shape: Vec<usize>| {
            Tensor::<2>::from_data(TensorData::new(v.to_vec(), shape), &device)
        };
        let xt = t(&x, vec![rows, cols]).require_grad();
        let st = t(&scale, vec![1, cols]).reshape([cols]).require_grad();
        let bt = t(&bias, vec![1, cols]).reshape([cols]).require_grad();
        let y = layer_norm(xt.clone(), st.clone(), bt.clone(), eps as f32);
        let grads = (y.clone() * t(&w, vec![rows, cols])).sum().backward();
        let (want_y, want_dx, want_ds, want_db) = layer_norm_f64(&x, &scale, &bias, &w, eps);
        let v2 = |t: Tensor<2>| t.into_data().try_to_vec::<f32>().unwrap();
        let v1 = |t: Tensor<1>| t.into_data().try_to_vec::<f32>().unwrap();
        let what = format!("layer norm {rows}x{cols}");
        assert_close_rel(&what, &v2(y.inner()), &want_y, 1e-5, 1e-5);
        assert_close_rel(
            &format!("{what} dx"),
            &v2(xt.grad(&grads).unwrap()),
            &want_dx,
            1e-4,
            1e-4,
        );
        assert_close_rel(
            &format!("{what} dscale"),
            &v1(st.grad(&grads).unwrap()),
            &want_ds,
            1e-5,
            1e-4,
        );
        assert_close_rel(
            &format!("{what} dbias"),
            &v1(bt.grad(&grads).unwrap()),
            &want_db,
            1e-5,
            1e-4,
        );
    }
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
