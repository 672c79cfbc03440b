//! Paged attention for multi-token (prefill) rows, read in place, tiled flash-style.
//!
//! Same cache layout, storage types, windows and roundings as [`crate::decode`] (see its
//! module doc). Row `r` is a request's chunk of `q_len = cu_seqlens_q[r + 1] -
//! cu_seqlens_q[r]` query tokens at positions `s .. s + q_len`, `s = seqlens[r] - q_len`;
//! all its keys (the cached ones and this step's, written by the caller first) are in the
//! cache. The query at position `p` sees positions `0 ..= p` (full attention) or
//! `p + 1 - w ..= p` (sliding window `w`). With a ring, every position the chunk needs must
//! still be there: `min(seqlens[r], q_len + w - 1) <= width * page` is checked (the core
//! also drops a step's new keys below its last `w`, so its callers send rows of at most `w`
//! tokens).
//!
//! Work is split into tiles: a tile is up to [`TILE_ROWS`] query rows (a few consecutive
//! query tokens times the query heads sharing one KV head) against the tile's keys in
//! blocks of [`KEYS`]. A block of keys and values is widened to fp32 once (bf16 / fp16
//! exactly, int8 dequantized) and reused by every row of the tile: the scores are a small
//! GEMM, the softmax is online (running max and sum per row, fp32), the weighted values
//! another small GEMM; the output is rounded once. Blocks start at the first position the
//! tile's first token sees, so (full attention) a query's keys are summed in the same
//! blocks whatever chunk of its prompt it came in. Tiles (row, KV head, query tokens) are
//! split between the threads of the kernel pool ([`crate::parallel`]), never the keys of
//! one tile.
//!
//! Paths, chosen per call by runtime CPU detection: head sizes that are a multiple of 16 on
//! AVX-512F take the `avx512` module (register-blocked products, softmax 16 rows per
//! register); everything else the same loops in plain Rust (compiled for AVX-512F / AVX2
//! where the CPU has them). They differ only in the order of fp32 additions.

use std::sync::Mutex;

use crate::decode::{err, exp_in_place, validate_cache, DecodeArgs, ElemsMut, Window};
use crate::error::KernelError;

/// Keys per block.
const KEYS: usize = 32;
/// Query rows a tile aims at (rounded to whole tokens; the tile's rows are padded to a
/// multiple of [`ROWS`] with zero queries that see no key and whose results are dropped).
pub const TILE_ROWS: usize = 48;
/// A tile's rows are padded to a multiple of this (one register of rows).
const ROWS: usize = 16;

/// The inputs of one call: the decode kernel's arguments, with `q` holding the rows'
/// tokens one after the other (`[tokens, heads, dim]`) and `seqlens` the keys of each row
/// after this step (its cached positions plus its tokens), and the rows' token offsets.
#[derive(Clone, Copy, Debug)]
pub struct PrefillArgs<'a> {
    /// the cache, block tables, shapes, scores and threads (the threads split tiles)
    pub paged: DecodeArgs<'a>,
    /// `[rows + 1]` token offsets of the rows in `q` (starts at 0, increasing)
    pub cu_seqlens_q: &'a [i32],
}

impl PrefillArgs<'_> {
    /// Query tokens of row `r` and the position of its first.
    fn row(&self, r: usize) -> (usize, usize, usize) {
        let (t0, t1) = (
            self.cu_seqlens_q[r] as usize,
            self.cu_seqlens_q[r + 1] as usize,
        );
        (t0, t1 - t0, self.paged.seqlens[r] as usize - (t1 - t0))
    }
}

