//! The CPU convolution (`kernels::conv2d`: im2col + GEMM with its own backward) against a
//! direct f64 convolution written out here (forward, and the gradients of `sum(r * y)` with
//! respect to input, weight and bias), over strides, asymmetric padding, dilation, 1x1
//! kernels, one image and more images than cores, and with the ReLU a fused Conv applies;
//! and the same problems through Burn's own `conv2d` (and `relu`) as a second opinion.

use super::common;

use burn::tensor::activation::relu;
use burn::tensor::module::conv2d as burn_conv2d;
use burn::tensor::ops::ConvOptions;
use burn::tensor::{Device, Tensor, TensorData};
use burn_onnx_train::kernels::conv2d;
use common::*;

/// One convolution problem: shapes and options.
struct Case {
    x: [usize; 4],
    w: [usize; 4],
    stride: [usize; 2],
    padding: [(usize, usize); 2],
    dilation: [usize; 2],
    bias: bool,
    relu: bool,
}

impl Case {
    fn options(&self) -> ConvOptions<2> {
        ConvOptions {
            stride: self.stride,
            padding: self.padding,
            dilation: self.dilation,
            groups: 1,
        }
    }

    fn out(&self) -> [usize; 4] {
        let o = |i: usize| {
            let span = self.dilation[i] * (self.w[2 + i] - 1) + 1;
            (self.x[2 + i] + self.padding[i].0 + self.padding[i].1 - span) / self.stride[i] + 1
        };
        [self.x[0], self.w[0], o(0), o(1)]
    }
}

fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut next = lcg(seed);
    (0..n)
        .map(|_| (next() % 2001) as f32 / 1000.0 - 1.0)
        .collect()
}

/// `y`, `dx`, `dw`, `db` of `sum(r * conv(x, w) + b)` by direct summation in f64.
fn direct(case: &Case, x: &[f32], w: &[f32], b: &[f32], r: &[f32]) -> [Vec<f64>; 4] {
    let [n, cin, h, wd] = case.x;
    let [cout, _, kh, kw] = case.w;
    let [_, _, oh, ow] = case.out();
    let mut y = vec![0f64; n * cout * oh * ow];
    let (mut dx, mut dw, mut db) = (vec![0f64; x.len()], vec![0f64; w.len()], vec![0f64; cout]);
    for img in 0..n {
        for co in 0..cout {
            for oy in 0..oh {
                for ox in 0..ow {
                    let yi = ((img * cout + co) * oh + oy) * ow + ox;
                    let mut acc = if case.bias { f64::from(b[co]) } else { 0.0 };
                    let taps = || {
                        (0..cin).flat_map(move |ci| {
                            (0..kh).flat_map(move |ki| (0..kw).map(move |kj| (ci, ki, kj)))
                        })
                    };
                    // (input index, weight index) of every tap inside the image.
                    let inside = |(ci, ki, kj): (usize, usize, usize)| {
                        let iy = (oy * case.stride[0] + ki * case.dilation[0]) as isize
                            - case.padding[0].0 as isize;
                        let ix = (ox * case.stride[1] + kj * case.dilation[1]) as isize
                            - case.padding[1].0 as isize;
                        (iy >= 0 && ix >= 0 && iy < h as isize && ix < wd as isize).then(|| {
                            (
                                ((img * cin + ci) * h + iy as usize) * wd + ix as usize,
                                ((co * cin + ci) * kh + ki) * kw + kj,
                            )
                        })
                    };
                    for (xi, wi) in taps().filter_map(inside) {
                        acc += f64::from(x[xi]) * f64::from(w[wi]);
                    }
                    let g = if case.relu && acc <= 0.0 {
                        0.0
                    } else {
                        f64::from(r[yi])
                    };
                    db[co] += g;
                    for (xi, wi) in taps().filter_map(inside) {
                        dx[xi] += g * f64::from(w[wi]);
                        dw[wi] += g * f64::from(x[xi]);
                    }
                    if case.relu {
                        acc = acc.max(0.0);
                    }
                    y[yi] = acc;
                }
            }
        }
    }
    [y, dx, dw, db]
}

type ConvFn = fn(Tensor<4>, Tensor<4>, Option<Tensor<1>>, ConvOptions<2>) -> Tensor<4>;

