//! The AVX-512 decode path for head_dim 64 and 128 (the hot shapes): one KV head at a
//! time, its query heads in groups of at most `16 / NV` (`NV = dim / 16` registers per
//! vector), so that a group's queries and output sums stay in registers while each key and
//! value is widened once, straight into registers, for the whole group.
//!
//! * Scores: 16 keys at a time, each key's `dim` products summed into one 16-lane vector
//!   per head, then the 16 vectors of a block transpose-reduced (4 shuffle levels) into one
//!   vector of 16 scores, stored head-major. The tail block repeats the row's last key and
//!   its extra scores are replaced by `-inf` (weight 0).
//! * Softmax over each head's scores (the same Cephes exp as the portable path), then the
//!   value pass accumulates `weight * value` in registers; the output is multiplied by
//!   `1 / sum` and rounded once to its type.
//! * bf16 is widened by masking / shifting 32-bit lanes: a register holds the even or the
//!   odd elements of 32 (exact, no shuffle). Queries are permuted the same way once per row
//!   (a dot product does not care about the order), the sums are put back in order once per
//!   head.
//!
//! Every cache read is through a bounds-checked slice of one head vector; the only raw
//! loads and stores are of 16 lanes inside a slice whose length was checked right there.

use std::arch::x86_64::*;
use std::ops::Range;

use super::{key_range, DecodeArgs, Elems, ElemsMut, Window};

const LANES: usize = 16;

/// The head sizes this path handles.
pub(super) fn handles(dim: usize) -> bool {
    matches!(dim, 64 | 128)
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    F32,
    Bf16,
    F16,
    /// int8 with one scale per slot and KV head: dot products and value sums run on the
    /// widened integers; each key's score is multiplied by its key scale, each value's
    /// softmax weight by its value scale (the same sums as over the dequantized vectors,
    /// in another rounding order)
    I8,
}

/// A cache element type.
///
/// # Safety
/// `E` must be `f32` when `KIND` is `Kind::F32`, `i8` when it is `Kind::I8` and `u16`
/// otherwise (`widen` reads the elements as such).
unsafe trait Store {
    type E: Copy;
    const KIND: Kind;
    fn of<'a>(e: Elems<'a>) -> Option<&'a [Self::E]>;
    /// An int8 cache's scales (`[slots, kv_heads]`); empty for the float types.
    fn scales<'a>(_e: Elems<'a>) -> &'a [f32] {
        &[]
    }
}

struct F32s;
struct Bf16s;
struct F16s;
struct I8s;

// SAFETY: E = i8 with Kind::I8.
unsafe impl Store for I8s {
    type E = i8;
    const KIND: Kind = Kind::I8;
    fn of<'a>(e: Elems<'a>) -> Option<&'a [i8]> {
        match e {
            Elems::I8 { data, .. } => Some(data),
            _ => None,
        }
    }
    fn scales<'a>(e: Elems<'a>) -> &'a [f32] {
        match e {
            Elems::I8 { scales, .. } => scales,
            _ => &[],
        }
    }
}

// SAFETY: E = f32 with Kind::F32.
unsafe impl Store for F32s {
    type E = f32;
    const KIND: Kind = Kind::F32;
    fn of<'a>(e: Elems<'a>) -> Option<&'a [f32]> {
        match e {
            Elems::F32(s) => Some(s),
            _ => None,
        }
    }
}

// SAFETY: E = u16 with Kind::Bf16.
unsafe impl Store for Bf16s {
    type E = u16;
    const KIND: Kind = Kind::Bf16;
    fn of<'a>(e: Elems<'a>) -> Option<&'a [u16]> {
        match e {
            Elems::Bf16(s) => Some(s),
            _ => None,
        }
    }
}

// SAFETY: E = u16 with Kind::F16.
unsafe impl Store for F16s {
    type E = u16;
    const KIND: Kind = Kind::F16;
    fn of<'a>(e: Elems<'a>) -> Option<&'a [u16]> {
        match e {
            Elems::F16(s) => Some(s),
            _ => None,
        }
    }
}

