//! The panel products on AVX-512 VNNI: 16 output columns in the 16 i32 lanes of a zmm
//! register, one `vpdpbusd` per quad of inputs (the 16 columns' codes of 4 inputs, unsigned,
//! times one row's 4 int8 inputs broadcast), up to [`MAX_ROWS`] rows sharing each load and
//! unpacking of the weights. Each lane follows the portable formula ([`super::portable`])
//! operation for operation: integer sums (exact), then `cvtdq2ps`, `mulps` and fused
//! multiply-adds in the same order, so both paths give the same bits.
//!
//! Code vectors from the packed streams ([`super::packing`]): 8-bit codes are loaded as
//! they are; a row of nibbles gives two quads (`v & 0xF`, `(v >> 4) & 0xF`); the fifth bits
//! (Q5_K, Q5_0, Q5_1) and Q6_K's bit pairs are shifted to bit 4 (16-bit shifts: the bits
//! that cross a byte are masked off) and merged with one `vpternlogd` (`a | (b & c)`);
//! IQ4_NL's indices become codes (value + 128) with one `vpshufb` from its table. Sub-block
//! scales are widened once a panel block: to i32 lanes for Q4_K, Q5_K and Q6_K, whose block
//! sums stay integers (`vpmulld` + `vpaddd` a sub-block and row), to f32 lanes for the
//! others' one exact fused multiply-add a sub-block and row; the K-types' mins meet the
//! activations' partial sums in `vpdpwssd` (two sub-blocks a lane).
//! Q3_K and Q2_K's bit pairs are shifted down and masked, Q3_K's third bits merged at bit 2;
//! IQ4_XS's indices become their codes (value + 128) in one `vpshufb` from a 16-byte table.

use std::arch::x86_64::*;

use super::act::{sum_pair, A256, A32};
use super::blocks::table_codes;
use super::packing::{factor_streams, panel_block_bytes, stream_starts, PANEL};
use super::{ActRows, PanelFn, QType, MAX_ROWS};
use crate::asm::dpwssd;

/// Whether the CPU runs these kernels (AVX-512 F, BW and VNNI).
pub(crate) fn available() -> bool {
    is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512bw")
        && is_x86_feature_detected!("avx512vnni")
}

/// The safe panel product of `qt` (a [`PanelFn`]).
pub(crate) fn panel_fn(qt: QType) -> PanelFn {
    match qt {
        QType::Q8_0 => panel::<0>,
        QType::Q4_0 => panel::<1>,
        QType::Q4_1 => panel::<2>,
        QType::Q4_K => panel::<3>,
        QType::Q5_K => panel::<4>,
        QType::Q6_K => panel::<5>,
        QType::Q5_0 => panel::<{ QType::Q5_0 as u8 }>,
        QType::Q5_1 => panel::<{ QType::Q5_1 as u8 }>,
        QType::IQ4_NL => panel::<{ QType::IQ4_NL as u8 }>,
        QType::Q3_K => panel::<{ QType::Q3_K as u8 }>,
        QType::Q2_K => panel::<{ QType::Q2_K as u8 }>,
        QType::IQ4_XS => panel::<{ QType::IQ4_XS as u8 }>,
        QType::MXFP4 => panel::<{ QType::MXFP4 as u8 }>,
    }
}

