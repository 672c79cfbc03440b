//! Paged attention for decode rows (one query token per row), read in place.
//!
//! Layout (ARCHITECTURE.md §3): the cache of one layer is `[slots, kv_heads, dim]`, a chunk
//! `c` owns slots `c * page .. (c + 1) * page`. Row `r` sees the positions of its request:
//!
//! * full attention: `0 .. seqlens[r]`, position `p` at slot
//!   `table[r][p / page] * page + p % page`;
//! * sliding window `w` with a ring of `R = width` chunks: `max(0, n - w) .. n`
//!   (`n = seqlens[r]`), position `p` at slot `table[r][(p / page) % R] * page + p % page`.
//!
//! The step's own key and value are already in the cache (the caller writes first). Query
//! head `h` reads KV head `h / (heads / kv_heads)`. Scores, softmax and the weighted sum are
//! fp32 whatever the storage type (bf16 / fp16 values are widened exactly); the output is
//! rounded once to its own type.
//!
//! Paths, chosen per call by runtime CPU detection: head_dim 64 and 128 on AVX-512F + FMA
//! take the `avx512` module (KV head outer, query heads and sums in registers); other head
//! sizes on AVX-512, and everything on AVX2 or without SIMD, take the generic loop
//! `rows_impl`. They differ only in the order of fp32 additions.
//!
//! An int8 cache ([`Elems::I8`], one scale per slot and KV head) is read in place, never as
//! a dequantized copy: `rows_impl` dequantizes each key and value slot into its fp32
//! scratch row as it reads it; the AVX-512 path widens the integers into registers and
//! applies the scales to the scores (keys) and the softmax weights (values).

use crate::error::KernelError;
use half::{bf16, f16};

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx512;

/// A read-only tensor's elements in one of the storage types.
#[derive(Clone, Copy, Debug)]
pub enum Elems<'a> {
    F32(&'a [f32]),
    /// bf16 bit patterns
    Bf16(&'a [u16]),
    /// IEEE half bit patterns
    F16(&'a [u16]),
    /// symmetric int8 with one fp32 scale per `group` consecutive elements: element `i` is
    /// `data[i] * scales[i / group]` (a KV cache: one scale per slot and KV head, `group` =
    /// head_dim)
    I8 {
        data: &'a [i8],
        scales: &'a [f32],
        group: usize,
    },
}

/// A writable tensor's elements in one of the storage types.
#[derive(Debug)]
pub enum ElemsMut<'a> {
    F32(&'a mut [f32]),
    Bf16(&'a mut [u16]),
    F16(&'a mut [u16]),
}

/// Which positions a row's query sees.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Window {
    Full,
    /// the last `window` positions, through a ring of `width` chunks per row
    Sliding {
        window: usize,
    },
}

/// The inputs of one call; shapes in the field docs (row-major, contiguous).
#[derive(Clone, Copy, Debug)]
pub struct DecodeArgs<'a> {
    /// `[rows, heads, dim]`
    pub q: Elems<'a>,
    /// `[slots, kv_heads, dim]`, `slots` a multiple of `page`
    pub k_cache: Elems<'a>,
    /// same shape and type as `k_cache`
    pub v_cache: Elems<'a>,
    /// `[rows, width]` chunk ids
    pub block_tables: &'a [i32],
    /// `[rows]` keys of each row (its cached positions plus the new one), >= 1
    pub seqlens: &'a [i32],
    pub heads: usize,
    pub kv_heads: usize,
    pub dim: usize,
    pub page: usize,
    pub width: usize,
    pub window: Window,
    /// multiplies every score
    pub scale: f32,
    /// scores become `tanh(s / c) * c` (Gemma 2)
    pub softcap: Option<f32>,
    /// threads of the kernel pool ([`crate::parallel`]) the rows are split between; 1 runs
    /// on the caller's thread
    pub threads: usize,
}

/// What is wrong with a call: the arguments do not fit the layout.
pub(crate) fn err<T>(msg: String) -> Result<T, KernelError> {
    Err(KernelError::Layout(msg))
}

impl Elems<'_> {
    pub(crate) fn len(&self) -> usize {
        match self {
            Elems::F32(s) => s.len(),
            Elems::Bf16(s) | Elems::F16(s) => s.len(),
            Elems::I8 { data, .. } => data.len(),
        }
    }

    /// Whether the elements are int8 with scales (read dequantized).
    pub(crate) fn is_quantized(&self) -> bool {
        matches!(self, Elems::I8 { .. })
    }

    /// `out[i] = self[start + i]` widened to f32.
    #[inline(always)]
    pub(crate) fn load(&self, start: usize, out: &mut [f32]) {
        let n = out.len();
        match self {
            Elems::F32(s) => out.copy_from_slice(&s[start..start + n]),
            Elems::Bf16(s) => {
                for (o, &b) in out.iter_mut().zip(&s[start..start + n]) {
                    *o = f32::from_bits((b as u32) << 16);
                }
            }
            Elems::F16(s) => {
                for (o, &b) in out.iter_mut().zip(&s[start..start + n]) {
                    *o = f16::from_bits(b).to_f32();
                }
            }
            Elems::I8 {
                data,
                scales,
                group,
            } => dequantize(&data[start..start + n], scales, start, *group, out),
        }
    }
}

/// `out[i] = data[i] * scales[(start + i) / group]`: int8 elements starting at element
/// `start` of their tensor, each group (a KV head's vector) times its scale.
#[inline(always)]
fn dequantize(data: &[i8], scales: &[f32], start: usize, group: usize, out: &mut [f32]) {
    let mut i = 0;
    while i < data.len() {
        let at = start + i;
        let take = (group - at % group).min(data.len() - i);
        let s = scales[at / group];
        for (o, &x) in out[i..i + take].iter_mut().zip(&data[i..i + take]) {
            *o = f32::from(x) * s;
        }
        i += take;
    }
}

impl<'a> ElemsMut<'a> {
    pub(crate) fn len(&self) -> usize {
        match self {
            ElemsMut::F32(s) => s.len(),
            ElemsMut::Bf16(s) | ElemsMut::F16(s) => s.len(),
        }
    }

    /// Consecutive pieces of `piece` elements (the last may be shorter).
    fn split(self, piece: usize) -> Vec<ElemsMut<'a>> {
        match self {
            ElemsMut::F32(s) => s.chunks_mut(piece).map(ElemsMut::F32).collect(),
            ElemsMut::Bf16(s) => s.chunks_mut(piece).map(ElemsMut::Bf16).collect(),
            ElemsMut::F16(s) => s.chunks_mut(piece).map(ElemsMut::F16).collect(),
        }
    }

    /// `self[start + i] = vals[i] * mul`, rounded to nearest even.
    pub(crate) fn store(&mut self, start: usize, vals: &[f32], mul: f32) {
        let n = vals.len();
        match self {
            ElemsMut::F32(s) => {
                for (o, &v) in s[start..start + n].iter_mut().zip(vals) {
                    *o = v * mul;
                }
            }
            ElemsMut::Bf16(s) => {
                for (o, &v) in s[start..start + n].iter_mut().zip(vals) {
                    *o = bf16::from_f32(v * mul).to_bits();
                }
            }
            ElemsMut::F16(s) => {
                for (o, &v) in s[start..start + n].iter_mut().zip(vals) {
                    *o = f16::from_f32(v * mul).to_bits();
                }
            }
        }
    }
}

