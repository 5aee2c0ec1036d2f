//! Out-of-place transposition of an f32 matrix, in 8 x 8 register blocks where the CPU has
//! AVX. The GEMM reads a right-hand operand stored along its inner dimension (a transposed
//! weight, `g W^T` in a matmul's backward; `col^T` in a convolution's weight gradient) up
//! to 2.4x slower than one stored row by row (`BENCHMARKS.md`); [`super::matmul`] and
//! [`super::conv`] transpose such an operand first when that pays.

use std::mem::MaybeUninit;

use rayon::prelude::*;

/// Output rows per piece (each piece reads a band of `PIECE` source columns).
const PIECE: usize = 64;

/// `dst [cols, rows]` (row-major) = `src [rows, cols]` transposed, `src`'s rows `stride`
/// elements apart; every element of `dst` is written. `parallel`: pieces across the
/// current rayon pool (otherwise on this thread only).
pub fn transpose(
    src: &[f32],
    rows: usize,
    cols: usize,
    stride: usize,
    dst: &mut [MaybeUninit<f32>],
    parallel: bool,
) {
    assert!(
        rows == 0 || cols == 0 || (rows - 1) * stride + cols <= src.len(),
        "transpose: a {rows} x {cols} matrix with row stride {stride} overruns {} values",
        src.len()
    );
    assert_eq!(dst.len(), rows * cols, "transpose: destination size");
    if rows == 0 || cols == 0 {
        return;
    }
    let piece = |(p, out): (usize, &mut [MaybeUninit<f32>])| {
        transpose_band(src, rows, stride, p * PIECE, out);
    };
    if parallel {
        dst.par_chunks_mut(PIECE * rows).enumerate().for_each(piece);
    } else {
        dst.chunks_mut(PIECE * rows).enumerate().for_each(piece);
    }
}

/// Rows `c0..` of the output (`out.len() / rows` of them): source columns `c0..`.
fn transpose_band(
    src: &[f32],
    rows: usize,
    stride: usize,
    c0: usize,
    out: &mut [MaybeUninit<f32>],
) {
    let cn = out.len() / rows;
    #[cfg(target_arch = "x86_64")]
    let avx = std::arch::is_x86_feature_detected!("avx");
    let mut r = 0;
    while r < rows {
        let rn = (rows - r).min(8);
        let mut c = 0;
        #[cfg(target_arch = "x86_64")]
        if avx && rn == 8 {
            while c + 8 <= cn {
                // SAFETY: AVX is present; the block reads rows r..r+8, columns c0+c..c0+c+8
                // of `src` (inside it by the assert in `transpose`) and writes rows c..c+8,
                // columns r..r+8 of `out` (inside its `cn` rows of `rows`).
                unsafe {
                    block8(
                        src.as_ptr().add(r * stride + c0 + c),
                        stride,
                        out.as_mut_ptr().add(c * rows + r).cast(),
                        rows,
                    )
                };
                c += 8;
            }
        }
        for cc in c..cn {
            for rr in r..r + rn {
                out[cc * rows + rr].write(src[rr * stride + c0 + cc]);
            }
        }
        r += rn;
    }
}

/// One 8 x 8 block: `dst[j * ds + i] = src[i * ss + j]`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx")]
unsafe fn block8(src: *const f32, ss: usize, dst: *mut f32, ds: usize) {
    use std::arch::x86_64::*;
    // SAFETY: the caller guarantees 8 rows of 8 values at `src` (rows `ss` apart) and at
    // `dst` (rows `ds` apart).
    unsafe {
        let row = |i: usize| _mm256_loadu_ps(src.add(i * ss));
        let (r0, r1, r2, r3) = (row(0), row(1), row(2), row(3));
        let (r4, r5, r6, r7) = (row(4), row(5), row(6), row(7));
        // Pairs of rows interleaved, then quads, then the 128-bit halves exchanged.
        let (t0, t1) = (_mm256_unpacklo_ps(r0, r1), _mm256_unpackhi_ps(r0, r1));
        let (t2, t3) = (_mm256_unpacklo_ps(r2, r3), _mm256_unpackhi_ps(r2, r3));
        let (t4, t5) = (_mm256_unpacklo_ps(r4, r5), _mm256_unpackhi_ps(r4, r5));
        let (t6, t7) = (_mm256_unpacklo_ps(r6, r7), _mm256_unpackhi_ps(r6, r7));
        let (u0, u1) = (
            _mm256_shuffle_ps::<0x44>(t0, t2),
            _mm256_shuffle_ps::<0xEE>(t0, t2),
        );
        let (u2, u3) = (
            _mm256_shuffle_ps::<0x44>(t1, t3),
            _mm256_shuffle_ps::<0xEE>(t1, t3),
        );
        let (u4, u5) = (
            _mm256_shuffle_ps::<0x44>(t4, t6),
            _mm256_shuffle_ps::<0xEE>(t4, t6),
        );
        let (u6, u7) = (
            _mm256_shuffle_ps::<0x44>(t5, t7),
            _mm256_shuffle_ps::<0xEE>(t5, t7),
        );
        let store = |j: usize, v| _mm256_storeu_ps(dst.add(j * ds), v);
        store(0, _mm256_permute2f128_ps::<0x20>(u0, u4));
        store(1, _mm256_permute2f128_ps::<0x20>(u1, u5));
        store(2, _mm256_permute2f128_ps::<0x20>(u2, u6));
        store(3, _mm256_permute2f128_ps::<0x20>(u3, u7));
        store(4, _mm256_permute2f128_ps::<0x31>(u0, u4));
        store(5, _mm256_permute2f128_ps::<0x31>(u1, u5));
        store(6, _mm256_permute2f128_ps::<0x31>(u2, u6));
        store(7, _mm256_permute2f128_ps::<0x31>(u3, u7));
    }
}