/// Rows `range` of `a` (validated by `validate`), written to `out` (which starts at the
/// first of them). Only for `handles(a.dim)`.
#[target_feature(enable = "avx512f,fma")]
pub(super) fn rows(a: &DecodeArgs<'_>, range: Range<usize>, out: &mut ElemsMut<'_>) {
    match (a.k_cache, a.dim) {
        (Elems::F32(_), 64) => rows_of::<F32s, 4>(a, range, out),
        (Elems::F32(_), _) => rows_of::<F32s, 8>(a, range, out),
        (Elems::Bf16(_), 64) => rows_of::<Bf16s, 4>(a, range, out),
        (Elems::Bf16(_), _) => rows_of::<Bf16s, 8>(a, range, out),
        (Elems::F16(_), 64) => rows_of::<F16s, 4>(a, range, out),
        (Elems::F16(_), _) => rows_of::<F16s, 8>(a, range, out),
        (Elems::I8 { .. }, 64) => rows_of::<I8s, 4>(a, range, out),
        (Elems::I8 { .. }, _) => rows_of::<I8s, 8>(a, range, out),
    }
}

/// Per-thread buffers.
struct Scratch {
    /// `[keys rounded up to 16]` element offset of each key's slot, in position order
    offs: Vec<usize>,
    /// the same for the next row (prefetched during the last KV head of this one)
    next: Vec<usize>,
    /// `[heads, dim]` scaled queries, in the cache type's register order
    q: Vec<f32>,
    /// `[group, keys rounded up to 16]` scores, then softmax weights
    w: Vec<f32>,
    /// int8: `[keys rounded up to 16]` key and value scales of one KV head (else empty)
    ks: Vec<f32>,
    vs: Vec<f32>,
}

/// One KV head's cache (the slots' rows shifted to that head) and the row's key offsets;
/// `then`: the keys the next group will score (prefetched near the end of the value pass).
struct Kv<'s, E> {
    k: &'s [E],
    v: &'s [E],
    offs: &'s [usize],
    keys: usize,
    then: Stream<'s, E>,
    /// int8: each key's and value's scale, in `offs` order (else empty)
    ks: &'s [f32],
    vs: &'s [f32],
}

/// Head vectors to prefetch: `offs` into `x`.
#[derive(Clone, Copy)]
struct Stream<'s, E> {
    x: &'s [E],
    offs: &'s [usize],
}

/// How many bytes of head vectors ahead of their use they are prefetched, into L2
/// (measured on the 30-layer benchmark: 8 KiB into L2 beats 1-4 KiB into L1 and 8-16 KiB
/// into L3; it hardly matters when L3 holds the cache).
const AHEAD_BYTES: usize = 8192;

/// Two streams read one after the other, prefetched `AHEAD_BYTES` in advance.
struct Ahead<'s, E> {
    now: Stream<'s, E>,
    then: Stream<'s, E>,
}

impl<E> Ahead<'_, E> {
    /// Prefetches the vector `AHEAD_BYTES` after vector `i` of the chain (nothing past its
    /// end).
    #[inline(always)]
    fn fetch<const NV: usize>(&self, i: usize) {
        let bytes = NV * LANES * std::mem::size_of::<E>();
        let i = i + AHEAD_BYTES / bytes;
        let (x, o) = match self.now.offs.get(i) {
            Some(&o) => (self.now.x, o),
            None => match self.then.offs.get(i - self.now.offs.len()) {
                Some(&o) => (self.then.x, o),
                None => return,
            },
        };
        let p = x.as_ptr().wrapping_add(o).cast::<i8>();
        for line in (0..bytes).step_by(64) {
            // SAFETY: a prefetch is a hint: it reads nothing architecturally and cannot
            // fault, whatever the address (which is in bounds here anyway); SSE, which
            // has it, is part of x86_64.
            unsafe { _mm_prefetch::<_MM_HINT_T1>(p.wrapping_add(line)) }
        }
    }
}

