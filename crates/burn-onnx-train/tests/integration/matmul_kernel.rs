//! The CPU matrix product (`kernels::matmul`) against an f64 triple loop, forward and both
//! gradients (`dA = W B^T`, `dB = A^T W` for the loss `sum(A B * W)`): plain, batched,
//! through transposed and sliced views, on the GEMM's parallel paths, with an inner
//! dimension of 0, with a right-hand side stored along the inner dimension (copied
//! row-major first), and with only one operand needing a gradient. Each value is held to
//! 1e-6 of the sum of the magnitudes of the products it adds up.

use super::common;

use burn::tensor::{Device, TensorData};
use burn_onnx_train::kernels::matmul;
use burn_onnx_train::value::{MAX_RANK, PhysTensor, padded};
use common::lcg;

/// Random values in [-2, 2).
fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut next = lcg(seed);
    (0..n)
        .map(|_| (next() % 4000) as f32 / 1000.0 - 2.0)
        .collect()
}

/// Row-major `[batch, rows, cols]` matrices in f64.
struct Mats {
    v: Vec<f64>,
    rows: usize,
    cols: usize,
}

impl Mats {
    fn at(&self, b: usize, i: usize, j: usize) -> f64 {
        self.v[(b * self.rows + i) * self.cols + j]
    }
}

/// `x y` per batch with, per value, the sum of the products' magnitudes.
fn product(x: &Mats, y: &Mats, batch: usize) -> (Vec<f64>, Vec<f64>) {
    let (m, k, n) = (x.rows, x.cols, y.cols);
    let (mut out, mut scale) = (vec![0.0; batch * m * n], vec![0.0; batch * m * n]);
    for b in 0..batch {
        for i in 0..m {
            for j in 0..n {
                for l in 0..k {
                    let p = x.at(b, i, l) * y.at(b, l, j);
                    out[(b * m + i) * n + j] += p;
                    scale[(b * m + i) * n + j] += p.abs();
                }
            }
        }
    }
    (out, scale)
}

fn transposed(x: &Mats, batch: usize) -> Mats {
    let mut v = Vec::with_capacity(x.v.len());
    for b in 0..batch {
        for j in 0..x.cols {
            for i in 0..x.rows {
                v.push(x.at(b, i, j));
            }
        }
    }
    Mats {
        v,
        rows: x.cols,
        cols: x.rows,
    }
}

fn check(what: &str, got: PhysTensor, want: &(Vec<f64>, Vec<f64>)) {
    let got = got.into_data().try_to_vec::<f32>().unwrap();
    assert_eq!(got.len(), want.0.len(), "{what}: length");
    for (i, ((&g, &w), &s)) in got.iter().zip(&want.0).zip(&want.1).enumerate() {
        assert!(
            (f64::from(g) - w).abs() <= 1e-6 * s + 1e-12,
            "{what}[{i}]: {g} vs {w} (scale {s})"
        );
    }
}

fn host(t: &PhysTensor) -> Vec<f64> {
    let v = t.clone().into_data().try_to_vec::<f32>().unwrap();
    v.into_iter().map(f64::from).collect()
}

/// `[1, .., batch..., m, n]` as the interpreter's physical shape.
fn phys_shape(batch: &[usize], rows: usize, cols: usize) -> Vec<usize> {
    let mut s = batch.to_vec();
    s.extend([rows, cols]);
    phys(&s)
}

/// A logical shape left-padded with ones to the physical rank.
fn phys(shape: &[usize]) -> Vec<usize> {
    padded(shape).unwrap().to_vec()
}

/// The last two physical axes.
const ROWS: usize = MAX_RANK - 2;
const COLS: usize = MAX_RANK - 1;

/// How B is laid out in memory.
#[derive(Clone, Copy, PartialEq)]
enum BLayout {
    /// Row-major `[.., k, n]`.
    Rows,
    /// Columns `2..2 + n` of a row-major `[.., k, n + 3]`.
    Sliced,
    /// A slice `[.., n, k]` of a row-major `[.., n, k + 3]`, swapped: stored along `k`, its
    /// columns `k + 3` apart (the kernel copies it row-major first when `k >= n`).
    Transposed,
}

