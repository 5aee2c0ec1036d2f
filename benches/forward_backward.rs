//! Forward+backward time of imported ONNX models on the CPU (Flex) backend:
//! gpt2_tiny at batch 4 x 128 tokens (with the LM loss) and SqueezeNet 1.1 at batch 8
//! (with cross-entropy). `cargo bench --bench forward_backward`.

use std::hint::black_box;
use std::path::PathBuf;
use std::time::Duration;

use burn::tensor::Device;
use burn_onnx_train::model::float_input;
use burn_onnx_train::model::loss::{cross_entropy, lm_cross_entropy};
use burn_onnx_train::{Mode, OnnxModel, Value};
use criterion::{Criterion, criterion_group, criterion_main};
use ndarray::{ArrayD, IxDyn};

/// Same allocator as the examples and the CLI (see examples/gpt2/main.rs).
#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn model_path(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("crates/burn-onnx-train/tests/data/refkit/models")
        .join(name)
}

fn gpt2(c: &mut Criterion) {
    let device = Device::flex().autodiff();
    let model = OnnxModel::load(model_path("gpt2_tiny.onnx"), &device).unwrap();
    let ids = ArrayD::from_shape_fn(IxDyn(&[4, 128]), |i| {
        ((i[0] * 131 + i[1] * 17) % 1024) as i64
    });
    c.bench_function("gpt2_tiny fwd+bwd batch 4x128", |b| {
        b.iter(|| {
            let out = model
                .forward(
                    vec![("input_ids".into(), Value::Int(ids.clone()))],
                    Mode::Train,
                )
                .unwrap();
            let Some(Value::Float(logits)) = out.first().cloned() else {
                unreachable!()
            };
            black_box(lm_cross_entropy(logits, &ids).unwrap().backward())
        })
    });
}

fn squeezenet(c: &mut Criterion) {
    let device = Device::flex().autodiff();
    let model = OnnxModel::load(model_path("squeezenet1_1_dynbatch.onnx"), &device).unwrap();
    let n = 8 * 3 * 224 * 224;
    let x: Vec<f32> = (0..n)
        .map(|i| ((i * 7919) % 1000) as f32 / 1000.0 - 0.5)
        .collect();
    let x = float_input(x, &[8, 3, 224, 224], &device).unwrap();
    let targets = ArrayD::from_shape_fn(IxDyn(&[8]), |i| (i[0] * 97 % 1000) as i64);
    c.bench_function("squeezenet1_1 fwd+bwd batch 8", |b| {
        b.iter(|| {
            let out = model
                .forward(vec![("input".into(), x.clone())], Mode::Train)
                .unwrap();
            let Some(Value::Float(logits)) = out.first().cloned() else {
                unreachable!()
            };
            black_box(cross_entropy(logits, &targets).unwrap().backward())
        })
    });
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(10).warm_up_time(Duration::from_secs(2)).measurement_time(Duration::from_secs(10));
    targets = gpt2, squeezenet
}
criterion_main!(benches);
