//! The AMX tile backend of [`super::linear`]: per pair of column blocks, 32 rows of bf16
//! inputs at a time through 2 x 2 accumulator tiles (inline assembly), each input tile and
//! weight block loaded once for two products, the bias loaded as the accumulators' start,
//! the f32 sums stored straight into `out` where a whole tile fits.

use std::ops::Range;

#[cfg(target_arch = "x86_64")]
use crate::linear::pair_blocks::{BLOCK, TILE_K, TILE_N};
use crate::linear::OutColumns;
#[cfg(target_arch = "x86_64")]
use std::arch::asm;

/// Rows of `x` per pass through the four accumulator tiles (2 x 2 tiles of 16 x 16).
pub(super) const ROWS_PER_PASS: usize = 32;

/// The tile configuration: palette 1, tiles 0..=7 of 16 rows x 64 bytes (0-3 the
/// accumulators of 2 x 2 tiles, 4 and 5 input rows, 6 and 7 weight blocks).
#[cfg(target_arch = "x86_64")]
#[repr(C, align(64))]
struct Config([u8; 64]);

#[cfg(target_arch = "x86_64")]
fn config() -> Config {
    let mut c = Config([0; 64]);
    c.0[0] = 1;
    for t in 0..8 {
        c.0[16 + 2 * t] = 64; // bytes per row
        c.0[48 + t] = 16; // rows
    }
    c
}

/// Runs the column-block pairs `pairs` for every row of `a` ([rows, kp] bf16, whole
/// passes of 32 rows).
#[cfg(target_arch = "x86_64")]
pub(super) fn run_pairs(
    a: &[u16],
    kp: usize,
    packed: &[u16],
    pairs: Range<usize>,
    bias: Option<&[f32]>,
    out: &OutColumns,
) {
    let k_blocks = kp / TILE_K;
    let rows = a.len() / kp;
    let cfg = config();
    let mut acc = [0f32; 4 * 16 * TILE_N];
    // bytes per row of `a`, and of a weight block
    let (a_stride, s64) = (kp * 2, 64usize);
    // SAFETY: AMX is available (`linear` checked `available()`, which also obtained the
    // tile permission); the config is 64 aligned bytes describing valid tiles.
    unsafe { asm!("ldtilecfg [{}]", in(reg) cfg.0.as_ptr(), options(nostack)) };
    for pair in pairs {
        let nb = 2 * pair;
        let w0 = &packed[nb * k_blocks * BLOCK..(nb + 1) * k_blocks * BLOCK];
        let w1 = &packed[(nb + 1) * k_blocks * BLOCK..(nb + 2) * k_blocks * BLOCK];
        for row0 in (0..rows).step_by(ROWS_PER_PASS) {
            let a0 = &a[row0 * kp..(row0 + 16) * kp];
            let a1 = &a[(row0 + 16) * kp..(row0 + 32) * kp];
            // SAFETY (the asm blocks): tiles 0..=7 are configured as 16 rows x 64 bytes.
            // Each load reads 16 rows of 64 bytes, `stride` apart, inside a 1 KiB block
            // of `w0` / `w1` (rows 64 bytes apart), inside `a0` / `a1` (16 rows of `kp`
            // elements; columns kb * 32 .. + 32 <= kp), or 64 bytes of `bias` (stride
            // 0: the same row 16 times; columns nb * 16 .. + 32 <= its padded length).
            // The stores write 16 rows x 64 bytes into `acc` (whole) or, through
            // `out.block`, into a tile of `out` that lies inside it.
            unsafe {
                match bias {
                    Some(b) => asm!(
                        "tileloadd tmm0, [{b0} + {z}*1]", "tileloadd tmm1, [{b1} + {z}*1]",
                        "tileloadd tmm2, [{b0} + {z}*1]", "tileloadd tmm3, [{b1} + {z}*1]",
                        b0 = in(reg) b[nb * TILE_N..nb * TILE_N + TILE_N].as_ptr(),
                        b1 = in(reg) b[(nb + 1) * TILE_N..(nb + 2) * TILE_N].as_ptr(),
                        z = in(reg) 0usize, options(nostack, readonly)),
                    None => asm!(
                        "tilezero tmm0",
                        "tilezero tmm1",
                        "tilezero tmm2",
                        "tilezero tmm3",
                        options(nostack)
                    ),
                }
            }
            for kb in 0..k_blocks {
                unsafe {
                    asm!(
                        "tileloadd tmm4, [{a0} + {sa}*1]",
                        "tileloadd tmm6, [{b0} + {s64}*1]",
                        "tdpbf16ps tmm0, tmm4, tmm6",
                        "tileloadd tmm7, [{b1} + {s64}*1]",
                        "tdpbf16ps tmm1, tmm4, tmm7",
                        "tileloadd tmm5, [{a1} + {sa}*1]",
                        "tdpbf16ps tmm2, tmm5, tmm6",
                        "tdpbf16ps tmm3, tmm5, tmm7",
                        a0 = in(reg) a0[kb * TILE_K..].as_ptr(),
                        a1 = in(reg) a1[kb * TILE_K..].as_ptr(),
                        b0 = in(reg) w0[kb * BLOCK..].as_ptr(),
                        b1 = in(reg) w1[kb * BLOCK..].as_ptr(),
                        sa = in(reg) a_stride, s64 = in(reg) s64,
                        options(nostack, readonly),
                    );
                }
            }
            // accumulators: 0 rows row0.. cols nb, 1 cols nb + 1, 2 and 3 rows row0 + 16..
            let tile = 16 * TILE_N;
            let c = acc.as_mut_ptr();
            let place = [(0, 0), (0, 1), (16, 0), (16, 1)];
            let direct = place.map(|(dr, db)| out.block(row0 + dr, (nb + db) * TILE_N, 16, TILE_N));
            let dst = |t: usize| direct[t].unwrap_or(c.wrapping_add(t * tile));
            let stride = |t: usize| {
                if direct[t].is_some() {
                    out.n() * 4
                } else {
                    s64
                }
            };
            unsafe {
                asm!(
                    "tilestored [{c0} + {s0}*1], tmm0",
                    "tilestored [{c1} + {s1}*1], tmm1",
                    "tilestored [{c2} + {s2}*1], tmm2",
                    "tilestored [{c3} + {s3}*1], tmm3",
                    c0 = in(reg) dst(0), c1 = in(reg) dst(1), c2 = in(reg) dst(2),
                    c3 = in(reg) dst(3), s0 = in(reg) stride(0), s1 = in(reg) stride(1),
                    s2 = in(reg) stride(2), s3 = in(reg) stride(3), options(nostack),
                );
            }
            for (t, (dr, db)) in place.into_iter().enumerate() {
                if direct[t].is_none() {
                    out.write_block(row0 + dr, (nb + db) * TILE_N, &acc[t * tile..], 16, TILE_N);
                }
            }
        }
    }
    // SAFETY: releases this thread's tile state (nothing is read from it afterwards).
    unsafe { asm!("tilerelease", options(nostack)) };
}

#[cfg(not(target_arch = "x86_64"))]
pub(super) fn run_pairs(
    _: &[u16],
    _: usize,
    _: &[u16],
    _: Range<usize>,
    _: Option<&[f32]>,
    _: &OutColumns,
) {
    unreachable!("AMX is never available off x86-64")
}