/// `y`, `dx`, `dw` and `db` (empty without bias) through `conv` under autodiff.
fn autodiff(case: &Case, conv: ConvFn, inputs: [&[f32]; 4]) -> [Vec<f32>; 4] {
    let [x, w, b, r] = inputs;
    let device = Device::flex().autodiff();
    let t4 = |v: &[f32], s: [usize; 4]| {
        Tensor::<4>::from_data(TensorData::new(v.to_vec(), s.to_vec()), &device)
    };
    let xt = t4(x, case.x).require_grad();
    let wt = t4(w, case.w).require_grad();
    let bt = case.bias.then(|| {
        Tensor::<1>::from_data(TensorData::new(b.to_vec(), vec![b.len()]), &device).require_grad()
    });
    let y = conv(xt.clone(), wt.clone(), bt.clone(), case.options());
    let grads = (y.clone() * t4(r, case.out())).sum().backward();
    let v = |t: Tensor<4>| t.into_data().try_to_vec::<f32>().unwrap();
    [
        y.inner().into_data().try_to_vec::<f32>().unwrap(),
        v(xt.grad(&grads).unwrap()),
        v(wt.grad(&grads).unwrap()),
        bt.map(|b| {
            b.grad(&grads)
                .unwrap()
                .into_data()
                .try_to_vec::<f32>()
                .unwrap()
        })
        .unwrap_or_default(),
    ]
}

/// Every element within `1e-5 + 1e-5 |want|` of the f64 value (sums of up to a few hundred
/// products of values in [-1, 1]).
fn assert_matches(what: &str, got: &[f32], want: &[f64]) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        assert!(
            (f64::from(g) - w).abs() <= 1e-5 + 1e-5 * w.abs(),
            "{what}[{i}]: {g} vs {w}"
        );
    }
}

fn check(name: &str, case: Case) {
    let x = values(case.x.iter().product(), 1);
    let w = values(case.w.iter().product(), 2);
    let b = values(case.w[0], 3);
    let r = values(case.out().iter().product(), 4);
    let [y, dx, dw, db] = direct(&case, &x, &w, &b, &r);
    let (kernel, burn): (ConvFn, ConvFn) = if case.relu {
        (
            |x, w, b, o| conv2d(x, w, b, o, true),
            |x, w, b, o| relu(burn_conv2d(x, w, b, o)),
        )
    } else {
        (|x, w, b, o| conv2d(x, w, b, o, false), burn_conv2d)
    };
    for (conv, which) in [(kernel, "kernel"), (burn, "burn")] {
        let got = autodiff(&case, conv, [&x, &w, &b, &r]);
        assert_matches(&format!("{name} {which} y"), &got[0], &y);
        assert_matches(&format!("{name} {which} dx"), &got[1], &dx);
        assert_matches(&format!("{name} {which} dw"), &got[2], &dw);
        if case.bias {
            assert_matches(&format!("{name} {which} db"), &got[3], &db);
        }
    }
    assert!(
        dw.iter().any(|v| v.abs() > 1e-3),
        "{name}: a trivial problem"
    );
}

#[test]
fn strided_padded_3x3_with_bias() {
    check(
        "3x3 s2 p1",
        Case {
            x: [3, 3, 9, 11],
            w: [4, 3, 3, 3],
            stride: [2, 2],
            padding: [(1, 1), (1, 1)],
            dilation: [1, 1],
            bias: true,
            relu: false,
        },
    );
}

#[test]
fn asymmetric_padding_mixed_strides_and_dilation() {
    check(
        "asymmetric",
        Case {
            x: [2, 2, 8, 10],
            w: [3, 2, 3, 2],
            stride: [1, 2],
            padding: [(0, 2), (1, 0)],
            dilation: [2, 1],
            bias: false,
            relu: false,
        },
    );
}

#[test]
fn pointwise_and_strided_1x1() {
    for (stride, name) in [([1, 1], "1x1"), ([2, 2], "1x1 s2")] {
        check(
            name,
            Case {
                x: [5, 6, 7, 5],
                w: [8, 6, 1, 1],
                stride,
                padding: [(0, 0), (0, 0)],
                dilation: [1, 1],
                bias: true,
                relu: false,
            },
        );
    }
}

#[test]
fn one_image_and_a_kernel_wider_than_the_padding() {
    check(
        "one image 5x5 p1",
        Case {
            x: [1, 4, 6, 6],
            w: [2, 4, 5, 5],
            stride: [1, 1],
            padding: [(1, 1), (1, 1)],
            dilation: [1, 1],
            bias: true,
            relu: false,
        },
    );
}

#[test]
fn relu_folded_into_the_convolution() {
    // Outputs on both sides of zero: the ReLU's mask decides half the gradients.
    check(
        "3x3 p1 relu",
        Case {
            x: [3, 4, 7, 6],
            w: [5, 4, 3, 3],
            stride: [1, 1],
            padding: [(1, 1), (1, 1)],
            dilation: [1, 1],
            bias: true,
            relu: true,
        },
    );
}