/// `out[i][c]`: the panel `w` (`nb` blocks of type number `T`) times activation row `i` of
/// `acts` (`out.len()` rows, 1 to [`MAX_ROWS`]), fetching `next` (the next panels, or empty)
/// into the L2 cache on the way. Panics on a length that does not match, or where
/// [`available`] is false.
fn panel<const T: u8>(
    w: &[u8],
    next: &[u8],
    nb: usize,
    acts: ActRows<'_>,
    out: &mut [[f32; PANEL]],
) {
    let qt = QType::ALL[T as usize];
    let r = out.len();
    assert!(available(), "AVX-512 VNNI is not available");
    assert!((1..=MAX_ROWS).contains(&r), "1 to {MAX_ROWS} rows, not {r}");
    assert_eq!(
        w.len(),
        nb * panel_block_bytes(qt),
        "one panel of {nb} blocks"
    );
    let pf = Fetch {
        at: next.as_ptr(),
        len: next.len(),
        nb,
    };
    let o = out.as_mut_ptr();
    macro_rules! rows {
        ($f:ident, $a:expr $(, $c:expr)?) => {
            // SAFETY: the CPU has AVX-512 F, BW and VNNI (asserted above); `w` holds one
            // panel of `nb` blocks of `qt` (asserted above), `$a` holds `r * nb` activation
            // blocks (asserted by the caller of this macro) and `o` points at `r` rows of 16
            // f32: the contract of each kernel; the kernel is the one of `r` rows.
            unsafe {
                match r {
                    1 => $f::<1 $(, $c)?>(w.as_ptr(), nb, $a, o, pf),
                    2 => $f::<2 $(, $c)?>(w.as_ptr(), nb, $a, o, pf),
                    3 => $f::<3 $(, $c)?>(w.as_ptr(), nb, $a, o, pf),
                    4 => $f::<4 $(, $c)?>(w.as_ptr(), nb, $a, o, pf),
                    5 => $f::<5 $(, $c)?>(w.as_ptr(), nb, $a, o, pf),
                    6 => $f::<6 $(, $c)?>(w.as_ptr(), nb, $a, o, pf),
                    7 => $f::<7 $(, $c)?>(w.as_ptr(), nb, $a, o, pf),
                    _ => $f::<8 $(, $c)?>(w.as_ptr(), nb, $a, o, pf),
                }
            }
        };
    }
    match (qt, acts) {
        (qt, ActRows::A32(a)) if qt.block() == 32 => {
            assert_eq!(a.len(), r * nb, "{r} rows of {nb} blocks");
            let a = a.as_ptr();
            by_type32!(qt, rows!(blocks32, a))
        }
        (QType::Q4_K | QType::Q5_K, ActRows::A256(a)) => {
            assert_eq!(a.len(), r * nb, "{r} rows of {nb} blocks");
            let a = a.as_ptr();
            if qt == QType::Q5_K {
                rows!(q45k, a, true)
            } else {
                rows!(q45k, a, false)
            }
        }
        (QType::Q6_K, ActRows::A256(a)) => {
            assert_eq!(a.len(), r * nb, "{r} rows of {nb} blocks");
            let a = a.as_ptr();
            rows!(q6k, a)
        }
        (QType::Q3_K, ActRows::A256(a)) => {
            assert_eq!(a.len(), r * nb, "{r} rows of {nb} blocks");
            let a = a.as_ptr();
            rows!(small_k, a, { QType::Q3_K as u8 })
        }
        (QType::Q2_K, ActRows::A256(a)) => {
            assert_eq!(a.len(), r * nb, "{r} rows of {nb} blocks");
            let a = a.as_ptr();
            rows!(small_k, a, { QType::Q2_K as u8 })
        }
        (QType::IQ4_XS, ActRows::A256(a)) => {
            assert_eq!(a.len(), r * nb, "{r} rows of {nb} blocks");
            let a = a.as_ptr();
            rows!(small_k, a, { QType::IQ4_XS as u8 })
        }
        _ => panic!("{}: wrong activation format", qt.name()),
    }
}

/// The bytes a kernel fetches into the L2 cache while it runs: `len` bytes from `at` (none
/// when `len` is 0), the `b`th of `nb` near-equal parts during block `b`; the K-types' kernels
/// [`split`](Fetch::split) it a part a sub-block, so that the prefetches spread over the
/// panel's work instead of coming in bursts (at one row, a burst a block filled the core's
/// line fill buffers and held up the loads of the panel in hand: 10-40% slower).
#[derive(Clone, Copy)]
struct Fetch {
    at: *const u8,
    len: usize,
    nb: usize,
}

impl Fetch {
    /// The same bytes in `s` times as many parts (fetched a part a sub-block).
    #[inline(always)]
    fn split(self, s: usize) -> Fetch {
        Fetch {
            nb: self.nb * s,
            ..self
        }
    }

