//! The products and the softmax of a tile on AVX-512F, in the tile's transposed layout:
//! scores and weights are key-major (`[KEYS, mp]`, 16 query rows per register), so the
//! softmax of 16 rows runs lane-wise (maxima and sums over keys are vertical, no
//! horizontal reduction) and each key's head vector is read straight from its widened
//! slot (no transpose of the key block).
//!
//! * scores: 4 keys by up to 64 query rows (16 registers of sums); per head element, one
//!   load per 16 rows of the transposed queries and 4 broadcast key elements;
//! * values: 4 rows by 64 output lanes (16 registers), then by 16 lanes for the rest of
//!   the head (a multiple of 16); per key, its value vectors loaded once for the 4 rows.
//!
//! Every raw load and store is of 16 lanes inside a slice whose length is asserted in the
//! same function.

use std::arch::x86_64::*;

use super::KEYS;
use crate::decode::avx512::exp16;

/// Whether this path handles head size `dim`.
pub(super) fn handles(dim: usize) -> bool {
    dim.is_multiple_of(16)
}

/// `st[n][r] = sum_j k[n][j] * qt[j][r]` for keys `n < nk` (`qt` `[d, mp]`, `k`
/// `[KEYS, d]`, `st` `[KEYS, mp]`, `mp` a multiple of 16).
#[target_feature(enable = "avx512f")]
pub(super) fn scores(qt: &[f32], k: &[f32], st: &mut [f32], d: usize, mp: usize, nk: usize) {
    let vecs = mp / 16;
    let mut v0 = 0;
    while v0 < vecs {
        match vecs - v0 {
            1 => scores_nr::<1>(qt, k, st, d, mp, nk, v0),
            2 => scores_nr::<2>(qt, k, st, d, mp, nk, v0),
            3 => scores_nr::<3>(qt, k, st, d, mp, nk, v0),
            _ => scores_nr::<4>(qt, k, st, d, mp, nk, v0),
        }
        v0 += 4;
    }
}

/// [`scores`] for the query rows `16 * v0 .. 16 * (v0 + NR)`.
#[target_feature(enable = "avx512f")]
#[inline]
fn scores_nr<const NR: usize>(
    qt: &[f32],
    k: &[f32],
    st: &mut [f32],
    d: usize,
    mp: usize,
    nk: usize,
    v0: usize,
) {
    assert!((v0 + NR) * 16 <= mp && qt.len() >= d * mp && st.len() >= KEYS * mp);
    assert!(k.len() >= KEYS * d && nk <= KEYS);
    for n0 in (0..nk).step_by(4) {
        let mut acc = [[_mm512_setzero_ps(); NR]; 4];
        for j in 0..d {
            let mut q = [_mm512_setzero_ps(); NR];
            for (x, q) in q.iter_mut().enumerate() {
                // SAFETY: j * mp + (v0 + x + 1) * 16 <= d * mp <= qt.len() (asserted).
                *q = unsafe { _mm512_loadu_ps(qt.as_ptr().add(j * mp + (v0 + x) * 16)) };
            }
            for (i, acc) in acc.iter_mut().enumerate() {
                let kx = _mm512_set1_ps(k[(n0 + i) * d + j]);
                for (a, &q) in acc.iter_mut().zip(&q) {
                    *a = _mm512_fmadd_ps(kx, q, *a);
                }
            }
        }
        for (i, acc) in acc.iter().enumerate() {
            for (x, &a) in acc.iter().enumerate() {
                // SAFETY: n0 + i < KEYS and (v0 + x + 1) * 16 <= mp: inside st's KEYS * mp
                // elements (asserted; st is a unique borrow).
                unsafe { _mm512_storeu_ps(st.as_mut_ptr().add((n0 + i) * mp + (v0 + x) * 16), a) };
            }
        }
    }
}

