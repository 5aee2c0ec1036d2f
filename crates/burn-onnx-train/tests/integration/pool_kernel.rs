//! The CPU max pooling (`kernels::max_pool2d`) against a direct max pooling written out here
//! (PyTorch's rules: the first maximum of a window takes the gradient, NaN wins, with
//! `ceil_mode` a last partial window is kept unless it starts in the end padding), and
//! against Burn's own `max_pool2d`: ceil mode, padding, dilation, asymmetric padding, ties
//! (a ReLU output full of zeros) and NaN.

use super::common;

use burn::tensor::module::max_pool2d as burn_max_pool2d;
use burn::tensor::ops::MaxPoolOptions;
use burn::tensor::{Device, Tensor, TensorData};
use burn_onnx_train::kernels::max_pool2d;
use common::*;

type PoolFn = fn(Tensor<4>, MaxPoolOptions<2>) -> Tensor<4>;

/// Output size along spatial axis `i` (0: height, 1: width).
fn out_size(shape: [usize; 4], o: &MaxPoolOptions<2>, i: usize) -> usize {
    let (input, k, pad, s, d) = (
        shape[2 + i],
        o.kernel_size[i],
        o.padding[i],
        o.stride[i],
        o.dilation[i],
    );
    let span = d * (k - 1) + 1;
    let num = input + pad.0 + pad.1 - span;
    if !o.ceil_mode {
        return num / s + 1;
    }
    let out = num.div_ceil(s) + 1;
    if (out - 1) * s >= input + pad.0 {
        out - 1
    } else {
        out
    }
}

/// Output and input gradient of `sum(r * maxpool(x))`, by the definition.
fn direct(shape: [usize; 4], o: &MaxPoolOptions<2>, x: &[f32], r: &[f32]) -> (Vec<f32>, Vec<f32>) {
    let [n, c, h, w] = shape;
    let (oh, ow) = (out_size(shape, o, 0), out_size(shape, o, 1));
    let (mut y, mut dx) = (
        vec![f32::NEG_INFINITY; n * c * oh * ow],
        vec![0f32; x.len()],
    );
    for plane in 0..n * c {
        for oy in 0..oh {
            for ox in 0..ow {
                let mut best: Option<usize> = None;
                for ky in 0..o.kernel_size[0] {
                    for kx in 0..o.kernel_size[1] {
                        let iy = (oy * o.stride[0] + ky * o.dilation[0]) as isize
                            - o.padding[0].0 as isize;
                        let ix = (ox * o.stride[1] + kx * o.dilation[1]) as isize
                            - o.padding[1].0 as isize;
                        if iy < 0 || ix < 0 || iy >= h as isize || ix >= w as isize {
                            continue;
                        }
                        let i = (plane * h + iy as usize) * w + ix as usize;
                        if best.is_none_or(|b| x[i] > x[b] || x[i].is_nan()) {
                            best = Some(i);
                        }
                    }
                }
                let out = (plane * oh + oy) * ow + ox;
                if let Some(b) = best {
                    y[out] = x[b];
                    dx[b] += r[out];
                }
            }
        }
    }
    (y, dx)
}

fn run(
    pool: PoolFn,
    shape: [usize; 4],
    o: &MaxPoolOptions<2>,
    x: &[f32],
    r: &[f32],
) -> (Vec<f32>, Vec<f32>) {
    let device = Device::flex().autodiff();
    let xt =
        Tensor::<4>::from_data(TensorData::new(x.to_vec(), shape.to_vec()), &device).require_grad();
    let y = pool(xt.clone(), o.clone());
    let rt = Tensor::<4>::from_data(TensorData::new(r.to_vec(), y.dims().to_vec()), &device);
    let grads = (y.clone() * rt).sum().backward();
    (
        y.inner().into_data().try_to_vec::<f32>().unwrap(),
        xt.grad(&grads)
            .unwrap()
            .into_data()
            .try_to_vec::<f32>()
            .unwrap(),
    )
}

fn same(what: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g.is_nan() && w.is_nan()) || (g - w).abs() <= 1e-6 * w.abs().max(1.0),
            "{what}[{i}]: {g} vs {w}"
        );
    }
}

/// Values in [-1, 1]; with `relu`, `max(v - 0.7, 0)`: 85% zeros, so a quarter of 3x3
/// windows are all ties.
fn check(name: &str, shape: [usize; 4], o: MaxPoolOptions<2>, relu: bool, burn_too: bool) {
    let mut next = lcg(5);
    let mut x: Vec<f32> = (0..shape.iter().product())
        .map(|_| (next() % 2001) as f32 / 1000.0 - 1.0)
        .map(|v| if relu { (v - 0.7).max(0.0) } else { v })
        .collect();
    if !relu {
        x[7] = f32::NAN;
    }
    let out = |i: usize| out_size(shape, &o, i);
    let r: Vec<f32> = (0..shape[0] * shape[1] * out(0) * out(1))
        .map(|_| (next() % 2001) as f32 / 1000.0 - 1.0)
        .collect();
    let (y, dx) = direct(shape, &o, &x, &r);
    let (gy, gdx) = run(max_pool2d, shape, &o, &x, &r);
    same(&format!("{name} y"), &gy, &y);
    same(&format!("{name} dx"), &gdx, &dx);
    assert!(
        dx.iter().filter(|v| **v != 0.0).count() > 4,
        "{name}: a trivial problem"
    );
    if burn_too {
        let (by, bdx) = run(burn_max_pool2d, shape, &o, &x, &r);
        same(&format!("{name} burn y"), &by, &y);
        same(&format!("{name} burn dx"), &bdx, &dx);
    }
}

fn options(
    k: usize,
    s: usize,
    pad: [(usize, usize); 2],
    d: usize,
    ceil: bool,
) -> MaxPoolOptions<2> {
    MaxPoolOptions {
        kernel_size: [k, k],
        stride: [s, s],
        padding: pad,
        dilation: [d, d],
        ceil_mode: ceil,
    }
}

#[test]
fn squeezenet_pooling_ceil_mode_with_ties() {
    // SqueezeNet 1.1's 3x3 stride 2 ceil-mode pooling on odd sizes, after a ReLU.
    check(
        "ceil relu",
        [2, 3, 13, 11],
        options(3, 2, [(0, 0); 2], 1, true),
        true,
        true,
    );
    // Even sizes: ceil mode keeps a last partial window in both directions, beside the
    // whole windows that are scanned a row at a time.
    check(
        "ceil relu partial",
        [2, 3, 12, 20],
        options(3, 2, [(0, 0); 2], 1, true),
        true,
        true,
    );
}

#[test]
fn padding_dilation_and_nan() {
    check(
        "pad dilation",
        [2, 2, 10, 9],
        options(3, 1, [(1, 1); 2], 2, false),
        false,
        true,
    );
    check(
        "floor k2",
        [1, 4, 7, 8],
        options(2, 2, [(0, 0); 2], 1, false),
        false,
        true,
    );
}

#[test]
fn asymmetric_padding() {
    // ONNX `pads` may differ at the two ends; the definition above is the reference.
    check(
        "asymmetric",
        [2, 2, 9, 8],
        options(3, 2, [(0, 2), (1, 0)], 1, false),
        false,
        false,
    );
}
