//! The fused CPU kernels against the plain Burn compositions they replace, forward +
//! backward under autodiff on the Flex backend, at the shapes of a gpt2_tiny step (4 x 128
//! tokens): tanh and GELU over the MLP's `[512, 512]` hidden activations, softmax over the
//! attention's `[1024, 128]` score rows, and softmax cross-entropy over GPT-2's 50257-class
//! logits for 64 tokens, layer normalisation of the `[512, 128]` residual rows (and of
//! GPT-2 124M's width 768); and at the shapes of a SqueezeNet 1.1 step (8 images of 224x224):
//! its first convolution (3 -> 64, 3x3 stride 2), a fire module's 3x3 expand (16 -> 64 on
//! 55x55) and 1x1 squeeze (128 -> 16), and the first 3x3 stride-2 ceil-mode max pooling.
//! `cargo bench --bench fused_ops`.

use std::hint::black_box;
use std::time::Duration;

use burn::tensor::activation;
use burn::tensor::module::{conv2d as burn_conv2d, max_pool2d as burn_max_pool2d};
use burn::tensor::ops::{ConvOptions, MaxPoolOptions};
use burn::tensor::{Bool, Device, Int, Tensor, TensorData};
use burn_onnx_train::kernels::{
    conv2d, cross_entropy_rows, cross_entropy_rows_reference, gelu_tanh, layer_norm, masked_fill,
    max_pool2d, softmax, tanh,
};
use criterion::{Criterion, criterion_group, criterion_main};

#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn values(rows: usize, cols: usize) -> Tensor<8> {
    let x: Vec<f32> = (0..rows * cols)
        .map(|i| ((i * 7919) % 2000) as f32 / 250.0 - 4.0)
        .collect();
    Tensor::from_data(
        TensorData::new(x, vec![1, 1, 1, 1, 1, 1, rows, cols]),
        &Device::flex().autodiff(),
    )
}

