//! The panel products on AVX2 (with FMA and F16C), for CPUs without AVX-512 VNNI: the same
//! packed layout and the same formula as [`super::vnni`], 8 output columns in the 8 i32
//! lanes of a ymm register (a panel in two halves), up to [`ROWS`] rows at a time.
//!
//! There is no `vpdpbusd`: `vpmaddubsw` multiplies the unsigned codes by the int8 inputs and
//! adds pairs into i16 with signed saturation, so partial sums are widened (`vpmaddwd` by
//! ones) before they could saturate: a pair is at most 2 * 15 * 127 = 3810 for 4-bit codes
//! (8 quads summed in i16: 30480), 7874 for Q5_K, Q5_0 and Q5_1 (4 quads), 16002 for Q6_K
//! (2 quads). Q8_0's codes `w + 128` would saturate, so its quads take `|w|` times `sign(w) *
//! x` (`vpsignb`; a pair is at most 2 * 128 * 127 = 32512) and sum `w * x` directly, the
//! integer VNNI's `-128 * sum(x) + sum((w + 128) * x)` comes to; IQ4_NL's quads do the same
//! with its table values (looked up by index with `vpshufb`, `|w| <= 127`), and so do
//! IQ4_XS's, widened quad by quad. Q3_K's and Q2_K's codes (at most 7: 1778 a pair) are
//! summed a sub-block of 4 quads. Every integer sum is the same exact value as on the other
//! paths and every f32 operation the same, so the results are the same bits.

use std::arch::x86_64::*;

use super::act::{sum_pair, A256, A32};
use super::blocks::table_values;
use super::packing::{factor_streams, panel_block_bytes, stream_starts, PANEL};
use super::{ActRows, PanelFn, QType, MAX_ROWS};

/// Rows a kernel call takes (16 ymm registers: three or four a row).
const ROWS: usize = 4;

