//! The product of one weight block with one activation block, the one formula every path
//! follows (this portable one, the GGUF-row [`super::vec_dot`] and the SIMD kernels): an
//! exact integer sum over the block (or sub-block), then a fixed sequence of f32 operations
//! into the running sum of an output, blocks in k order. The SIMD kernels run the same
//! operations lane by lane, so every path gives the same bits.
//!
//! For a block with integer form [`Block`] (codes `u`, scales `sc`, mins `mn`, factors `d`,
//! `e`) and activation block `(qs, dx)` (`fma(a, b, c)`: `a * b + c` rounded once):
//!
//! * Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL: `s = init + sum(u * qs)` (i32), `acc = fma(f32(s),
//!   d * dx, acc)`, then for Q4_1 and Q5_1 `acc = fma(e, sd, acc)` (`init`, `sd`: [`A32`];
//!   IQ4_NL's `u` is its table value + 128, [`IQ4NL_U`]);
//! * Q4_K, Q5_K: `t[j] = sum_{32 j..}(u * qs)`, `s1 = sum_j sc[j] * t[j]` (i32, j = 0..8),
//!   `s2 = sum_j mn[j] * sum32[j]` (i32), `acc = fma(f32(s1), d * dx, acc)`,
//!   `acc = fma(-f32(s2), e * dx, acc)`;
//! * Q6_K: `t[j] = neg32_sum16[j] + sum_{16 j..}(u * qs)`, `s1 = sum_j sc[j] * t[j]` (i32,
//!   j = 0..16), `acc = fma(f32(s1), d * dx, acc)`;
//! * Q3_K: `t[j] = -4 * sum16[j] + sum_{16 j..}(u * qs)`, `s1 = fma(f32(t[j]), f32(sc[j]),
//!   s1)` for j = 0..16 (f32), `acc = fma(s1, d * dx, acc)`;
//! * Q2_K: `t[j] = sum_{16 j..}(u * qs)`, `s1` as Q3_K's (f32), `s2 = sum_j mn[j] *
//!   sum16[j]` (i32), then `acc` as Q4_K's;
//! * IQ4_XS: `t[j] = -128 * sum32[j] + sum_{32 j..}(v * qs)`, `v = IQ4_VALUES[u] + 128` (the
//!   value as an unsigned code), `s1` as Q3_K's over j = 0..8, `acc = fma(s1, d * dx, acc)`.
//!
//! The integer sums are exact in i32: |t[j]| < 2^20, |s2| < 2^21, and Q4_K's, Q5_K's and
//! Q6_K's whole-block `s1` < 2^27 (`|u - 32| * |q| * 16 * |sc| * 16` for Q6_K, the largest),
//! so those three types round once a block, where `f32(s1)` is taken: the AMX tiles
//! ([`super::amx_rows`]) sum a block in one integer product, and every other path gives
//! the same bits. Q3_K's, Q2_K's and IQ4_XS's products `f32(t[j]) * sc[j]` are exact
//! (< 2^24), so their `s1`'s fused multiply-adds round as plain adds would.

use super::act::{A256, A32};
use super::blocks::{is_table32, table_codes, Block, IQ4_VALUES};
use super::packing::{factor_streams, PANEL};
use super::{ActRows, QType};

#[inline]
fn idot(u: &[u8], q: &[i8]) -> i32 {
    u.iter()
        .zip(q)
        .map(|(&u, &q)| i32::from(u) * i32::from(q))
        .sum()
}

/// `acc` plus block `blk` (of a 32-weight type) times `a`.
#[inline(always)]
pub(crate) fn dot_a32(qt: QType, blk: &Block, a: &A32, acc: f32) -> f32 {
    let s = if is_table32(qt) {
        let codes = table_codes(qt);
        let u: [u8; 32] = std::array::from_fn(|t| codes[usize::from(blk.codes[t] & 0xF)]);
        a.init + idot(&u, &a.qs)
    } else {
        a.init + idot(&blk.codes[..32], &a.qs)
    };
    let mut acc = (s as f32).mul_add(blk.d * a.d, acc);
    if factor_streams(qt).1.is_some() {
        acc = blk.e.mul_add(a.sd, acc);
    }
    acc
}

/// IQ4_XS's 4-bit index `u` as its unsigned code (the value + 128).
#[inline(always)]
pub(crate) fn iq4_code(u: u8) -> u8 {
    (IQ4_VALUES[usize::from(u & 0xF)] as u8) ^ 0x80
}