fn same_kind(a: &Elems<'_>, b: &Elems<'_>) -> bool {
    std::mem::discriminant(a) == std::mem::discriminant(b)
}

/// Checks every shape, length and chunk id `paged_decode_attention` will use; returns the
/// number of slots of the cache.
fn validate(a: &DecodeArgs<'_>, out_len: usize) -> Result<usize, KernelError> {
    let rows = a.seqlens.len();
    let q_len = rows * a.heads * a.dim;
    if a.q.len() != q_len || out_len != q_len {
        return err(format!(
            "q and out must have rows*heads*dim = {q_len} elements (q {}, out {out_len})",
            a.q.len()
        ));
    }
    validate_cache(a)
}

/// Checks everything of `a` but the lengths of `q` and the output (shared with the prefill
/// kernel, whose queries are laid out by token): sizes, tables, chunk ids, cache lengths
/// and types; returns the number of slots of the cache.
pub(crate) fn validate_cache(a: &DecodeArgs<'_>) -> Result<usize, KernelError> {
    let rows = a.seqlens.len();
    if a.heads == 0 || a.kv_heads == 0 || a.dim == 0 || a.page == 0 || a.width == 0 {
        return err("heads, kv_heads, dim, page and width must be >= 1".into());
    }
    if !a.heads.is_multiple_of(a.kv_heads) {
        return err(format!(
            "heads ({}) must be a multiple of kv_heads ({})",
            a.heads, a.kv_heads
        ));
    }
    if a.block_tables.len() != rows * a.width {
        return err(format!(
            "block_tables must have rows*width = {} entries, not {}",
            rows * a.width,
            a.block_tables.len()
        ));
    }
    if !same_kind(&a.k_cache, &a.v_cache) || a.k_cache.len() != a.v_cache.len() {
        return err("k_cache and v_cache must have the same type and length".into());
    }
    if a.q.is_quantized() {
        return err("q must be float32, bfloat16 or float16, not int8".into());
    }
    for (name, c) in [("k", &a.k_cache), ("v", &a.v_cache)] {
        if let Elems::I8 {
            data,
            scales,
            group,
        } = c
        {
            if *group != a.dim || scales.len() * a.dim != data.len() {
                return err(format!(
                    "{name}_scales must have one scale per slot and KV head ({} for {} \
                     elements of head size {}), with group = head size, not {} (group {group})",
                    data.len() / a.dim,
                    data.len(),
                    a.dim,
                    scales.len()
                ));
            }
        }
    }
    let row = a.kv_heads * a.dim;
    if !a.k_cache.len().is_multiple_of(row * a.page) {
        return err(format!(
            "cache length {} is not a whole number of chunks of page*kv_heads*dim = {}",
            a.k_cache.len(),
            row * a.page
        ));
    }
    let slots = a.k_cache.len() / row;
    let chunks = slots / a.page;
    if let Window::Sliding { window } = a.window {
        if window == 0 {
            return err("sliding window must be >= 1".into());
        }
    }
    for (r, &n) in a.seqlens.iter().enumerate() {
        if n < 1 {
            return err(format!(
                "seqlens[{r}] = {n}: every row needs at least one key"
            ));
        }
        let n = n as usize;
        let used = match a.window {
            Window::Full => {
                let need = n.div_ceil(a.page);
                if need > a.width {
                    return err(format!(
                        "row {r}: {n} keys need {need} chunks, the table has {}",
                        a.width
                    ));
                }
                need
            }
            Window::Sliding { .. } => a.width,
        };
        for (col, &c) in a.block_tables[r * a.width..r * a.width + used]
            .iter()
            .enumerate()
        {
            if c < 0 || c as usize >= chunks {
                return err(format!(
                    "block_tables[{r}][{col}] = {c} is outside the cache's {chunks} chunks"
                ));
            }
        }
    }
    Ok(slots)
}