/// Whether the CPU runs these kernels (AVX2, FMA and F16C).
pub(crate) fn available() -> bool {
    is_x86_feature_detected!("avx2")
        && is_x86_feature_detected!("fma")
        && is_x86_feature_detected!("f16c")
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

/// The bytes a kernel fetches while it runs (as `vnni::Fetch`): `len` bytes from `at` (none
/// when `len` is 0), the `b`th of `nb` near-equal parts during block (or, once
/// [`split`](Fetch::split), sub-block) `b`, every cache line, into the L1 (`prefetcht0`). On
/// AMD Zen 3 (one core, weights past the L3, one row) fetching one line in two into the L2,
/// counting on an adjacent-line prefetcher for the other (as Intel's L2 pairs lines), left
/// half the lines to demand misses: Q4_K 8960 x 1536 took 1.60-1.71 ms; every line, a part
/// a sub-block, 1.01-1.07 ms; into the L1 0.76-0.91 ms (4 to 64 rows faster or level;
/// docs/benchmarks.md, "AMD Zen 3, AVX2 only").
#[derive(Clone, Copy)]
struct Fetch {
    at: *const u8,
    len: usize,
    nb: usize,
}

impl Fetch {
    const NONE: Fetch = Fetch {
        at: std::ptr::null(),
        len: 0,
        nb: 1,
    };

    /// The same bytes in `s` times as many parts (fetched a part a sub-block).
    #[inline(always)]
    fn split(self, s: usize) -> Fetch {
        Fetch {
            nb: self.nb * s,
            ..self
        }
    }

    #[inline(always)]
    fn part(self, b: usize) {
        if self.len == 0 {
            return;
        }
        let (from, to) = (self.len * b / self.nb, self.len * (b + 1) / self.nb);
        let mut at = from & !63;
        while at < to {
            // SAFETY: `prefetcht0` (SSE, part of x86-64) reads nothing into the program
            // and cannot fault; the address is formed with `wrapping_add`.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(self.at.wrapping_add(at).cast()) };
            at += 64;
        }
    }
}

/// `out[i][c]` as `vnni::panel`, in halves of 8 columns and groups of up to [`ROWS`] rows.
/// Panics on a length that does not match, or where [`available`] is false.
fn panel<const T: u8>(
    w: &[u8],
    next: &[u8],
    nb: usize,
    acts: ActRows<'_>,
    out: &mut [[f32; PANEL]],
) {
    let qt = QType::ALL[T as usize];
    let r = out.len();
    assert!(available(), "AVX2, FMA and F16C are not available");
    assert!((1..=MAX_ROWS).contains(&r), "1 to {MAX_ROWS} rows, not {r}");
    assert_eq!(
        w.len(),
        nb * panel_block_bytes(qt),
        "one panel of {nb} blocks"
    );
    match (qt, acts) {
        (qt, ActRows::A32(a)) if qt.block() == 32 => {
            assert_eq!(a.len(), r * nb, "{r} rows of {nb} blocks")
        }
        (
            QType::Q4_K | QType::Q5_K | QType::Q6_K | QType::Q3_K | QType::Q2_K | QType::IQ4_XS,
            ActRows::A256(a),
        ) => {
            assert_eq!(a.len(), r * nb, "{r} rows of {nb} blocks")
        }
        _ => panic!("{}: wrong activation format", qt.name()),
    }
    for h in 0..2 {
        for i0 in (0..r).step_by(ROWS) {
            let rows = (r - i0).min(ROWS);
            // the first pass fetches the next panels
            let pf = if h == 0 && i0 == 0 {
                Fetch {
                    at: next.as_ptr(),
                    len: next.len(),
                    nb,
                }
            } else {
                Fetch::NONE
            };
            let o = out[i0..].as_mut_ptr();
            macro_rules! rows {
                ($f:ident, $a:expr $(, $c:expr)?) => {
                    // SAFETY: the CPU has AVX2, FMA and F16C (asserted above); `w` holds one
                    // panel of `nb` blocks of `qt`, the activations hold `r * nb` blocks
                    // (both asserted above), so rows `i0 .. i0 + rows` start at block
                    // `i0 * nb`; `o` points at rows `i0 ..` of `out`, `rows` of them: the
                    // contract of the kernel of `rows` rows; `h` < 2.
                    unsafe {
                        match rows {
                            1 => $f::<1 $(, $c)?>(w.as_ptr(), nb, $a, o, h, pf),
                            2 => $f::<2 $(, $c)?>(w.as_ptr(), nb, $a, o, h, pf),
                            3 => $f::<3 $(, $c)?>(w.as_ptr(), nb, $a, o, h, pf),
                            _ => $f::<4 $(, $c)?>(w.as_ptr(), nb, $a, o, h, pf),
                        }
                    }
                };
            }
            match acts {
                ActRows::A32(a) => {
                    let a = a[i0 * nb..].as_ptr();
                    by_type32!(qt, rows!(blocks32, a))
                }
                ActRows::A256(a) => {
                    let a = a[i0 * nb..].as_ptr();
                    match qt {
                        QType::Q4_K => rows!(q45k, a, false),
                        QType::Q5_K => rows!(q45k, a, true),
                        QType::Q3_K => rows!(small_k, a, { QType::Q3_K as u8 }),
                        QType::Q2_K => rows!(small_k, a, { QType::Q2_K as u8 }),
                        QType::IQ4_XS => rows!(small_k, a, { QType::IQ4_XS as u8 }),
                        _ => rows!(q6k, a),
                    }
                }
            }
        }
    }
}

/// 32 bytes at `p`.
///
/// # Safety
/// `p .. p + 32` is readable.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn load(p: *const u8) -> __m256i {
    _mm256_loadu_si256(p.cast())
}

/// The 4 bytes at `p` in every i32 lane.
///
/// # Safety
/// `p .. p + 4` is readable.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn quad(p: *const i8) -> __m256i {
    _mm256_set1_epi32(p.cast::<i32>().read_unaligned())
}

/// 8 fp16 at `p` widened to f32.
///
/// # Safety
/// `p .. p + 16` is readable.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn halves(p: *const u8) -> __m256 {
    _mm256_cvtph_ps(_mm_loadu_si128(p.cast()))
}

/// i16 pairs summed into i32 lanes.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn widen(v: __m256i) -> __m256i {
    _mm256_madd_epi16(v, _mm256_set1_epi16(1))
}

/// Each i32 lane's scale `v` (|v| < 2^15) as the i16 pair `(v, v)`: `vpmaddwd` by it
/// multiplies the pair sums of an i16 lane pair by the scale and adds them, exactly.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn scale_pairs(v: __m256i) -> __m256i {
    _mm256_or_si256(
        _mm256_and_si256(v, _mm256_set1_epi32(0xFFFF)),
        _mm256_slli_epi32::<16>(v),
    )
}