/// One step of the online softmax for every row over keys `kb .. kb + nk` (see
/// `super::Products::softmax`), 16 rows at a time.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f")]
pub(super) fn softmax(
    st: &mut [f32],
    mp: usize,
    nk: usize,
    kb: usize,
    lo: &[i32],
    hi: &[i32],
    max: &mut [f32],
    sum: &mut [f32],
    alpha: &mut [f32],
) {
    assert!(mp.is_multiple_of(16) && st.len() >= KEYS * mp && nk <= KEYS);
    assert!(lo.len() >= mp && hi.len() >= mp && max.len() >= mp);
    assert!(sum.len() >= mp && alpha.len() >= mp);
    let inf = _mm512_set1_ps(f32::NEG_INFINITY);
    for r in (0..mp).step_by(16) {
        // SAFETY: r + 16 <= mp <= the lengths of lo, hi, max, sum, alpha (asserted).
        let (lov, hiv, old, old_sum) = unsafe {
            (
                _mm512_loadu_si512(lo.as_ptr().add(r).cast()),
                _mm512_loadu_si512(hi.as_ptr().add(r).cast()),
                _mm512_loadu_ps(max.as_ptr().add(r)),
                _mm512_loadu_ps(sum.as_ptr().add(r)),
            )
        };
        let mut masks = [0u16; KEYS];
        let mut block = inf;
        for (n, m) in masks.iter_mut().enumerate().take(nk) {
            let x = _mm512_set1_epi32((kb + n) as i32);
            *m = _mm512_cmple_epi32_mask(lov, x) & _mm512_cmple_epi32_mask(x, hiv);
            // SAFETY: n < KEYS, r + 16 <= mp: inside st (asserted).
            let s = unsafe { _mm512_loadu_ps(st.as_ptr().add(n * mp + r)) };
            block = _mm512_max_ps(block, _mm512_mask_blend_ps(*m, inf, s));
        }
        let new = _mm512_max_ps(old, block);
        let seen = _mm512_cmp_ps_mask::<_CMP_NEQ_OQ>(new, inf);
        let a = _mm512_mask_blend_ps(seen, _mm512_set1_ps(1.0), exp16(_mm512_sub_ps(old, new)));
        let mut total = _mm512_mul_ps(old_sum, a);
        for (n, &m) in masks.iter().enumerate().take(nk) {
            // SAFETY: as above (st is a unique borrow).
            unsafe {
                let p = st.as_mut_ptr().add(n * mp + r);
                let e = _mm512_maskz_mov_ps(m, exp16(_mm512_sub_ps(_mm512_loadu_ps(p), new)));
                total = _mm512_add_ps(total, e);
                _mm512_storeu_ps(p, e);
            }
        }
        // SAFETY: as for the loads above (unique borrows).
        unsafe {
            _mm512_storeu_ps(max.as_mut_ptr().add(r), new);
            _mm512_storeu_ps(sum.as_mut_ptr().add(r), total);
            _mm512_storeu_ps(alpha.as_mut_ptr().add(r), a);
        }
    }
}

/// `o[r] = o[r] * alpha[r] + sum_{n < nk} pt[n][r] * v[n]` (`pt` `[KEYS, mp]`, `v`
/// `[KEYS, d]`, `o` `[mp, d]`, `mp` a multiple of 4, `d` of 16).
#[target_feature(enable = "avx512f")]
pub(super) fn accumulate(pt: &[f32], v: &[f32], o: &mut [f32], d: usize, nk: usize, alpha: &[f32]) {
    let mp = o.len() / d;
    assert!(mp.is_multiple_of(4) && o.len() == mp * d && d.is_multiple_of(16));
    assert!(pt.len() >= KEYS * mp && v.len() >= KEYS * d && alpha.len() >= mp && nk <= KEYS);
    for r in (0..mp).step_by(4) {
        let mut c = 0;
        while c + 64 <= d {
            block::<4>(pt, v, o, (d, mp, nk), r, c, alpha);
            c += 64;
        }
        while c < d {
            block::<1>(pt, v, o, (d, mp, nk), r, c, alpha);
            c += 16;
        }
    }
}

/// Rows `r .. r + 4`, lanes `c .. c + 16 * NV` of [`accumulate`].
#[target_feature(enable = "avx512f")]
#[inline]
fn block<const NV: usize>(
    pt: &[f32],
    v: &[f32],
    o: &mut [f32],
    (d, mp, nk): (usize, usize, usize),
    r: usize,
    c: usize,
    alpha: &[f32],
) {
    assert!((r + 4) * d <= o.len() && c + 16 * NV <= d && nk * d <= v.len());
    let mut acc = [[_mm512_setzero_ps(); NV]; 4];
    for (i, acc) in acc.iter_mut().enumerate() {
        let scale = _mm512_set1_ps(alpha[r + i]);
        for (x, a) in acc.iter_mut().enumerate() {
            // SAFETY: (r + i) * d + c + 16 * (x + 1) <= (r + 4) * d <= o.len() (asserted).
            let old = unsafe { _mm512_loadu_ps(o.as_ptr().add((r + i) * d + c + 16 * x)) };
            *a = _mm512_mul_ps(old, scale);
        }
    }
    for n in 0..nk {
        let mut vv = [_mm512_setzero_ps(); NV];
        for (x, w) in vv.iter_mut().enumerate() {
            // SAFETY: n * d + c + 16 * (x + 1) <= nk * d <= v.len() (asserted).
            *w = unsafe { _mm512_loadu_ps(v.as_ptr().add(n * d + c + 16 * x)) };
        }
        for (i, acc) in acc.iter_mut().enumerate() {
            let w = _mm512_set1_ps(pt[n * mp + r + i]);
            for (a, &x) in acc.iter_mut().zip(&vv) {
                *a = _mm512_fmadd_ps(w, x, *a);
            }
        }
    }
    for (i, acc) in acc.iter().enumerate() {
        for (x, a) in acc.iter().enumerate() {
            // SAFETY: as for the loads above (o is a unique borrow).
            unsafe { _mm512_storeu_ps(o.as_mut_ptr().add((r + i) * d + c + 16 * x), *a) };
        }
    }
}