#[target_feature(enable = "avx512f,fma")]
fn rows_of<S: Store, const NV: usize>(
    a: &DecodeArgs<'_>,
    range: Range<usize>,
    out: &mut ElemsMut<'_>,
) {
    let (Some(k), Some(v)) = (S::of(a.k_cache), S::of(a.v_cache)) else {
        unreachable!("validate checked that both caches have one type")
    };
    let d = NV * LANES;
    assert_eq!(a.dim, d);
    let g = a.heads / a.kv_heads;
    let row_len = a.kv_heads * d;
    let most = LANES / NV; // heads of a group: NV * most = 16 registers of sums
    let parts = g.div_ceil(most);
    let (k_scales, v_scales) = (S::scales(a.k_cache), S::scales(a.v_cache));
    let mut s = Scratch {
        offs: Vec::new(),
        next: Vec::new(),
        q: vec![0.0; a.heads * d],
        w: Vec::new(),
        ks: Vec::new(),
        vs: Vec::new(),
    };
    let first_row = range.start;
    let end = range.end;
    if first_row < end {
        row_offsets(a, first_row, key_range(a, first_row), row_len, &mut s.next);
    }
    for r in range {
        std::mem::swap(&mut s.offs, &mut s.next);
        s.next.clear();
        if r + 1 < end {
            row_offsets(a, r + 1, key_range(a, r + 1), row_len, &mut s.next);
        }
        let n_keys = key_range(a, r).len();
        let n_next = if r + 1 < end {
            key_range(a, r + 1).len()
        } else {
            0
        };
        prep_q::<S, NV>(a.q, r * a.heads * d, a.scale, &mut s.q);
        s.w.resize(most * s.offs.len(), 0.0);
        for kvh in 0..a.kv_heads {
            if S::KIND == Kind::I8 {
                // (slot, kvh)'s scale: offset slot * kv_heads * d, so index offset / d + kvh
                s.ks.clear();
                s.ks.extend(s.offs.iter().map(|&o| k_scales[o / d + kvh]));
                s.vs.clear();
                s.vs.extend(s.offs.iter().map(|&o| v_scales[o / d + kvh]));
            }
            let mut h = kvh * g;
            for p in 0..parts {
                let then = if p + 1 < parts {
                    Stream {
                        x: &k[kvh * d..],
                        offs: &s.offs[..n_keys],
                    }
                } else if kvh + 1 < a.kv_heads {
                    Stream {
                        x: &k[(kvh + 1) * d..],
                        offs: &s.offs[..n_keys],
                    }
                } else {
                    Stream {
                        x: k,
                        offs: &s.next[..n_next],
                    }
                };
                let kv = Kv {
                    k: &k[kvh * d..],
                    v: &v[kvh * d..],
                    offs: &s.offs,
                    keys: n_keys,
                    then,
                    ks: &s.ks,
                    vs: &s.vs,
                };
                let hg = g / parts + usize::from(p < g % parts);
                let q = &s.q[h * d..(h + hg) * d];
                let at = ((r - first_row) * a.heads + h) * d;
                match hg {
                    1 => group::<S, NV, 1>(a.softcap, &kv, q, &mut s.w, out, at),
                    2 => group::<S, NV, 2>(a.softcap, &kv, q, &mut s.w, out, at),
                    3 => group::<S, NV, 3>(a.softcap, &kv, q, &mut s.w, out, at),
                    _ => group::<S, NV, 4>(a.softcap, &kv, q, &mut s.w, out, at),
                }
                h += hg;
            }
        }
    }
}

/// The element offsets (`slot * row_len`) of the keys `keys` of row `r`, in order, then
/// the last one repeated up to a multiple of 16.
fn row_offsets(
    a: &DecodeArgs<'_>,
    r: usize,
    keys: Range<usize>,
    row_len: usize,
    out: &mut Vec<usize>,
) {
    out.clear();
    let table = &a.block_tables[r * a.width..(r + 1) * a.width];
    let mut p = keys.start;
    while p < keys.end {
        let col = match a.window {
            Window::Full => p / a.page,
            Window::Sliding { .. } => (p / a.page) % a.width,
        };
        let off = p % a.page;
        let take = (a.page - off).min(keys.end - p);
        let base = table[col] as usize * a.page + off;
        out.extend((base..base + take).map(|slot| slot * row_len));
        p += take;
    }
    let last = *out.last().expect("validate: every row has a key");
    out.resize(out.len().next_multiple_of(LANES), last);
}

/// `dst = q[at..][..heads * dim] * scale`, each head's vector in `S`'s register order.
#[target_feature(enable = "avx512f,fma")]
fn prep_q<S: Store, const NV: usize>(q: Elems<'_>, at: usize, scale: f32, dst: &mut [f32]) {
    let scale = _mm512_set1_ps(scale);
    for (i, pair) in dst.chunks_exact_mut(2 * LANES).enumerate() {
        let from = at + i * 2 * LANES;
        let lo = _mm512_mul_ps(load16(q, from), scale);
        let hi = _mm512_mul_ps(load16(q, from + LANES), scale);
        let (lo, hi) = if S::KIND == Kind::Bf16 {
            deinterleave(lo, hi)
        } else {
            (lo, hi)
        };
        let (a, b) = pair.split_at_mut(LANES);
        store_f32(a, lo);
        store_f32(b, hi);
    }
}