    /// Fetches part `b` (one prefetch a cache line; a prefetch never faults, and the
    /// addresses are formed with `wrapping_add`, never dereferenced).
    #[inline(always)]
    fn part(self, b: usize) {
        if self.len == 0 {
            return;
        }
        let (from, to) = (self.len * b / self.nb, self.len * (b + 1) / self.nb);
        // (every line: one line in two, counting on the L2's adjacent-line prefetcher for
        // the other, streamed 10-30% slower at one row)
        let mut at = from & !63;
        while at < to {
            // SAFETY: `prefetcht1` (SSE, part of x86-64) reads nothing into the program
            // and cannot fault.
            unsafe { _mm_prefetch::<_MM_HINT_T1>(self.at.wrapping_add(at).cast()) };
            at += 64;
        }
    }
}

/// 64 bytes at `p`.
///
/// # Safety
/// `p .. p + 64` is readable.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
#[inline]
unsafe fn load(p: *const u8) -> __m512i {
    _mm512_loadu_si512(p.cast())
}

/// The 4 bytes at `p` (4 int8 inputs) in every i32 lane (an embedded broadcast of
/// `vpdpbusd`).
///
/// # Safety
/// `p .. p + 4` is readable.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
#[inline]
pub(super) unsafe fn quad(p: *const i8) -> __m512i {
    _mm512_set1_epi32(p.cast::<i32>().read_unaligned())
}

/// 16 fp16 at `p` widened to f32.
///
/// # Safety
/// `p .. p + 32` is readable.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
#[inline]
unsafe fn halves(p: *const u8) -> __m512 {
    _mm512_cvtph_ps(_mm256_loadu_si256(p.cast()))
}

/// `fma(f32(s), d * dx, acc)` lane by lane (the portable order).
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
#[inline]
unsafe fn scaled(acc: __m512, s: __m512, d: __m512, dx: f32) -> __m512 {
    _mm512_fmadd_ps(s, _mm512_mul_ps(d, _mm512_set1_ps(dx)), acc)
}

/// Stores `R` rows of sums.
///
/// # Safety
/// `out .. out + R` rows of 16 f32 are writable.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
#[inline]
unsafe fn store<const R: usize>(out: *mut [f32; PANEL], acc: &[__m512; R]) {
    for (i, v) in acc.iter().enumerate() {
        _mm512_storeu_ps(out.add(i).cast(), *v);
    }
}

