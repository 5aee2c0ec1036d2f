//! One AdamW update, the fused update (`FusedAdam`: in place per parameter on the CPU, one
//! launch for all parameters on a CubeCL device) against Burn's `AdamW` (a chain of tensor
//! ops per parameter), on the parameters of gpt2_tiny and of the GPT-2 example's default
//! model (vocabulary 50257, width 128), on the CPU and, with feature `wgpu`, on wgpu
//! (lavapipe on these GPU-less machines). Gradients are fixed random values; every
//! iteration waits for the device. `cargo bench --bench fused_optimizer` (CPU),
//! `cargo bench --features wgpu --bench fused_optimizer` (both).

use std::hint::black_box;
use std::path::PathBuf;
use std::time::Duration;

use burn::module::{Module, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::{Device, Tensor, TensorData};
use burn_onnx_train::OnnxModel;
use burn_onnx_train::frontend::builders::gpt2::{Gpt2Config, write_gpt2};
use burn_onnx_train::kernels::FusedAdam;
use burn_onnx_train::train::DeviceSpec;
use burn_onnx_train::train::config::OptimizerConfig;
use burn_onnx_train::train::optimizer::{build_optimizer, flat_rule, weight_decays};
use burn_ort_dist::ReplicaOptimizer;
use criterion::{Criterion, criterion_group, criterion_main};

#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Fixed gradients for every trainable parameter, and the parameter count.
struct Grads(Vec<(ParamId, Tensor<1>, Vec<usize>)>, usize, usize);

impl ModuleVisitor for Grads {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        let t = param.val();
        if t.is_require_grad() {
            let shape = t.dims().to_vec();
            let n: usize = shape.iter().product();
            let v: Vec<f32> = (0..n)
                .map(|i| ((i * 7919) % 2000) as f32 / 2e5 - 5e-3)
                .collect();
            let g = Tensor::<1>::from_data(TensorData::new(v, [n]), &t.device().inner());
            self.0.push((param.id, g, shape));
            self.1 += 1;
            self.2 += n;
        }
    }
}

/// The gradients, shaped as their parameters, for one update.
struct Register<'a>(&'a [(ParamId, Tensor<1>, Vec<usize>)], GradientsParams);

impl ModuleVisitor for Register<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        if let Some((_, g, _)) = self.0.iter().find(|(id, ..)| *id == param.id) {
            self.1
                .register(param.id, g.clone().reshape(param.val().dims()));
        }
    }
}

fn gradients(model: &OnnxModel, list: &[(ParamId, Tensor<1>, Vec<usize>)]) -> GradientsParams {
    let mut r = Register(list, GradientsParams::new());
    model.visit(&mut r);
    r.1
}

fn bench_model(c: &mut Criterion, name: &str, model: OnnxModel, device: &Device) {
    let mut g = Grads(Vec::new(), 0, 0);
    model.visit(&mut g);
    println!("{name}: {} trainable tensors, {} values", g.1, g.2);
    let config = OptimizerConfig {
        weight_decay: 0.01,
        no_weight_decay: vec!["bias".into()],
        ..Default::default()
    };
    let mut fused = FusedAdam::new(flat_rule(&config), weight_decays(&config, &model)).unwrap();
    let mut burn = build_optimizer(&config, &model);
    let mut m = model.clone();
    c.bench_function(&format!("{name} AdamW update fused"), |b| {
        b.iter(|| {
            let grads = gradients(&m, &g.0);
            m = fused.step(1e-4, m.clone(), grads).unwrap();
            device.sync().unwrap();
        })
    });
    let mut m = model;
    c.bench_function(&format!("{name} AdamW update burn"), |b| {
        b.iter(|| {
            let grads = gradients(&m, &g.0);
            m = ReplicaOptimizer::step(&mut burn, 1e-4, m.clone(), grads).unwrap();
            device.sync().unwrap();
        })
    });
    black_box(m);
}

fn updates_on(c: &mut Criterion, on: &str, device: Device) {
    let tiny = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("crates/burn-onnx-train/tests/data/refkit/models/gpt2_tiny.onnx");
    bench_model(
        c,
        &format!("{on} gpt2_tiny"),
        OnnxModel::load(tiny, &device).unwrap(),
        &device,
    );
    let example = std::env::temp_dir().join("fused_optimizer_bench_gpt2.onnx");
    write_gpt2(&Gpt2Config::default(), &example).unwrap();
    bench_model(
        c,
        &format!("{on} gpt2 example"),
        OnnxModel::load(&example, &device).unwrap(),
        &device,
    );
}

fn updates(c: &mut Criterion) {
    updates_on(c, "cpu", DeviceSpec::Cpu.device(0).unwrap().autodiff());
    #[cfg(feature = "wgpu")]
    updates_on(
        c,
        "wgpu",
        DeviceSpec::Wgpu(None).device(0).unwrap().autodiff(),
    );
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(10).measurement_time(Duration::from_secs(5));
    targets = updates
}
criterion_main!(benches);