/// `a | (b & c)` bitwise.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn or_and(a: __m256i, b: __m256i, c: __m256i) -> __m256i {
    _mm256_or_si256(a, _mm256_and_si256(b, c))
}

/// Stores `R` rows of 8 sums into columns `8 h ..` of `out`.
///
/// # Safety
/// `out .. out + R` rows of 16 f32 are writable; `h < 2`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn store<const R: usize>(out: *mut [f32; PANEL], h: usize, acc: &[__m256; R]) {
    for (i, v) in acc.iter().enumerate() {
        _mm256_storeu_ps(out.add(i).cast::<f32>().add(8 * h), *v);
    }
}

/// The 32-weight types (`K`: the type's number, as `QType::Q8_0 as u8`), `R` rows,
/// columns `8 h ..`.
///
/// # Safety
/// The CPU has AVX2, FMA and F16C; `w` points at one packed panel of `nb` blocks of the
/// type; `a` at `R * nb` activation blocks (row `i`'s block `b` at `i * nb + b`); `out` at
/// `R` writable rows of 16 f32; `h < 2`.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn blocks32<const R: usize, const K: u8>(
    w: *const u8,
    nb: usize,
    a: *const A32,
    out: *mut [f32; PANEL],
    h: usize,
    pf: Fetch,
) {
    let qt = QType::ALL[K as usize];
    let st = stream_starts(qt, nb);
    let (ds, ms) = factor_streams(qt);
    let code_bytes = if K == QType::Q8_0 as u8 { 512 } else { 256 };
    let five = K == QType::Q5_0 as u8 || K == QType::Q5_1 as u8;
    let m4 = _mm256_set1_epi8(0x0F);
    let bit4 = _mm256_set1_epi8(0x10);
    let flip = _mm256_set1_epi8(-128);
    // IQ4_NL's or MXFP4's values (int8) by index, in both 128-bit lanes for `vpshufb`
    let table = _mm256_broadcastsi128_si256(_mm_loadu_si128(table_values(qt).as_ptr().cast()));
    let mut acc = [_mm256_setzero_ps(); R];
    for b in 0..nb {
        pf.part(b);
        // (b < nb and h < 2: every offset below stays inside its stream's `nb` blocks, the
        // sizes of `packing::streams`; row i's block b is inside `a`'s R * nb blocks)
        let ab: [*const A32; R] = std::array::from_fn(|i| a.add(i * nb + b));
        let codes = w.add(st[0] + b * code_bytes + 32 * h);
        let mut s = [_mm256_setzero_si256(); R];
        if K == QType::Q8_0 as u8 {
            for q in 0..8 {
                // w = u ^ 0x80: |w| times sign(w) * x, exactly sum(w * x)
                let wv = _mm256_xor_si256(load(codes.add(64 * q)), flip);
                let aw = _mm256_abs_epi8(wv);
                for i in 0..R {
                    let x = _mm256_sign_epi8(quad((*ab[i]).qs.as_ptr().add(4 * q)), wv);
                    s[i] = _mm256_add_epi32(s[i], widen(_mm256_maddubs_epi16(aw, x)));
                }
            }
        } else if K == QType::IQ4_NL as u8 || K == QType::MXFP4 as u8 {
            // the table's int8 values w: |w| times sign(w) * x as Q8_0 (|w| <= 127: a pair
            // is at most 32258, widened a quad), exactly sum(w * x) = init + sum(u * x)
            for p in 0..4 {
                let v = load(codes.add(64 * p));
                let lo = _mm256_shuffle_epi8(table, _mm256_and_si256(v, m4));
                let hi =
                    _mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_srli_epi16::<4>(v), m4));
                let (alo, ahi) = (_mm256_abs_epi8(lo), _mm256_abs_epi8(hi));
                for i in 0..R {
                    let qs = (*ab[i]).qs.as_ptr().add(8 * p);
                    let t = _mm256_add_epi32(
                        widen(_mm256_maddubs_epi16(alo, _mm256_sign_epi8(quad(qs), lo))),
                        widen(_mm256_maddubs_epi16(
                            ahi,
                            _mm256_sign_epi8(quad(qs.add(4)), hi),
                        )),
                    );
                    s[i] = _mm256_add_epi32(s[i], t);
                }
            }
        } else {
            // fifth bits (Q5_0, Q5_1): bit v of a byte for quad v
            let mut hb = if five {
                load(w.add(st[1] + 64 * b + 32 * h))
            } else {
                _mm256_setzero_si256()
            };
            let mut s16 = [_mm256_setzero_si256(); R];
            for p in 0..4 {
                let v = load(codes.add(64 * p));
                let mut lo = _mm256_and_si256(v, m4);
                let mut hi = _mm256_and_si256(_mm256_srli_epi16::<4>(v), m4);
                if five {
                    lo = or_and(lo, _mm256_slli_epi16::<4>(hb), bit4);
                    hi = or_and(hi, _mm256_slli_epi16::<3>(hb), bit4);
                    hb = _mm256_srli_epi16::<2>(hb);
                }
                for i in 0..R {
                    let qs = (*ab[i]).qs.as_ptr().add(8 * p);
                    let t = _mm256_add_epi16(
                        _mm256_maddubs_epi16(lo, quad(qs)),
                        _mm256_maddubs_epi16(hi, quad(qs.add(4))),
                    );
                    s16[i] = _mm256_add_epi16(s16[i], t);
                }
                // 5-bit codes: 4 quads a widening (7874 a pair)
                if five && p % 2 == 1 {
                    for i in 0..R {
                        s[i] = _mm256_add_epi32(s[i], widen(s16[i]));
                        s16[i] = _mm256_setzero_si256();
                    }
                }
            }
            for i in 0..R {
                s[i] = _mm256_add_epi32(
                    _mm256_add_epi32(s[i], widen(s16[i])),
                    _mm256_set1_epi32((*ab[i]).init),
                );
            }
        }
        let d = halves(w.add(st[ds] + 32 * b + 16 * h));
        for i in 0..R {
            let dx = _mm256_set1_ps((*ab[i]).d);
            acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[i]), _mm256_mul_ps(d, dx), acc[i]);
        }
        if let Some(ms) = ms {
            let m = halves(w.add(st[ms] + 32 * b + 16 * h));
            for i in 0..R {
                acc[i] = _mm256_fmadd_ps(m, _mm256_set1_ps((*ab[i]).sd), acc[i]);
            }
        }
    }
    store::<R>(out, h, &acc);
}