/// The query heads `q` (`[HG, dim]`, register order) of one KV head: scores, softmax and
/// weighted values; writes `out[at..][..HG * dim]`.
#[target_feature(enable = "avx512f,fma")]
fn group<S: Store, const NV: usize, const HG: usize>(
    softcap: Option<f32>,
    kv: &Kv<'_, S::E>,
    q: &[f32],
    w: &mut [f32],
    out: &mut ElemsMut<'_>,
    at: usize,
) {
    let d = NV * LANES;
    let kp = kv.offs.len();
    let mut qv = [[_mm512_setzero_ps(); NV]; HG];
    for (i, qh) in qv.iter_mut().enumerate() {
        for (c, x) in qh.iter_mut().enumerate() {
            *x = load_f32(&q[i * d + c * LANES..]);
        }
    }
    let ahead = Ahead {
        now: Stream {
            x: kv.k,
            offs: &kv.offs[..kv.keys],
        },
        then: Stream {
            x: kv.v,
            offs: &kv.offs[..kv.keys],
        },
    };
    for (b, block) in kv.offs.chunks_exact(LANES).enumerate() {
        let block: &[usize; LANES] = block.try_into().expect("chunks of 16");
        let mut s = scores16::<S, NV, HG>(&qv, kv.k, block, &ahead, b * LANES);
        if S::KIND == Kind::I8 {
            let scale = load_f32(&kv.ks[b * LANES..]);
            for si in s.iter_mut() {
                *si = _mm512_mul_ps(*si, scale);
            }
        }
        for (i, si) in s.iter().enumerate() {
            store_f32(&mut w[i * kp + b * LANES..], *si);
        }
    }
    let mut inv = [0f32; HG];
    for (i, z) in inv.iter_mut().enumerate() {
        let wi = &mut w[i * kp..(i + 1) * kp];
        if let Some(cap) = softcap {
            for x in wi[..kv.keys].iter_mut() {
                *x = (*x / cap).tanh() * cap;
            }
        }
        wi[kv.keys..].fill(f32::NEG_INFINITY);
        *z = softmax(wi);
        if S::KIND == Kind::I8 {
            // weight * (scale * value): the scale folded into the weight
            for (x, &sc) in wi.iter_mut().zip(kv.vs) {
                *x *= sc;
            }
        }
    }
    let acc = values::<S, NV, HG>(kv, w);
    for (i, (acc, &z)) in acc.iter().zip(&inv).enumerate() {
        let z = _mm512_set1_ps(z);
        for pair in 0..NV / 2 {
            let lo = _mm512_mul_ps(acc[2 * pair], z);
            let hi = _mm512_mul_ps(acc[2 * pair + 1], z);
            let (lo, hi) = if S::KIND == Kind::Bf16 {
                interleave(lo, hi)
            } else {
                (lo, hi)
            };
            let o = at + i * d + pair * 2 * LANES;
            store16(out, o, lo);
            store16(out, o + LANES, hi);
        }
    }
}

/// The scores of the 16 keys at `offs` for the `HG` query heads `q`: one vector of 16
/// (key order) per head. Quad `p` (keys `p, p + 4, p + 8, p + 12`) puts key `4 * l + p` in
/// its 128-bit lane `l`; the last two levels make element `4 * l + p` of the result.
#[target_feature(enable = "avx512f,fma")]
#[inline]
fn scores16<S: Store, const NV: usize, const HG: usize>(
    q: &[[__m512; NV]; HG],
    k: &[S::E],
    offs: &[usize; LANES],
    ahead: &Ahead<'_, S::E>,
    first: usize,
) -> [__m512; HG] {
    let d = NV * LANES;
    let mut quads = [[_mm512_setzero_ps(); HG]; 4];
    for (p, quad) in quads.iter_mut().enumerate() {
        for i in 0..4 {
            ahead.fetch::<NV>(first + 4 * p + i);
        }
        let ab = fold1(
            dots::<S, NV, HG>(q, &k[offs[p]..][..d]),
            dots::<S, NV, HG>(q, &k[offs[p + 4]..][..d]),
        );
        let cd = fold1(
            dots::<S, NV, HG>(q, &k[offs[p + 8]..][..d]),
            dots::<S, NV, HG>(q, &k[offs[p + 12]..][..d]),
        );
        *quad = fold2(ab, cd);
    }
    fold4(fold3(quads[0], quads[1]), fold3(quads[2], quads[3]))
}

