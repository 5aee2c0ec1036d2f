//! The fused CPU kernels against the plain Burn compositions they replace, forward +
//! backward under autodiff on the Flex backend, at the shapes of a gpt2_tiny step (4 x 128
//! tokens): tanh and GELU over the MLP's `[512, 512]` hidden activations, softmax over the
//! attention's `[1024, 128]` score rows, and softmax cross-entropy over GPT-2's 50257-class
//! logits for 64 tokens. `cargo bench --bench fused_ops`.

use std::hint::black_box;
use std::time::Duration;

use burn::tensor::activation;
use burn::tensor::{Device, Int, Tensor, TensorData};
use burn_onnx_train::kernels::{
    cross_entropy_rows, cross_entropy_rows_reference, gelu_tanh, softmax, tanh,
};
use criterion::{Criterion, criterion_group, criterion_main};

#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn values(rows: usize, cols: usize) -> Tensor<6> {
    let x: Vec<f32> = (0..rows * cols)
        .map(|i| ((i * 7919) % 2000) as f32 / 250.0 - 4.0)
        .collect();
    Tensor::from_data(
        TensorData::new(x, vec![1, 1, 1, 1, rows, cols]),
        &Device::flex().autodiff(),
    )
}

/// Forward and backward of `f` on `[rows, cols]`.
fn pair(
    c: &mut Criterion,
    name: &str,
    rows: usize,
    cols: usize,
    fused: fn(Tensor<6>) -> Tensor<6>,
    plain: fn(Tensor<6>) -> Tensor<6>,
) {
    let x = values(rows, cols);
    for (kind, f) in [("fused", fused), ("burn", plain)] {
        c.bench_function(&format!("{name} [{rows}, {cols}] fwd+bwd {kind}"), |b| {
            b.iter(|| {
                let x = x.clone().require_grad();
                black_box(f(x).sum().backward())
            })
        });
    }
}

fn activations(c: &mut Criterion) {
    pair(c, "tanh", 512, 512, tanh, |x| x.tanh());
    pair(
        c,
        "gelu_tanh",
        512,
        512,
        gelu_tanh,
        activation::gelu_approximate,
    );
    pair(
        c,
        "softmax",
        1024,
        128,
        |x| softmax(x, 5),
        |x| activation::softmax(x, 5),
    );
}

fn cross_entropy(c: &mut Criterion) {
    let (rows, classes) = (64, 50257);
    let device = Device::flex().autodiff();
    let logits: Vec<f32> = (0..rows * classes)
        .map(|i| ((i * 7919) % 2000) as f32 / 250.0 - 4.0)
        .collect();
    let x = Tensor::<2>::from_data(TensorData::new(logits, vec![rows, classes]), &device);
    let t = Tensor::<1, Int>::from_data(
        TensorData::new(
            (0..rows as i64)
                .map(|r| r * 769 % classes as i64)
                .collect::<Vec<_>>(),
            vec![rows],
        ),
        &device,
    );
    type Ce = fn(Tensor<2>, Tensor<1, Int>) -> Tensor<1>;
    for (kind, f) in [
        ("fused", cross_entropy_rows as Ce),
        ("burn", cross_entropy_rows_reference as Ce),
    ] {
        c.bench_function(
            &format!("cross_entropy [{rows}, {classes}] fwd+bwd {kind}"),
            |b| b.iter(|| black_box(f(x.clone().require_grad(), t.clone()).sum().backward())),
        );
    }
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(20).warm_up_time(Duration::from_secs(1)).measurement_time(Duration::from_secs(4));
    targets = activations, cross_entropy
}
criterion_main!(benches);