/// Forward and gradients of `A B` for `A [batch.., m, k]`, `B [batch.., k, n]`; A is built
/// transposed (`[.., k, m]` swapped) when `a_transposed`, and B as `b` says, so the kernel
/// reads both through strides.
fn case(batch: &[usize], m: usize, k: usize, n: usize, a_transposed: bool, b: BLayout) {
    let what = format!("{batch:?} x [{m}, {k}] x [{k}, {n}]");
    let count: usize = batch.iter().product();
    let device = Device::flex().autodiff();
    let a = if a_transposed {
        let t = values(count * k * m, 1);
        PhysTensor::from_data(TensorData::new(t, phys_shape(batch, k, m)), &device)
            .swap_dims(ROWS, COLS)
    } else {
        let t = values(count * m * k, 1);
        PhysTensor::from_data(TensorData::new(t, phys_shape(batch, m, k)), &device)
    }
    .require_grad();
    let b = match b {
        BLayout::Rows => {
            let t = values(count * k * n, 2);
            PhysTensor::from_data(TensorData::new(t, phys_shape(batch, k, n)), &device)
        }
        BLayout::Sliced => {
            let t = values(count * k * (n + 3), 2);
            PhysTensor::from_data(TensorData::new(t, phys_shape(batch, k, n + 3)), &device)
                .narrow(COLS, 2, n)
        }
        BLayout::Transposed => {
            let t = values(count * n * (k + 3), 2);
            PhysTensor::from_data(TensorData::new(t, phys_shape(batch, n, k + 3)), &device)
                .narrow(COLS, 1, k)
                .swap_dims(ROWS, COLS)
        }
    }
    .require_grad();
    let w = PhysTensor::from_data(
        TensorData::new(values(count * m * n, 3), phys_shape(batch, m, n)),
        &device,
    );
    let (am, bm) = (
        Mats {
            v: host(&a),
            rows: m,
            cols: k,
        },
        Mats {
            v: host(&b),
            rows: k,
            cols: n,
        },
    );
    let wm = Mats {
        v: host(&w),
        rows: m,
        cols: n,
    };
    let c = matmul(a.clone(), b.clone());
    assert_eq!(c.dims(), phys_shape(batch, m, n)[..], "{what}: shape");
    check(
        &format!("{what} product"),
        c.clone(),
        &product(&am, &bm, count),
    );
    let grads = (c * w).sum().backward();
    let da = a.grad(&grads).unwrap();
    let db = b.grad(&grads).unwrap();
    check(
        &format!("{what} dA"),
        da,
        &product(&wm, &transposed(&bm, count), count),
    );
    check(
        &format!("{what} dB"),
        db,
        &product(&transposed(&am, count), &wm, count),
    );
}

#[test]
fn products_and_gradients_match_f64() {
    use BLayout::*;
    case(&[], 5, 7, 3, false, Rows);
    case(&[], 5, 7, 3, true, Sliced);
    case(&[2, 3], 4, 6, 5, false, Rows);
    case(&[2, 3], 4, 6, 5, true, Sliced);
    // One GEMM on every core (>= 192^3 multiply-adds; its backward runs the two gradient
    // GEMMs side by side, one per core), and a batch run in parallel.
    case(&[], 200, 200, 200, true, Rows);
    case(&[4, 4], 64, 64, 64, false, Sliced);
}

#[test]
fn a_right_hand_side_stored_along_k_is_copied_row_major_and_matches_f64() {
    use BLayout::*;
    // k >= n and k n >= 64^2: B is copied row-major before the GEMM, on this thread, in
    // 8 x 8 blocks with ragged edges (k, n not multiples of 8) ...
    case(&[], 9, 203, 45, false, Transposed);
    case(&[], 9, 203, 45, true, Transposed);
    // ... on every core (k n >= 2^16), and per matrix of a batch;
    case(&[], 3, 517, 130, false, Transposed);
    case(&[2, 3], 4, 130, 66, false, Transposed);
    // k < n keeps the strided read.
    case(&[], 6, 45, 203, false, Transposed);
}

#[test]
fn an_empty_inner_dimension_gives_zeros() {
    let device = Device::flex();
    let a = PhysTensor::zeros(padded(&[3, 0]).unwrap(), &device);
    let b = PhysTensor::zeros(padded(&[0, 4]).unwrap(), &device);
    let c = matmul(a, b).into_data().try_to_vec::<f32>().unwrap();
    assert_eq!(c, vec![0.0; 12]);
}

#[test]
fn only_the_operand_that_needs_it_gets_a_gradient() {
    let device = Device::flex().autodiff();
    let a =
        PhysTensor::from_data(TensorData::new(values(6, 1), phys(&[2, 3])), &device).require_grad();
    let b = PhysTensor::from_data(TensorData::new(values(12, 2), phys(&[3, 4])), &device);
    let grads = matmul(a.clone(), b.clone()).sum().backward();
    assert!(b.grad(&grads).is_none());
    // d sum(A B) / dA = 1 B^T: every row is B's row sums.
    let bv = host(&b);
    let want: Vec<f64> = (0..2)
        .flat_map(|_| (0..3).map(|l| bv[l * 4..l * 4 + 4].iter().sum::<f64>()))
        .collect();
    let got = host(&a.grad(&grads).unwrap());
    for (g, w) in got.iter().zip(&want) {
        assert!(
            (g - w).abs() <= 1e-6 * (1.0 + w.abs()),
            "{got:?} vs {want:?}"
        );
    }
}

#[test]
fn broadcast_batches_take_burns_matmul() {
    let device = Device::flex();
    let a = PhysTensor::from_data(TensorData::new(values(2 * 6, 1), phys(&[2, 2, 3])), &device);
    let b = PhysTensor::from_data(TensorData::new(values(12, 2), phys(&[3, 4])), &device);
    let got = matmul(a.clone(), b.clone())
        .into_data()
        .try_to_vec::<f32>()
        .unwrap();
    let want = a.matmul(b).into_data().try_to_vec::<f32>().unwrap();
    assert_eq!(got, want);
}
