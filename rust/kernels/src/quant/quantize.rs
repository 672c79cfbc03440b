//! Float weight rows to GGUF K-type blocks (Q4_K, Q5_K, Q6_K): quantize-on-load for the
//! types `gguf.quants` has no quantizer for. The search follows llama.cpp's reference
//! quantizers (the files users compare against are made that way):
//!
//! * Q4_K, Q5_K: every sub-block of 32 weights gets an affine fit `x ~ s * u - m` (codes
//!   `u` in `0..=nmax`, `m >= 0`); a grid of code spacings around `(max - min) / nmax` is
//!   tried, each spacing's codes refitted by weighted least squares (weights
//!   `rms(sub-block) + |x|`: large weights matter most), the fit of least weighted
//!   squared error kept. The 8 scales and 8 mins are then coded in 6 bits relative to the
//!   block's largest (`d = max s / 63`, `dmin = max m / 63`, both fp16, each scale and min
//!   then the nearest multiple of its factor), and the codes recomputed against the coded
//!   values.
//! * Q6_K: every sub-block of 16 gets a symmetric fit `x ~ s * l` (`l` in `-32..=31`, the
//!   weight of largest magnitude coded -32), weighted by `x^2`, over 19 spacings around
//!   `max|x| / 32`; the 16 scales are coded in int8 relative to the largest (`d = -top /
//!   128` in fp16, each scale the nearest multiple of `d`), and the codes recomputed.
//!
//! (Unlike llama.cpp, the integer scales are fitted to the fp16-rounded factors: for real
//! weights Q6_K's `d` is often an fp16 subnormal, a few percent off before that refit.)
//!
//! Weights must be finite; a block whose fp16 factors would overflow (weights beyond
//! about 6e7) is refused. The factors' fp16 range also bounds precision from below: rows
//! of standard deviation under about 1e-5 come back coarser than the types' usual error
//! (as from any K-type GGUF file), under about 1e-7 as noise of their own size.

use half::f16;

use super::blocks::{encode, Block};
use super::{err, split, QType};
use crate::error::KernelError;

/// Why a row was not quantized.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum RowError {
    /// weight `col` of the row is NaN or infinite
    NotFinite { col: usize, value: f32 },
    /// block `block`'s fp16 factors would overflow
    Overflow { block: usize },
}

/// `v` rounded to the nearest integer, ties to even, for `|v| < 2^22` (adding 1.5 * 2^23
/// leaves no fraction bits; plain SSE2, no libm call).
#[inline(always)]
fn round(v: f32) -> f32 {
    const SHIFT: f32 = 12_582_912.0;
    (v + SHIFT) - SHIFT
}

/// `v` rounded into `lo..=hi` (integers).
#[inline(always)]
fn code(v: f32, lo: f32, hi: f32) -> f32 {
    round(v.clamp(lo, hi))
}

/// The fp16 factor of a block whose largest integer scale is `n` and largest scale `top`:
/// the fp16 value nearest `top / n`, one step further from zero when `top` would need an
/// integer scale beyond `n + 1/2` against it (so the largest scale stays within half a
/// step); None when it overflows fp16.
fn factor(top: f32, n: f32) -> Option<f32> {
    let mut h = f16::from_f32(top / n);
    if h.to_f32().abs() * (n + 0.5) < top.abs() {
        // (sign and magnitude: the next bit pattern is one step further from zero)
        h = f16::from_bits(h.to_bits() + 1);
    }
    let h = h.to_f32();
    h.is_finite().then_some(h)
}

/// The affine search's grid: spacings `(nmax + first + step * i) / (max - min)`,
/// `i = 0..=steps`.
#[derive(Clone, Copy)]
struct Grid {
    nmax: f32,
    first: f32,
    step: f32,
    steps: usize,
}

const Q4_GRID: Grid = Grid {
    nmax: 15.0,
    first: -1.0,
    step: 0.1,
    steps: 20,
};

const Q5_GRID: Grid = Grid {
    nmax: 31.0,
    first: -0.5,
    step: 0.1,
    steps: 15,
};

/// `sum_i f(i)` over a sub-block of 32, in 8 interleaved partial sums (so that the loop
/// runs on vector registers; a fixed order, so the same bits on every CPU).
#[inline(always)]
fn sum32(f: impl Fn(usize) -> f32) -> f32 {
    let mut acc = [0f32; 8];
    for i in (0..32).step_by(8) {
        for (l, a) in acc.iter_mut().enumerate() {
            *a += f(i + l);
        }
    }
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]))
}