/// The 32-weight types (`K`: the type's number, as `QType::Q8_0 as u8`), `R` rows.
///
/// # Safety
/// The CPU has AVX-512 F, BW and VNNI; `w` points at one packed panel of `nb` blocks of the
/// type; `a` at `R * nb` activation blocks (row `i`'s block `b` at `i * nb + b`); `out` at
/// `R` writable rows of 16 f32.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
unsafe fn blocks32<const R: usize, const K: u8>(
    w: *const u8,
    nb: usize,
    a: *const A32,
    out: *mut [f32; PANEL],
    pf: Fetch,
) {
    let qt = QType::ALL[K as usize];
    let st = stream_starts(qt, nb);
    let (ds, ms) = factor_streams(qt);
    let code_bytes = if K == QType::Q8_0 as u8 { 512 } else { 256 };
    let five = K == QType::Q5_0 as u8 || K == QType::Q5_1 as u8;
    // one or two rows: two chains of `vpdpbusd` a row (their latency, not their rate,
    // bounds a single chain)
    let split = R <= 2;
    let m4 = _mm512_set1_epi8(0x0F);
    let bit4 = _mm512_set1_epi8(0x10);
    // IQ4_NL's or MXFP4's codes (value + 128) by index, in each 128-bit lane for `vpshufb`
    let table = _mm512_broadcast_i32x4(_mm_loadu_si128(table_codes(qt).as_ptr().cast()));
    let mut acc = [_mm512_setzero_ps(); R];
    for b in 0..nb {
        pf.part(b);
        // (b < nb: every offset below stays inside stream `s`'s `nb` blocks, the sizes of
        // `packing::streams`; row i's block b is inside `a`'s R * nb blocks)
        let ab: [*const A32; R] = std::array::from_fn(|i| a.add(i * nb + b));
        let mut s: [__m512i; R] = std::array::from_fn(|i| _mm512_set1_epi32((*ab[i]).init));
        let mut s_odd = [_mm512_setzero_si512(); R];
        let codes = w.add(st[0] + b * code_bytes);
        if K == QType::Q8_0 as u8 {
            for q in 0..8 {
                let c = load(codes.add(64 * q));
                for i in 0..R {
                    let x = quad((*ab[i]).qs.as_ptr().add(4 * q));
                    if split && q % 2 == 1 {
                        s_odd[i] = _mm512_dpbusd_epi32(s_odd[i], c, x);
                    } else {
                        s[i] = _mm512_dpbusd_epi32(s[i], c, x);
                    }
                }
            }
        } else {
            // fifth bits (Q5_0, Q5_1): bit v of a byte for quad v
            let h = if five {
                load(w.add(st[1] + 64 * b))
            } else {
                _mm512_setzero_si512()
            };
            for p in 0..4 {
                let v = load(codes.add(64 * p));
                let mut lo = _mm512_and_si512(v, m4);
                let mut hi = _mm512_and_si512(_mm512_srli_epi16::<4>(v), m4);
                if five {
                    // quads 2 p and 2 p + 1: 16 added where bit 2 p / 2 p + 1 of h is set
                    // (a byte test into a mask and a masked add: no shift competes with
                    // `vpdpbusd` for its port)
                    let k_lo = _mm512_test_epi8_mask(h, _mm512_set1_epi8(1 << (2 * p)));
                    let k_hi = _mm512_test_epi8_mask(h, _mm512_set1_epi8(1 << (2 * p + 1)));
                    lo = _mm512_mask_add_epi8(lo, k_lo, lo, bit4);
                    hi = _mm512_mask_add_epi8(hi, k_hi, hi, bit4);
                } else if K == QType::IQ4_NL as u8 || K == QType::MXFP4 as u8 {
                    lo = _mm512_shuffle_epi8(table, lo);
                    hi = _mm512_shuffle_epi8(table, hi);
                }
                for i in 0..R {
                    let qs = (*ab[i]).qs.as_ptr().add(8 * p);
                    s[i] = _mm512_dpbusd_epi32(s[i], lo, quad(qs));
                    if split {
                        s_odd[i] = _mm512_dpbusd_epi32(s_odd[i], hi, quad(qs.add(4)));
                    } else {
                        s[i] = _mm512_dpbusd_epi32(s[i], hi, quad(qs.add(4)));
                    }
                }
            }
        }
        let d = halves(w.add(st[ds] + 32 * b));
        for i in 0..R {
            let si = if split {
                _mm512_add_epi32(s[i], s_odd[i])
            } else {
                s[i]
            };
            acc[i] = scaled(acc[i], _mm512_cvtepi32_ps(si), d, (*ab[i]).d);
        }
        if let Some(ms) = ms {
            let m = halves(w.add(st[ms] + 32 * b));
            for i in 0..R {
                acc[i] = _mm512_fmadd_ps(m, _mm512_set1_ps((*ab[i]).sd), acc[i]);
            }
        }
    }
    store::<R>(out, &acc);
}

/// `a | (b & c)` bitwise.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
#[inline]
unsafe fn or_and(a: __m512i, b: __m512i, c: __m512i) -> __m512i {
    _mm512_ternarylogic_epi32::<0xF8>(a, b, c)
}

/// The largest magnitude of the sum of 4 of Q4_K's sub-block products `sc[j] * t[j]` (codes
/// up to 15, inputs up to 127, 32 a sub-block, scales up to 63): under 2^24, so the f32
/// sums of sub-blocks 0-3 and of 4-7 are exact (every fused multiply-add on the way too), and
/// their f32 sum rounds once, as `f32(S)` of the block's i32 sum does. That is how the
/// register kernels take Q4_K's block sum without an integer multiply. Q5_K's halves may
/// pass 2^24 (codes up to 31), so its sum is an i32.
pub(super) const Q4K_HALF_MAX: i64 = 4 * 15 * 127 * 32 * 63;

