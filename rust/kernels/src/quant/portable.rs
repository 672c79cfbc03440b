//! The product of one weight block with one activation block, the one formula every path
//! follows (this portable one, the GGUF-row [`super::vec_dot`] and the SIMD kernels): an
//! exact integer sum over the block, then a fixed sequence of f32 operations into the
//! running sum of an output (no fused multiply-adds), blocks in k order. The SIMD kernels
//! run the same operations lane by lane, so every path gives the same bits.
//!
//! For a block with integer form [`Block`] (codes `u`, scales `sc`, mins `mn`, factors `d`,
//! `e`) and activation block `(qs, dx)`:
//!
//! * Q8_0, Q4_0, Q4_1: `s = init + sum(u * qs)`, `acc += f32(s) * (d * dx)`, then for Q4_1
//!   `acc += e * sd` (`init`, `sd`: [`A32`]);
//! * Q4_K, Q5_K: `s1 = sum_j sc[j] * sum_{32 j..}(u * qs)`, `s2 = sum_j mn[j] * sum32[j]`,
//!   `acc += f32(s1) * (d * dx)`, `acc -= f32(s2) * (e * dx)`;
//! * Q6_K: `s1 = sum_j sc[j] * (neg32_sum16[j] + sum_{16 j..}(u * qs))`,
//!   `acc += f32(s1) * (d * dx)`.
//!
//! The integer sums are exact in i32: |s1| < 2^27 (Q6_K: 16 * 128 * 16 * 32 * 127), the
//! others smaller.

use super::act::{A256, A32};
use super::blocks::Block;
use super::packing::{decode_panel, PANEL};
use super::{ActRows, QType};

#[inline]
fn idot(u: &[u8], q: &[i8]) -> i32 {
    u.iter()
        .zip(q)
        .map(|(&u, &q)| i32::from(u) * i32::from(q))
        .sum()
}

/// `acc` plus block `blk` (of a 32-weight type) times `a`.
#[inline]
pub(crate) fn dot_a32(qt: QType, blk: &Block, a: &A32, acc: f32) -> f32 {
    let s = a.init + idot(&blk.codes[..32], &a.qs);
    let mut acc = acc + s as f32 * (blk.d * a.d);
    if qt == QType::Q4_1 {
        acc = acc + blk.e * a.sd;
    }
    acc
}

/// `acc` plus block `blk` (of a K-type) times `a`.
#[inline]
pub(crate) fn dot_a256(qt: QType, blk: &Block, a: &A256, acc: f32) -> f32 {
    if qt == QType::Q6_K {
        let s1: i32 = (0..16)
            .map(|j| {
                let r = 16 * j..16 * j + 16;
                blk.sc[j] * (a.neg32_sum16[j] + idot(&blk.codes[r.clone()], &a.qs[r]))
            })
            .sum();
        acc + s1 as f32 * (blk.d * a.d)
    } else {
        let s1: i32 = (0..8)
            .map(|j| {
                let r = 32 * j..32 * j + 32;
                blk.sc[j] * idot(&blk.codes[r.clone()], &a.qs[r])
            })
            .sum();
        let s2: i32 = (0..8).map(|j| blk.mn[j] * i32::from(a.sum32[j])).sum();
        let acc = acc + s1 as f32 * (blk.d * a.d);
        acc - s2 as f32 * (blk.e * a.d)
    }
}

/// `out[i][c] = sum over blocks` of the panel `panel` (`nb` blocks of `qt`) times row `i` of
/// `acts` (`out.len()` rows of `nb` blocks), following the formula of the module docs.
pub(crate) fn panel(
    qt: QType,
    panel: &[u8],
    nb: usize,
    acts: ActRows<'_>,
    out: &mut [[f32; PANEL]],
) {
    out.iter_mut().for_each(|o| *o = [0.0; PANEL]);
    for b in 0..nb {
        let blks = decode_panel(qt, panel, nb, b);
        for (i, o) in out.iter_mut().enumerate() {
            match acts {
                ActRows::A32(a) => {
                    let a = &a[i * nb + b];
                    for (o, blk) in o.iter_mut().zip(&blks) {
                        *o = dot_a32(qt, blk, a, *o);
                    }
                }
                ActRows::A256(a) => {
                    let a = &a[i * nb + b];
                    for (o, blk) in o.iter_mut().zip(&blks) {
                        *o = dot_a256(qt, blk, a, *o);
                    }
                }
            }
        }
    }
}