/// Forward and backward of `f` on `[rows, cols]`.
fn pair(
    c: &mut Criterion,
    name: &str,
    rows: usize,
    cols: usize,
    fused: fn(Tensor<8>) -> Tensor<8>,
    plain: fn(Tensor<8>) -> Tensor<8>,
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
        |x| softmax(x, 7),
        |x| activation::softmax(x, 7),
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

fn image(shape: [usize; 4], seed: usize) -> Tensor<4> {
    let x: Vec<f32> = (0..shape.iter().product::<usize>())
        .map(|i| ((i * 7919 + seed) % 2000) as f32 / 1000.0 - 1.0)
        .collect();
    Tensor::from_data(
        TensorData::new(x, shape.to_vec()),
        &Device::flex().autodiff(),
    )
}

fn convolutions(c: &mut Criterion) {
    type Conv = fn(Tensor<4>, Tensor<4>, Option<Tensor<1>>, ConvOptions<2>) -> Tensor<4>;
    for (name, x, w, stride, pad) in [
        ("conv 3->64 3x3 s2", [8, 3, 224, 224], [64, 3, 3, 3], 2, 0),
        ("conv 16->64 3x3", [8, 16, 55, 55], [64, 16, 3, 3], 1, 1),
        ("conv 128->16 1x1", [8, 128, 55, 55], [16, 128, 1, 1], 1, 0),
    ] {
        let (x, w, b) = (
            image(x, 1),
            image(w, 2),
            image([1, 1, 1, w[0]], 3).reshape([w[0]]),
        );
        let options = ConvOptions::new([stride; 2], [pad; 2], [1, 1], 1);
        let fused: Conv = |x, w, b, o| conv2d(x, w, b, o, false);
        let relu_after: Conv = |x, w, b, o| activation::relu(burn_conv2d(x, w, b, o));
        let relu_folded: Conv = |x, w, b, o| conv2d(x, w, b, o, true);
        for (kind, f) in [("fused", relu_folded), ("burn", relu_after)] {
            c.bench_function(&format!("{name} fwd relu {kind}"), |bench| {
                bench.iter(|| black_box(f(x.clone(), w.clone(), Some(b.clone()), options.clone())))
            });
        }
        for (kind, f) in [("fused", fused), ("burn", burn_conv2d as Conv)] {
            c.bench_function(&format!("{name} fwd+bwd {kind}"), |bench| {
                bench.iter(|| {
                    let (x, w, b) = (
                        x.clone().require_grad(),
                        w.clone().require_grad(),
                        b.clone().require_grad(),
                    );
                    black_box(f(x, w, Some(b), options.clone()).sum().backward())
                })
            });
        }
    }
}

fn pooling(c: &mut Criterion) {
    type Pool = fn(Tensor<4>, MaxPoolOptions<2>) -> Tensor<4>;
    let x = image([8, 64, 111, 111], 4);
    let options = MaxPoolOptions {
        kernel_size: [3, 3],
        stride: [2, 2],
        padding: [(0, 0); 2],
        dilation: [1, 1],
        ceil_mode: true,
    };
    for (kind, f) in [
        ("fused", max_pool2d as Pool),
        ("burn", burn_max_pool2d as Pool),
    ] {
        c.bench_function(
            &format!("max_pool 3x3 s2 [8, 64, 111, 111] fwd+bwd {kind}"),
            |b| {
                b.iter(|| {
                    black_box(
                        f(x.clone().require_grad(), options.clone())
                            .sum()
                            .backward(),
                    )
                })
            },
        );
    }
}

/// Burn's composition of a row layer norm (what `ops/normalization.rs` runs off the CPU).
fn layer_norm_burn(x: Tensor<2>, scale: Tensor<1>, bias: Tensor<1>, eps: f32) -> Tensor<2> {
    let mean = x.clone().mean_dim(1);
    let centered = x - mean;
    let var = centered.clone().square().mean_dim(1);
    let normed = centered / var.add_scalar(eps).sqrt();
    normed * scale.unsqueeze() + bias.unsqueeze()
}

fn layer_norms(c: &mut Criterion) {
    type Norm = fn(Tensor<2>, Tensor<1>, Tensor<1>, f32) -> Tensor<2>;
    for (rows, cols) in [(512, 128), (512, 768)] {
        let x: Tensor<2> = values(rows, cols).reshape([rows, cols]);
        let device = x.device();
        let scale = Tensor::<1>::ones([cols], &device);
        let bias = Tensor::<1>::zeros([cols], &device);
        for (kind, f) in [("fused", layer_norm as Norm), ("burn", layer_norm_burn)] {
            c.bench_function(
                &format!("layer_norm [{rows}, {cols}] fwd+bwd {kind}"),
                |b| {
                    b.iter(|| {
                        let (x, s, bi) = (
                            x.clone().require_grad(),
                            scale.clone().require_grad(),
                            bias.clone().require_grad(),
                        );
                        black_box(f(x, s, bi, 1e-5).sum().backward())
                    })
                },
            );
        }
    }
}

/// The causal mask (`Where(mask, scores, -inf)`), forward + backward: the fused masked fill
/// (the mask kept at its [T, T] period) against Burn's `mask_fill` on a mask of the scores'
/// size, built once outside the timing (the interpreter used to build it on every call).
fn masks(c: &mut Criterion) {
    let device = Device::flex().autodiff();
    let (heads, t) = (2 * 12, 128);
    let scores = values(heads * t, t).reshape([1, 1, 1, 1, 2, 12, t, t]);
    let keep: Vec<bool> = (0..t * t).map(|i| i % t <= i / t).collect();
    let masked: Vec<bool> = (0..heads).flat_map(|_| keep.iter().map(|k| !k)).collect();
    let mask =
        Tensor::<8, Bool>::from_data(TensorData::new(masked, [1, 1, 1, 1, 2, 12, t, t]), &device);
    let keep: std::sync::Arc<[bool]> = keep.into();
    c.bench_function("causal mask [2, 12, 128, 128] fwd+bwd fused", |b| {
        b.iter(|| {
            let x = scores.clone().require_grad();
            black_box(masked_fill(x, keep.clone(), -1e9).sum().backward())
        })
    });
    c.bench_function("causal mask [2, 12, 128, 128] fwd+bwd burn", |b| {
        b.iter(|| {
            let x = scores.clone().require_grad();
            black_box(x.mask_fill(mask.clone(), -1e9).sum().backward())
        })
    });
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(20).warm_up_time(Duration::from_secs(1)).measurement_time(Duration::from_secs(4));
    targets = activations, cross_entropy, layer_norms, convolutions, pooling, masks
}
criterion_main!(benches);