/// Per head, the 16 lane-wise partial sums of `q[h] . key` (`key`: one head vector).
#[target_feature(enable = "avx512f,fma")]
#[inline]
fn dots<S: Store, const NV: usize, const HG: usize>(
    q: &[[__m512; NV]; HG],
    key: &[S::E],
) -> [__m512; HG] {
    let k = widen::<S, NV>(key);
    let mut t = [_mm512_setzero_ps(); HG];
    for (t, qh) in t.iter_mut().zip(q) {
        let mut s = _mm512_mul_ps(qh[0], k[0]);
        for c in 1..NV {
            s = _mm512_fmadd_ps(qh[c], k[c], s);
        }
        *t = s;
    }
    t
}

/// Level 1 of the reduction: `a`'s 16 lanes summed into 128-bit lanes 0-1, `b`'s into 2-3.
#[target_feature(enable = "avx512f")]
#[inline]
fn fold1<const HG: usize>(a: [__m512; HG], b: [__m512; HG]) -> [__m512; HG] {
    let mut o = a;
    for ((o, a), b) in o.iter_mut().zip(a).zip(b) {
        *o = _mm512_add_ps(
            _mm512_shuffle_f32x4::<0x44>(a, b),
            _mm512_shuffle_f32x4::<0xEE>(a, b),
        );
    }
    o
}

/// Level 2: two level-1 pairs into one 128-bit lane per key (`a`'s two keys, then `b`'s).
#[target_feature(enable = "avx512f")]
#[inline]
fn fold2<const HG: usize>(a: [__m512; HG], b: [__m512; HG]) -> [__m512; HG] {
    let mut o = a;
    for ((o, a), b) in o.iter_mut().zip(a).zip(b) {
        *o = _mm512_add_ps(
            _mm512_shuffle_f32x4::<0x88>(a, b),
            _mm512_shuffle_f32x4::<0xDD>(a, b),
        );
    }
    o
}

/// Level 3: in each 128-bit lane, `a`'s key in elements 0-1, `b`'s in 2-3.
#[target_feature(enable = "avx512f")]
#[inline]
fn fold3<const HG: usize>(a: [__m512; HG], b: [__m512; HG]) -> [__m512; HG] {
    let mut o = a;
    for ((o, a), b) in o.iter_mut().zip(a).zip(b) {
        *o = _mm512_add_ps(
            _mm512_shuffle_ps::<0x44>(a, b),
            _mm512_shuffle_ps::<0xEE>(a, b),
        );
    }
    o
}

/// Level 4: one element per key: lane `l` holds `[a's 2 keys, b's 2 keys]` of lane `l`.
#[target_feature(enable = "avx512f")]
#[inline]
fn fold4<const HG: usize>(a: [__m512; HG], b: [__m512; HG]) -> [__m512; HG] {
    let mut o = a;
    for ((o, a), b) in o.iter_mut().zip(a).zip(b) {
        *o = _mm512_add_ps(
            _mm512_shuffle_ps::<0x88>(a, b),
            _mm512_shuffle_ps::<0xDD>(a, b),
        );
    }
    o
}

/// `sum_j w[h][j] * value_j` for the group's heads (`w`: `[HG, offs.len()]`), in registers;
/// two sets of sums over alternate keys when one set is too short to hide FMA latency.
#[target_feature(enable = "avx512f,fma")]
#[inline]
fn values<S: Store, const NV: usize, const HG: usize>(
    kv: &Kv<'_, S::E>,
    w: &[f32],
) -> [[__m512; NV]; HG] {
    let d = NV * LANES;
    let kp = kv.offs.len();
    let offs = &kv.offs[..kv.keys];
    let wts: [&[f32]; HG] = std::array::from_fn(|i| &w[i * kp..i * kp + kv.keys]);
    let ahead = Ahead {
        now: Stream { x: kv.v, offs },
        then: kv.then,
    };
    let mut acc = [[_mm512_setzero_ps(); NV]; HG];
    let mut j = 0;
    if HG * NV < 8 {
        let mut acc2 = acc;
        while j + 2 <= offs.len() {
            ahead.fetch::<NV>(j);
            ahead.fetch::<NV>(j + 1);
            let v0 = widen::<S, NV>(&kv.v[offs[j]..][..d]);
            let v1 = widen::<S, NV>(&kv.v[offs[j + 1]..][..d]);
            for ((a0, a1), wt) in acc.iter_mut().zip(acc2.iter_mut()).zip(&wts) {
                let (w0, w1) = (_mm512_set1_ps(wt[j]), _mm512_set1_ps(wt[j + 1]));
                for c in 0..NV {
                    a0[c] = _mm512_fmadd_ps(w0, v0[c], a0[c]);
                    a1[c] = _mm512_fmadd_ps(w1, v1[c], a1[c]);
                }
            }
            j += 2;
        }
        for (a0, a1) in acc.iter_mut().zip(acc2) {
            for (x, y) in a0.iter_mut().zip(a1) {
                *x = _mm512_add_ps(*x, y);
            }
        }
    }
    for (j, &o) in offs.iter().enumerate().skip(j) {
        ahead.fetch::<NV>(j);
        let v = widen::<S, NV>(&kv.v[o..][..d]);
        for (a, wt) in acc.iter_mut().zip(&wts) {
            let w0 = _mm512_set1_ps(wt[j]);
            for c in 0..NV {
                a[c] = _mm512_fmadd_ps(w0, v[c], a[c]);
            }
        }
    }
    acc
}

