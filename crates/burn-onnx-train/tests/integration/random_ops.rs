//! The random generators (RandomUniform, RandomNormal, their `*Like` forms, Bernoulli,
//! Multinomial) against their distributions' closed forms: range, mean, variance and
//! frequencies of 10^4-10^5 draws, each bound at least 4 standard errors wide and far
//! inside what a wrong distribution would give. Draws are a pure function of the pass's
//! seed; gradients flow through a VAE's reparameterisation to `mu` and `logvar` as the
//! closed form says. Fixtures: `tools/gen_random_fixtures.py`.

use super::common;

use std::collections::HashMap;

use burn::tensor::{Tensor, TensorData};
use burn_onnx_train::value::host_tensor::HostTensor;
use burn_onnx_train::value::{MAX_RANK, padded};
use burn_onnx_train::{Mode, OnnxModel, Value};
use common::*;
use ndarray::{ArrayD, IxDyn};

fn draws(seed: u64) -> HashMap<String, Value> {
    let device = eval_device();
    let model = OnnxModel::load(data("random/draws.onnx"), &device).unwrap();
    let x = HostTensor::Float(ArrayD::zeros(IxDyn(&[300, 400])));
    let p: Vec<f32> = [0.0, 0.25, 0.7, 1.0]
        .iter()
        .flat_map(|&p| std::iter::repeat_n(p, 10_000))
        .collect();
    let p = HostTensor::Float(ArrayD::from_shape_vec(IxDyn(&[4, 10_000]), p).unwrap());
    let ln = |v: f32| v.ln();
    let logits = vec![0.0, ln(2.0), ln(3.0), ln(4.0), 0.0, 0.0, 0.0, 10.0];
    let logits = HostTensor::Float(ArrayD::from_shape_vec(IxDyn(&[2, 4]), logits).unwrap());
    let feeds = [("x", x), ("p", p), ("logits", logits)]
        .into_iter()
        .map(|(k, v)| (k.to_string(), Value::from_host(&v, &device).unwrap()))
        .collect();
    let out = model.forward_seeded(feeds, Mode::Eval, seed).unwrap();
    out.outputs.into_iter().collect()
}

fn floats(v: &Value) -> Vec<f64> {
    let Value::Float(f) = v else {
        panic!("a float output, got {}", v.kind())
    };
    f.to_array()
        .unwrap()
        .iter()
        .map(|&x| f64::from(x))
        .collect()
}

/// Mean and (population) standard deviation.
fn moments(v: &[f64]) -> (f64, f64) {
    let n = v.len() as f64;
    let mean = v.iter().sum::<f64>() / n;
    let var = v.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / n;
    (mean, var.sqrt())
}

fn assert_within(what: &str, got: f64, want: f64, tol: f64) {
    assert!(
        (got - want).abs() <= tol,
        "{what}: {got} vs {want} (tolerance {tol})"
    );
}

#[test]
fn uniform_and_normal_draws_have_their_distributions_moments() {
    let out = draws(11);
    // U[-2, 3): mean 0.5, sd 5/sqrt(12); standard error of the mean 0.0046.
    let u = floats(&out["u"]);
    assert_eq!(u.len(), 100_000);
    let (lo, hi) = u
        .iter()
        .fold((f64::MAX, f64::MIN), |(a, b), &x| (a.min(x), b.max(x)));
    assert!(
        (-2.0..-1.99).contains(&lo) && (2.99..3.0).contains(&hi),
        "range [{lo}, {hi}]"
    );
    let (m, s) = moments(&u);
    assert_within("uniform mean", m, 0.5, 0.02);
    assert_within("uniform sd", s, 5.0 / 12f64.sqrt(), 0.015);

    // N(1, 2^2): standard errors 0.0063 (mean) and 0.0045 (sd); 68.27% within one sd.
    let n = floats(&out["n"]);
    let (m, s) = moments(&n);
    assert_within("normal mean", m, 1.0, 0.03);
    assert_within("normal sd", s, 2.0, 0.025);
    let inside = n.iter().filter(|x| (*x - 1.0).abs() < 2.0).count() as f64 / n.len() as f64;
    assert_within("normal mass within one sd", inside, 0.6827, 0.008);

    // The *Like forms take the input's shape, with the default N(0, 1) and U[0, 1).
    let Value::Float(nl) = &out["nl"] else {
        panic!()
    };
    assert_eq!(nl.shape(), vec![300, 400]);
    let (m, s) = moments(&floats(&out["nl"]));
    assert_within("normal-like mean", m, 0.0, 0.015);
    assert_within("normal-like sd", s, 1.0, 0.012);
    let ul = floats(&out["ul"]);
    assert!(ul.iter().all(|x| (0.0..1.0).contains(x)));
    let (m, s) = moments(&ul);
    assert_within("uniform-like mean", m, 0.5, 0.004);
    assert_within("uniform-like sd", s, 12f64.sqrt().recip(), 0.004);
}