/// `[f(0), .., f(31)]` (a plain indexed loop: it vectorizes, where `array::from_fn`'s
/// iterator does not).
#[inline(always)]
fn map32(f: impl Fn(usize) -> f32) -> [f32; 32] {
    let mut out = [0f32; 32];
    for (i, o) in out.iter_mut().enumerate() {
        *o = f(i);
    }
    out
}

/// Weighted squared error of `s * u + o` against `x`.
fn affine_error(x: &[f32; 32], w: &[f32; 32], u: &[f32; 32], s: f32, o: f32) -> f32 {
    sum32(|i| w[i] * (s * u[i] + o - x[i]).powi(2))
}

/// One sub-block's trial codes and their sums, as the affine search reads them, in
/// [`sum32`]'s order whatever the lanes.
struct Fit32<C, U, S, E> {
    /// `code(inv * (x - lo), 0, nmax)` of each weight
    codes: U,
    /// `(sum w u, sum w u u, sum w u x)`
    sums: S,
    /// `sum w (s u + o - x)^2`
    error: E,
    _codes: std::marker::PhantomData<C>,
}

/// `(min(0, x), max(x))`: the range the affine fit spans (0 joins it below).
fn range_with_zero(x: &[f32; 32]) -> (f32, f32) {
    (
        x.iter().fold(0f32, |a, &v| a.min(v)),
        x.iter().fold(x[0], |a, &v| a.max(v)),
    )
}

/// The weights of fit of a sub-block: `rms(x) + |x|` (large weights matter most).
fn fit_weights(x: &[f32; 32]) -> [f32; 32] {
    let rms = (sum32(|i| x[i] * x[i]) / 32.0).sqrt();
    map32(|i| rms + x[i].abs())
}

/// The value of largest magnitude (the first of equals), signed; 0 for none.
fn signed_top(x: &[f32]) -> f32 {
    x.iter()
        .fold(0f32, |a, &v| if v.abs() > a.abs() { v } else { a })
}

/// The affine fit `(s, m)` of one sub-block (`x ~ s * u - m`, `m >= 0`), see the module
/// docs (`s = 0` when no spread is left once 0 joins the weights' range).
fn fit_affine(x: &[f32; 32], w: &[f32; 32], g: Grid) -> (f32, f32) {
    let (lo, hi) = range_with_zero(x);
    if hi <= lo {
        return (0.0, -lo);
    }
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2 (just detected).
        return unsafe { avx2::fit(x, w, g, lo, hi) };
    }
    fit_plain(x, w, g, lo, hi)
}

/// [`fit_affine`] past its range check, one lane at a time (any CPU).
fn fit_plain(x: &[f32; 32], w: &[f32; 32], g: Grid, lo: f32, hi: f32) -> (f32, f32) {
    let f = Fit32 {
        codes: |inv: f32| map32(|i| code(inv * (x[i] - lo), 0.0, g.nmax)),
        sums: |u: &[f32; 32]| {
            let wu = map32(|t| w[t] * u[t]);
            (
                sum32(|t| wu[t]),
                sum32(|t| wu[t] * u[t]),
                sum32(|t| wu[t] * x[t]),
            )
        },
        error: |u: &[f32; 32], s: f32, o: f32| affine_error(x, w, u, s, o),
        _codes: std::marker::PhantomData,
    };
    search(&f, x, w, g, lo, hi)
}

/// [`fit_affine`]'s search over the spacings of `g` (`lo < hi`: the weights' range with 0).
#[inline(always)]
fn search<C, U, S, E>(
    f: &Fit32<C, U, S, E>,
    x: &[f32; 32],
    w: &[f32; 32],
    g: Grid,
    lo: f32,
    hi: f32,
) -> (f32, f32)
where
    U: Fn(f32) -> C,
    S: Fn(&C) -> (f32, f32, f32),
    E: Fn(&C, f32, f32) -> f32,
{
    let range = hi - lo;
    let (sw, swx) = (sum32(|i| w[i]), sum32(|i| w[i] * x[i]));
    // the plain min / max grid first
    let (mut s, mut o) = (range / g.nmax, lo);
    let mut best = (f.error)(&(f.codes)(g.nmax / range), s, o);
    for i in 0..=g.steps {
        let u = (f.codes)((g.nmax + g.first + g.step * i as f32) / range);
        let (sl, sll, sxl) = (f.sums)(&u);
        let det = sw * sll - sl * sl;
        if det <= 0.0 {
            continue;
        }
        let mut ts = (sw * sxl - swx * sl) / det;
        let mut to = (sll * swx - sl * sxl) / det;
        if to > 0.0 {
            // the offset is a min subtracted (>= 0): refit through zero
            to = 0.0;
            ts = sxl / sll;
        }
        let e = (f.error)(&u, ts, to);
        if e < best {
            (best, s, o) = (e, ts, to);
        }
    }
    (s, -o)
}