/// `x = exp(x - max x)` in place (`x.len()` a multiple of 16, `-inf` allowed); returns
/// `1 / sum x`.
#[target_feature(enable = "avx512f,fma")]
fn softmax(x: &mut [f32]) -> f32 {
    let mut m = _mm512_set1_ps(f32::NEG_INFINITY);
    for c in x.chunks_exact(LANES) {
        m = _mm512_max_ps(m, load_f32(c));
    }
    let m = _mm512_set1_ps(_mm512_reduce_max_ps(m));
    let mut z = _mm512_setzero_ps();
    for c in x.chunks_exact_mut(LANES) {
        let e = exp16(_mm512_sub_ps(load_f32(c), m));
        store_f32(c, e);
        z = _mm512_add_ps(z, e);
    }
    1.0 / _mm512_reduce_add_ps(z)
}

/// `exp` of 16 lanes `<= 0`: the same operations, in the same order, as
/// `super::exp_in_place` (so the same results).
#[target_feature(enable = "avx512f")]
#[inline]
pub(crate) fn exp16(x: __m512) -> __m512 {
    let c = _mm512_set1_ps;
    let v = _mm512_max_ps(x, c(-87.0));
    let round = c(12_582_912.0);
    let fx = _mm512_sub_ps(
        _mm512_add_ps(_mm512_mul_ps(v, c(std::f32::consts::LOG2_E)), round),
        round,
    );
    let r = _mm512_sub_ps(
        _mm512_sub_ps(v, _mm512_mul_ps(fx, c(0.693_359_4))),
        _mm512_mul_ps(fx, c(-2.121_944_4e-4)),
    );
    let mut y = c(1.987_569_1e-4);
    for k in [
        1.398_2e-3,
        8.333_452e-3,
        4.166_579_6e-2,
        1.666_666_5e-1,
        0.5,
    ] {
        y = _mm512_add_ps(_mm512_mul_ps(y, r), c(k));
    }
    y = _mm512_add_ps(
        _mm512_add_ps(_mm512_mul_ps(_mm512_mul_ps(y, r), r), r),
        c(1.0),
    );
    let e = _mm512_add_epi32(_mm512_cvttps_epi32(fx), _mm512_set1_epi32(127));
    let pow2 = _mm512_castsi512_ps(_mm512_slli_epi32::<23>(e));
    let under = _mm512_cmp_ps_mask::<_CMP_LT_OQ>(x, c(-87.0));
    _mm512_maskz_mul_ps(!under, y, pow2)
}