/// Q4_K (`Q5` false) or Q5_K, `R` rows, columns `8 h ..`.
///
/// # Safety
/// As [`blocks32`], with [`A256`] activation blocks.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q45k<const R: usize, const Q5: bool>(
    w: *const u8,
    nb: usize,
    a: *const A256,
    out: *mut [f32; PANEL],
    h: usize,
    pf: Fetch,
) {
    let st = stream_starts(if Q5 { QType::Q5_K } else { QType::Q4_K }, nb);
    let (qh, sc, mins, dd, dmin) = if Q5 {
        (st[1], st[2], st[3], st[4], st[5])
    } else {
        (0, st[1], st[2], st[3], st[4])
    };
    let m4 = _mm256_set1_epi8(0x0F);
    let bit4 = _mm256_set1_epi8(0x10);
    let mut acc = [_mm256_setzero_ps(); R];
    let pf = pf.split(8);
    for b in 0..nb {
        // (offsets inside each stream's `nb` blocks and `a`'s R * nb blocks, as in blocks32)
        let ab: [*const A256; R] = std::array::from_fn(|i| a.add(i * nb + b));
        let nib = w.add(st[0] + 2048 * b + 32 * h);
        let mut s1 = [_mm256_setzero_si256(); R];
        for j in 0..8 {
            pf.part(8 * b + j);
            let scale = scale_pairs(_mm256_cvtepu8_epi32(_mm_loadl_epi64(
                w.add(sc + 128 * b + 16 * j + 8 * h).cast(),
            )));
            let mut hb = if Q5 {
                load(w.add(qh + 512 * b + 64 * j + 32 * h))
            } else {
                _mm256_setzero_si256()
            };
            let mut t16 = [_mm256_setzero_si256(); R];
            for l in 0..4 {
                let v = load(nib.add(64 * (4 * j + l)));
                let mut lo = _mm256_and_si256(v, m4);
                let mut hi = _mm256_and_si256(_mm256_srli_epi16::<4>(v), m4);
                if Q5 {
                    lo = or_and(lo, _mm256_slli_epi16::<4>(hb), bit4);
                    hi = or_and(hi, _mm256_slli_epi16::<3>(hb), bit4);
                    hb = _mm256_srli_epi16::<2>(hb);
                }
                for i in 0..R {
                    let qs = (*ab[i]).qs.as_ptr().add(32 * j + 8 * l);
                    let p = _mm256_add_epi16(
                        _mm256_maddubs_epi16(lo, quad(qs)),
                        _mm256_maddubs_epi16(hi, quad(qs.add(4))),
                    );
                    t16[i] = _mm256_add_epi16(t16[i], p);
                }
                // Q5_K: 4 quads a widening (7874 a pair)
                if Q5 && l == 1 {
                    for i in 0..R {
                        s1[i] = _mm256_add_epi32(s1[i], _mm256_madd_epi16(t16[i], scale));
                        t16[i] = _mm256_setzero_si256();
                    }
                }
            }
            for i in 0..R {
                s1[i] = _mm256_add_epi32(s1[i], _mm256_madd_epi16(t16[i], scale));
            }
        }
        let mut s2 = [_mm256_setzero_si256(); R];
        for p in 0..4 {
            let mp = _mm256_cvtepu8_epi16(_mm_loadu_si128(
                w.add(mins + 128 * b + 32 * p + 16 * h).cast(),
            ));
            for i in 0..R {
                let pair = sum_pair(&(*ab[i]).sum32, p);
                let m = _mm256_madd_epi16(mp, _mm256_set1_epi32(pair));
                s2[i] = _mm256_add_epi32(s2[i], m);
            }
        }
        let d = halves(w.add(dd + 32 * b + 16 * h));
        let e = halves(w.add(dmin + 32 * b + 16 * h));
        for i in 0..R {
            let dx = _mm256_set1_ps((*ab[i]).d);
            let s1f = _mm256_cvtepi32_ps(s1[i]);
            acc[i] = _mm256_fmadd_ps(s1f, _mm256_mul_ps(d, dx), acc[i]);
            let s2f = _mm256_cvtepi32_ps(s2[i]);
            acc[i] = _mm256_fnmadd_ps(s2f, _mm256_mul_ps(e, dx), acc[i]);
        }
    }
    store::<R>(out, h, &acc);
}