/// The start of sub-block `j`'s integer sum for the K-types with a code offset (Q6_K,
/// Q3_K, IQ4_XS; else 0).
#[inline(always)]
fn k_init(qt: QType, a: &A256, j: usize) -> i32 {
    match qt {
        QType::Q6_K => a.neg32_sum16[j],
        QType::Q3_K => -4 * i32::from(a.sum16[j]),
        QType::IQ4_XS => -128 * i32::from(a.sum32[j]),
        _ => 0,
    }
}

/// `acc` plus block `blk` (of Q3_K, Q2_K or IQ4_XS) times `a`.
#[inline(always)]
fn dot_a256_small(qt: QType, blk: &Block, a: &A256, acc: f32) -> f32 {
    let per = if qt == QType::IQ4_XS { 32 } else { 16 };
    let mut s1 = 0f32;
    for j in 0..256 / per {
        let r = per * j..per * j + per;
        let dot = if qt == QType::IQ4_XS {
            let v: [u8; 32] = std::array::from_fn(|i| iq4_code(blk.codes[r.start + i]));
            idot(&v, &a.qs[r])
        } else {
            idot(&blk.codes[r.clone()], &a.qs[r])
        };
        let t = k_init(qt, a, j) + dot;
        // (exact product: one rounding, as the SIMD kernels' fused multiply-add)
        s1 += t as f32 * blk.sc[j] as f32;
    }
    let acc = s1.mul_add(blk.d * a.d, acc);
    if qt != QType::Q2_K {
        return acc;
    }
    let s2: i32 = (0..16).map(|j| blk.mn[j] * i32::from(a.sum16[j])).sum();
    (-(s2 as f32)).mul_add(blk.e * a.d, acc)
}