/// Q4_K (`Q5` false) or Q5_K, `R` rows.
///
/// # Safety
/// As [`blocks32`], with [`A256`] activation blocks.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
unsafe fn q45k<const R: usize, const Q5: bool>(
    w: *const u8,
    nb: usize,
    a: *const A256,
    out: *mut [f32; PANEL],
    pf: Fetch,
) {
    let st = stream_starts(if Q5 { QType::Q5_K } else { QType::Q4_K }, nb);
    // (stream numbers: nibbles, [fifth bits], sc, mins, d, dmin)
    let (qh, sc, mins, dd, dmin) = if Q5 {
        (st[1], st[2], st[3], st[4], st[5])
    } else {
        (0, st[1], st[2], st[3], st[4])
    };
    let split = R <= 2;
    let m4 = _mm512_set1_epi8(0x0F);
    let bit4 = _mm512_set1_epi8(0x10);
    let pf = pf.split(8);
    let mut acc = [_mm512_setzero_ps(); R];
    for b in 0..nb {
        // (offsets inside each stream's `nb` blocks and `a`'s R * nb blocks, as in blocks32)
        let ab: [*const A256; R] = std::array::from_fn(|i| a.add(i * nb + b));
        let nib = w.add(st[0] + 2048 * b);
        // the block's sum: Q5_K's in i32, Q4_K's as two exact f32 halves (`first`, `s1f`)
        let mut s1 = [_mm512_setzero_si512(); R];
        let (mut first, mut s1f) = ([_mm512_setzero_ps(); R], [_mm512_setzero_ps(); R]);
        for j in 0..8 {
            if !Q5 && j == 4 {
                (first, s1f) = (s1f, [_mm512_setzero_ps(); R]);
            }
            pf.part(8 * b + j);
            let mut t = [_mm512_setzero_si512(); R];
            let mut t_hi = [_mm512_setzero_si512(); R];
            // fifth bits of sub-block j: bit v of a byte for quad v
            let mut h = if Q5 {
                load(w.add(qh + 512 * b + 64 * j))
            } else {
                _mm512_setzero_si512()
            };
            for l in 0..4 {
                let v = load(nib.add(64 * (4 * j + l)));
                let mut lo = _mm512_and_si512(v, m4);
                let mut hi = _mm512_and_si512(_mm512_srli_epi16::<4>(v), m4);
                if Q5 {
                    // quads 2 l and 2 l + 1: bits 0 and 1 of h (shifted down 2 l so far)
                    lo = or_and(lo, _mm512_slli_epi16::<4>(h), bit4);
                    hi = or_and(hi, _mm512_slli_epi16::<3>(h), bit4);
                    h = _mm512_srli_epi16::<2>(h);
                }
                for i in 0..R {
                    let qs = (*ab[i]).qs.as_ptr().add(32 * j + 8 * l);
                    t[i] = _mm512_dpbusd_epi32(t[i], lo, quad(qs));
                    if split {
                        t_hi[i] = _mm512_dpbusd_epi32(t_hi[i], hi, quad(qs.add(4)));
                    } else {
                        t[i] = _mm512_dpbusd_epi32(t[i], hi, quad(qs.add(4)));
                    }
                }
            }
            let scale = _mm512_cvtepu8_epi32(_mm_loadu_si128(w.add(sc + 128 * b + 16 * j).cast()));
            let scale_ps = _mm512_cvtepi32_ps(scale);
            for i in 0..R {
                let ti = if split {
                    _mm512_add_epi32(t[i], t_hi[i])
                } else {
                    t[i]
                };
                if Q5 {
                    s1[i] = _mm512_add_epi32(s1[i], _mm512_mullo_epi32(ti, scale));
                } else {
                    const { assert!(Q4K_HALF_MAX < 1 << 24) }; // (exact)
                    s1f[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ti), scale_ps, s1f[i]);
                }
            }
        }
        let mut s2 = [_mm512_setzero_si512(); R];
        for p in 0..4 {
            let mp =
                _mm512_cvtepu8_epi16(_mm256_loadu_si256(w.add(mins + 128 * b + 32 * p).cast()));
            for i in 0..R {
                let pair = sum_pair(&(*ab[i]).sum32, p);
                s2[i] = dpwssd(s2[i], mp, _mm512_set1_epi32(pair));
            }
        }
        let d = halves(w.add(dd + 32 * b));
        let e = halves(w.add(dmin + 32 * b));
        for i in 0..R {
            let dx = (*ab[i]).d;
            let s1 = if Q5 {
                _mm512_cvtepi32_ps(s1[i])
            } else {
                _mm512_add_ps(first[i], s1f[i])
            };
            acc[i] = scaled(acc[i], s1, d, dx);
            let edx = _mm512_mul_ps(e, _mm512_set1_ps(dx));
            acc[i] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(s2[i]), edx, acc[i]);
        }
    }
    store::<R>(out, &acc);
}