/// Q6_K, `R` rows, columns `8 h ..`.
///
/// # Safety
/// As [`blocks32`], with [`A256`] activation blocks.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q6k<const R: usize>(
    w: *const u8,
    nb: usize,
    a: *const A256,
    out: *mut [f32; PANEL],
    h: usize,
    pf: Fetch,
) {
    let st = stream_starts(QType::Q6_K, nb);
    let m4 = _mm256_set1_epi8(0x0F);
    let bits45 = _mm256_set1_epi8(0x30);
    let mut acc = [_mm256_setzero_ps(); R];
    let pf = pf.split(16);
    for b in 0..nb {
        // (offsets inside each stream's `nb` blocks and `a`'s R * nb blocks, as in blocks32)
        let ab: [*const A256; R] = std::array::from_fn(|i| a.add(i * nb + b));
        let nib = w.add(st[0] + 2048 * b + 32 * h);
        let mut s1 = [_mm256_setzero_si256(); R];
        for j in 0..16 {
            pf.part(16 * b + j);
            let hb = load(w.add(st[1] + 1024 * b + 64 * j + 32 * h));
            let v0 = load(nib.add(128 * j));
            let v1 = load(nib.add(128 * j + 64));
            let c = [
                or_and(_mm256_and_si256(v0, m4), _mm256_slli_epi16::<4>(hb), bits45),
                or_and(
                    _mm256_and_si256(_mm256_srli_epi16::<4>(v0), m4),
                    _mm256_slli_epi16::<2>(hb),
                    bits45,
                ),
                or_and(_mm256_and_si256(v1, m4), hb, bits45),
                or_and(
                    _mm256_and_si256(_mm256_srli_epi16::<4>(v1), m4),
                    _mm256_srli_epi16::<2>(hb),
                    bits45,
                ),
            ];
            let scale = _mm256_cvtepi8_epi32(_mm_loadl_epi64(
                w.add(st[2] + 256 * b + 16 * j + 8 * h).cast(),
            ));
            let pairs = scale_pairs(scale);
            for i in 0..R {
                let qs = (*ab[i]).qs.as_ptr().add(16 * j);
                // 2 quads a widening (16002 a pair)
                let p01 = _mm256_add_epi16(
                    _mm256_maddubs_epi16(c[0], quad(qs)),
                    _mm256_maddubs_epi16(c[1], quad(qs.add(4))),
                );
                let p23 = _mm256_add_epi16(
                    _mm256_maddubs_epi16(c[2], quad(qs.add(8))),
                    _mm256_maddubs_epi16(c[3], quad(qs.add(12))),
                );
                let offset = _mm256_mullo_epi32(_mm256_set1_epi32((*ab[i]).neg32_sum16[j]), scale);
                let t =
                    _mm256_add_epi32(_mm256_madd_epi16(p01, pairs), _mm256_madd_epi16(p23, pairs));
                s1[i] = _mm256_add_epi32(s1[i], _mm256_add_epi32(t, offset));
            }
        }
        let d = halves(w.add(st[3] + 32 * b + 16 * h));
        for i in 0..R {
            let dx = _mm256_set1_ps((*ab[i]).d);
            let s1f = _mm256_cvtepi32_ps(s1[i]);
            acc[i] = _mm256_fmadd_ps(s1f, _mm256_mul_ps(d, dx), acc[i]);
        }
    }
    store::<R>(out, h, &acc);
}

