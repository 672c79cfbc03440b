//! The product of one weight block with one activation block, the one formula every path
//! follows (this portable one, the GGUF-row [`super::vec_dot`] and the SIMD kernels): an
//! exact integer sum over the block (or sub-block), then a fixed sequence of f32 operations
//! into the running sum of an output, blocks in k order. The SIMD kernels run the same
//! operations lane by lane, so every path gives the same bits.
//!
//! For a block with integer form [`Block`] (codes `u`, scales `sc`, mins `mn`, factors `d`,
//! `e`) and activation block `(qs, dx)` (`fma(a, b, c)`: `a * b + c` rounded once):
//!
//! * Q8_0, Q4_0, Q4_1: `s = init + sum(u * qs)` (i32), `acc = fma(f32(s), d * dx, acc)`,
//!   then for Q4_1 `acc = fma(e, sd, acc)` (`init`, `sd`: [`A32`]);
//! * Q4_K, Q5_K: `t[j] = sum_{32 j..}(u * qs)` (i32), `s1 = fma(f32(t[j]), f32(sc[j]), s1)`
//!   for j = 0..8 (f32), `s2 = sum_j mn[j] * sum32[j]` (i32), `acc = fma(s1, d * dx, acc)`,
//!   `acc = fma(-f32(s2), e * dx, acc)`;
//! * Q6_K: `t[j] = neg32_sum16[j] + sum_{16 j..}(u * qs)`, `s1 = fma(f32(t[j]), f32(sc[j]),
//!   s1)` for j = 0..16, `acc = fma(s1, d * dx, acc)`.
//!
//! The integer sums are exact in i32 (|t[j]| < 2^17, |s2| < 2^21), and so are the products
//! `f32(t[j]) * sc[j]` (< 2^24), so `s1`'s fused multiply-adds round as plain adds would.

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
    let mut acc = (s as f32).mul_add(blk.d * a.d, acc);
    if qt == QType::Q4_1 {
        acc = blk.e.mul_add(a.sd, acc);
    }
    acc
}

/// `acc` plus block `blk` (of a K-type) times `a`.
#[inline]
pub(crate) fn dot_a256(qt: QType, blk: &Block, a: &A256, acc: f32) -> f32 {
    let mut s1 = 0f32;
    if qt == QType::Q6_K {
        for j in 0..16 {
            let r = 16 * j..16 * j + 16;
            let t = a.neg32_sum16[j] + idot(&blk.codes[r.clone()], &a.qs[r]);
            // (exact product: one rounding, as the SIMD kernels' fused multiply-add)
            s1 += t as f32 * blk.sc[j] as f32;
        }
        s1.mul_add(blk.d * a.d, acc)
    } else {
        for j in 0..8 {
            let r = 32 * j..32 * j + 32;
            let t = idot(&blk.codes[r.clone()], &a.qs[r]);
            s1 += t as f32 * blk.sc[j] as f32;
        }
        let s2: i32 = (0..8).map(|j| blk.mn[j] * i32::from(a.sum32[j])).sum();
        let acc = s1.mul_add(blk.d * a.d, acc);
        (-(s2 as f32)).mul_add(blk.e * a.d, acc)
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
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("fma") {
        // SAFETY: the CPU has FMA, the only target feature `panel_fma` enables.
        unsafe { panel_fma(qt, panel, nb, acts, out) };
        return;
    }
    panel_body(qt, panel, nb, acts, out)
}

/// [`panel`] where `mul_add` is one instruction (else it is a correctly rounded libm call:
/// the same values, slower).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "fma")]
fn panel_fma(qt: QType, panel: &[u8], nb: usize, acts: ActRows<'_>, out: &mut [[f32; PANEL]]) {
    panel_body(qt, panel, nb, acts, out)
}

#[inline(always)]
fn panel_body(qt: QType, panel: &[u8], nb: usize, acts: ActRows<'_>, out: &mut [[f32; PANEL]]) {
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