/// Checks every shape, length, offset and chunk id the kernel will use.
fn validate(a: &PrefillArgs<'_>, out_len: usize) -> Result<(), KernelError> {
    validate_cache(&a.paged)?;
    let rows = a.paged.seqlens.len();
    let cu = a.cu_seqlens_q;
    if cu.len() != rows + 1 || cu[0] != 0 {
        return err(format!(
            "cu_seqlens_q must have rows+1 = {} offsets starting at 0 (it has {})",
            rows + 1,
            cu.len()
        ));
    }
    for r in 0..rows {
        let (q, n) = (cu[r + 1] - cu[r], a.paged.seqlens[r]);
        if q < 1 || q > n {
            return err(format!(
                "row {r}: {q} query tokens (cu_seqlens_q) with seqlens {n}: every row needs \
                 1 ..= seqlens tokens"
            ));
        }
        if let Window::Sliding { window } = a.paged.window {
            let span = (q as usize + window - 1).min(n as usize);
            if span > a.paged.width * a.paged.page {
                return err(format!(
                    "row {r}: its {q} tokens with window {window} need {span} positions, \
                     more than the ring's width*page = {}",
                    a.paged.width * a.paged.page
                ));
            }
        }
    }
    let want = cu[rows] as usize * a.paged.heads * a.paged.dim;
    if a.paged.q.len() != want || out_len != want {
        return err(format!(
            "q and out must have tokens*heads*dim = {want} elements (q {}, out {out_len})",
            a.paged.q.len()
        ));
    }
    Ok(())
}

/// Causal attention of each row's query tokens over the row's keys in the paged cache;
/// writes `out` (`[tokens, heads, dim]`). Every index is checked first: a bad argument is
/// an error, never a read outside the slices.
pub fn paged_prefill_attention(
    a: &PrefillArgs<'_>,
    mut out: ElemsMut<'_>,
) -> Result<(), KernelError> {
    validate(a, out.len())?;
    let items = tiles(a);
    let threads = a.paged.threads.clamp(1, items.len().max(1));
    if threads == 1 {
        let mut t = Tile::new(a);
        for it in &items {
            run_tile(a, it, &mut t);
            store(a, it, &t, &mut out);
        }
        return Ok(());
    }
    let done: Vec<Mutex<Option<Tile>>> = items.iter().map(|_| Mutex::new(None)).collect();
    crate::parallel::pool().run(threads, items.len(), &|i| {
        let mut t = Tile::new(a);
        run_tile(a, &items[i], &mut t);
        *done[i].lock().unwrap_or_else(|e| e.into_inner()) = Some(t);
    });
    for (it, slot) in items.iter().zip(done) {
        let t = slot.into_inner().unwrap_or_else(|e| e.into_inner());
        store(a, it, &t.expect("every tile ran"), &mut out);
    }
    Ok(())
}

/// One tile: query tokens `t0 .. t1` (within the row) of row `row`, KV head `kvh`.
struct Item {
    row: usize,
    kvh: usize,
    t0: usize,
    t1: usize,
}

/// Query tokens per tile for `g` query heads per KV head.
fn tile_tokens(g: usize) -> usize {
    (TILE_ROWS / g).max(1)
}

/// Every tile of the call, row by row, KV head by KV head.
fn tiles(a: &PrefillArgs<'_>) -> Vec<Item> {
    let tq = tile_tokens(a.paged.heads / a.paged.kv_heads);
    let mut items = Vec::new();
    for row in 0..a.paged.seqlens.len() {
        let (_, q_len, _) = a.row(row);
        for kvh in 0..a.paged.kv_heads {
            for t0 in (0..q_len).step_by(tq) {
                items.push(Item {
                    row,
                    kvh,
                    t0,
                    t1: (t0 + tq).min(q_len),
                });
            }
        }
    }
    items
}

/// A tile's buffers (`mp` rows: the tile's rows rounded up to a multiple of [`ROWS`]).
/// Scores and weights are key-major, the queries transposed: the products and the
/// softmax then run 16 rows per register.
struct Tile {
    q: Vec<f32>,       // [mp, dim] scaled queries
    qt: Vec<f32>,      // [dim, mp] the same, transposed
    k: Vec<f32>,       // [KEYS, dim] the key block, widened
    v: Vec<f32>,       // [KEYS, dim] the value block, widened
    s: Vec<f32>,       // [KEYS, mp] scores, then softmax weights
    o: Vec<f32>,       // [mp, dim] weighted sums
    max: Vec<f32>,     // [mp] running score maxima
    sum: Vec<f32>,     // [mp] running softmax denominators
    alpha: Vec<f32>,   // [mp] this block's rescaling of the running sums
    lo: Vec<i32>,      // [mp] first position each row sees (padding: none)
    hi: Vec<i32>,      // [mp] last position each row sees (padding: -1)
    slots: Vec<usize>, // the tile's key slots, in position order
}

