//! ZeRO's update on the device (taken where the group moves device tensors, as NCCL does on
//! CUDA devices) on 3 thread ranks (on the CPU; `burn-onnx-train`'s `tests/gpu.rs` runs this
//! file on the GPU), with `ThroughHost` carrying the device collectives
//! through host memory (no GPU here). Stages 1, 2 and 3 with SGD, Adam, AdamW and LAMB end
//! where Burn's own optimizers end on one process fed the ranks' mean gradient clipped to
//! the global norm (computed here, in f64); the parameters moved, the frozen one did not,
//! and every rank took the device path. A checkpoint of the device state resumes on the
//! host path and on the device path as the run goes on.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use burn::module::{Module, ModuleVisitor, Param, ParamId};
use burn::optim::decay::WeightDecayConfig;
use burn::optim::momentum::MomentumConfig;
use burn::optim::{
    AdamConfig, AdamWConfig, GradientsParams, LambConfig, ModuleOptimizer, SgdConfig,
};
use burn::tensor::{Device, Tensor, TensorData};
use burn_ort_dist::update::zero::flat_optim::Rule;
use burn_ort_dist::update::zero::layout::chunk_of;
use burn_ort_dist::{Communicator, Reduction, ThroughHost, UpdateStrategy, Zero, run_threads};

const WORLD: usize = 3;
const LR: f64 = 1e-2;
const DECAY: f32 = 0.1;
/// Below the mean gradient's norm (~4.4): every update clips.
const MAX_NORM: f32 = 2.0;
/// Element counts of `a` (3 x 5), `b`, `c` and the frozen `d`: 29 values, shards of 10,
/// parameters across shard boundaries.
const LENS: [usize; 4] = [15, 4, 7, 3];

#[derive(Module, Debug)]
struct Net {
    a: Param<Tensor<2>>,
    b: Param<Tensor<1>>,
    c: Param<Tensor<1>>,
    d: Param<Tensor<1>>,
}

/// ZeRO-3's module: this rank's chunk of each of [`Net`]'s parameters, same ids.
#[derive(Module, Debug)]
struct Chunks {
    a: Param<Tensor<1>>,
    b: Param<Tensor<1>>,
    c: Param<Tensor<1>>,
    d: Param<Tensor<1>>,
}

/// The parameters' device: the CPU here, the GPU under `burn-onnx-train`'s `tests/gpu.rs`,
/// which includes this file.
fn device() -> Device {
    super::zero_device().autodiff()
}

/// A gradient of `values` (without autodiff) on [`device`].
fn gradient(values: Vec<f32>) -> Tensor<1> {
    let n = values.len();
    Tensor::from_data(TensorData::new(values, [n]), &super::zero_device())
}

fn initial(k: usize) -> Vec<f32> {
    (0..LENS[k])
        .map(|j| (0.3 + 0.37 * j as f32 + k as f32).cos())
        .collect()
}

/// Rank `rank`'s gradient of parameter `k` (0 to 2).
fn grad(rank: usize, k: usize) -> Vec<f64> {
    (0..LENS[k])
        .map(|j| 1.5 * (1.0 + 0.7 * j as f64 + 1.3 * k as f64 + 0.9 * rank as f64).sin())
        .collect()
}

/// The mean over the ranks of parameter `k`'s gradient.
fn mean_grad(k: usize) -> Vec<f32> {
    (0..LENS[k])
        .map(|j| ((0..WORLD).map(|r| grad(r, k)[j]).sum::<f64>() / WORLD as f64) as f32)
        .collect()
}

fn param<const D: usize>(k: usize, values: Vec<f32>, shape: [usize; D]) -> Param<Tensor<D>> {
    let t = Tensor::from_data(TensorData::new(values, shape), &device());
    let t = if k < 3 { t.require_grad() } else { t };
    Param::initialized(ParamId::from(k as u64 + 1), t)
}

fn net() -> Net {
    Net {
        a: param(0, initial(0), [3, 5]),
        b: param(1, initial(1), [4]),
        c: param(2, initial(2), [7]),
        d: param(3, initial(3), [3]),
    }
}