/// `v` shifted right by `n` bits in each 16-bit lane (`n` known once unrolled).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn srl16(v: __m256i, n: usize) -> __m256i {
    _mm256_srl_epi16(v, _mm_cvtsi32_si128(n as i32))
}

/// Bit `k` (< 8) of each byte of `h` at bit 2 (as `vnni::bit_at2`).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn bit_at2(h: __m256i, k: usize) -> __m256i {
    if k >= 2 {
        srl16(h, k - 2)
    } else {
        _mm256_sll_epi16(h, _mm_cvtsi32_si128((2 - k) as i32))
    }
}

/// Q3_K, Q2_K or IQ4_XS (`K`: the type's number), `R` rows, columns `8 h ..`.
///
/// # Safety
/// As [`blocks32`], with [`A256`] activation blocks.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn small_k<const R: usize, const K: u8>(
    w: *const u8,
    nb: usize,
    a: *const A256,
    out: *mut [f32; PANEL],
    h: usize,
    pf: Fetch,
) {
    let qt = QType::ALL[K as usize];
    let st = stream_starts(qt, nb);
    let iq4 = qt == QType::IQ4_XS;
    let subs = if iq4 { 8 } else { 16 };
    let (sc_s, dd) = if qt == QType::Q3_K { (2, 3) } else { (1, 2) };
    let m3 = _mm256_set1_epi8(3);
    let m4 = _mm256_set1_epi8(0x0F);
    let bit2 = _mm256_set1_epi8(4);
    let values =
        _mm256_broadcastsi128_si256(_mm_loadu_si128(super::blocks::IQ4_VALUES.as_ptr().cast()));
    let mut acc = [_mm256_setzero_ps(); R];
    let pf = pf.split(8);
    for b in 0..nb {
        // (offsets inside each stream's `nb` blocks and `a`'s R * nb blocks, as in blocks32)
        let ab: [*const A256; R] = std::array::from_fn(|i| a.add(i * nb + b));
        let mut s1 = [_mm256_setzero_ps(); R];
        for j in 0..subs {
            pf.part(8 * b + j / (subs / 8));
            let scb = _mm_loadl_epi64(w.add(st[sc_s] + 16 * subs * b + 16 * j + 8 * h).cast());
            let scale = _mm256_cvtepi32_ps(if qt == QType::Q2_K {
                _mm256_and_si256(_mm256_cvtepu8_epi32(scb), _mm256_set1_epi32(0xF))
            } else {
                _mm256_cvtepi8_epi32(scb)
            });
            let mut t = [_mm256_setzero_si256(); R];
            if iq4 {
                // the int8 values: |v| times sign(v) * x (a pair at most 2 * 127 * 127)
                for l in 0..4 {
                    let v = load(w.add(st[0] + 2048 * b + 64 * (4 * j + l) + 32 * h));
                    let lo = _mm256_shuffle_epi8(values, _mm256_and_si256(v, m4));
                    let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(v), m4);
                    let hi = _mm256_shuffle_epi8(values, hi);
                    for (q, c) in [(2 * l, lo), (2 * l + 1, hi)] {
                        let ac = _mm256_abs_epi8(c);
                        for i in 0..R {
                            let qs = (*ab[i]).qs.as_ptr().add(32 * j + 4 * q);
                            let x = _mm256_sign_epi8(quad(qs), c);
                            t[i] = _mm256_add_epi32(t[i], widen(_mm256_maddubs_epi16(ac, x)));
                        }
                    }
                }
            } else {
                let v = load(w.add(st[0] + 1024 * b + 64 * j + 32 * h));
                // (the odd sub-block's third bits moved down first: constant shifts below)
                let hb = if qt != QType::Q3_K {
                    _mm256_setzero_si256()
                } else if j % 2 == 1 {
                    _mm256_srli_epi16::<4>(load(w.add(st[1] + 512 * b + 64 * (j / 2) + 32 * h)))
                } else {
                    load(w.add(st[1] + 512 * b + 64 * (j / 2) + 32 * h))
                };
                let c: [__m256i; 4] = std::array::from_fn(|q| {
                    let lo = _mm256_and_si256(srl16(v, 2 * q), m3);
                    if qt == QType::Q3_K {
                        or_and(lo, bit_at2(hb, q), bit2)
                    } else {
                        lo
                    }
                });
                for i in 0..R {
                    let qs = (*ab[i]).qs.as_ptr().add(16 * j);
                    // 4 quads a widening (1778 a pair)
                    let p01 = _mm256_add_epi16(
                        _mm256_maddubs_epi16(c[0], quad(qs)),
                        _mm256_maddubs_epi16(c[1], quad(qs.add(4))),
                    );
                    let p23 = _mm256_add_epi16(
                        _mm256_maddubs_epi16(c[2], quad(qs.add(8))),
                        _mm256_maddubs_epi16(c[3], quad(qs.add(12))),
                    );
                    let init = if qt == QType::Q3_K {
                        -4 * i32::from((*ab[i]).sum16[j])
                    } else {
                        0
                    };
                    t[i] = _mm256_add_epi32(
                        widen(_mm256_add_epi16(p01, p23)),
                        _mm256_set1_epi32(init),
                    );
                }
            }
            for i in 0..R {
                s1[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t[i]), scale, s1[i]);
            }
        }
        let d = halves(w.add(st[dd] + 32 * b + 16 * h));
        for i in 0..R {
            let dx = _mm256_set1_ps((*ab[i]).d);
            acc[i] = _mm256_fmadd_ps(s1[i], _mm256_mul_ps(d, dx), acc[i]);
        }
        if qt == QType::Q2_K {
            let mut s2 = [_mm256_setzero_si256(); R];
            for p in 0..8 {
                let at = w.add(st[1] + 256 * b + 32 * p + 8 * h);
                let lo = _mm256_srli_epi32::<4>(_mm256_cvtepu8_epi32(_mm_loadl_epi64(at.cast())));
                let hi = _mm256_cvtepu8_epi32(_mm_loadl_epi64(at.add(16).cast()));
                let mp = _mm256_or_si256(lo, _mm256_slli_epi32::<16>(_mm256_srli_epi32::<4>(hi)));
                for i in 0..R {
                    let pair = sum_pair(&(*ab[i]).sum16, p);
                    let m = _mm256_madd_epi16(mp, _mm256_set1_epi32(pair));
                    s2[i] = _mm256_add_epi32(s2[i], m);
                }
            }
            let e = halves(w.add(st[3] + 32 * b + 16 * h));
            for i in 0..R {
                let dx = _mm256_set1_ps((*ab[i]).d);
                let s2f = _mm256_cvtepi32_ps(s2[i]);
                acc[i] = _mm256_fnmadd_ps(s2f, _mm256_mul_ps(e, dx), acc[i]);
            }
        }
    }
    store::<R>(out, h, &acc);
}