/// Attention of each row's query over its cached keys and values; writes `out`
/// (`[rows, heads, dim]`). Every index is checked first: a bad argument is an error, never
/// a read outside the slices.
pub fn paged_decode_attention(a: &DecodeArgs<'_>, out: ElemsMut<'_>) -> Result<(), KernelError> {
    validate(a, out.len())?;
    let rows = a.seqlens.len();
    if rows == 0 {
        return Ok(());
    }
    let threads = a.threads.clamp(1, rows);
    if threads == 1 {
        run_rows(a, 0..rows, out);
        return Ok(());
    }
    let per = rows.div_ceil(threads);
    let pieces = out.split(per * a.heads * a.dim);
    let ranges = crate::parallel::row_ranges(rows, threads);
    crate::parallel::run_pieces(ranges.into_iter().zip(pieces).collect(), |range, piece| {
        run_rows(a, range, piece)
    });
    Ok(())
}

/// Rows `range`, written to `out` (which starts at the first of them).
fn run_rows(a: &DecodeArgs<'_>, range: std::ops::Range<usize>, mut out: ElemsMut<'_>) {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("fma")
        {
            if avx512::handles(a.dim) {
                // SAFETY: `avx512::rows` is safe but for its target features, AVX-512F and
                // FMA, both just detected on this CPU (its reads are bounds-checked slices).
                unsafe { avx512::rows(a, range, &mut out) };
                return;
            }
            // SAFETY: `rows_avx512` only differs from `rows_portable` in the instructions the
            // compiler may use (AVX-512F, FMA), and both were just detected on this CPU.
            unsafe { rows_avx512(a, range, &mut out) };
            return;
        }
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
        {
            // SAFETY: as above, for AVX2 and FMA, detected on this CPU.
            unsafe { rows_avx2(a, range, &mut out) };
            return;
        }
    }
    rows_portable(a, range, &mut out);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,fma")]