/// The affine search on AVX2: a sub-block in 4 registers of 8 lanes, which are
/// [`sum32`]'s 8 partial sums; every lane does the scalar operations in the scalar order
/// (`max` / `min` with the operands ordered as `clamp`'s comparisons, no fused
/// multiply-adds), so the fit is the same bits as [`fit_plain`]'s. (The closures inherit
/// `fit`'s target features, so the intrinsics inline; `array::from_fn` would not.)
#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::{search, Fit32, Grid};

    type Lanes = [__m256; 4];

    /// `[f(0), f(1), f(2), f(3)]`.
    #[inline(always)]
    fn four(f: impl Fn(usize) -> __m256) -> Lanes {
        [f(0), f(1), f(2), f(3)]
    }

    /// `sum32`'s order: each lane's sum from 0, then `((a0 + a4) + (a1 + a5)) + ((a2 +
    /// a6) + (a3 + a7))`.
    #[target_feature(enable = "avx2")]
    #[inline]
    fn total(v: Lanes) -> f32 {
        let a = _mm256_add_ps(_mm256_setzero_ps(), v[0]);
        let a = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(a, v[1]), v[2]), v[3]);
        let t = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps::<1>(a));
        let u = _mm_add_ps(t, _mm_shuffle_ps::<0b10_11_00_01>(t, t));
        _mm_cvtss_f32(_mm_add_ss(u, _mm_movehl_ps(u, u)))
    }

    /// [`super::fit_affine`] past its range check.
    ///
    /// # Safety
    /// The CPU has AVX2.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn fit(
        x: &[f32; 32],
        w: &[f32; 32],
        g: Grid,
        lo: f32,
        hi: f32,
    ) -> (f32, f32) {
        // SAFETY: each load reads 8 of the 32 floats (k < 4).
        let xs = four(|k| unsafe { _mm256_loadu_ps(x[8 * k..].as_ptr()) });
        // SAFETY: as above.
        let ws = four(|k| unsafe { _mm256_loadu_ps(w[8 * k..].as_ptr()) });
        let (lo_v, nmax, zero) = (
            _mm256_set1_ps(lo),
            _mm256_set1_ps(g.nmax),
            _mm256_setzero_ps(),
        );
        let shift = _mm256_set1_ps(12_582_912.0);
        let f = Fit32 {
            codes: |inv: f32| {
                let inv = _mm256_set1_ps(inv);
                four(|k| {
                    let v = _mm256_mul_ps(inv, _mm256_sub_ps(xs[k], lo_v));
                    // clamp: `v < 0 -> 0`, then `v > nmax -> nmax`; then `round`
                    let v = _mm256_min_ps(nmax, _mm256_max_ps(zero, v));
                    _mm256_sub_ps(_mm256_add_ps(v, shift), shift)
                })
            },
            sums: |u: &Lanes| {
                let wu = four(|k| _mm256_mul_ps(ws[k], u[k]));
                (
                    total(wu),
                    total(four(|k| _mm256_mul_ps(wu[k], u[k]))),
                    total(four(|k| _mm256_mul_ps(wu[k], xs[k]))),
                )
            },
            error: |u: &Lanes, s: f32, o: f32| {
                let (s, o) = (_mm256_set1_ps(s), _mm256_set1_ps(o));
                total(four(|k| {
                    let t = _mm256_sub_ps(_mm256_add_ps(_mm256_mul_ps(s, u[k]), o), xs[k]);
                    _mm256_mul_ps(ws[k], _mm256_mul_ps(t, t))
                }))
            },
            _codes: std::marker::PhantomData,
        };
        search(&f, x, w, g, lo, hi)
    }

    /// [`super::symmetric_sums`], a spacing a lane (three registers of 8), the inputs in
    /// order: each lane's operations and their order are the scalar loop's.
    ///
    /// # Safety
    /// The CPU has AVX2.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn symmetric_sums(x: &[f32; 16], inv: &[f32; 24]) -> ([f32; 24], [f32; 24]) {
        // SAFETY: each load reads 8 of the 24 floats (k < 3).
        let inv: [__m256; 3] = [0, 1, 2].map(|k| unsafe { _mm256_loadu_ps(inv[8 * k..].as_ptr()) });
        let (lo, hi) = (_mm256_set1_ps(-32.0), _mm256_set1_ps(31.0));
        let shift = _mm256_set1_ps(12_582_912.0);
        let (mut sxl, mut sll) = ([_mm256_setzero_ps(); 3], [_mm256_setzero_ps(); 3]);
        for &xi in x {
            let (w, xv) = (xi * xi, _mm256_set1_ps(xi));
            let (wv, wx) = (_mm256_set1_ps(w), _mm256_set1_ps(w * xi));
            for k in 0..3 {
                // clamp: `v < -32 -> -32`, then `v > 31 -> 31`; then `round`
                let v = _mm256_min_ps(hi, _mm256_max_ps(lo, _mm256_mul_ps(inv[k], xv)));
                let l = _mm256_sub_ps(_mm256_add_ps(v, shift), shift);
                sxl[k] = _mm256_add_ps(sxl[k], _mm256_mul_ps(wx, l));
                sll[k] = _mm256_add_ps(sll[k], _mm256_mul_ps(_mm256_mul_ps(wv, l), l));
            }
        }
        let mut out = ([0f32; 24], [0f32; 24]);
        for k in 0..3 {
            // SAFETY: each store writes 8 of the 24 floats (k < 3).
            unsafe {
                _mm256_storeu_ps(out.0[8 * k..].as_mut_ptr(), sxl[k]);
                _mm256_storeu_ps(out.1[8 * k..].as_mut_ptr(), sll[k]);
            }
        }
        out
    }
}