impl Tile {
    fn new(a: &PrefillArgs<'_>) -> Tile {
        let g = a.paged.heads / a.paged.kv_heads;
        let mp = (tile_tokens(g) * g).next_multiple_of(ROWS);
        let d = a.paged.dim;
        Tile {
            q: vec![0.0; mp * d],
            qt: vec![0.0; d * mp],
            k: vec![0.0; KEYS * d],
            v: vec![0.0; KEYS * d],
            s: vec![0.0; KEYS * mp],
            o: vec![0.0; mp * d],
            max: vec![0.0; mp],
            sum: vec![0.0; mp],
            alpha: vec![1.0; mp],
            lo: vec![0; mp],
            hi: vec![0; mp],
            slots: Vec::new(),
        }
    }
}

/// Writes tile `it`'s rows (`t.o / t.sum`) to `out`, rounded once.
fn store(a: &PrefillArgs<'_>, it: &Item, t: &Tile, out: &mut ElemsMut<'_>) {
    let (g, d) = (a.paged.heads / a.paged.kv_heads, a.paged.dim);
    let (tok0, _, _) = a.row(it.row);
    for ti in 0..it.t1 - it.t0 {
        for i in 0..g {
            let ri = ti * g + i;
            let at = ((tok0 + it.t0 + ti) * a.paged.heads + it.kvh * g + i) * d;
            out.store(at, &t.o[ri * d..(ri + 1) * d], 1.0 / t.sum[ri]);
        }
    }
}

/// Runs tile `it` into `t` on the best path this CPU has.
fn run_tile(a: &PrefillArgs<'_>, it: &Item, t: &mut Tile) {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("fma")
        {
            if avx512::handles(a.paged.dim) {
                // SAFETY: `tile_avx512` only runs `Avx512`'s products, which need AVX-512F,
                // just detected on this CPU (as FMA, which the compiler may use there).
                unsafe { tile_avx512(a, it, t) };
                return;
            }
            // SAFETY: `tile_portable_avx512` differs from the portable path only in the
            // instructions the compiler may use (AVX-512F, FMA), both just detected.
            unsafe { tile_portable_avx512(a, it, t) };
            return;
        }
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
        {
            // SAFETY: as above, for AVX2 and FMA, detected on this CPU.
            unsafe { tile_avx2(a, it, t) };
            return;
        }
    }
    tile_impl::<Portable>(a, it, t)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,fma")]