/// Q6_K, `R` rows.
///
/// # Safety
/// As [`blocks32`], with [`A256`] activation blocks.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
unsafe fn q6k<const R: usize>(
    w: *const u8,
    nb: usize,
    a: *const A256,
    out: *mut [f32; PANEL],
    pf: Fetch,
) {
    let st = stream_starts(QType::Q6_K, nb);
    let split = R <= 2;
    let m4 = _mm512_set1_epi8(0x0F);
    let bits45 = _mm512_set1_epi8(0x30);
    let pf = pf.split(16);
    let mut acc = [_mm512_setzero_ps(); R];
    for b in 0..nb {
        // (offsets inside each stream's `nb` blocks and `a`'s R * nb blocks, as in blocks32)
        let ab: [*const A256; R] = std::array::from_fn(|i| a.add(i * nb + b));
        let nib = w.add(st[0] + 2048 * b);
        let mut s1 = [_mm512_setzero_si512(); R];
        for j in 0..16 {
            pf.part(16 * b + j);
            // sub-block j (16 inputs, quads 0..4): nibble rows 2 j, 2 j + 1, bit pairs row j
            let h = load(w.add(st[1] + 1024 * b + 64 * j));
            let v0 = load(nib.add(128 * j));
            let v1 = load(nib.add(128 * j + 64));
            let c = [
                or_and(_mm512_and_si512(v0, m4), _mm512_slli_epi16::<4>(h), bits45),
                or_and(
                    _mm512_and_si512(_mm512_srli_epi16::<4>(v0), m4),
                    _mm512_slli_epi16::<2>(h),
                    bits45,
                ),
                or_and(_mm512_and_si512(v1, m4), h, bits45),
                or_and(
                    _mm512_and_si512(_mm512_srli_epi16::<4>(v1), m4),
                    _mm512_srli_epi16::<2>(h),
                    bits45,
                ),
            ];
            let scale =
                _mm512_cvtepi8_epi32(_mm_loadu_si128(w.add(st[2] + 256 * b + 16 * j).cast()));
            for i in 0..R {
                let qs = (*ab[i]).qs.as_ptr().add(16 * j);
                let mut t = _mm512_set1_epi32((*ab[i]).neg32_sum16[j]);
                let mut t_odd = _mm512_setzero_si512();
                for (v, c) in c.iter().enumerate() {
                    if split && v % 2 == 1 {
                        t_odd = _mm512_dpbusd_epi32(t_odd, *c, quad(qs.add(4 * v)));
                    } else {
                        t = _mm512_dpbusd_epi32(t, *c, quad(qs.add(4 * v)));
                    }
                }
                if split {
                    t = _mm512_add_epi32(t, t_odd);
                }
                s1[i] = _mm512_add_epi32(s1[i], _mm512_mullo_epi32(t, scale));
            }
        }
        let d = halves(w.add(st[3] + 32 * b));
        for i in 0..R {
            acc[i] = scaled(acc[i], _mm512_cvtepi32_ps(s1[i]), d, (*ab[i]).d);
        }
    }
    store::<R>(out, &acc);
}

/// `v` shifted right by `n` bits in each 16-bit lane (`n` known once unrolled).
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
#[inline]
fn srl16(v: __m512i, n: usize) -> __m512i {
    _mm512_srl_epi16(v, _mm_cvtsi32_si128(n as i32))
}

/// `v` shifted left by `n` bits in each 16-bit lane.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
#[inline]
fn sll16(v: __m512i, n: usize) -> __m512i {
    _mm512_sll_epi16(v, _mm_cvtsi32_si128(n as i32))
}

/// Bit `k` (< 8) of each byte of `h` at bit 2 (the other bits anything): a 16-bit shift
/// moves the bits of both bytes of a lane alike, and bit 2 of either byte comes from its own
/// byte.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
#[inline]
fn bit_at2(h: __m512i, k: usize) -> __m512i {
    if k >= 2 {
        srl16(h, k - 2)
    } else {
        sll16(h, 2 - k)
    }
}