/// One Q4_K / Q5_K block of `x` (256 weights).
fn block_k4(qt: QType, x: &[f32]) -> Option<Block> {
    let g = if qt == QType::Q5_K { Q5_GRID } else { Q4_GRID };
    let (mut scales, mut mins) = ([0f32; 8], [0f32; 8]);
    for (j, sub) in x.chunks_exact(32).enumerate() {
        let sub: &[f32; 32] = sub.try_into().expect("32 weights");
        (scales[j], mins[j]) = fit_affine(sub, &fit_weights(sub), g);
    }
    let max_s = scales.iter().fold(0f32, |a, &v| a.max(v));
    let max_m = mins.iter().fold(0f32, |a, &v| a.max(v));
    let mut blk = Block::ZERO;
    blk.d = factor(max_s, 63.0)?;
    blk.e = factor(max_m, 63.0)?;
    // each scale and min: the nearest multiple of its coded factor
    let six = |v: f32, f: f32| if f > 0.0 { code(v / f, 0.0, 63.0) } else { 0.0 };
    for j in 0..8 {
        blk.sc[j] = six(scales[j], blk.d) as i32;
        blk.mn[j] = six(mins[j], blk.e) as i32;
        let (a, m) = (blk.d * blk.sc[j] as f32, blk.e * blk.mn[j] as f32);
        if a == 0.0 {
            continue;
        }
        let codes = &mut blk.codes[32 * j..32 * j + 32];
        for (c, &v) in codes.iter_mut().zip(&x[32 * j..]) {
            *c = code((v + m) / a, 0.0, g.nmax) as u8;
        }
    }
    Some(blk)
}

/// Spacings the symmetric fit tries (the first `-32 / top`, then `-(32 + 0.1 i) / top`
/// for `i` in `-9..=9` but 0), with room for 24 (three registers of 8).
const SPACINGS: usize = 19;

/// The symmetric fit `s` of one Q6_K sub-block (`x ~ s * l`, see the module docs).
fn fit_symmetric(x: &[f32; 16]) -> f32 {
    let top = signed_top(x);
    if top.abs() < 1e-15 {
        return 0.0;
    }
    let mut inv = [0f32; 24];
    inv[0] = -32.0 / top;
    for (slot, i) in inv[1..SPACINGS]
        .iter_mut()
        .zip((-9..=9).filter(|&i| i != 0))
    {
        *slot = -(32.0 + 0.1 * i as f32) / top;
    }
    let (sxl, sll) = symmetric_sums(x, &inv);
    let mut s = if sll[0] > 0.0 { sxl[0] / sll[0] } else { 0.0 };
    // the error falls as sxl^2 / sll rises
    let mut gain = s * sxl[0];
    for t in 1..SPACINGS {
        if sll[t] > 0.0 && sxl[t] * sxl[t] > gain * sll[t] {
            s = sxl[t] / sll[t];
            gain = s * sxl[t];
        }
    }
    s
}