fn chunks(rank: usize) -> Chunks {
    let c = |k: usize| {
        let v = chunk_of(&initial(k), rank, WORLD);
        let n = v.len();
        param(k, v, [n])
    };
    Chunks {
        a: c(0),
        b: c(1),
        c: c(2),
        d: c(3),
    }
}

/// The gradients a rank's update receives: its own whole gradients (stages 1, 2), or its
/// chunks of the mean (stage 3: the backward reduce-scattered them).
fn grads(rank: usize, stage: usize) -> GradientsParams {
    let mut g = GradientsParams::new();
    for k in 0..3 {
        let id = ParamId::from(k as u64 + 1);
        let values: Vec<f32> = match stage {
            3 => chunk_of(&mean_grad(k), rank, WORLD),
            _ => grad(rank, k).iter().map(|&x| x as f32).collect(),
        };
        let t = gradient(values);
        if k == 0 && stage != 3 {
            g.register(id, t.reshape([3, 5]));
        } else {
            g.register(id, t);
        }
    }
    g
}

/// Every parameter's values, flat, in order.
fn values<M: Module>(m: &M) -> Vec<Vec<f32>> {
    struct V(Vec<Vec<f32>>);
    impl ModuleVisitor for V {
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<D>>) {
            let v = p
                .val()
                .into_data()
                .convert::<f32>()
                .try_to_vec::<f32>()
                .unwrap();
            self.0.push(v);
        }
    }
    let mut v = V(Vec::new());
    m.visit(&mut v);
    v.0
}

fn burn_optimizer(rule: Rule) -> ModuleOptimizer {
    let l2 = Some(WeightDecayConfig { penalty: DECAY });
    match rule {
        Rule::Sgd { momentum } => SgdConfig::new()
            .with_momentum(Some(MomentumConfig {
                momentum,
                dampening: 0.0,
                nesterov: false,
            }))
            .with_weight_decay(l2)
            .init(),
        Rule::Adam {
            beta1,
            beta2,
            epsilon,
        } => AdamConfig::new()
            .with_beta_1(beta1)
            .with_beta_2(beta2)
            .with_epsilon(epsilon)
            .with_weight_decay(l2)
            .init(),
        Rule::AdamW {
            beta1,
            beta2,
            epsilon,
        } => AdamWConfig::new()
            .with_beta_1(beta1)
            .with_beta_2(beta2)
            .with_epsilon(epsilon)
            .with_weight_decay(DECAY)
            .init(),
        Rule::Lamb {
            beta1,
            beta2,
            epsilon,
        } => LambConfig::new()
            .with_beta_1(beta1)
            .with_beta_2(beta2)
            .with_epsilon(epsilon)
            .with_weight_decay(DECAY)
            .init(),
    }
}

/// Burn's optimizer for `rule` on one process, `steps` updates with the mean gradient
/// scaled by `clip_grad_norm_`'s factor.
fn burn_reference(rule: Rule, steps: usize) -> Vec<Vec<f32>> {
    let mean: Vec<Vec<f32>> = (0..3).map(mean_grad).collect();
    let norm = mean
        .iter()
        .flatten()
        .map(|&x| f64::from(x) * f64::from(x))
        .sum::<f64>()
        .sqrt() as f32;
    assert!(
        norm > MAX_NORM,
        "the mean gradient's norm {norm} is clipped"
    );
    let scale = MAX_NORM / (norm + 1e-6);
    let mut optim = burn_optimizer(rule);
    let mut m = net();
    for _ in 0..steps {
        let mut g = GradientsParams::new();
        for (k, v) in mean.iter().enumerate() {
            let scaled: Vec<f32> = v.iter().map(|x| x * scale).collect();
            let t = gradient(scaled);
            let id = ParamId::from(k as u64 + 1);
            match k {
                0 => g.register(id, t.reshape([3, 5])),
                _ => g.register(id, t),
            }
        }
        m = optim.step(LR, m, g);
    }
    values(&m)
}

fn zero(stage: usize, comm: Arc<dyn Communicator>, rule: Rule) -> Zero {
    Zero::new(stage, comm, rule, Reduction::Mean, |_| DECAY, &net()).unwrap()
}