/// IQ4_XS's codes (value + 128) by index, in each 128-bit lane (a `vpshufb` table).
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
#[inline]
pub(crate) fn iq4_table() -> __m512i {
    let t: [u8; 16] = std::array::from_fn(|i| super::portable::iq4_code(i as u8));
    // SAFETY: `t` is 16 readable bytes.
    _mm512_broadcast_i32x4(unsafe { _mm_loadu_si128(t.as_ptr().cast()) })
}

/// Sub-blocks and quads a sub-block of Q3_K, Q2_K and IQ4_XS.
pub(crate) const fn small_shape(qt: QType) -> (usize, usize) {
    match qt {
        QType::IQ4_XS => (8, 8),
        _ => (16, 4),
    }
}

/// The stream numbers of the sub-block scales and of `d` (Q3_K, Q2_K, IQ4_XS).
pub(crate) const fn small_streams(qt: QType) -> (usize, usize) {
    match qt {
        QType::Q3_K => (2, 3),
        _ => (1, 2),
    }
}

/// The code vectors of sub-block `j` of block `b` (Q3_K, Q2_K: 4 quads; IQ4_XS: 8) of the
/// panel `w` (streams at `st`); `table`: [`iq4_table`].
///
/// # Safety
/// The CPU has AVX-512 F, BW and VNNI; `w` points at one packed panel of `nb > b` blocks of
/// `qt` whose streams start at `st`; `j` is below the type's sub-blocks.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
#[inline]
pub(crate) unsafe fn small_codes(
    qt: QType,
    w: *const u8,
    st: &[usize; 6],
    b: usize,
    j: usize,
    table: __m512i,
) -> [__m512i; 8] {
    let mut c = [_mm512_setzero_si512(); 8];
    // (offsets inside each stream's `nb` blocks: the sizes of `packing::streams`)
    if qt == QType::IQ4_XS {
        let m4 = _mm512_set1_epi8(0x0F);
        for l in 0..4 {
            let v = load(w.add(st[0] + 2048 * b + 64 * (4 * j + l)));
            c[2 * l] = _mm512_shuffle_epi8(table, _mm512_and_si512(v, m4));
            let hi = _mm512_and_si512(_mm512_srli_epi16::<4>(v), m4);
            c[2 * l + 1] = _mm512_shuffle_epi8(table, hi);
        }
        return c;
    }
    let m3 = _mm512_set1_epi8(3);
    let v = load(w.add(st[0] + 1024 * b + 64 * j));
    for (q, c) in c.iter_mut().take(4).enumerate() {
        *c = _mm512_and_si512(srl16(v, 2 * q), m3);
    }
    if qt == QType::Q3_K {
        // third bits: bit 4 (j % 2) + q of row j / 2 (the odd sub-block's moved down
        // first: the shifts below are then constants)
        let mut h = load(w.add(st[1] + 512 * b + 64 * (j / 2)));
        if j % 2 == 1 {
            h = _mm512_srli_epi16::<4>(h);
        }
        let bit2 = _mm512_set1_epi8(4);
        for (q, c) in c.iter_mut().take(4).enumerate() {
            *c = or_and(*c, bit_at2(h, q), bit2);
        }
    }
    c
}

/// Sub-block `j`'s scales of block `b` as 16 f32 (Q2_K: the low nibbles).
///
/// # Safety
/// As [`small_codes`].
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
#[inline]
pub(crate) unsafe fn small_scale(
    qt: QType,
    w: *const u8,
    st: &[usize; 6],
    b: usize,
    j: usize,
) -> __m512 {
    let (subs, _) = small_shape(qt);
    let (sc, _) = small_streams(qt);
    let v = _mm_loadu_si128(w.add(st[sc] + 16 * subs * b + 16 * j).cast());
    if qt == QType::Q2_K {
        let u = _mm512_and_si512(_mm512_cvtepu8_epi32(v), _mm512_set1_epi32(0xF));
        _mm512_cvtepi32_ps(u)
    } else {
        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(v))
    }
}

