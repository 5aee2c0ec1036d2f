//! `exp` and `tanh` for f32 as straight-line polynomial code (Cephes' `expf` and `tanhf`:
//! range reduction, a minimax polynomial, selects instead of branches), so a loop over a
//! slice compiles to SIMD instructions; accurate to a few f32 ulps (the tests check them
//! against f64). `libm`'s scalar calls, one element at a time, were a quarter of a GPT-2
//! forward pass.

/// `e^x`; inputs below -87 give 0 and above 88 give `e^88` (callers stay below: softmax
/// exponentiates `x - max <= 0`, tanh saturates first).
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const C1: f32 = 0.693_359_4;
    const C2: f32 = -2.121_944_4e-4;
    const ROUND: f32 = 12_582_912.0; // 1.5 * 2^23: adding and subtracting it rounds to an integer.
    let clamped = x.clamp(-87.0, 88.0);
    let n = (clamped * LOG2E + ROUND) - ROUND;
    let r = clamped - n * C1 - n * C2;
    let mut p = 1.987_569_1e-4f32;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 1.666_666_5e-1;
    p = p * r + 5.000_000_1e-1;
    let y = p * r * r + r + 1.0;
    let scale = f32::from_bits(((n as i32 + 127) << 23) as u32);
    if x < -87.0 { 0.0 } else { scale * y }
}

/// `tanh(x)`: an odd polynomial below |x| = 0.625, `1 - 2 / (e^(2|x|) + 1)` above.
#[inline(always)]
pub fn tanh(x: f32) -> f32 {
    let z = x.abs();
    let s = x * x;
    let small =
        ((((-5.704_988_7e-3 * s + 2.063_908_9e-2) * s - 5.373_971_6e-2) * s + 1.333_144_2e-1) * s
            - 3.333_328_2e-1)
            * s
            * x
            + x;
    let large = 1.0 - 2.0 / (exp(2.0 * z.min(44.0)) + 1.0);
    if z > 0.625 { large.copysign(x) } else { small }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn max_rel(f: fn(f32) -> f32, reference: fn(f64) -> f64, from: f32, to: f32) -> f64 {
        let mut worst = 0.0f64;
        let steps = 200_000;
        for i in 0..=steps {
            let x = from + (to - from) * i as f32 / steps as f32;
            let want = reference(f64::from(x));
            let got = f64::from(f(x));
            let err = (got - want).abs() / want.abs().max(1e-30);
            worst = worst.max(err);
        }
        worst
    }

    #[test]
    fn exp_is_within_two_ulps() {
        assert!(
            max_rel(exp, f64::exp, -87.0, 88.0) < 2.5e-7,
            "{}",
            max_rel(exp, f64::exp, -87.0, 88.0)
        );
        assert_eq!(exp(0.0), 1.0);
        assert_eq!(exp(-1e30), 0.0);
    }

    #[test]
    fn tanh_is_within_two_ulps() {
        let e = max_rel(tanh, f64::tanh, -20.0, 20.0);
        assert!(e < 2.5e-7, "{e}");
        assert!(max_rel(tanh, f64::tanh, -1e-3, 1e-3) < 2.5e-7);
        assert_eq!(tanh(0.0), 0.0);
        assert_eq!(tanh(1e4), 1.0);
        assert_eq!(tanh(-1e4), -1.0);
        assert!(tanh(f32::NAN).is_nan());
    }
}
