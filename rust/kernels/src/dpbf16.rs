//! The [`amx`](crate::amx) products on CPUs without AMX but with AVX-512 BF16 (AMD Zen 4
//! and later, Intel Cooper Lake): `vdpbf16ps` sums the products of bf16 pairs into 16 f32
//! lanes, the same arithmetic as a tile product, over the same packed weight layout.
//!
//! A packed weight block row (16 columns x 2 inputs, 64 bytes) is one zmm register of
//! bf16 pairs, lane `j` holding inputs `2p, 2p + 1` of column `j`; broadcasting a row's
//! input pair `2p, 2p + 1` to every lane and `vdpbf16ps` adds both products to column `j`'s
//! sum in lane `j`. Per pair of column blocks, up to 8 rows at a time keep their 2 x 8
//! accumulators in registers for the whole k loop; the rows' inputs stay in L1 and the
//! pair's weight blocks (36 KiB at k = 576) in L2 between row groups.

use std::ops::Range;

use crate::amx::{OutColumns, TILE_K, TILE_N};

/// Rows whose accumulators one pass keeps in registers (2 x 8 of the 32 zmm).
const ROWS_PER_GROUP: usize = 8;

/// Whether the CPU runs `vdpbf16ps` on zmm registers (AVX-512F and AVX-512 BF16).
pub fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512bf16")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Runs the column-block pairs `pairs` for rows `0..rows` of `a` ([rows, kp] bf16, `kp` a
/// multiple of 32, zero beyond the real inputs); `packed` and `bias` (padded to the pairs)
/// as [`crate::amx::linear`] has them. Panics if [`available`] is false or a slice is
/// shorter than those shapes need (the caller checked them).
pub(crate) fn run_pairs(
    a: &[u16],
    kp: usize,
    rows: usize,
    packed: &[u16],
    pairs: Range<usize>,
    bias: Option<&[f32]>,
    out: &OutColumns,
) {
    assert!(available(), "AVX-512 BF16 is not available");
    assert!(kp.is_multiple_of(TILE_K) && a.len() >= rows * kp);
    let pair_len = 2 * (kp / TILE_K) * TILE_N * TILE_K;
    for pair in pairs {
        let w = &packed[pair * pair_len..(pair + 1) * pair_len];
        let b = bias.map(|b| &b[pair * 2 * TILE_N..(pair + 1) * 2 * TILE_N]);
        for row0 in (0..rows).step_by(ROWS_PER_GROUP) {
            let r = (rows - row0).min(ROWS_PER_GROUP);
            let a = &a[row0 * kp..(row0 + r) * kp];
            let mut sums = [[0f32; 2 * TILE_N]; ROWS_PER_GROUP];
            group(a, kp, r, w, b, &mut sums[..r]);
            for (i, s) in sums[..r].iter().enumerate() {
                out.write_row(row0 + i, pair * 2 * TILE_N, s);
            }
        }
    }
}

/// `sums[i] = bias + a[i] . w` for the `r` rows of `a` and the 32 columns of the weight
/// pair `w` (two packed column blocks, `kp / 32` blocks each).
fn group(a: &[u16], kp: usize, r: usize, w: &[u16], bias: Option<&[f32]>, sums: &mut [[f32; 32]]) {
    // (the const row counts let the compiler keep every accumulator in a register)
    macro_rules! rows {
        ($($n:literal)*) => {
            match r {
                $($n => kernel::run::<$n>(a, kp, w, bias, sums),)*
                _ => unreachable!("1..=8 rows per group"),
            }
        };
    }
    rows!(1 2 3 4 5 6 7 8);
}

#[cfg(target_arch = "x86_64")]
mod kernel {
    use crate::amx::{TILE_K, TILE_N};
    use std::arch::x86_64::*;

    /// See [`super::group`]; `R` rows.
    pub(super) fn run<const R: usize>(
        a: &[u16],
        kp: usize,
        w: &[u16],
        bias: Option<&[f32]>,
        sums: &mut [[f32; 32]],
    ) {
        let blocks = kp / TILE_K;
        let block = TILE_N * TILE_K;
        assert!(a.len() == R * kp && w.len() == 2 * blocks * block && sums.len() == R);
        assert!(bias.is_none_or(|b| b.len() == 2 * TILE_N));
        // SAFETY: `run_pairs` asserted that the CPU has AVX-512F and AVX-512 BF16, the
        // only target features `dot` enables; the lengths `dot` relies on are asserted
        // just above.
        unsafe { dot::<R>(a, kp, w, bias, sums) }
    }

    /// The k loop of [`run`] (lengths checked there).
    #[target_feature(enable = "avx512f,avx512bf16")]
    fn dot<const R: usize>(
        a: &[u16],
        kp: usize,
        w: &[u16],
        bias: Option<&[f32]>,
        sums: &mut [[f32; 32]],
    ) {
        let blocks = kp / TILE_K;
        let block = TILE_N * TILE_K;
        let (w0, w1) = w.split_at(blocks * block);
        let start = |j: usize| match bias {
            // SAFETY: bias has 32 elements (asserted in `run`); 16 are read from 16 * j.
            Some(b) => unsafe { _mm512_loadu_ps(b.as_ptr().add(16 * j)) },
            None => _mm512_setzero_ps(),
        };
        let mut acc = [[start(0), start(1)]; R];
        for kb in 0..blocks {
            for p in 0..TILE_K / 2 {
                let at = kb * block + p * 2 * TILE_N;
                // SAFETY: `at + 32 <= blocks * block` (kb < blocks, p < 16): one block
                // row of 32 u16 (64 bytes) inside `w0` and `w1`; unaligned loads.
                let (b0, b1) = unsafe {
                    (
                        _mm512_loadu_si512(w0.as_ptr().add(at).cast()),
                        _mm512_loadu_si512(w1.as_ptr().add(at).cast()),
                    )
                };
                let (b0, b1) = (pairs(b0), pairs(b1));
                let col = kb * TILE_K + 2 * p;
                for (i, acc) in acc.iter_mut().enumerate() {
                    // SAFETY: `i * kp + col + 1 < R * kp = a.len()` (col + 1 < kp): the
                    // input pair 2p, 2p + 1 of row i, read as one unaligned u32.
                    let x = unsafe { a.as_ptr().add(i * kp + col).cast::<i32>().read_unaligned() };
                    let x = pairs(_mm512_set1_epi32(x));
                    acc[0] = _mm512_dpbf16_ps(acc[0], x, b0);
                    acc[1] = _mm512_dpbf16_ps(acc[1], x, b1);
                }
            }
        }
        for (s, acc) in sums.iter_mut().zip(&acc) {
            // SAFETY: each row of `sums` has 32 f32: 16 stored at 0 and 16 at 16.
            unsafe {
                _mm512_storeu_ps(s.as_mut_ptr(), acc[0]);
                _mm512_storeu_ps(s.as_mut_ptr().add(16), acc[1]);
            }
        }
    }

    /// The 32 bf16 of `v` as the pair vector `vdpbf16ps` takes.
    #[inline(always)]
    fn pairs(v: __m512i) -> __m512bh {
        // SAFETY: both are 64-byte vectors of plain bits; every bit pattern is a valid
        // `__m512bh`.
        unsafe { std::mem::transmute::<__m512i, __m512bh>(v) }
    }
}

#[cfg(not(target_arch = "x86_64"))]
mod kernel {
    pub(super) fn run<const R: usize>(
        _: &[u16],
        _: usize,
        _: &[u16],
        _: Option<&[f32]>,
        _: &mut [[f32; 32]],
    ) {
        unreachable!("AVX-512 BF16 is never available off x86-64")
    }
}