fn rows_avx512(a: &DecodeArgs<'_>, range: std::ops::Range<usize>, out: &mut ElemsMut<'_>) {
    rows_impl::<Avx512>(a, range, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn rows_avx2(a: &DecodeArgs<'_>, range: std::ops::Range<usize>, out: &mut ElemsMut<'_>) {
    rows_impl::<Portable>(a, range, out)
}

fn rows_portable(a: &DecodeArgs<'_>, range: std::ops::Range<usize>, out: &mut ElemsMut<'_>) {
    rows_impl::<Portable>(a, range, out)
}

/// The two inner products of the kernel.
trait Vector {
    /// `sum a[i] * b[i]` over the shorter length.
    fn dot(a: &[f32], b: &[f32]) -> f32;
    /// `acc[i] += w * x[i]` over the shorter length.
    fn axpy(acc: &mut [f32], w: f32, x: &[f32]);
}

/// Plain Rust, vectorized as well as the compiler manages.
struct Portable;

impl Vector for Portable {
    #[inline(always)]
    fn dot(a: &[f32], b: &[f32]) -> f32 {
        dot(a, b)
    }
    #[inline(always)]
    fn axpy(acc: &mut [f32], w: f32, x: &[f32]) {
        axpy(acc, w, x)
    }
}

/// AVX-512F, 16 lanes. Only used by `rows_avx512`, i.e. after AVX-512F was detected.
#[cfg(target_arch = "x86_64")]
struct Avx512;

#[cfg(target_arch = "x86_64")]
impl Vector for Avx512 {
    #[inline(always)]
    fn dot(a: &[f32], b: &[f32]) -> f32 {
        // SAFETY: `Avx512` is only instantiated inside `rows_avx512`, which runs only after
        // `is_x86_feature_detected!("avx512f")` (see `run_rows`).
        unsafe { dot512(a, b) }
    }
    #[inline(always)]
    fn axpy(acc: &mut [f32], w: f32, x: &[f32]) {
        // SAFETY: as in `dot`.
        unsafe { axpy512(acc, w, x) }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
fn dot512(a: &[f32], b: &[f32]) -> f32 {
    use std::arch::x86_64::*;
    let n = a.len().min(b.len());
    let mut acc = _mm512_setzero_ps();
    let mut i = 0;
    while i + 16 <= n {
        // SAFETY: i + 16 <= n <= both lengths, so the 16 floats read from each are in bounds.
        let (x, y) = unsafe {
            (
                _mm512_loadu_ps(a.as_ptr().add(i)),
                _mm512_loadu_ps(b.as_ptr().add(i)),
            )
        };
        acc = _mm512_fmadd_ps(x, y, acc);
        i += 16;
    }
    let mut sum = _mm512_reduce_add_ps(acc);
    for j in i..n {
        sum += a[j] * b[j];
    }
    sum
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
fn axpy512(acc: &mut [f32], w: f32, x: &[f32]) {
    use std::arch::x86_64::*;
    let n = acc.len().min(x.len());
    let wv = _mm512_set1_ps(w);
    let mut i = 0;
    while i + 16 <= n {
        // SAFETY: i + 16 <= n <= both lengths: the 16 floats read from `x` and read and
        // written in `acc` (a unique borrow) are in bounds.
        unsafe {
            let p = acc.as_mut_ptr().add(i);
            let v = _mm512_fmadd_ps(wv, _mm512_loadu_ps(x.as_ptr().add(i)), _mm512_loadu_ps(p));
            _mm512_storeu_ps(p, v);
        }
        i += 16;
    }
    for j in i..n {
        acc[j] += w * x[j];
    }
}

/// The positions row `r` attends to (its slots: see the module doc).
fn key_range(a: &DecodeArgs<'_>, r: usize) -> std::ops::Range<usize> {
    let n = a.seqlens[r] as usize;
    match a.window {
        Window::Full => 0..n,
        Window::Sliding { window } => n - n.min(window)..n,
    }
}

/// Per-thread buffers.
struct Scratch {
    slots: Vec<usize>, // [n] the row's key slots, in position order
    q: Vec<f32>,       // [heads, dim] scaled queries
    kv: Vec<f32>,      // [kv_heads, dim] one widened key or value slot
    scores: Vec<f32>,  // [n, heads]
    acc: Vec<f32>,     // [heads, dim]
    max: Vec<f32>,     // [heads] score maxima
    inv: Vec<f32>,     // [heads] 1 / softmax denominators
}

/// The slots of positions `start .. end` of a row with chunk table `table`.
#[inline(always)]
fn row_slots(a: &DecodeArgs<'_>, table: &[i32], start: usize, end: usize, out: &mut Vec<usize>) {
    out.clear();
    let mut p = start;
    while p < end {
        let col = match a.window {
            Window::Full => p / a.page,
            Window::Sliding { .. } => (p / a.page) % a.width,
        };
        let off = p % a.page;
        let take = (a.page - off).min(end - p);
        let base = table[col] as usize * a.page + off;
        out.extend(base..base + take);
        p += take;
    }
}

#[inline(always)]
fn rows_impl<V: Vector>(a: &DecodeArgs<'_>, range: std::ops::Range<usize>, out: &mut ElemsMut<'_>) {
    let g = a.heads / a.kv_heads;
    let d = a.dim;
    let row_len = a.kv_heads * d;
    let mut s = Scratch {
        slots: Vec::new(),
        q: vec![0.0; a.heads * d],
        kv: vec![0.0; row_len],
        scores: Vec::new(),
        acc: vec![0.0; a.heads * d],
        max: Vec::with_capacity(a.heads),
        inv: vec![0.0; a.heads],
    };
    let first_row = range.start;
    for r in range {
        let range = key_range(a, r);
        let keys = range.len();
        row_slots(
            a,
            &a.block_tables[r * a.width..(r + 1) * a.width],
            range.start,
            range.end,
            &mut s.slots,
        );
        a.q.load(r * a.heads * d, &mut s.q);
        for x in s.q.iter_mut() {
            *x *= a.scale;
        }
        // scores key-major: [keys, heads]
        let heads = a.heads;
        s.scores.clear();
        s.scores.resize(keys * heads, 0.0);
        for (&slot, srow) in s.slots.iter().zip(s.scores.chunks_exact_mut(heads)) {
            a.k_cache.load(slot * row_len, &mut s.kv);
            for kvh in 0..a.kv_heads {
                let kv = &s.kv[kvh * d..(kvh + 1) * d];
                for i in 0..g {
                    let h = kvh * g + i;
                    srow[h] = V::dot(&s.q[h * d..(h + 1) * d], kv);
                }
            }
        }
        if let Some(cap) = a.softcap {
            for x in s.scores.iter_mut() {
                *x = (*x / cap).tanh() * cap;
            }
        }
        s.max.clear();
        s.max.resize(heads, f32::NEG_INFINITY);
        for srow in s.scores.chunks_exact(heads) {
            for (m, &x) in s.max.iter_mut().zip(srow) {
                *m = m.max(x);
            }
        }
        for srow in s.scores.chunks_exact_mut(heads) {
            for (x, &m) in srow.iter_mut().zip(&s.max) {
                *x -= m;
            }
        }
        exp_in_place(&mut s.scores);
        s.inv.iter_mut().for_each(|x| *x = 0.0);
        for srow in s.scores.chunks_exact(heads) {
            for (z, &x) in s.inv.iter_mut().zip(srow) {
                *z += x;
            }
        }
        for z in s.inv.iter_mut() {
            *z = 1.0 / *z;
        }
        s.acc.iter_mut().for_each(|x| *x = 0.0);
        for (&slot, srow) in s.slots.iter().zip(s.scores.chunks_exact(heads)) {
            a.v_cache.load(slot * row_len, &mut s.kv);
            for kvh in 0..a.kv_heads {
                let kv = &s.kv[kvh * d..(kvh + 1) * d];
                for i in 0..g {
                    let h = kvh * g + i;
                    V::axpy(&mut s.acc[h * d..(h + 1) * d], srow[h], kv);
                }
            }
        }
        for h in 0..a.heads {
            let at = ((r - first_row) * a.heads + h) * d;
            out.store(at, &s.acc[h * d..(h + 1) * d], s.inv[h]);
        }
    }
}

/// `sum a[i] * b[i]` with 16 independent partial sums, reduced as a tree (vectorizable).
#[inline(always)]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut lanes = [0f32; 16];
    let mut ca = a.chunks_exact(16);
    let mut cb = b.chunks_exact(16);
    for (x, y) in (&mut ca).zip(&mut cb) {
        for j in 0..16 {
            lanes[j] += x[j] * y[j];
        }
    }
    let mut half = 8;
    while half > 0 {
        for j in 0..half {
            lanes[j] += lanes[j + half];
        }
        half /= 2;
    }
    let mut sum = lanes[0];
    for (x, y) in ca.remainder().iter().zip(cb.remainder()) {
        sum += x * y;
    }
    sum
}

/// `acc[i] += w * x[i]`.
#[inline(always)]
fn axpy(acc: &mut [f32], w: f32, x: &[f32]) {
    for (a, &v) in acc.iter_mut().zip(x) {
        *a += w * v;
    }
}

/// `x = exp(x)` for `x <= 0` (after the max is subtracted), Cephes' single-precision
/// polynomial: relative error below 2e-7 over the range; `exp(x) = 0` below -87.
#[inline(always)]
pub(crate) fn exp_in_place(xs: &mut [f32]) {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const C1: f32 = 0.693_359_4;
    const C2: f32 = -2.121_944_4e-4;
    const ROUND: f32 = 12_582_912.0; // 1.5 * 2^23: adding it rounds to an integer
    for x in xs.iter_mut() {
        let v = x.max(-87.0);
        let fx = (v * LOG2E + ROUND) - ROUND;
        let r = v - fx * C1 - fx * C2;
        let mut y = 1.987_569_1e-4_f32;
        y = y * r + 1.398_2e-3;
        y = y * r + 8.333_452e-3;
        y = y * r + 4.166_579_6e-2;
        y = y * r + 1.666_666_5e-1;
        y = y * r + 0.5;
        y = y * r * r + r + 1.0;
        let pow2 = f32::from_bits((((fx as i32) + 127) as u32) << 23);
        *x = if *x < -87.0 { 0.0 } else { y * pow2 };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// f64 reference of the same semantics, from widened values.
    #[allow(clippy::too_many_arguments)]
    fn reference(
        q: &[f32],
        k: &[f32],
        v: &[f32],
        table: &[i32],
        seqlens: &[i32],
        heads: usize,
        kv_heads: usize,
        dim: usize,
        page: usize,
        width: usize,
        window: Window,
        scale: f32,
        softcap: Option<f32>,
    ) -> Vec<f64> {
        let g = heads / kv_heads;
        let mut out = vec![0f64; q.len()];
        for (r, &n) in seqlens.iter().enumerate() {
            let n = n as usize;
            let pos: Vec<usize> = match window {
                Window::Full => (0..n).collect(),
                Window::Sliding { window } => (n.saturating_sub(window)..n).collect(),
            };
            for h in 0..heads {
                let kvh = h / g;
                let qv = &q[(r * heads + h) * dim..][..dim];
                let slots: Vec<usize> = pos
                    .iter()
                    .map(|&p| {
                        let col = match window {
                            Window::Full => p / page,
                            Window::Sliding { .. } => (p / page) % width,
                        };
                        table[r * width + col] as usize * page + p % page
                    })
                    .collect();
                let mut sc: Vec<f64> = slots
                    .iter()
                    .map(|&s| {
                        let kr = &k[(s * kv_heads + kvh) * dim..][..dim];
                        let mut x: f64 =
                            qv.iter().zip(kr).map(|(a, b)| *a as f64 * *b as f64).sum();
                        x *= scale as f64;
                        if let Some(c) = softcap {
                            x = (x / c as f64).tanh() * c as f64;
                        }
                        x
                    })
                    .collect();
                let m = sc.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                sc.iter_mut().for_each(|x| *x = (*x - m).exp());
                let z: f64 = sc.iter().sum();
                for (w, &s) in sc.iter().zip(&slots) {
                    let vr = &v[(s * kv_heads + kvh) * dim..][..dim];
                    for j in 0..dim {
                        out[(r * heads + h) * dim + j] += w / z * vr[j] as f64;
                    }
                }
            }
        }
        out
    }

    fn lcg(seed: &mut u64) -> f32 {
        *seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((*seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }

    struct Case {
        q: Vec<f32>,
        k: Vec<f32>,
        v: Vec<f32>,
        table: Vec<i32>,
        seqlens: Vec<i32>,
        heads: usize,
        kv_heads: usize,
        dim: usize,
        page: usize,
        width: usize,
        window: Window,
    }

    /// The kernel's arguments for case `c` over caches `k` / `v` (f32 queries, scale 1/8).
    fn args_of<'a>(
        c: &'a Case,
        k: Elems<'a>,
        v: Elems<'a>,
        softcap: Option<f32>,
        threads: usize,
    ) -> DecodeArgs<'a> {
        DecodeArgs {
            q: Elems::F32(&c.q),
            k_cache: k,
            v_cache: v,
            block_tables: &c.table,
            seqlens: &c.seqlens,
            heads: c.heads,
            kv_heads: c.kv_heads,
            dim: c.dim,
            page: c.page,
            width: c.width,
            window: c.window,
            scale: 0.125,
            softcap,
            threads,
        }
    }

    fn case(
        seed: u64,
        rows: usize,
        kv_heads: usize,
        g: usize,
        dim: usize,
        page: usize,
        window: Window,
    ) -> Case {
        let width = match window {
            Window::Full => 6,
            Window::Sliding { window } => window.div_ceil(page) + 1,
        };
        case_of_width(seed, rows, kv_heads, g, dim, page, window, width)
    }

    /// `case` with `width` chunks per row (full attention: up to `width * page` keys).
    #[allow(clippy::too_many_arguments)]
    fn case_of_width(
        seed: u64,
        rows: usize,
        kv_heads: usize,
        g: usize,
        dim: usize,
        page: usize,
        window: Window,
        width: usize,
    ) -> Case {
        let mut s = seed;
        let heads = kv_heads * g;
        let chunks = 40.max(width + 3);
        let max_keys = match window {
            Window::Full => width * page,
            Window::Sliding { .. } => 5 * page * width,
        };
        let mut table = Vec::new();
        let mut seqlens = Vec::new();
        for _ in 0..rows {
            let n = 1 + ((lcg(&mut s) + 1.0) * 0.5 * (max_keys - 1) as f32) as usize;
            seqlens.push(n.min(max_keys) as i32);
            for _ in 0..width {
                table.push(2 + ((lcg(&mut s) + 1.0) * 0.5 * (chunks - 3) as f32) as i32);
            }
        }
        let n = |len: usize, s: &mut u64| (0..len).map(|_| lcg(s) * 3.0).collect::<Vec<_>>();
        Case {
            q: n(rows * heads * dim, &mut s),
            k: n(chunks * page * kv_heads * dim, &mut s),
            v: n(chunks * page * kv_heads * dim, &mut s),
            table,
            seqlens,
            heads,
            kv_heads,
            dim,
            page,
            width,
            window,
        }
    }

    fn run(
        c: &Case,
        softcap: Option<f32>,
        threads: usize,
        bf16_cache: bool,
    ) -> (Vec<f32>, Vec<f64>) {
        let ty = if bf16_cache { Ty::Bf16 } else { Ty::F32 };
        run_typed(c, softcap, threads, ty, Ty::F32)
    }

    /// A storage type of the tests.
    #[derive(Clone, Copy, Debug, PartialEq)]
    enum Ty {
        F32,
        Bf16,
        F16,
    }

    impl Ty {
        /// `x` rounded to the type (bits for the half types; f32 left as is).
        fn bits(self, x: &[f32]) -> Vec<u16> {
            match self {
                Ty::F32 => Vec::new(),
                Ty::Bf16 => x.iter().map(|&v| bf16::from_f32(v).to_bits()).collect(),
                Ty::F16 => x.iter().map(|&v| f16::from_f32(v).to_bits()).collect(),
            }
        }
        /// The values the kernel sees (`x` rounded to the type, widened back).
        fn widened(self, x: &[f32]) -> Vec<f32> {
            match self {
                Ty::F32 => x.to_vec(),
                Ty::Bf16 => self
                    .bits(x)
                    .iter()
                    .map(|&b| bf16::from_bits(b).to_f32())
                    .collect(),
                Ty::F16 => self
                    .bits(x)
                    .iter()
                    .map(|&b| f16::from_bits(b).to_f32())
                    .collect(),
            }
        }
        fn elems<'a>(self, f: &'a [f32], bits: &'a [u16]) -> Elems<'a> {
            match self {
                Ty::F32 => Elems::F32(f),
                Ty::Bf16 => Elems::Bf16(bits),
                Ty::F16 => Elems::F16(bits),
            }
        }
    }

    /// The kernel's fp32 output with a cache of type `cache` and queries of type `q`, and
    /// the f64 reference over the values the kernel sees.
    fn run_typed(
        c: &Case,
        softcap: Option<f32>,
        threads: usize,
        cache: Ty,
        q: Ty,
    ) -> (Vec<f32>, Vec<f64>) {
        let (kb, vb, qb) = (cache.bits(&c.k), cache.bits(&c.v), q.bits(&c.q));
        let args = DecodeArgs {
            q: q.elems(&c.q, &qb),
            ..args_of(
                c,
                cache.elems(&c.k, &kb),
                cache.elems(&c.v, &vb),
                softcap,
                threads,
            )
        };
        let mut out = vec![0f32; c.q.len()];
        paged_decode_attention(&args, ElemsMut::F32(&mut out)).unwrap();
        let want = reference(
            &q.widened(&c.q),
            &cache.widened(&c.k),
            &cache.widened(&c.v),
            &c.table,
            &c.seqlens,
            c.heads,
            c.kv_heads,
            c.dim,
            c.page,
            c.width,
            c.window,
            0.125,
            softcap,
        );
        (out, want)
    }

    fn assert_close(got: &[f32], want: &[f64], tol: f64) {
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            assert!(
                (*g as f64 - w).abs() <= tol * (1.0 + w.abs()),
                "elem {i}: {g} vs {w}"
            );
        }
    }

    #[test]
    fn full_attention_matches_the_reference() {
        for (rows, kvh, g, dim, page) in [(5, 2, 3, 64, 8), (1, 1, 1, 16, 4), (9, 3, 4, 20, 16)] {
            let c = case(rows as u64, rows, kvh, g, dim, page, Window::Full);
            for threads in [1, 2, 3] {
                for bf in [false, true] {
                    let (got, want) = run(&c, None, threads, bf);
                    assert_close(&got, &want, 2e-5);
                }
            }
        }
    }

    #[test]
    fn sliding_window_and_softcap_match_the_reference() {
        for window in [1, 7, 16, 33] {
            let c = case(
                window as u64 + 7,
                6,
                2,
                2,
                32,
                8,
                Window::Sliding { window },
            );
            let (got, want) = run(&c, None, 2, true);
            assert_close(&got, &want, 2e-5);
            let (got, want) = run(&c, Some(5.0), 1, false);
            assert_close(&got, &want, 2e-5);
        }
    }

    #[test]
    fn bf16_output_is_the_rounded_fp32_output() {
        let c = case(3, 4, 2, 2, 64, 16, Window::Full);
        let (f, _) = run(&c, None, 1, true);
        let kb: Vec<u16> = c.k.iter().map(|&v| bf16::from_f32(v).to_bits()).collect();
        let vb: Vec<u16> = c.v.iter().map(|&v| bf16::from_f32(v).to_bits()).collect();
        let args = args_of(&c, Elems::Bf16(&kb), Elems::Bf16(&vb), None, 1);
        let mut out = vec![0u16; c.q.len()];
        paged_decode_attention(&args, ElemsMut::Bf16(&mut out)).unwrap();
        for (o, x) in out.iter().zip(&f) {
            assert_eq!(*o, bf16::from_f32(*x).to_bits());
        }
    }

    /// The specialized head sizes (64, 128: the AVX-512 path where the CPU has it) over
    /// group sizes 1 ..= 8, all cache types, windows, softcap, pages that split the rows
    /// anywhere, rows of 1 key and of several hundred.
    #[test]
    fn specialized_head_sizes_match_the_reference() {
        let mut seed = 100;
        for dim in [64, 128] {
            for g in [1, 2, 3, 4, 5, 8] {
                for (kvh, page, window) in [
                    (1, 16, Window::Full),
                    (2, 7, Window::Full),
                    (3, 32, Window::Sliding { window: 40 }),
                    (2, 16, Window::Sliding { window: 1 }),
                    (1, 5, Window::Sliding { window: 17 }),
                ] {
                    seed += 1;
                    let c = case(seed, 5, kvh, g, dim, page, window);
                    for cache in [Ty::Bf16, Ty::F32, Ty::F16] {
                        let cap = (cache == Ty::F16).then_some(4.0);
                        let threads = 1 + seed as usize % 3;
                        let (got, want) = run_typed(&c, cap, threads, cache, Ty::F32);
                        assert_close(&got, &want, 2e-5);
                    }
                }
            }
        }
    }

    #[test]
    fn one_key_and_many_keys_match_the_reference() {
        for (dim, g, page, width) in [(64, 3, 16, 24), (128, 2, 64, 6), (64, 1, 1, 300)] {
            let mut c = case_of_width(dim as u64, 6, 2, g, dim, page, Window::Full, width);
            c.seqlens = vec![1, (width * page) as i32, 2, 15, 16, 17];
            for cache in [Ty::Bf16, Ty::F32] {
                let (got, want) = run_typed(&c, None, 1, cache, cache);
                assert_close(&got, &want, 2e-5);
                let (got, want) = run_typed(&c, Some(2.5), 2, cache, Ty::F16);
                assert_close(&got, &want, 2e-5);
            }
        }
    }

    #[test]
    fn half_outputs_are_the_rounded_fp32_output() {
        for dim in [64, 128, 48] {
            let c = case(dim as u64, 4, 2, 3, dim, 16, Window::Sliding { window: 50 });
            let (f, _) = run_typed(&c, None, 1, Ty::Bf16, Ty::Bf16);
            let (kb, vb, qb) = (
                Ty::Bf16.bits(&c.k),
                Ty::Bf16.bits(&c.v),
                Ty::Bf16.bits(&c.q),
            );
            let args = DecodeArgs {
                q: Elems::Bf16(&qb),
                ..args_of(&c, Elems::Bf16(&kb), Elems::Bf16(&vb), None, 1)
            };
            let mut out = vec![0u16; c.q.len()];
            paged_decode_attention(&args, ElemsMut::F16(&mut out)).unwrap();
            for (o, x) in out.iter().zip(&f) {
                assert_eq!(*o, f16::from_f32(*x).to_bits());
            }
            paged_decode_attention(&args, ElemsMut::Bf16(&mut out)).unwrap();
            for (o, x) in out.iter().zip(&f) {
                assert_eq!(*o, bf16::from_f32(*x).to_bits());
            }
        }
    }

    #[test]
    fn bad_arguments_are_errors_not_reads() {
        let c = case(1, 3, 1, 2, 16, 4, Window::Full);
        let base = DecodeArgs {
            scale: 1.0,
            ..args_of(&c, Elems::F32(&c.k), Elems::F32(&c.v), None, 1)
        };
        let mut out = vec![0f32; c.q.len()];
        let mut bad_table = c.table.clone();
        bad_table[0] = 1000;
        let cases: Vec<(DecodeArgs, &str)> = vec![
            (
                DecodeArgs {
                    block_tables: &bad_table,
                    ..base
                },
                "outside",
            ),
            (
                DecodeArgs {
                    seqlens: &[0, 1, 1],
                    ..base
                },
                "at least one key",
            ),
            (
                DecodeArgs {
                    seqlens: &[1000, 1, 1],
                    ..base
                },
                "chunks",
            ),
            (
                DecodeArgs {
                    kv_heads: 3,
                    ..base
                },
                "multiple",
            ),
            (
                DecodeArgs {
                    q: Elems::F32(&c.q[1..]),
                    ..base
                },
                "elements",
            ),
            (
                DecodeArgs {
                    v_cache: Elems::Bf16(&[]),
                    ..base
                },
                "same type",
            ),
        ];
        for (args, msg) in cases {
            let e = paged_decode_attention(&args, ElemsMut::F32(&mut out)).unwrap_err();
            assert!(e.to_string().contains(msg), "{e} lacks {msg:?}");
        }
    }

    #[test]
    fn exp_is_accurate() {
        let mut x: Vec<f32> = (0..2000).map(|i| -(i as f32) * 0.05).collect();
        let want: Vec<f64> = x.iter().map(|&v| (v as f64).exp()).collect();
        exp_in_place(&mut x);
        for (g, w) in x.iter().zip(&want) {
            assert!((*g as f64 - w).abs() <= 3e-7 * w + 2e-38, "{g} vs {w}");
        }
        let mut y = [f32::NEG_INFINITY, -1e30, -88.0];
        exp_in_place(&mut y);
        assert_eq!(y, [0.0, 0.0, 0.0]);
    }

    /// `x` quantized per `dim` elements (symmetric absmax int8, one scale each), and the
    /// values those int8 elements and scales stand for.
    fn quantize(x: &[f32], dim: usize) -> (Vec<i8>, Vec<f32>, Vec<f32>) {
        let mut data = Vec::with_capacity(x.len());
        let mut scales = Vec::with_capacity(x.len() / dim);
        let mut seen = Vec::with_capacity(x.len());
        for v in x.chunks_exact(dim) {
            let amax = v.iter().fold(0f32, |m, &e| m.max(e.abs()));
            let s = if amax > 0.0 { amax / 127.0 } else { 1.0 };
            scales.push(s);
            for &e in v {
                let q = (e / s).round().clamp(-127.0, 127.0) as i8;
                data.push(q);
                seen.push(f32::from(q) * s);
            }
        }
        (data, scales, seen)
    }

    /// The kernel over an int8 cache against the f64 reference over the dequantized cache.
    fn run_int8(c: &Case, softcap: Option<f32>, threads: usize) -> (Vec<f32>, Vec<f64>) {
        let (kq, ks, kd) = quantize(&c.k, c.dim);
        let (vq, vs, vd) = quantize(&c.v, c.dim);
        let k = Elems::I8 {
            data: &kq,
            scales: &ks,
            group: c.dim,
        };
        let v = Elems::I8 {
            data: &vq,
            scales: &vs,
            group: c.dim,
        };
        let args = args_of(c, k, v, softcap, threads);
        let mut out = vec![0f32; c.q.len()];
        paged_decode_attention(&args, ElemsMut::F32(&mut out)).unwrap();
        let want = reference(
            &c.q, &kd, &vd, &c.table, &c.seqlens, c.heads, c.kv_heads, c.dim, c.page, c.width,
            c.window, 0.125, softcap,
        );
        (out, want)
    }

    #[test]
    fn int8_cache_matches_the_dequantized_reference() {
        for (rows, kvh, g, dim, page, window) in [
            (5, 2, 3, 64, 8, Window::Full),
            (3, 1, 2, 128, 16, Window::Full),
            (4, 3, 1, 20, 4, Window::Sliding { window: 9 }),
        ] {
            let c = case(rows as u64 + 11, rows, kvh, g, dim, page, window);
            for threads in [1, 2] {
                let (got, want) = run_int8(&c, None, threads);
                assert_close(&got, &want, 2e-5);
            }
            let (got, want) = run_int8(&c, Some(4.0), 1);
            assert_close(&got, &want, 2e-5);
        }
    }

    #[test]
    fn int8_scales_of_the_wrong_length_are_errors() {
        let c = case(1, 2, 2, 1, 16, 4, Window::Full);
        let data = vec![0i8; c.k.len()];
        let short = vec![1f32; c.k.len() / 16 - 1];
        let full = vec![1f32; c.k.len() / 16];
        let bad = Elems::I8 {
            data: &data,
            scales: &short,
            group: 16,
        };
        let good = Elems::I8 {
            data: &data,
            scales: &full,
            group: 16,
        };
        let mut out = vec![0f32; c.q.len()];
        assert!(
            paged_decode_attention(&args_of(&c, bad, good, None, 1), ElemsMut::F32(&mut out))
                .is_err()
        );
        let wrong_group = Elems::I8 {
            data: &data,
            scales: &full,
            group: 8,
        };
        assert!(paged_decode_attention(
            &args_of(&c, good, wrong_group, None, 1),
            ElemsMut::F32(&mut out)
        )
        .is_err());
        let q8 = Elems::I8 {
            data: &data[..c.q.len()],
            scales: &full[..c.q.len() / 16],
            group: 16,
        };
        let args = DecodeArgs {
            q: q8,
            ..args_of(&c, good, good, None, 1)
        };
        assert!(paged_decode_attention(&args, ElemsMut::F32(&mut out)).is_err());
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]
        #[test]
        fn random_layouts_match_the_reference(seed in 0u64..1000, rows in 1usize..8,
                                              kvh in 1usize..4, g in 1usize..5,
                                              dim in 1usize..40, page in 1usize..10,
                                              window in 0usize..20, threads in 1usize..4) {
            let w = if window == 0 { Window::Full } else { Window::Sliding { window } };
            let c = case(seed, rows, kvh, g, dim, page, w);
            let (got, want) = run(&c, None, threads, seed % 2 == 0);
            assert_close(&got, &want, 3e-5);
        }

        #[test]
        fn random_int8_layouts_match_the_dequantized_reference(seed in 0u64..1000,
                                                              rows in 1usize..6,
                                                              kvh in 1usize..4, g in 1usize..9,
                                                              dim in prop::sample::select(
                                                                  vec![8usize, 24, 64, 128]),
                                                              page in 1usize..40,
                                                              window in 0usize..80,
                                                              threads in 1usize..4,
                                                              cap in any::<bool>()) {
            let w = if window == 0 { Window::Full } else { Window::Sliding { window } };
            let c = case(seed, rows, kvh, g, dim, page, w);
            let (got, want) = run_int8(&c, cap.then_some(3.0), threads);
            assert_close(&got, &want, 3e-5);
        }

        #[test]
        fn random_specialized_layouts_match_the_reference(seed in 0u64..1000,
                                                          rows in 1usize..6, kvh in 1usize..4,
                                                          g in 1usize..9, wide in any::<bool>(),
                                                          page in 1usize..40,
                                                          window in 0usize..80,
                                                          threads in 1usize..4,
                                                          cache in 0usize..3,
                                                          cap in any::<bool>()) {
            let w = if window == 0 { Window::Full } else { Window::Sliding { window } };
            let c = case(seed, rows, kvh, g, if wide { 128 } else { 64 }, page, w);
            let cache = [Ty::F32, Ty::Bf16, Ty::F16][cache];
            let (got, want) = run_typed(&c, cap.then_some(3.0), threads, cache, Ty::F32);
            assert_close(&got, &want, 3e-5);
        }
    }
}