/// One head vector (`NV * 16` elements at the start of `x`) widened to f32, in `S`'s
/// register order: natural for f32 / f16 / int8 (unscaled); for bf16, register `2p` holds elements
/// `32p, 32p + 2, ..` and register `2p + 1` elements `32p + 1, 32p + 3, ..`.
#[target_feature(enable = "avx512f")]
#[inline]
fn widen<S: Store, const NV: usize>(x: &[S::E]) -> [__m512; NV] {
    let x = &x[..NV * LANES];
    let p = x.as_ptr();
    let mut v = [_mm512_setzero_ps(); NV];
    match S::KIND {
        Kind::F32 => {
            for (c, o) in v.iter_mut().enumerate() {
                // SAFETY: `E` is f32 (`Store`'s contract) and `16 * c + 16 <= x.len()`.
                *o = unsafe { _mm512_loadu_ps(p.cast::<f32>().add(c * LANES)) };
            }
        }
        Kind::F16 => {
            for (c, o) in v.iter_mut().enumerate() {
                // SAFETY: `E` is u16 and `16 * c + 16 <= x.len()`: 32 bytes in bounds.
                let h = unsafe { _mm256_loadu_si256(p.cast::<u16>().add(c * LANES).cast()) };
                *o = _mm512_cvtph_ps(h);
            }
        }
        Kind::I8 => {
            for (c, o) in v.iter_mut().enumerate() {
                // SAFETY: `E` is i8 and `16 * c + 16 <= x.len()`: 16 bytes in bounds.
                let b = unsafe { _mm_loadu_si128(p.cast::<i8>().add(c * LANES).cast()) };
                *o = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
            }
        }
        Kind::Bf16 => {
            let high = _mm512_set1_epi32(0xFFFF_0000_u32 as i32);
            for pair in 0..NV / 2 {
                // SAFETY: `E` is u16 and `32 * pair + 32 <= x.len()`: 64 bytes in bounds.
                let b = unsafe { _mm512_loadu_si512(p.cast::<u16>().add(pair * 2 * LANES).cast()) };
                v[2 * pair] = _mm512_castsi512_ps(_mm512_slli_epi32::<16>(b));
                v[2 * pair + 1] = _mm512_castsi512_ps(_mm512_and_si512(b, high));
            }
        }
    }
    v
}

/// Natural order `(x[0..16], x[16..32])` to bf16 register order (evens, odds).
#[target_feature(enable = "avx512f")]
#[inline]
fn deinterleave(lo: __m512, hi: __m512) -> (__m512, __m512) {
    let even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    let odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
    (
        _mm512_permutex2var_ps(lo, even, hi),
        _mm512_permutex2var_ps(lo, odd, hi),
    )
}

/// Inverse of `deinterleave`.
#[target_feature(enable = "avx512f")]
#[inline]
fn interleave(even: __m512, odd: __m512) -> (__m512, __m512) {
    let lo = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    let hi = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
    (
        _mm512_permutex2var_ps(even, lo, odd),
        _mm512_permutex2var_ps(even, hi, odd),
    )
}

/// `x[0..16]`.
#[target_feature(enable = "avx512f")]
#[inline]
fn load_f32(x: &[f32]) -> __m512 {
    let x = &x[..LANES];
    // SAFETY: `x` has 16 elements.
    unsafe { _mm512_loadu_ps(x.as_ptr()) }
}

/// `x[0..16] = v`.
#[target_feature(enable = "avx512f")]
#[inline]
fn store_f32(x: &mut [f32], v: __m512) {
    let x = &mut x[..LANES];
    // SAFETY: `x` has 16 elements, borrowed uniquely.
    unsafe { _mm512_storeu_ps(x.as_mut_ptr(), v) }
}

/// `e[at..at + 16]` widened to f32 (natural order).
#[target_feature(enable = "avx512f")]
#[inline]
fn load16(e: Elems<'_>, at: usize) -> __m512 {
    match e {
        Elems::F32(s) => load_f32(&s[at..]),
        Elems::Bf16(s) => {
            let s = &s[at..at + LANES];
            // SAFETY: `s` has 16 u16 elements: 32 bytes.
            let h = unsafe { _mm256_loadu_si256(s.as_ptr().cast()) };
            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)))
        }
        Elems::F16(s) => {
            let s = &s[at..at + LANES];
            // SAFETY: as above.
            let h = unsafe { _mm256_loadu_si256(s.as_ptr().cast()) };
            _mm512_cvtph_ps(h)
        }
        Elems::I8 { .. } => unreachable!("queries and caches here are never int8"),
    }
}

/// `out[at..at + 16] = v`, rounded to nearest even (bf16 exactly as `half::bf16::from_f32`,
/// NaN included; f16 by the hardware conversion).
#[target_feature(enable = "avx512f")]
#[inline]
fn store16(out: &mut ElemsMut<'_>, at: usize, v: __m512) {
    match out {
        ElemsMut::F32(s) => store_f32(&mut s[at..], v),
        ElemsMut::Bf16(s) => {
            let s = &mut s[at..at + LANES];
            let h = _mm512_cvtepi32_epi16(bf16_bits(v));
            // SAFETY: `s` has 16 u16 elements (32 bytes), borrowed uniquely.
            unsafe { _mm256_storeu_si256(s.as_mut_ptr().cast(), h) }
        }
        ElemsMut::F16(s) => {
            let s = &mut s[at..at + LANES];
            let h = _mm512_cvtps_ph::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(v);
            // SAFETY: as above.
            unsafe { _mm256_storeu_si256(s.as_mut_ptr().cast(), h) }
        }
    }
}

