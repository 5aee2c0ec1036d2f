//! Tanh, GELU (tanh form), softmax and layer normalisation, forward and backward, on a
//! given device against f64 closed forms: `integration/kernels.rs` runs them on the CPU's
//! fused kernels, `gpu.rs` on the CubeCL ones.

use burn::tensor::{DType, Device, FloatDType, Tensor, TensorData};
use burn_onnx_train::kernels::{
    add_bias_residual, gelu_tanh, gelu_tanh_biased, layer_norm, layer_norm_in, softmax, tanh,
};
use burn_onnx_train::value::{MAX_RANK, PhysTensor, padded};

use super::lcg;

/// `[rows, cols]` values over +-12 with a few at +-60 (saturated tanh, softmax far from
/// uniform), and upstream-gradient weights.
pub fn activation_problem(rows: usize, cols: usize) -> (Vec<f32>, Vec<f32>) {
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

/// `f(x)` and the gradient of `sum(w * f(x))` on `device` (an autodiff device), through the
/// interpreter's kernels.
fn activation_and_grad(
    device: &Device,
    rows: usize,
    cols: usize,
    f: fn(PhysTensor) -> PhysTensor,
) -> (Vec<f32>, Vec<f32>) {
    let (x, w) = activation_problem(rows, cols);
    let x = physical(x, &[rows, cols], device).require_grad();
    let w = physical(w, &[rows, cols], device);
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

/// `values` as an f32 tensor of logical `shape` on `device`, padded to the physical rank.
fn physical(values: Vec<f32>, shape: &[usize], device: &Device) -> PhysTensor {
    PhysTensor::from_data(
        TensorData::new(values, padded(shape).unwrap().to_vec()),
        device,
    )
}

/// Tanh on `device` against f64; tolerances times `slack` (1 on the CPU).
pub fn check_tanh(device: &Device, slack: f64) {
    let (rows, cols) = (37, 1000);
    let (x, w) = activation_problem(rows, cols);
    let (y, g) = activation_and_grad(device, rows, cols, tanh);
    let want_y: Vec<f64> = x.iter().map(|&v| f64::from(v).tanh()).collect();
    let want_g: Vec<f64> = want_y
        .iter()
        .zip(&w)
        .map(|(&t, &w)| f64::from(w) * (1.0 - t * t))
        .collect();
    assert_close_rel("tanh", &y, &want_y, 3e-7 * slack, 0.0);
    assert_close_rel("tanh gradient", &g, &want_g, 1e-6 * slack, 1e-7 * slack);
}

/// GELU (tanh form) on `device` against f64; tolerances times `slack`.
pub fn check_gelu_tanh(device: &Device, slack: f64) {
    let (rows, cols) = (37, 1000);
    let (x, w) = activation_problem(rows, cols);
    let (y, g) = activation_and_grad(device, rows, cols, gelu_tanh);
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
    assert_close_rel("gelu", &y, &want_y, 1e-6 * slack, 1e-7 * slack);
    assert_close_rel("gelu gradient", &g, &want_g, 1e-5 * slack, 1e-6 * slack);
}

/// `gelu_tanh(x + bias)` in f64 for rows of `x` (the bias as long as a row), with the
/// gradients of `sum(y * w)`: `(y, dx, dbias)`.
fn biased_gelu_closed_form(x: &[f32], w: &[f32], bias: &[f32]) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let cols = bias.len();
    let (k, c) = ((2.0 / std::f64::consts::PI).sqrt(), 0.044715);
    let (mut y, mut dx, mut db) = (Vec::new(), Vec::new(), vec![0.0; cols]);
    for (i, (&x, &w)) in x.iter().zip(w).enumerate() {
        let v = f64::from(x) + f64::from(bias[i % cols]);
        let t = (k * (v + c * v * v * v)).tanh();
        y.push(0.5 * v * (1.0 + t));
        let d = f64::from(w)
            * (0.5 * (1.0 + t) + 0.5 * v * (1.0 - t * t) * k * (1.0 + 3.0 * c * v * v));
        dx.push(d);
        db[i % cols] += d;
    }
    (y, dx, db)
}

/// GELU (tanh form) of `x + bias` on `device` against f64: the output, and the gradients of
/// `sum(w * y)` for `x` and for `bias` (its sum over the rows); tolerances times `slack`.
pub fn check_gelu_tanh_biased(device: &Device, slack: f64) {
    let (rows, cols) = (37, 1000);
    let (x, w) = activation_problem(rows, cols);
    let bias: Vec<f32> = (0..cols).map(|j| 2.0 * (j as f32 * 0.37).sin()).collect();
    let (xt, bt) = (
        physical(x.clone(), &[rows, cols], device).require_grad(),
        physical(bias.clone(), &[cols], device).require_grad(),
    );
    let y = gelu_tanh_biased(xt.clone(), bt.clone());
    let weights = physical(w.clone(), &[rows, cols], device);
    let grads = (y.clone() * weights).sum().backward();
    let read = |t: PhysTensor| t.into_data().try_to_vec::<f32>().unwrap();
    let (got_y, got_dx, got_db) = (
        read(y.inner()),
        read(xt.grad(&grads).unwrap()),
        read(bt.grad(&grads).unwrap()),
    );
    let (want_y, want_dx, want_db) = biased_gelu_closed_form(&x, &w, &bias);
    assert_close_rel("biased gelu", &got_y, &want_y, 1e-6 * slack, 1e-6 * slack);
    assert_close_rel(
        "biased gelu, x's gradient",
        &got_dx,
        &want_dx,
        1e-5 * slack,
        1e-6 * slack,
    );
    // The bias's gradient sums 37 rows: f32's summation noise.
    assert_close_rel(
        "biased gelu, bias's gradient",
        &got_db,
        &want_db,
        1e-5 * slack,
        1e-5 * slack,
    );
}

/// The biased tanh GELU of an f16 input on a CubeCL `device` (the MLP's hidden activation
/// written in the autocast precision): the output and the input's gradient in f16, each
/// within an f16 rounding of the f64 closed form of the rounded input and output gradient,
/// the bias's gradient in f32 within an f16 rounding of its sum (summed with f32
/// accumulators, rounded to f16 once).
pub fn check_gelu_tanh_biased_f16(device: &Device) {
    let (rows, cols) = (37, 1000);
    let (x, w) = activation_problem(rows, cols);
    let bias: Vec<f32> = (0..cols).map(|j| 2.0 * (j as f32 * 0.37).sin()).collect();
    let f32_tensor = |values: Vec<f32>, shape: &[usize]| physical(values, shape, device);
    let read = |t: PhysTensor| {
        t.cast(FloatDType::F32)
            .into_data()
            .try_to_vec::<f32>()
            .unwrap()
    };
    let xt = f32_tensor(x, &[rows, cols])
        .cast(FloatDType::F16)
        .require_grad();
    let bt = f32_tensor(bias.clone(), &[cols]).require_grad();
    let wt = f32_tensor(w, &[rows, cols]).cast(FloatDType::F16);
    let (x16, w16) = (read(xt.clone().inner()), read(wt.clone()));
    let y = gelu_tanh_biased(xt.clone(), bt.clone());
    assert_eq!(y.dtype(), DType::F16, "the output in the input's precision");
    let grads = (y.clone() * wt).sum().backward();
    let (dx, db) = (xt.grad(&grads).unwrap(), bt.grad(&grads).unwrap());
    assert_eq!(
        dx.dtype(),
        DType::F16,
        "the input's gradient in its precision"
    );
    assert_eq!(
        db.dtype(),
        DType::F32,
        "the bias's gradient in its precision"
    );
    let (got_y, got_dx, got_db) = (read(y.inner()), read(dx), read(db));
    let (want_y, want_dx, want_db) = biased_gelu_closed_form(&x16, &w16, &bias);
    // Half an f16 unit (2^-11 relative) for the one rounding, with room for f32's own
    // error below it; f16's smallest normal as the absolute floor.
    let (rtol, atol) = (5.0e-4, 6.2e-5);
    assert_close_rel("f16 biased gelu", &got_y, &want_y, rtol, atol);
    assert_close_rel(
        "f16 biased gelu, x's gradient",
        &got_dx,
        &want_dx,
        rtol,
        atol,
    );
    // 37 rounded terms summed in f32, the sum rounded to f16 once.
    assert_close_rel(
        "f16 biased gelu, bias's gradient",
        &got_db,
        &want_db,
        rtol,
        37.0 * atol,
    );
    // A bias the fused kernels do not take (one value for every column): the composition,
    // the f16 input cast up to the bias's f32 first.
    let scalar = f32_tensor(vec![0.25], &[1]);
    let y = gelu_tanh_biased(xt.clone(), scalar);
    assert_eq!(
        y.dtype(),
        DType::F32,
        "the composition runs in the bias's precision"
    );
    let shifted = biased_gelu_closed_form(&x16, &w16, &vec![0.25; cols]).0;
    assert_close_rel("f16 gelu, scalar bias", &read(y), &shifted, 1e-5, 1e-5);
}

/// Softmax over the last axis on `device` against f64, for each `(rows, cols)` of `shapes`;
/// tolerances times `slack`.
pub fn check_softmax(device: &Device, slack: f64, shapes: &[(usize, usize)]) {
    for &(rows, cols) in shapes {
        let (x, w) = activation_problem(rows, cols);
        let (y, g) = activation_and_grad(device, rows, cols, |t| softmax(t, MAX_RANK - 1));
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
        assert_close_rel(
            &format!("softmax {rows}x{cols}"),
            &y,
            &want_y,
            1e-6 * slack,
            1e-12,
        );
        for (i, ((&got, want), scale)) in g.iter().zip(&want_g).zip(&scale_g).enumerate() {
            assert!(
                (f64::from(got) - want).abs() <= 1e-6 * slack * scale + 1e-12,
                "softmax gradient {rows}x{cols}[{i}]: {got} vs {want} (scale {scale})"
            );
        }
    }
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

/// A product's output, its bias and the residual added in one op on `device`
/// (`kernels::add_bias_residual`) against the f64 sums, with the gradients of `sum(y * w)`:
/// `w` to `x` and to the residual, its column sums to the bias.
pub fn check_add_bias_residual(device: &Device) {
    let (rows, cols) = (37, 1000);
    let (x, w) = activation_problem(rows, cols);
    let r: Vec<f32> = x.iter().rev().map(|v| v * 0.5).collect();
    let bias: Vec<f32> = (0..cols).map(|j| (j as f32 * 0.37).cos()).collect();
    let tensor = |values: Vec<f32>, shape: &[usize]| physical(values, shape, device);
    let (xt, bt, rt) = (
        tensor(x.clone(), &[rows, cols]).require_grad(),
        tensor(bias.clone(), &[cols]).require_grad(),
        tensor(r.clone(), &[rows, cols]).require_grad(),
    );
    let y = add_bias_residual(xt.clone(), bt.clone(), rt.clone());
    let grads = (y.clone() * tensor(w.clone(), &[rows, cols]))
        .sum()
        .backward();
    let read = |t: PhysTensor| t.into_data().try_to_vec::<f32>().unwrap();
    let want_y: Vec<f64> = (0..rows * cols)
        .map(|i| f64::from(x[i]) + f64::from(bias[i % cols]) + f64::from(r[i]))
        .collect();
    let want_g: Vec<f64> = w.iter().map(|&v| f64::from(v)).collect();
    let mut want_db = vec![0.0; cols];
    for (i, &v) in w.iter().enumerate() {
        want_db[i % cols] += f64::from(v);
    }
    assert_close_rel("bias and residual", &read(y.inner()), &want_y, 1e-6, 1e-6);
    let dx = read(xt.grad(&grads).unwrap());
    assert_close_rel("bias and residual, x's gradient", &dx, &want_g, 0.0, 0.0);
    let dr = read(rt.grad(&grads).unwrap());
    assert_close_rel(
        "bias and residual, the residual's gradient",
        &dr,
        &want_g,
        0.0,
        0.0,
    );
    let db = read(bt.grad(&grads).unwrap());
    assert_close_rel(
        "bias and residual, bias's gradient",
        &db,
        &want_db,
        1e-5,
        1e-5,
    );
}

/// A layer norm's `(x, w, scale, bias)` of `rows x cols`: rows offset from zero, the first
/// one nearly constant (a variance far below `eps`).
fn layer_norm_problem(rows: usize, cols: usize) -> (Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>) {
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
    (x, w, scale, bias)
}

/// `x` (`[rows, scale.len()]`), `scale` and `bias` as tensors on `device` that take
/// gradients.
fn layer_norm_leaves(
    device: &Device,
    x: &[f32],
    scale: &[f32],
    bias: &[f32],
) -> (Tensor<2>, Tensor<1>, Tensor<1>) {
    let cols = scale.len();
    let t = |v: &[f32], shape: Vec<usize>| {
        Tensor::<2>::from_data(TensorData::new(v.to_vec(), shape), device)
    };
    (
        t(x, vec![x.len() / cols, cols]).require_grad(),
        t(scale, vec![1, cols]).reshape([cols]).require_grad(),
        t(bias, vec![1, cols]).reshape([cols]).require_grad(),
    )
}

/// Layer norm on `device` against f64 for each `(rows, cols)` of `shapes`; tolerances
/// times `slack`.
pub fn check_layer_norm(device: &Device, slack: f64, shapes: &[(usize, usize)]) {
    for &(rows, cols) in shapes {
        let (x, w, scale, bias) = layer_norm_problem(rows, cols);
        let eps = 1e-5;
        let t = |v: &[f32], shape: Vec<usize>| {
            Tensor::<2>::from_data(TensorData::new(v.to_vec(), shape), device)
        };
        let (xt, st, bt) = layer_norm_leaves(device, &x, &scale, &bias);
        let y = layer_norm(xt.clone(), st.clone(), bt.clone(), eps as f32);
        let grads = (y.clone() * t(&w, vec![rows, cols])).sum().backward();
        let (want_y, want_dx, want_ds, want_db) = layer_norm_f64(&x, &scale, &bias, &w, eps);
        let v2 = |t: Tensor<2>| t.into_data().try_to_vec::<f32>().unwrap();
        let v1 = |t: Tensor<1>| t.into_data().try_to_vec::<f32>().unwrap();
        let what = format!("layer norm {rows}x{cols}");
        assert_close_rel(&what, &v2(y.inner()), &want_y, 1e-5 * slack, 1e-5 * slack);
        assert_close_rel(
            &format!("{what} dx"),
            &v2(xt.grad(&grads).unwrap()),
            &want_dx,
            1e-4 * slack,
            1e-4 * slack,
        );
        assert_close_rel(
            &format!("{what} dscale"),
            &v1(st.grad(&grads).unwrap()),
            &want_ds,
            1e-5 * slack,
            1e-4 * slack,
        );
        assert_close_rel(
            &format!("{what} dbias"),
            &v1(bt.grad(&grads).unwrap()),
            &want_db,
            1e-5 * slack,
            1e-4 * slack,
        );
    }
}

/// The layer norm writing its output in f16 on a CubeCL `device` (a norm read by products
/// only): the output within half an f16 unit of the f64 closed form, its gradient
/// arriving in f16, and `x`'s, `scale`'s and `bias`'s gradients in f32 to f32's precision
/// against the closed form of that rounded gradient.
pub fn check_layer_norm_f16_out(device: &Device, slack: f64) {
    let (rows, cols) = (37, 1000);
    let (x, w, scale, bias) = layer_norm_problem(rows, cols);
    let eps = 1e-5;
    let (xt, st, bt) = layer_norm_leaves(device, &x, &scale, &bias);
    let wt = Tensor::<2>::from_data(TensorData::new(w, vec![rows, cols]), device);
    let y = layer_norm_in(
        xt.clone(),
        st.clone(),
        bt.clone(),
        eps as f32,
        FloatDType::F16,
    );
    assert_eq!(y.dtype(), DType::F16, "the output in the asked precision");
    let wt = wt.cast(FloatDType::F16);
    let w16 = wt
        .clone()
        .cast(FloatDType::F32)
        .into_data()
        .try_to_vec::<f32>()
        .unwrap();
    let grads = (y.clone() * wt).sum().backward();
    let (dx, ds, db) = (
        xt.grad(&grads).unwrap(),
        st.grad(&grads).unwrap(),
        bt.grad(&grads).unwrap(),
    );
    assert_eq!(
        [dx.dtype(), ds.dtype(), db.dtype()],
        [DType::F32; 3],
        "the gradients in f32"
    );
    let (want_y, want_dx, want_ds, want_db) = layer_norm_f64(&x, &scale, &bias, &w16, eps);
    let v2 = |t: Tensor<2>| {
        t.cast(FloatDType::F32)
            .into_data()
            .try_to_vec::<f32>()
            .unwrap()
    };
    let v1 = |t: Tensor<1>| t.into_data().try_to_vec::<f32>().unwrap();
    assert_close_rel("f16 layer norm", &v2(y.inner()), &want_y, 5e-4, 6.2e-5);
    let (rtol, atol) = (1e-4 * slack, 1e-4 * slack);
    assert_close_rel("f16 layer norm dx", &v2(dx), &want_dx, rtol, atol);
    assert_close_rel("f16 layer norm dscale", &v1(ds), &want_ds, rtol, atol);
    assert_close_rel("f16 layer norm dbias", &v1(db), &want_db, rtol, atol);
}