/// `steps` updates of `stage` on every rank over `ThroughHost`: each rank's parameters
/// (stage 3: joined from the ranks' chunks) and its device collectives.
fn on_device(stage: usize, rule: Rule, steps: usize) -> (Vec<Vec<Vec<f32>>>, Vec<usize>) {
    let results = run_threads(
        WORLD,
        Duration::from_secs(60),
        |comm| -> Result<_, String> {
            let rank = comm.rank();
            let through = Arc::new(ThroughHost::over(comm));
            let mut z = zero(stage, through.clone(), rule);
            let err = |e: burn_ort_dist::DistError| e.to_string();
            let params = if stage == 3 {
                let mut m = chunks(rank);
                for _ in 0..steps {
                    (m, _) = z
                        .update(LR, m, grads(rank, 3), MAX_NORM, false)
                        .map_err(err)?;
                }
                values(&m)
            } else {
                let mut m = net();
                for _ in 0..steps {
                    (m, _) = z
                        .update(LR, m, grads(rank, stage), MAX_NORM, false)
                        .map_err(err)?;
                }
                values(&m)
            };
            Ok((params, through.calls()))
        },
    );
    let results: Vec<_> = results.into_iter().map(Result::unwrap).collect();
    let calls = results.iter().map(|r| r.1).collect();
    let per_rank: Vec<Vec<Vec<f32>>> = results.into_iter().map(|r| r.0).collect();
    if stage != 3 {
        return (per_rank, calls);
    }
    // Join the chunks: rank r's chunk of parameter k, in rank order, cut to its length.
    let joined = (0..4)
        .map(|k| {
            let mut v: Vec<f32> = per_rank.iter().flat_map(|r| r[k].clone()).collect();
            v.truncate(LENS[k]);
            v
        })
        .collect();
    (vec![joined], calls)
}

fn assert_close(got: &[Vec<f32>], want: &[Vec<f32>], atol: f32, what: &str) {
    for (k, (g, w)) in got.iter().zip(want).enumerate() {
        assert_eq!(g.len(), w.len(), "{what}: parameter {k}'s length");
        for (j, (x, y)) in g.iter().zip(w).enumerate() {
            assert!(
                (x - y).abs() <= atol,
                "{what}: parameter {k}[{j}] is {x}, Burn's optimizer gives {y}"
            );
        }
    }
}

#[test]
fn every_stage_and_rule_on_the_device_matches_burns_optimizer_on_the_mean_gradient() {
    let rules = [
        Rule::Sgd { momentum: 0.9 },
        Rule::Adam {
            beta1: 0.9,
            beta2: 0.999,
            epsilon: 1e-5,
        },
        Rule::AdamW {
            beta1: 0.9,
            beta2: 0.999,
            epsilon: 1e-5,
        },
        Rule::Lamb {
            beta1: 0.9,
            beta2: 0.999,
            epsilon: 1e-5,
        },
    ];
    let start: Vec<Vec<f32>> = (0..4).map(initial).collect();
    for rule in rules {
        let want = burn_reference(rule, 3);
        for stage in 1..=3 {
            let what = format!("ZeRO-{stage} {rule:?}");
            let (ranks, calls) = on_device(stage, rule, 3);
            assert!(
                calls.iter().all(|&c| c > 0),
                "{what}: every rank took the device path ({calls:?} device collectives)"
            );
            for params in &ranks {
                assert_close(params, &want, 2e-6, &what);
                assert_eq!(params[3], start[3], "{what}: the frozen parameter stays");
                let moved = params[..3]
                    .iter()
                    .flatten()
                    .zip(start[..3].iter().flatten())
                    .map(|(a, b)| (a - b).abs())
                    .fold(0.0f32, f32::max);
                assert!(moved > 1e-3, "{what}: the parameters moved ({moved})");
            }
        }
    }
}

/// Write rank `rank`'s state files of `z` into `dir`.
fn checkpoint(z: &Zero, dir: &Path) {
    let files = UpdateStrategy::<Net>::state_files(z).unwrap();
    for f in files {
        let mut w = std::fs::File::create(dir.join(&f.name)).unwrap();
        f.write_to(&mut w).unwrap();
    }
}