/// Q2_K's mins of sub-blocks `2 p`, `2 p + 1` of block `b` as i16 pairs (a lane a column).
///
/// # Safety
/// As [`small_codes`], `qt` Q2_K and `p < 8`.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
#[inline]
pub(crate) unsafe fn q2_min_pair(w: *const u8, st: &[usize; 6], b: usize, p: usize) -> __m512i {
    let at = w.add(st[1] + 256 * b + 32 * p);
    let lo = _mm512_srli_epi32::<4>(_mm512_cvtepu8_epi32(_mm_loadu_si128(at.cast())));
    let hi = _mm512_srli_epi32::<4>(_mm512_cvtepu8_epi32(_mm_loadu_si128(at.add(16).cast())));
    _mm512_or_si512(lo, _mm512_slli_epi32::<16>(hi))
}

/// The start of sub-block `j`'s integer sum (Q3_K: `-4 sum16`, IQ4_XS: `-128 sum32`, Q2_K:
/// 0).
#[inline(always)]
fn small_init(qt: QType, a: &A256, j: usize) -> i32 {
    match qt {
        QType::Q3_K => -4 * i32::from(a.sum16[j]),
        QType::IQ4_XS => -128 * i32::from(a.sum32[j]),
        _ => 0,
    }
}

/// Q3_K, Q2_K or IQ4_XS (`K`: the type's number), `R` rows.
///
/// # Safety
/// As [`blocks32`], with [`A256`] activation blocks.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
unsafe fn small_k<const R: usize, const K: u8>(
    w: *const u8,
    nb: usize,
    a: *const A256,
    out: *mut [f32; PANEL],
    pf: Fetch,
) {
    let qt = QType::ALL[K as usize];
    let st = stream_starts(qt, nb);
    let (subs, per) = small_shape(qt);
    let (_, dd) = small_streams(qt);
    let split = R <= 2;
    let table = iq4_table();
    let pf = pf.split(8);
    let mut acc = [_mm512_setzero_ps(); R];
    for b in 0..nb {
        // (offsets inside each stream's `nb` blocks and `a`'s R * nb blocks, as in blocks32)
        let ab: [*const A256; R] = std::array::from_fn(|i| a.add(i * nb + b));
        let mut s1 = [_mm512_setzero_ps(); R];
        for j in 0..subs {
            // 8 parts a block, as Q4_K's (a part every sub-block of 16: ~8% slower at
            // one row, hot)
            if j % (subs / 8) == 0 {
                pf.part(8 * b + j / (subs / 8));
            }
            let c = small_codes(qt, w, &st, b, j, table);
            let scale = small_scale(qt, w, &st, b, j);
            for i in 0..R {
                let qs = (*ab[i]).qs.as_ptr().add(4 * per * j);
                let mut t = _mm512_set1_epi32(small_init(qt, &*ab[i], j));
                let mut t_odd = _mm512_setzero_si512();
                for (v, c) in c.iter().enumerate().take(per) {
                    if split && v % 2 == 1 {
                        t_odd = _mm512_dpbusd_epi32(t_odd, *c, quad(qs.add(4 * v)));
                    } else {
                        t = _mm512_dpbusd_epi32(t, *c, quad(qs.add(4 * v)));
                    }
                }
                if split {
                    t = _mm512_add_epi32(t, t_odd);
                }
                // (exact product, < 2^24: rounds as the portable `s1 += t * sc`)
                s1[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), scale, s1[i]);
            }
        }
        let d = halves(w.add(st[dd] + 32 * b));
        for i in 0..R {
            acc[i] = scaled(acc[i], s1[i], d, (*ab[i]).d);
        }
        if qt == QType::Q2_K {
            let mut s2 = [_mm512_setzero_si512(); R];
            for p in 0..8 {
                let mp = q2_min_pair(w, &st, b, p);
                for i in 0..R {
                    let pair = sum_pair(&(*ab[i]).sum16, p);
                    s2[i] = dpwssd(s2[i], mp, _mm512_set1_epi32(pair));
                }
            }
            let e = halves(w.add(st[3] + 32 * b));
            for i in 0..R {
                let edx = _mm512_mul_ps(e, _mm512_set1_ps((*ab[i]).d));
                acc[i] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(s2[i]), edx, acc[i]);
            }
        }
    }
    store::<R>(out, &acc);
}