#[test]
fn bernoulli_and_multinomial_draw_with_the_given_probabilities() {
    let out = draws(12);
    let b = floats(&out["b"]);
    let Value::Bool(bb) = &out["bb"] else {
        panic!("dtype bool gives a bool tensor, got {}", out["bb"].kind())
    };
    let bb: Vec<bool> = bb.iter().copied().collect();
    for (row, p) in [0.0, 0.25, 0.7, 1.0].into_iter().enumerate() {
        let r = &b[row * 10_000..(row + 1) * 10_000];
        assert!(r.iter().all(|&v| v == 0.0 || v == 1.0), "draws are 0 or 1");
        let freq = r.iter().sum::<f64>() / 1e4;
        let freq_bool = bb[row * 10_000..(row + 1) * 10_000]
            .iter()
            .filter(|&&v| v)
            .count() as f64
            / 1e4;
        // Standard error at most 0.005.
        assert_within(&format!("Bernoulli({p}) frequency"), freq, p, 0.02);
        assert_within(
            &format!("Bernoulli({p}) frequency as bool"),
            freq_bool,
            p,
            0.02,
        );
    }

    let Value::Int(m) = &out["m"] else {
        panic!("Multinomial gives integers")
    };
    assert_eq!(m.shape(), &[2, 20_000]);
    let freq = |row: usize, class: i64| {
        m.index_axis(ndarray::Axis(0), row)
            .iter()
            .filter(|&&c| c == class)
            .count() as f64
            / 2e4
    };
    // Row 0: logits ln(1..4), so probabilities 0.1 .. 0.4 (standard error <= 0.0035).
    for class in 0..4 {
        let want = (class + 1) as f64 / 10.0;
        assert_within(
            &format!("class {class} frequency"),
            freq(0, class),
            want,
            0.015,
        );
    }
    // Row 1: the last class has probability e^10 / (3 + e^10) = 0.99986.
    assert!(freq(1, 3) > 0.998, "{}", freq(1, 3));
    assert!(m.iter().all(|&c| (0..4).contains(&c)));
}

#[test]
fn draws_are_a_function_of_the_pass_seed() {
    let (a, b, c) = (draws(21), draws(21), draws(22));
    for name in ["u", "n", "nl", "b"] {
        assert_eq!(
            floats(&a[name]),
            floats(&b[name]),
            "{name}: same seed, same draws"
        );
        let same = floats(&a[name])
            .iter()
            .zip(floats(&c[name]))
            .filter(|(x, y)| *x == y)
            .count();
        assert!(
            same < 1000 || name == "b",
            "{name}: another seed draws anew ({same} equal)"
        );
    }
    assert_ne!(floats(&a["b"]), floats(&c["b"]));
    // Two nodes of the same kind in one pass draw independently.
    assert_ne!(floats(&a["nl"])[..1000], floats(&a["u"])[..1000]);
}

#[test]
fn gradients_flow_through_the_reparameterisation() {
    // z = mu + exp(logvar / 2) * eps: d sum(w z) / d mu = w and
    // d / d logvar = w exp(logvar / 2) eps / 2 = w (z - mu) / 2, with eps the pass's draw.
    let device = train_device();
    let model = OnnxModel::load(data("random/reparam.onnx"), &device).unwrap();
    let out = model.forward_seeded(Vec::new(), Mode::Train, 5).unwrap();
    let Some(Value::Float(z)) = out.first().cloned() else {
        panic!("float output")
    };
    let w: Vec<f32> = (0..z.numel()).map(|i| (i % 7) as f32 - 3.0).collect();
    let wt: Tensor<MAX_RANK> = Tensor::from_data(
        TensorData::new(w.clone(), padded(&z.shape()).unwrap().to_vec()),
        &device,
    );
    let z_host = z.to_array().unwrap();
    let grads = (z.tensor * wt).sum().backward();
    let grads: HashMap<String, ArrayD<f32>> = model
        .param_grads(&grads)
        .into_iter()
        .map(|(k, v)| (k, v.to_array().unwrap()))
        .collect();
    let mu = model.param_by_name("mu").unwrap().to_array().unwrap();
    let eps_spread = z_host
        .iter()
        .zip(&mu)
        .map(|(z, m)| (z - m).abs())
        .fold(0.0f32, f32::max);
    assert!(eps_spread > 0.1, "the noise was drawn");
    for (i, ((&gm, &gl), (&zi, &mi))) in grads["mu"]
        .iter()
        .zip(&grads["logvar"])
        .zip(z_host.iter().zip(&mu))
        .enumerate()
    {
        assert_within(
            &format!("d/d mu[{i}]"),
            f64::from(gm),
            f64::from(w[i]),
            1e-6,
        );
        let want = f64::from(w[i]) * f64::from(zi - mi) / 2.0;
        assert_within(
            &format!("d/d logvar[{i}]"),
            f64::from(gl),
            want,
            1e-5 * (1.0 + want.abs()),
        );
    }
}