/// `acc` plus block `blk` (of a K-type) times `a`.
#[inline(always)]
pub(crate) fn dot_a256(qt: QType, blk: &Block, a: &A256, acc: f32) -> f32 {
    if matches!(qt, QType::Q3_K | QType::Q2_K | QType::IQ4_XS) {
        return dot_a256_small(qt, blk, a, acc);
    }
    let mut s1 = 0i32;
    if qt == QType::Q6_K {
        for j in 0..16 {
            let r = 16 * j..16 * j + 16;
            let t = a.neg32_sum16[j] + idot(&blk.codes[r.clone()], &a.qs[r]);
            s1 += t * blk.sc[j];
        }
        (s1 as f32).mul_add(blk.d * a.d, acc)
    } else {
        for j in 0..8 {
            let r = 32 * j..32 * j + 32;
            s1 += idot(&blk.codes[r.clone()], &a.qs[r]) * blk.sc[j];
        }
        let s2: i32 = (0..8).map(|j| blk.mn[j] * i32::from(a.sum32[j])).sum();
        let acc = (s1 as f32).mul_add(blk.d * a.d, acc);
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

/// The codes of quad `q` (inputs `4 q .. 4 q + 4`) of block `b` for the 16 columns (byte
/// `4 c + i`: column `c`, input `4 q + i`), read from the streams of `panel` as the SIMD
/// kernels read them ([`super::packing`]'s layout).
#[inline(always)]
fn quad_codes(qt: QType, panel: &[u8], st: &[usize; 6], b: usize, q: usize) -> [u8; 64] {
    let row = |at: usize| -> &[u8; 64] { panel[at..at + 64].try_into().expect("64 bytes") };
    if qt == QType::Q8_0 {
        return *row(st[0] + 512 * b + 64 * q);
    }
    if matches!(qt, QType::Q3_K | QType::Q2_K) {
        // sub-block j = q / 4, bits 2 (q % 4) of its bit-pair row; Q3_K's third bit: bit
        // q % 8 of row q / 8
        let v = row(st[0] + 1024 * b + 64 * (q / 4));
        let mut c: [u8; 64] = std::array::from_fn(|i| (v[i] >> (2 * (q % 4))) & 3);
        if qt == QType::Q3_K {
            let h = row(st[1] + 512 * b + 64 * (q / 8));
            for (c, h) in c.iter_mut().zip(h) {
                *c |= ((h >> (q % 8)) & 1) << 2;
            }
        }
        return c;
    }
    let bytes = if qt.block() == 32 { 256 } else { 2048 };
    let v = row(st[0] + bytes * b + 64 * (q / 2));
    let shift = 4 * (q % 2);
    let mut c: [u8; 64] = std::array::from_fn(|i| (v[i] >> shift) & 0xF);
    match qt {
        QType::Q5_K => {
            // sub-block j = q / 8, bit q % 8 of its fifth-bit row
            let h = row(st[1] + 512 * b + 64 * (q / 8));
            for (c, h) in c.iter_mut().zip(h) {
                *c |= ((h >> (q % 8)) & 1) << 4;
            }
        }
        QType::Q5_0 | QType::Q5_1 => {
            // bit q of the block's fifth-bit row
            let h = row(st[1] + 64 * b);
            for (c, h) in c.iter_mut().zip(h) {
                *c |= ((h >> q) & 1) << 4;
            }
        }
        QType::IQ4_NL | QType::MXFP4 => {
            let codes = table_codes(qt);
            for c in c.iter_mut() {
                *c = codes[usize::from(*c)];
            }
        }
        QType::Q6_K => {
            // sub-block j = q / 4, bits 2 (q % 4) of its bit-pair row
            let h = row(st[1] + 1024 * b + 64 * (q / 4));
            for (c, h) in c.iter_mut().zip(h) {
                *c |= ((h >> (2 * (q % 4))) & 3) << 4;
            }
        }
        QType::IQ4_XS => c.iter_mut().for_each(|c| *c = iq4_code(*c)),
        _ => {}
    }
    c
}

/// `t[c] += sum_i codes[4 c + i] * x[i]`: one quad for the 16 columns.
#[inline(always)]
fn add_quad(t: &mut [i32; PANEL], codes: &[u8; 64], x: &[i8]) {
    let x: [i32; 4] = std::array::from_fn(|i| i32::from(x[i]));
    for (c, t) in t.iter_mut().enumerate() {
        let u = &codes[4 * c..4 * c + 4];
        *t += (0..4).map(|i| i32::from(u[i]) * x[i]).sum::<i32>();
    }
}

/// 16 fp16 widened.
#[inline(always)]
fn halves(b: &[u8]) -> [f32; PANEL] {
    std::array::from_fn(|c| {
        half::f16::from_bits(u16::from_le_bytes([b[2 * c], b[2 * c + 1]])).to_f32()
    })
}

#[inline(always)]
fn panel_body(qt: QType, panel: &[u8], nb: usize, acts: ActRows<'_>, out: &mut [[f32; PANEL]]) {
    let st = super::packing::stream_starts(qt, nb);
    let rows = out.len();
    out.iter_mut().for_each(|o| *o = [0.0; PANEL]);
    // one block of codes of the 16 columns, quad by quad (shared by the rows)
    let mut codes = [[0u8; 64]; 64];
    for b in 0..nb {
        let quads = qt.block() / 4;
        for (q, c) in codes[..quads].iter_mut().enumerate() {
            *c = quad_codes(qt, panel, &st, b, q);
        }
        match acts {
            ActRows::A32(a) => {
                let (ds, ms) = factor_streams(qt);
                let d = halves(&panel[st[ds] + 32 * b..][..32]);
                let m = ms.map(|ms| halves(&panel[st[ms] + 32 * b..][..32]));
                for (i, o) in out.iter_mut().enumerate().take(rows) {
                    let a = &a[i * nb + b];
                    let mut s = [a.init; PANEL];
                    for (q, c) in codes[..8].iter().enumerate() {
                        add_quad(&mut s, c, &a.qs[4 * q..]);
                    }
                    for c in 0..PANEL {
                        o[c] = (s[c] as f32).mul_add(d[c] * a.d, o[c]);
                        if let Some(m) = m {
                            o[c] = m[c].mul_add(a.sd, o[c]);
                        }
                    }
                }
            }
            ActRows::A256(a) if matches!(qt, QType::Q3_K | QType::Q2_K | QType::IQ4_XS) => {
                small_k_block(qt, panel, &st, nb, b, &codes, a, out)
            }
            ActRows::A256(a) => {
                let q6 = qt == QType::Q6_K;
                let (subs, per) = if q6 { (16, 4) } else { (8, 8) };
                // (stream numbers: Q4_K nibbles, sc, mins, d, dmin; Q5_K one more before
                // sc; Q6_K nibbles, bit pairs, sc, d)
                let sc_at = match qt {
                    QType::Q4_K => st[1],
                    _ => st[2],
                } + if q6 { 256 } else { 128 } * b;
                let (d_at, e_at, mins_at) = match qt {
                    QType::Q4_K => (st[3], st[4], st[2]),
                    QType::Q5_K => (st[4], st[5], st[3]),
                    _ => (st[3], 0, 0),
                };
                let d = halves(&panel[d_at + 32 * b..][..32]);
                for (i, o) in out.iter_mut().enumerate().take(rows) {
                    let a = &a[i * nb + b];
                    let mut s1 = [0i32; PANEL];
                    for j in 0..subs {
                        let mut t = [if q6 { a.neg32_sum16[j] } else { 0 }; PANEL];
                        for (q, c) in codes.iter().enumerate().skip(per * j).take(per) {
                            add_quad(&mut t, c, &a.qs[4 * q..]);
                        }
                        for c in 0..PANEL {
                            let sc = panel[sc_at + 16 * j + c];
                            let sc = if q6 {
                                i32::from(sc as i8)
                            } else {
                                i32::from(sc)
                            };
                            s1[c] += t[c] * sc;
                        }
                    }
                    for c in 0..PANEL {
                        o[c] = (s1[c] as f32).mul_add(d[c] * a.d, o[c]);
                    }
                    if !q6 {
                        let e = halves(&panel[e_at + 32 * b..][..32]);
                        let mins = &panel[mins_at + 128 * b..][..128];
                        for c in 0..PANEL {
                            let s2: i32 = (0..8)
                                .map(|j| {
                                    i32::from(mins[32 * (j / 2) + 2 * c + j % 2])
                                        * i32::from(a.sum32[j])
                                })
                                .sum();
                            o[c] = (-(s2 as f32)).mul_add(e[c] * a.d, o[c]);
                        }
                    }
                }
            }
        }
    }
}

/// Block `b` of a Q3_K, Q2_K or IQ4_XS panel (`codes`: its quads) times each row of `a`,
/// added to `out` (the formula of the module docs).
#[allow(clippy::too_many_arguments)] // one block of `panel_body`: its panel and rows
#[inline(always)]
fn small_k_block(
    qt: QType,
    panel: &[u8],
    st: &[usize; 6],
    nb: usize,
    b: usize,
    codes: &[[u8; 64]; 64],
    a: &[A256],
    out: &mut [[f32; PANEL]],
) {
    // (stream numbers: Q3_K low pairs, third bits, sc, d; Q2_K pairs, sc and mins, d,
    // dmin; IQ4_XS nibbles, sc, d)
    let (subs, per, sc_s, d_s) = match qt {
        QType::Q3_K => (16, 4, 2, 3),
        QType::Q2_K => (16, 4, 1, 2),
        _ => (8, 8, 1, 2),
    };
    let sc = &panel[st[sc_s] + 16 * subs * b..][..16 * subs];
    let d = halves(&panel[st[d_s] + 32 * b..][..32]);
    for (i, o) in out.iter_mut().enumerate() {
        let a = &a[i * nb + b];
        let mut s1 = [0f32; PANEL];
        for j in 0..subs {
            let mut t = [k_init(qt, a, j); PANEL];
            for (q, c) in codes.iter().enumerate().skip(per * j).take(per) {
                add_quad(&mut t, c, &a.qs[4 * q..]);
            }
            for c in 0..PANEL {
                let v = sc[16 * j + c];
                let sc = match qt {
                    QType::Q2_K => f32::from(v & 0xF),
                    _ => f32::from(v as i8),
                };
                // (exact product: one rounding, as the kernels' fused one)
                s1[c] += t[c] as f32 * sc;
            }
        }
        for c in 0..PANEL {
            o[c] = s1[c].mul_add(d[c] * a.d, o[c]);
        }
        if qt == QType::Q2_K {
            let e = halves(&panel[st[3] + 32 * b..][..32]);
            for c in 0..PANEL {
                let s2: i32 = (0..16)
                    .map(|j| i32::from(sc[16 * j + c] >> 4) * i32::from(a.sum16[j]))
                    .sum();
                o[c] = (-(s2 as f32)).mul_add(e[c] * a.d, o[c]);
            }
        }
    }
}
