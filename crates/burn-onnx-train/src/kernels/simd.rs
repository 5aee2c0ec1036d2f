//! The host kernels' inner loops compiled for the widest vector unit the CPU has, chosen at
//! run time: the workspace builds for baseline x86-64 (SSE2, 4 lanes), so without this a
//! loop over `fast_math::exp` runs 4 floats at a time on a machine with AVX-512 (16).
//! [`vectorized`] runs a [`Kernel`] inside a `#[target_feature]` function, where its
//! `#[inline(always)]` body is inlined and vectorized for that unit (a closure or `fn` item
//! passed instead is compiled on its own, for the baseline, and only called from there).
//! The lane-split reductions below give the vectorizer independent accumulators (f32 sums
//! are never reordered otherwise). Same results on every path: no fused multiply-add is
//! introduced (Rust never contracts `a * b + c`) and the reductions' order does not depend
//! on the lane width. On gpt2_tiny this took a step from 32.8 to 30.9 ms (BENCHMARKS.md).

/// Independent accumulators of the reductions (a multiple of every vector width used).
const LANES: usize = 16;

/// A loop over slices, to be compiled for the widest vector unit.
pub trait Kernel {
    /// What the loop returns.
    type Output;
    /// The loop; implementations mark it `#[inline(always)]` (otherwise it is compiled for
    /// the baseline on its own).
    fn run(self) -> Self::Output;
}

/// `kernel.run()`, compiled with AVX-512 or AVX2 when this CPU has them.
#[inline(always)]
pub fn vectorized<K: Kernel>(kernel: K) -> K::Output {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512vl")
        {
            // SAFETY: the CPU has AVX-512F and VL (checked above).
            return unsafe { with_avx512(kernel) };
        }
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU has AVX2 (checked above).
            return unsafe { with_avx2(kernel) };
        }
    }
    kernel.run()
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512vl,avx2,avx")]
fn with_avx512<K: Kernel>(kernel: K) -> K::Output {
    kernel.run()
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,avx")]
fn with_avx2<K: Kernel>(kernel: K) -> K::Output {
    kernel.run()
}

/// The largest value of `x` (`-inf` when empty; NaN-ignoring like `f32::max`).
#[inline(always)]
pub fn max(x: &[f32]) -> f32 {
    let mut lanes = [f32::NEG_INFINITY; LANES];
    let mut chunks = x.chunks_exact(LANES);
    for c in &mut chunks {
        for (l, &v) in lanes.iter_mut().zip(c) {
            *l = l.max(v);
        }
    }
    let tail = chunks.remainder().iter().copied();
    lanes
        .into_iter()
        .chain(tail)
        .fold(f32::NEG_INFINITY, f32::max)
}

/// `sum(a[i] * b[i])` with the products summed in f64.
#[inline(always)]
pub fn dot_f64(a: &[f32], b: &[f32]) -> f64 {
    let mut lanes = [0f64; LANES];
    let (mut ca, mut cb) = (a.chunks_exact(LANES), b.chunks_exact(LANES));
    for (ca, cb) in (&mut ca).zip(&mut cb) {
        for ((l, &a), &b) in lanes.iter_mut().zip(ca).zip(cb) {
            *l += f64::from(a * b);
        }
    }
    let tail: f64 = ca
        .remainder()
        .iter()
        .zip(cb.remainder())
        .map(|(&a, &b)| f64::from(a * b))
        .sum();
    lanes.iter().sum::<f64>() + tail
}

/// `sum(f(x[i]))` in f64; `f` is inlined into the loop (keep it small: a call of an
/// `#[inline(always)]` function).
#[inline(always)]
pub fn sum_map_f64(x: &[f32], f: impl Fn(f32) -> f32) -> f64 {
    let mut lanes = [0f64; LANES];
    let mut chunks = x.chunks_exact(LANES);
    for c in &mut chunks {
        for (l, &v) in lanes.iter_mut().zip(c) {
            *l += f64::from(f(v));
        }
    }
    let tail: f64 = chunks.remainder().iter().map(|&v| f64::from(f(v))).sum();
    lanes.iter().sum::<f64>() + tail
}

/// `sum(x[i])` in f64.
#[inline(always)]
pub fn sum_f64(x: &[f32]) -> f64 {
    sum_map_f64(x, |v| v)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn values(n: usize) -> Vec<f32> {
        (0..n)
            .map(|i| ((i * 7919) % 1000) as f32 / 100.0 - 5.0)
            .collect()
    }

    #[test]
    fn reductions_match_plain_loops() {
        for n in [0, 1, 15, 16, 17, 128, 1000] {
            let (a, b) = (values(n), values(n + 3)[3..].to_vec());
            let want_max = a.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let want_sum: f64 = a.iter().map(|&v| f64::from(v)).sum();
            let want_dot: f64 = a.iter().zip(&b).map(|(&a, &b)| f64::from(a * b)).sum();
            let (m, sum, dot) = vectorized(Reductions(&a, &b));
            assert_eq!(m, want_max, "max of {n}");
            assert!((sum - want_sum).abs() <= 1e-9 * (1.0 + want_sum.abs()));
            assert!((dot - want_dot).abs() <= 1e-9 * (1.0 + want_dot.abs()));
            assert_eq!(
                (m, sum, dot),
                Reductions(&a, &b).run(),
                "wide and baseline differ"
            );
        }
        assert_eq!(max(&[1.0, f32::NAN, 3.0]), 3.0);
    }

    struct Reductions<'a>(&'a [f32], &'a [f32]);

    impl Kernel for Reductions<'_> {
        type Output = (f32, f64, f64);
        #[inline(always)]
        fn run(self) -> Self::Output {
            (max(self.0), sum_f64(self.0), dot_f64(self.0, self.1))
        }
    }
}
