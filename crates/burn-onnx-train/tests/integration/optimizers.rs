//! The runner's optimizers: LAMB against a reference implementation of the algorithm
//! (You et al. 2020, Algorithm 2, with bias correction) written here in f64, the no-decay
//! parameter group, and global-norm clipping against its formula.

use super::common;

use std::collections::HashMap;

use burn::optim::GradientsParams;
use burn::tensor::{Tensor, TensorData};
use burn_onnx_train::OnnxModel;
use burn_onnx_train::train::config::{OptimizerConfig, OptimizerKind};
use burn_onnx_train::train::optimizer::{build_optimizer, clip_global_norm};
use burn_onnx_train::value::{MAX_RANK, padded};
use common::*;
use ndarray::ArrayD;

/// Pseudo-random gradient for parameter `p` at step `t`.
fn fake_grad(shape: &[usize], p: usize, t: usize) -> ArrayD<f32> {
    let mut x = (p as u64 + 1) * 1_000_003 + t as u64 * 7919;
    ArrayD::from_shape_fn(ndarray::IxDyn(shape), |_| {
        x = x
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((x >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.1
    })
}

fn grads_for(model: &OnnxModel, t: usize) -> (GradientsParams, Vec<ArrayD<f32>>) {
    let mut grads = GradientsParams::new();
    let mut host = Vec::new();
    let device = model.device();
    for (i, (p, info)) in model.params().iter().zip(model.param_infos()).enumerate() {
        let g = fake_grad(&info.shape, i, t);
        let data = TensorData::new(
            g.iter().copied().collect::<Vec<f32>>(),
            padded(&info.shape).unwrap().to_vec(),
        );
        grads.register::<MAX_RANK>(p.id, Tensor::from_data(data, &device));
        host.push(g);
    }
    (grads, host)
}

struct RefLamb {
    m: Vec<Vec<f64>>,
    v: Vec<Vec<f64>>,
}

impl RefLamb {
    fn step(&mut self, t: usize, lr: f64, wd: f64, params: &mut [Vec<f64>], grads: &[ArrayD<f32>]) {
        let (b1, b2, eps) = (0.9f64, 0.999f64, 1e-6f64);
        for (i, p) in params.iter_mut().enumerate() {
            let g: Vec<f64> = grads[i].iter().map(|&x| x as f64).collect();
            let mut r = vec![0.0; p.len()];
            for j in 0..p.len() {
                self.m[i][j] = b1 * self.m[i][j] + (1.0 - b1) * g[j];
                self.v[i][j] = b2 * self.v[i][j] + (1.0 - b2) * g[j] * g[j];
                let mh = self.m[i][j] / (1.0 - b1.powi(t as i32));
                let vh = self.v[i][j] / (1.0 - b2.powi(t as i32));
                r[j] = mh / (vh.sqrt() + eps) + wd * p[j];
            }
            let pn = p.iter().map(|x| x * x).sum::<f64>().sqrt();
            let rn = r.iter().map(|x| x * x).sum::<f64>().sqrt();
            let trust = if pn > 0.0 && rn > 0.0 { pn / rn } else { 1.0 };
            for j in 0..p.len() {
                p[j] -= lr * trust * r[j];
            }
        }
    }
}

#[test]
fn lamb_matches_reference_implementation() {
    let device = train_device();
    let mut model = OnnxModel::load(refkit("models/mlp.onnx"), &device).unwrap();
    let c = OptimizerConfig {
        kind: OptimizerKind::Lamb,
        epsilon: 1e-6,
        weight_decay: 0.01,
        no_weight_decay: vec![],
        ..Default::default()
    };
    let mut optim = build_optimizer(&c, &model);
    let mut params: Vec<Vec<f64>> = (0..model.params().len())
        .map(|i| {
            model
                .param_value(i)
                .unwrap()
                .to_array()
                .unwrap()
                .iter()
                .map(|&x| x as f64)
                .collect()
        })
        .collect();
    let mut reference = RefLamb {
        m: params.iter().map(|p| vec![0.0; p.len()]).collect(),
        v: params.iter().map(|p| vec![0.0; p.len()]).collect(),
    };
    for t in 1..=5 {
        let (grads, host) = grads_for(&model, t);
        model = optim.step(0.01, model, grads);
        reference.step(t, 0.01, 0.01, &mut params, &host);
    }
    for (i, info) in model.param_infos().iter().enumerate() {
        let got = model.param_value(i).unwrap().to_array().unwrap();
        let want =
            ArrayD::from_shape_vec(got.raw_dim(), params[i].iter().map(|&x| x as f32).collect())
                .unwrap();
        assert_close(&format!("LAMB {}", info.name), &got, &want, 2e-6, 1e-5);
    }
}

#[test]
fn no_weight_decay_group_is_not_decayed() {
    let device = train_device();
    let model = OnnxModel::load(refkit("models/mlp.onnx"), &device).unwrap();
    let before: HashMap<String, ArrayD<f32>> = model
        .param_infos()
        .iter()
        .enumerate()
        .map(|(i, p)| {
            (
                p.name.clone(),
                model.param_value(i).unwrap().to_array().unwrap(),
            )
        })
        .collect();
    let c = OptimizerConfig {
        kind: OptimizerKind::Adamw,
        weight_decay: 0.5,
        no_weight_decay: vec!["bias".into()],
        ..Default::default()
    };
    let mut optim = build_optimizer(&c, &model);
    let mut grads = GradientsParams::new();
    for (p, info) in model.params().iter().zip(model.param_infos()) {
        let zeros = TensorData::new(
            vec![0f32; info.shape.iter().product()],
            padded(&info.shape).unwrap().to_vec(),
        );
        grads.register::<MAX_RANK>(p.id, Tensor::from_data(zeros, &device));
    }
    let model = optim.step(0.1, model, grads);
    for (i, info) in model.param_infos().iter().enumerate() {
        let after = model.param_value(i).unwrap().to_array().unwrap();
        let b = &before[&info.name];
        // Zero gradient: AdamW moves a parameter only by its decay, p * (1 - lr * wd).
        let want = if info.name.contains("bias") {
            b.clone()
        } else {
            b.mapv(|x| x * (1.0 - 0.1 * 0.5))
        };
        assert_close(&info.name, &after, &want, 1e-7, 1e-6);
    }
}

#[test]
fn global_norm_clipping_scales_all_gradients_together() {
    let device = eval_device();
    let model = OnnxModel::load(refkit("models/mlp.onnx"), &device).unwrap();
    let (mut grads, host) = grads_for(&model, 1);
    let norm: f64 = host
        .iter()
        .flat_map(|g| g.iter())
        .map(|&x| (x as f64) * (x as f64))
        .sum::<f64>()
        .sqrt();
    let max = (norm / 4.0) as f32;
    let reported = clip_global_norm(&mut grads, &model, max).unwrap();
    assert!(
        (reported as f64 - norm).abs() < 1e-4 * norm,
        "{reported} vs {norm}"
    );
    let scale = max as f64 / (norm + 1e-6);
    for (p, g) in model.params().iter().zip(&host) {
        let got = grads
            .get::<MAX_RANK>(p.id)
            .unwrap()
            .into_data()
            .convert::<f32>()
            .try_to_vec::<f32>()
            .unwrap();
        for (a, b) in got.iter().zip(g.iter()) {
            assert!(
                (*a as f64 - *b as f64 * scale).abs() < 1e-7,
                "{a} vs {}",
                *b as f64 * scale
            );
        }
    }
    // Below the threshold nothing changes.
    let (mut grads, host) = grads_for(&model, 2);
    clip_global_norm(&mut grads, &model, 1e6).unwrap();
    let first = grads
        .get::<MAX_RANK>(model.params()[0].id)
        .unwrap()
        .into_data()
        .convert::<f32>()
        .try_to_vec::<f32>()
        .unwrap();
    assert_eq!(first, host[0].iter().copied().collect::<Vec<f32>>());
}