/// `(sum w x l, sum w l^2)` of the codes `l = code(inv[t] * x, -32, 31)` of each spacing
/// `t` (`w = x^2`, summed in input order), on AVX2 where the CPU has it (a spacing a lane:
/// the same bits).
fn symmetric_sums(x: &[f32; 16], inv: &[f32; 24]) -> ([f32; 24], [f32; 24]) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2 (just detected).
        return unsafe { avx2::symmetric_sums(x, inv) };
    }
    symmetric_sums_plain(x, inv)
}

/// [`symmetric_sums`] one spacing at a time (any CPU).
fn symmetric_sums_plain(x: &[f32; 16], inv: &[f32; 24]) -> ([f32; 24], [f32; 24]) {
    let (mut sxl, mut sll) = ([0f32; 24], [0f32; 24]);
    for t in 0..24 {
        for &xi in x {
            let l = code(inv[t] * xi, -32.0, 31.0);
            let w = xi * xi;
            sxl[t] += w * xi * l;
            sll[t] += w * l * l;
        }
    }
    (sxl, sll)
}

/// One Q6_K block of `x` (256 weights).
fn block_q6k(x: &[f32]) -> Option<Block> {
    let mut scales = [0f32; 16];
    for (s, sub) in scales.iter_mut().zip(x.chunks_exact(16)) {
        *s = fit_symmetric(sub.try_into().expect("16 weights"));
    }
    let top = signed_top(&scales);
    let mut blk = Block::ZERO;
    blk.codes = [32; 256];
    if top.abs() < 1e-15 {
        return Some(blk);
    }
    blk.d = factor(-top, 128.0)?;
    for (j, &s) in scales.iter().enumerate() {
        blk.sc[j] = code(s / blk.d, -128.0, 127.0) as i32;
        let a = blk.d * blk.sc[j] as f32;
        if a == 0.0 {
            continue;
        }
        let codes = &mut blk.codes[16 * j..16 * j + 16];
        for (c, &v) in codes.iter_mut().zip(&x[16 * j..]) {
            *c = (code(v / a, -32.0, 31.0) + 32.0) as u8;
        }
    }
    Some(blk)
}

/// `(x, blocks)`: one row of weights (`x.len() / 256` blocks) to GGUF K-type blocks.
pub(crate) fn quantize_row<const T: u8>(x: &[f32], out: &mut [u8]) -> Result<(), RowError> {
    let qt = QType::ALL[T as usize];
    if let Some((col, &value)) = x.iter().enumerate().find(|(_, v)| !v.is_finite()) {
        return Err(RowError::NotFinite { col, value });
    }
    let bytes = qt.block_bytes();
    for (block, (x, b)) in x
        .chunks_exact(256)
        .zip(out.chunks_exact_mut(bytes))
        .enumerate()
    {
        let blk = match qt {
            QType::Q6_K => block_q6k(x),
            _ => block_k4(qt, x),
        };
        encode(qt, &blk.ok_or(RowError::Overflow { block })?, b);
    }
    Ok(())
}

/// Whether [`quantize`] takes `qt`.
pub fn quantizes(qt: QType) -> bool {
    qt.traits().quantize_weight_row.is_some()
}