/// ZeRO-2 AdamW: 2 updates on the device, a checkpoint of its device state, then one more
/// update three ways (on, a fresh strategy resumed on the device, one resumed on the host):
/// all end where 3 uninterrupted updates of Burn's AdamW end.
#[test]
fn a_checkpoint_of_the_device_state_resumes_on_the_device_and_on_the_host() {
    let rule = Rule::AdamW {
        beta1: 0.9,
        beta2: 0.999,
        epsilon: 1e-5,
    };
    let want = burn_reference(rule, 3);
    let dir = std::env::temp_dir().join(format!("zero-on-device-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let results = run_threads(
        WORLD,
        Duration::from_secs(60),
        |comm| -> Result<_, String> {
            let rank = comm.rank();
            let through: Arc<dyn Communicator> = Arc::new(ThroughHost::over(comm.clone()));
            let err = |e: burn_ort_dist::DistError| e.to_string();
            let mut z = zero(2, through.clone(), rule);
            let mut m = net();
            for _ in 0..2 {
                (m, _) = z
                    .update(LR, m, grads(rank, 2), MAX_NORM, false)
                    .map_err(err)?;
            }
            checkpoint(&z, &dir);
            comm.barrier().map_err(err)?;
            let mut ends = Vec::new();
            let (on, _) = z
                .update(LR, m.clone(), grads(rank, 2), MAX_NORM, false)
                .map_err(err)?;
            ends.push(values(&on));
            for host in [false, true] {
                let mut z = match host {
                    true => zero(2, comm.clone(), rule).on_host(),
                    false => zero(2, through.clone(), rule),
                };
                UpdateStrategy::<Net>::load_state(&mut z, &m, &[dir.clone()]).map_err(err)?;
                let (resumed, _) = z
                    .update(LR, m.clone(), grads(rank, 2), MAX_NORM, false)
                    .map_err(err)?;
                ends.push(values(&resumed));
            }
            Ok(ends)
        },
    );
    std::fs::remove_dir_all(&dir).ok();
    for r in results {
        for (params, how) in
            r.unwrap()
                .iter()
                .zip(["on", "resumed on the device", "resumed on the host"])
        {
            assert_close(params, &want, 2e-6, how);
        }
    }
}

/// With per-tensor norms asked for, the device path reads each parameter's gradient norm:
/// the norms of the mean gradient, and the global norm before clipping.
#[test]
fn per_tensor_norms_on_the_device_are_the_mean_gradients_norms() {
    let rule = Rule::AdamW {
        beta1: 0.9,
        beta2: 0.999,
        epsilon: 1e-5,
    };
    let norm = |v: &[f32]| v.iter().map(|&x| f64::from(x).powi(2)).sum::<f64>().sqrt();
    let want: Vec<f64> = (0..3).map(|k| norm(&mean_grad(k))).collect();
    let total = want.iter().map(|x| x * x).sum::<f64>().sqrt();
    for stage in 1..=2 {
        let results = run_threads(
            WORLD,
            Duration::from_secs(60),
            |comm| -> Result<_, String> {
                let rank = comm.rank();
                let through = Arc::new(ThroughHost::over(comm));
                let mut z = zero(stage, through, rule);
                let (_, report) = z
                    .update(LR, net(), grads(rank, stage), MAX_NORM, true)
                    .map_err(|e| e.to_string())?;
                let global = report.grad_norm.value().map_err(|e| e.to_string())?;
                Ok((global, report.tensor_grad_norms))
            },
        );
        for r in results {
            let (global, per_tensor) = r.unwrap();
            assert!(
                (f64::from(global) - total).abs() < 1e-5 * total,
                "stage {stage}: {global} vs {total}"
            );
            // Every parameter's, the frozen one's 0.
            assert_eq!(per_tensor.len(), 4, "stage {stage}: a norm per parameter");
            assert_eq!(
                per_tensor[3].1, 0.0,
                "stage {stage}: the frozen parameter's"
            );
            for ((id, n), w) in per_tensor.iter().zip(&want) {
                assert!(
                    (f64::from(*n) - w).abs() < 1e-5 * w,
                    "stage {stage}, parameter {id}: {n} vs {w}"
                );
            }
        }
    }
}