fn tile_avx512(a: &PrefillArgs<'_>, it: &Item, t: &mut Tile) {
    tile_impl::<Avx512>(a, it, t)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,fma")]
fn tile_portable_avx512(a: &PrefillArgs<'_>, it: &Item, t: &mut Tile) {
    tile_impl::<Portable>(a, it, t)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn tile_avx2(a: &PrefillArgs<'_>, it: &Item, t: &mut Tile) {
    tile_impl::<Portable>(a, it, t)
}

/// The work of a tile on one key block, in the tile's layout (see [`Tile`]).
trait Products {
    /// `st[n][r] = sum_j k[n][j] * qt[j][r]` for keys `n < nk`.
    fn scores(qt: &[f32], k: &[f32], st: &mut [f32], d: usize, mp: usize, nk: usize);
    /// For every row `r`: the keys `kb + n` (`n < nk`) it sees (`lo[r] <= kb + n <=
    /// hi[r]`) get weight `exp(st[n][r] - max)` (the others 0) with the running `max[r]`
    /// raised to the block's; `alpha[r]` is the factor the running sums must be rescaled
    /// by (1 while the row has seen no key), `sum[r]` is rescaled and gains the weights.
    #[allow(clippy::too_many_arguments)]
    fn softmax(
        st: &mut [f32],
        mp: usize,
        nk: usize,
        kb: usize,
        lo: &[i32],
        hi: &[i32],
        max: &mut [f32],
        sum: &mut [f32],
        alpha: &mut [f32],
    );
    /// `o[r] = o[r] * alpha[r] + sum_{n < nk} pt[n][r] * v[n]`.
    fn accumulate(pt: &[f32], v: &[f32], o: &mut [f32], d: usize, nk: usize, alpha: &[f32]);
}

/// Plain Rust loops.
struct Portable;

impl Products for Portable {
    #[inline(always)]
    fn scores(qt: &[f32], k: &[f32], st: &mut [f32], d: usize, mp: usize, nk: usize) {
        for n in 0..nk {
            let srow = &mut st[n * mp..(n + 1) * mp];
            srow.iter_mut().for_each(|x| *x = 0.0);
            for (j, &kx) in k[n * d..(n + 1) * d].iter().enumerate() {
                for (x, &q) in srow.iter_mut().zip(&qt[j * mp..(j + 1) * mp]) {
                    *x += kx * q;
                }
            }
        }
    }

    #[inline(always)]
    fn softmax(
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
        let mut row = [0f32; KEYS];
        for r in 0..mp {
            let c0 = (lo[r].max(kb as i32) as usize - kb).min(nk);
            let c1 = ((hi[r] + 1).max(kb as i32) as usize - kb).min(nk);
            if c0 >= c1 {
                (0..nk).for_each(|n| st[n * mp + r] = 0.0);
                alpha[r] = 1.0;
                continue;
            }
            for (n, x) in row.iter_mut().enumerate().take(nk) {
                *x = st[n * mp + r];
            }
            alpha[r] = online_softmax(&mut row, c0, c1, &mut max[r], &mut sum[r]);
            for (n, &x) in row.iter().enumerate().take(nk) {
                st[n * mp + r] = x;
            }
        }
    }

    #[inline(always)]
    fn accumulate(pt: &[f32], v: &[f32], o: &mut [f32], d: usize, nk: usize, alpha: &[f32]) {
        let mp = alpha.len();
        for (r, orow) in o.chunks_exact_mut(d).enumerate() {
            if alpha[r] != 1.0 {
                orow.iter_mut().for_each(|x| *x *= alpha[r]);
            }
            for n in 0..nk {
                let w = pt[n * mp + r];
                for (x, &y) in orow.iter_mut().zip(&v[n * d..(n + 1) * d]) {
                    *x += w * y;
                }
            }
        }
    }
}

/// AVX-512F register-blocked products and lane-wise softmax (head sizes a multiple of 16);
/// only instantiated in `tile_avx512`, i.e. after AVX-512F was detected.
#[cfg(target_arch = "x86_64")]
struct Avx512;

#[cfg(target_arch = "x86_64")]
impl Products for Avx512 {
    #[inline(always)]
    fn scores(qt: &[f32], k: &[f32], st: &mut [f32], d: usize, mp: usize, nk: usize) {
        // SAFETY: only reached from `tile_avx512`, run after AVX-512F was detected.
        unsafe { avx512::scores(qt, k, st, d, mp, nk) }
    }

    #[inline(always)]
    fn softmax(
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
        // SAFETY: as above.
        unsafe { avx512::softmax(st, mp, nk, kb, lo, hi, max, sum, alpha) }
    }

    #[inline(always)]
    fn accumulate(pt: &[f32], v: &[f32], o: &mut [f32], d: usize, nk: usize, alpha: &[f32]) {
        // SAFETY: as above.
        unsafe { avx512::accumulate(pt, v, o, d, nk, alpha) }
    }
}

/// The slots of positions `start .. end` of a row with chunk table `table`.
fn tile_slots(a: &PrefillArgs<'_>, table: &[i32], start: usize, end: usize, out: &mut Vec<usize>) {
    out.clear();
    let mut p = start;
    while p < end {
        let col = match a.paged.window {
            Window::Full => p / a.paged.page,
            Window::Sliding { .. } => (p / a.paged.page) % a.paged.width,
        };
        let off = p % a.paged.page;
        let take = (a.paged.page - off).min(end - p);
        let base = table[col] as usize * a.paged.page + off;
        out.extend(base..base + take);
        p += take;
    }
}

/// The positions the query at position `p` sees.
#[inline(always)]
fn visible(a: &PrefillArgs<'_>, p: usize) -> (usize, usize) {
    match a.paged.window {
        Window::Full => (0, p + 1),
        Window::Sliding { window } => ((p + 1).saturating_sub(window), p + 1),
    }
}

#[inline(always)]
fn tile_impl<P: Products>(a: &PrefillArgs<'_>, it: &Item, t: &mut Tile) {
    let (g, d) = (a.paged.heads / a.paged.kv_heads, a.paged.dim);
    let (tok0, _, s0) = a.row(it.row);
    let m = (it.t1 - it.t0) * g;
    let mp = m.next_multiple_of(ROWS);
    // queries, scaled and transposed; padding rows zero and seeing no key
    for ti in 0..it.t1 - it.t0 {
        let at = ((tok0 + it.t0 + ti) * a.paged.heads + it.kvh * g) * d;
        a.paged.q.load(at, &mut t.q[ti * g * d..(ti + 1) * g * d]);
    }
    for (r, qrow) in t.q.chunks_exact(d).enumerate().take(mp) {
        for (j, &x) in qrow.iter().enumerate() {
            t.qt[j * mp + r] = if r < m { x * a.paged.scale } else { 0.0 };
        }
        let (lo, hi) = if r < m {
            let (lo, hi) = visible(a, s0 + it.t0 + r / g);
            (lo as i32, hi as i32 - 1)
        } else {
            (i32::MAX, -1)
        };
        (t.lo[r], t.hi[r]) = (lo, hi);
    }
    t.o[..mp * d].iter_mut().for_each(|x| *x = 0.0);
    t.max[..mp].iter_mut().for_each(|x| *x = f32::NEG_INFINITY);
    t.sum[..mp].iter_mut().for_each(|x| *x = 0.0);
    let (lo, _) = visible(a, s0 + it.t0);
    let hi = s0 + it.t1;
    let table = &a.paged.block_tables[it.row * a.paged.width..(it.row + 1) * a.paged.width];
    tile_slots(a, table, lo, hi, &mut t.slots);
    let row_len = a.paged.kv_heads * d;
    for kb in (lo..hi).step_by(KEYS) {
        let nk = KEYS.min(hi - kb);
        for n in 0..KEYS {
            let (k, v) = (&mut t.k[n * d..(n + 1) * d], &mut t.v[n * d..(n + 1) * d]);
            if n < nk {
                let at = t.slots[kb - lo + n] * row_len + it.kvh * d;
                a.paged.k_cache.load(at, k);
                a.paged.v_cache.load(at, v);
            } else {
                k.iter_mut().for_each(|x| *x = 0.0);
                v.iter_mut().for_each(|x| *x = 0.0);
            }
        }
        let st = &mut t.s[..KEYS * mp];
        P::scores(&t.qt[..d * mp], &t.k, st, d, mp, nk);
        if let Some(cap) = a.paged.softcap {
            for x in st[..nk * mp].iter_mut() {
                *x = (*x / cap).tanh() * cap;
            }
        }
        P::softmax(
            st,
            mp,
            nk,
            kb,
            &t.lo[..mp],
            &t.hi[..mp],
            &mut t.max[..mp],
            &mut t.sum[..mp],
            &mut t.alpha[..mp],
        );
        P::accumulate(st, &t.v, &mut t.o[..mp * d], d, nk, &t.alpha[..mp]);
    }
}

/// One row's step of the online softmax over a block of scores, visible lanes
/// `c0 .. c1` (`c0 < c1`): the others become weight 0, the visible ones `exp(s - max)`
/// with the running `max` raised to the block's; `sum` is rescaled and gains the block's
/// weights. Returns the factor the row's sums must be rescaled by.
#[inline(always)]
fn online_softmax(s: &mut [f32; KEYS], c0: usize, c1: usize, max: &mut f32, sum: &mut f32) -> f32 {
    let block = s[c0..c1].iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
    let new = max.max(block);
    let alpha = if new == *max { 1.0 } else { (*max - new).exp() };
    *max = new;
    for (n, x) in s.iter_mut().enumerate() {
        *x = if n >= c0 && n < c1 {
            *x - new
        } else {
            f32::NEG_INFINITY
        };
    }
    exp_in_place(s);
    *sum = *sum * alpha + s.iter().sum::<f32>();
    alpha
}

#[cfg(target_arch = "x86_64")]
mod avx512;
#[cfg(test)]
mod tests;