/// `out` = the GGUF rows of the float weight `w` [n, k] quantized to `qt` (a K-type, see
/// [`quantizes`]; `k` whole blocks; `out` `n * k / 256 * block_bytes` bytes), rows split
/// over at most `threads` threads of the kernel pool. Fails naming the field at fault: a
/// type with no quantizer (`qtype`), a length (`w`, `out`), a NaN or infinite weight or
/// one too large for the type's fp16 factors (`w`, with its row and column).
pub fn quantize(
    qt: QType,
    w: &[f32],
    n: usize,
    k: usize,
    out: &mut [u8],
    threads: usize,
) -> Result<(), KernelError> {
    let Some(row_fn) = qt.traits().quantize_weight_row else {
        return Err(err(
            "qtype",
            format!("no quantizer here for {} (only the K-types)", qt.name()),
        ));
    };
    let nb = super::blocks_of(qt, k)?;
    if w.len() != n * k {
        return Err(err(
            "w",
            format!("has {} elements, not n * k = {}", w.len(), n * k),
        ));
    }
    let row_bytes = nb * qt.block_bytes();
    if out.len() != n * row_bytes {
        return Err(err(
            "out",
            format!(
                "has {} bytes, not n * k / {} * {} = {}",
                out.len(),
                qt.block(),
                qt.block_bytes(),
                n * row_bytes
            ),
        ));
    }
    if n == 0 || k == 0 {
        return Ok(());
    }
    // each piece: its rows' output and the first failure among them
    let ranges = split(n, threads);
    let mut fails: Vec<Option<(usize, RowError)>> = vec![None; ranges.len()];
    let mut pieces = Vec::new();
    let mut rest = &mut out[..];
    for (r, fail) in ranges.into_iter().zip(fails.iter_mut()) {
        let (piece, tail) = rest.split_at_mut(r.len() * row_bytes);
        rest = tail;
        pieces.push((r, (piece, fail)));
    }
    crate::parallel::run_pieces(pieces, |rows, (piece, fail)| {
        for (r, o) in rows.zip(piece.chunks_exact_mut(row_bytes)) {
            if let Err(e) = row_fn(&w[r * k..(r + 1) * k], o) {
                *fail = Some((r, e));
                return;
            }
        }
    });
    match fails.into_iter().flatten().next() {
        None => Ok(()),
        Some((r, RowError::NotFinite { col, value })) => Err(err(
            "w",
            format!("row {r}, column {col} is {value}: only finite weights quantize"),
        )),
        Some((r, RowError::Overflow { block })) => Err(err(
            "w",
            format!(
                "row {r}, columns {}..{}: weights too large for {}'s fp16 scales",
                block * 256,
                block * 256 + 256,
                qt.name()
            ),
        )),
    }
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::*;
    use crate::quant::tests::Rng;

    /// A random sub-block of `N` weights: uniform at one of 4 scales, then by `case` left
    /// as is, made all positive or all negative, 5/8 of it one repeated value, or one
    /// outlier 9 times larger.
    fn sub_block<const N: usize>(rng: &mut Rng, case: usize) -> [f32; N] {
        let scale = [1e-4f32, 0.02, 1.0, 500.0][case % 4];
        let mut x: [f32; N] = std::array::from_fn(|_| scale * rng.uniform(-1.0, 1.0));
        match case % 5 {
            1 => x.iter_mut().for_each(|v| *v = v.abs()),
            2 => x.iter_mut().for_each(|v| *v = -v.abs()),
            3 => x[..N * 5 / 8].fill(scale * 0.5),
            4 => x[case % N] *= 9.0,
            _ => {}
        }
        x
    }

    fn skip_without_avx2() -> bool {
        let skip = !std::arch::is_x86_feature_detected!("avx2");
        if skip {
            eprintln!("skipped: no AVX2");
        }
        skip
    }

    /// The AVX2 lanes give Q6_K's symmetric sums the bits of the plain loop.
    #[test]
    fn avx2_symmetric_sums_are_the_plain_sums() {
        if skip_without_avx2() {
            return;
        }
        let mut rng = Rng(11);
        for case in 0..4000 {
            let x = sub_block::<16>(&mut rng, case);
            let top = signed_top(&x);
            let inv: [f32; 24] = std::array::from_fn(|t| -(30.0 + 0.2 * t as f32) / top);
            let plain = symmetric_sums_plain(&x, &inv);
            // SAFETY: the CPU has AVX2 (checked above).
            let lanes = unsafe { avx2::symmetric_sums(&x, &inv) };
            let bits = |v: ([f32; 24], [f32; 24])| (v.0.map(f32::to_bits), v.1.map(f32::to_bits));
            assert_eq!(bits(plain), bits(lanes), "case {case}");
        }
    }

    /// The AVX2 lanes fit every sub-block to the bits of the plain ones.
    #[test]
    fn avx2_fits_are_the_plain_fits() {
        if skip_without_avx2() {
            return;
        }
        let mut rng = Rng(7);
        for case in 0..4000 {
            let x = sub_block::<32>(&mut rng, case);
            let (w, (lo, hi)) = (fit_weights(&x), range_with_zero(&x));
            if hi <= lo {
                continue;
            }
            for g in [Q4_GRID, Q5_GRID] {
                let plain = fit_plain(&x, &w, g, lo, hi);
                // SAFETY: the CPU has AVX2 (checked above).
                let lanes = unsafe { avx2::fit(&x, &w, g, lo, hi) };
                assert_eq!(
                    (plain.0.to_bits(), plain.1.to_bits()),
                    (lanes.0.to_bits(), lanes.1.to_bits()),
                    "case {case}"
                );
            }
        }
    }
}