/// The bf16 bit patterns of `v` (in the low 16 bits of each lane), rounded to nearest even;
/// a NaN keeps its top bits and gets the quiet bit.
#[target_feature(enable = "avx512f")]
#[inline]
fn bf16_bits(v: __m512) -> __m512i {
    let b = _mm512_castps_si512(v);
    let one = _mm512_set1_epi32(1);
    let lsb = _mm512_and_si512(_mm512_srli_epi32::<16>(b), one);
    let rounded = _mm512_add_epi32(b, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), lsb));
    let abs = _mm512_and_si512(b, _mm512_set1_epi32(0x7FFF_FFFF));
    let nan = _mm512_cmpgt_epu32_mask(abs, _mm512_set1_epi32(0x7F80_0000));
    let quiet = _mm512_or_si512(b, _mm512_set1_epi32(0x0040_0000));
    _mm512_srli_epi32::<16>(_mm512_mask_mov_epi32(rounded, nan, quiet))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::isa::{require_or_skip, Isa};

    /// The gate of these tests: AVX-512F and FMA here (else a reported skip, or a failure
    /// where `FERROBATCH_REQUIRE_ISA` names one).
    fn avx512() -> bool {
        require_or_skip(&[Isa::Avx512F, Isa::Fma])
    }

    #[test]
    fn exp16_is_exp_in_place() {
        if !avx512() {
            return;
        }
        let mut x: Vec<f32> = (0..4096).map(|i| -(i as f32) * 0.0273).collect();
        x.extend([f32::NEG_INFINITY, -87.0, -86.99, -88.0, 0.0, -0.0, -1e-30]);
        x.resize(x.len().next_multiple_of(LANES), -3.0);
        let mut want = x.clone();
        super::super::exp_in_place(&mut want);
        for (c, w) in x.chunks_exact(LANES).zip(want.chunks_exact(LANES)) {
            let mut got = [0f32; LANES];
            // SAFETY: AVX-512F was detected above.
            unsafe { store_f32(&mut got, exp16(load_f32(c))) };
            for (g, w) in got.iter().zip(w) {
                assert_eq!(g.to_bits(), w.to_bits());
            }
        }
    }

    #[test]
    fn bf16_rounding_is_half_s() {
        if !avx512() {
            return;
        }
        let mut bits: Vec<u32> = (0..1 << 16)
            .map(|i: u32| i.wrapping_mul(0x9E37_79B9))
            .collect();
        bits.extend([
            0x7F80_0000,
            0xFF80_0000,
            0x7F80_0001,
            0x7FC0_0000,
            0xFFFF_FFFF,
            0x7F7F_FFFF,
            0x0000_8000,
            0x0001_8000,
            0x0000_7FFF,
            0x3F80_8000,
            0x3F81_8000,
            0,
        ]);
        bits.resize(bits.len().next_multiple_of(LANES), 1);
        for c in bits.chunks_exact(LANES) {
            let f: Vec<f32> = c.iter().map(|&b| f32::from_bits(b)).collect();
            let mut got = [0u16; LANES];
            // SAFETY: AVX-512F was detected above.
            unsafe { store16(&mut ElemsMut::Bf16(&mut got), 0, load_f32(&f)) };
            for (g, x) in got.iter().zip(&f) {
                assert_eq!(*g, half::bf16::from_f32(*x).to_bits(), "{:#x}", x.to_bits());
            }
        }
    }

    #[test]
    fn interleave_inverts_deinterleave() {
        if !avx512() {
            return;
        }
        let x: Vec<f32> = (0..32).map(|i| i as f32).collect();
        let (mut e, mut o, mut lo, mut hi) = ([0f32; 16], [0f32; 16], [0f32; 16], [0f32; 16]);
        // SAFETY: AVX-512F was detected above.
        unsafe {
            let (a, b) = deinterleave(load_f32(&x), load_f32(&x[16..]));
            store_f32(&mut e, a);
            store_f32(&mut o, b);
            let (c, d) = interleave(a, b);
            store_f32(&mut lo, c);
            store_f32(&mut hi, d);
        }
        for j in 0..16 {
            assert_eq!(e[j], (2 * j) as f32);
            assert_eq!(o[j], (2 * j + 1) as f32);
        }
        assert_eq!([lo, hi].concat(), x);
    }
}
