//! The [`amx`](crate::amx) products' backend on CPUs without AMX but with AVX-512 BF16 (AMD Zen 4
//! and later, Intel Cooper Lake): `vdpbf16ps` sums the products of bf16 pairs into 16 f32
//! lanes, the same arithmetic as a tile product, over the same packed weight layout.
//!
//! A packed weight block row (16 columns x 2 inputs, 64 bytes) is one zmm register of
//! bf16 pairs, lane `j` holding inputs `2p, 2p + 1` of column `j`; broadcasting a row's
//! input pair `2p, 2p + 1` to every lane and `vdpbf16ps` adds both products to column `j`'s
//! sum in lane `j`. Per four column blocks (two pairs; a last lone pair: two), up to 6
//! rows (8) at a time keep their 6 x 4 (8 x 2) accumulators in registers for the whole k
//! loop; the rows' inputs stay in L1 and the blocks' weights (72 KiB at k = 576) in L2
//! between row groups.

use std::ops::Range;

use crate::isa::{self, Isa};
use crate::linear::pair_blocks::{TILE_K, TILE_N};
use crate::linear::OutColumns;

/// Column blocks per pass where two pairs remain, and the rows whose 6 x 4 accumulators
/// then stay in registers (with 4 weight rows and a broadcast input: 29 of the 32 zmm).
const QUAD: (usize, usize) = (4, 6);
/// The same for a last single pair: 8 rows x 2 blocks.
const PAIR: (usize, usize) = (2, 8);

/// What the backend needs of the CPU: AVX-512F and AVX-512 BF16.
pub(super) const NEEDS: &[Isa] = &[Isa::Avx512F, Isa::Avx512Bf16];

/// Whether the CPU runs `vdpbf16ps` on zmm registers ([`NEEDS`]).
pub fn available() -> bool {
    isa::all_detected(NEEDS)
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
    let block_len = (kp / TILE_K) * TILE_N * TILE_K;
    let mut pair = pairs.start;
    while pair < pairs.end {
        let (blocks, group_rows) = if pair + 2 <= pairs.end { QUAD } else { PAIR };
        let nb = 2 * pair;
        let w = &packed[nb * block_len..(nb + blocks) * block_len];
        let b = bias.map(|b| &b[nb * TILE_N..(nb + blocks) * TILE_N]);
        for row0 in (0..rows).step_by(group_rows) {
            let r = (rows - row0).min(group_rows);
            let a = &a[row0 * kp..(row0 + r) * kp];
            let mut sums = [[0f32; 4 * TILE_N]; 8];
            group(a, kp, r, blocks, w, b, &mut sums[..r]);
            for (i, s) in sums[..r].iter().enumerate() {
                for (h, half) in s[..blocks * TILE_N].chunks_exact(2 * TILE_N).enumerate() {
                    out.write_cols(row0 + i, (nb + 2 * h) * TILE_N, half);
                }
            }
        }
        pair += blocks / 2;
    }
}

/// `sums[i][..16 * blocks] = bias + a[i] . w` for the `r` rows of `a` and the `16 *
/// blocks` columns of `w` (`blocks` packed column blocks of `kp / 32` blocks each).
fn group(
    a: &[u16],
    kp: usize,
    r: usize,
    blocks: usize,
    w: &[u16],
    bias: Option<&[f32]>,
    sums: &mut [[f32; 64]],
) {
    // (const row and block counts let the compiler keep every accumulator in a register)
    macro_rules! rows {
        ($nb:literal: $($n:literal)*) => {
            match r {
                $($n => kernel::run::<$n, $nb>(a, kp, w, bias, sums),)*
                _ => unreachable!("rows per group"),
            }
        };
    }
    match blocks {
        4 => rows!(4: 1 2 3 4 5 6),
        2 => rows!(2: 1 2 3 4 5 6 7 8),
        _ => unreachable!("2 or 4 column blocks per pass"),
    }
}

#[cfg(target_arch = "x86_64")]
mod kernel {
    use crate::linear::pair_blocks::{TILE_K, TILE_N};
    use std::arch::x86_64::*;

    /// See [`super::group`]; `R` rows, `NB` column blocks.
    pub(super) fn run<const R: usize, const NB: usize>(
        a: &[u16],
        kp: usize,
        w: &[u16],
        bias: Option<&[f32]>,
        sums: &mut [[f32; 64]],
    ) {
        let blocks = kp / TILE_K;
        let block = TILE_N * TILE_K;
        assert!(NB <= 4 && a.len() == R * kp && w.len() == NB * blocks * block);
        assert!(sums.len() == R && bias.is_none_or(|b| b.len() == NB * TILE_N));
        // SAFETY: `run_pairs` asserted that the CPU has AVX-512F and AVX-512 BF16, the
        // only target features `dot` enables; the lengths `dot` relies on are asserted
        // just above.
        unsafe { dot::<R, NB>(a, kp, w, bias, sums) }
    }

    /// The k loop of [`run`] (lengths checked there).
    #[target_feature(enable = "avx512f,avx512bf16")]
    fn dot<const R: usize, const NB: usize>(
        a: &[u16],
        kp: usize,
        w: &[u16],
        bias: Option<&[f32]>,
        sums: &mut [[f32; 64]],
    ) {
        let blocks = kp / TILE_K;
        let block = TILE_N * TILE_K;
        let start: [__m512; NB] = std::array::from_fn(|j| match bias {
            // SAFETY: bias has 16 * NB elements (asserted in `run`); 16 are read from 16 j.
            Some(b) => unsafe { _mm512_loadu_ps(b.as_ptr().add(16 * j)) },
            None => _mm512_setzero_ps(),
        });
        let mut acc = [start; R];
        for kb in 0..blocks {
            for p in 0..TILE_K / 2 {
                let at = kb * block + p * 2 * TILE_N;
                // SAFETY: `j * blocks * block + at + 32 <= NB * blocks * block = w.len()`
                // (kb < blocks, p < 16): one block row of 32 u16 (64 bytes) of column
                // block j; unaligned loads.
                let wv: [__m512bh; NB] = std::array::from_fn(|j| {
                    pairs(unsafe {
                        _mm512_loadu_si512(w.as_ptr().add(j * blocks * block + at).cast())
                    })
                });
                let col = kb * TILE_K + 2 * p;
                for (i, acc) in acc.iter_mut().enumerate() {
                    // SAFETY: `i * kp + col + 1 < R * kp = a.len()` (col + 1 < kp): the
                    // input pair 2p, 2p + 1 of row i, read as one unaligned u32.
                    let x = unsafe { a.as_ptr().add(i * kp + col).cast::<i32>().read_unaligned() };
                    let x = pairs(_mm512_set1_epi32(x));
                    for (acc, wv) in acc.iter_mut().zip(&wv) {
                        *acc = _mm512_dpbf16_ps(*acc, x, *wv);
                    }
                }
            }
        }
        for (s, acc) in sums.iter_mut().zip(&acc) {
            for (j, v) in acc.iter().enumerate() {
                // SAFETY: each row of `sums` has 64 f32 and j < NB <= 4: 16 stored at 16 j.
                unsafe { _mm512_storeu_ps(s.as_mut_ptr().add(16 * j), *v) };
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
    pub(super) fn run<const R: usize, const NB: usize>(
        _: &[u16],
        _: usize,
        _: &[u16],
        _: Option<&[f32]>,
        _: &mut [[f32; 64]],
    ) {
        unreachable!("AVX-512 BF16 is never available off x86-64")
    }
}
