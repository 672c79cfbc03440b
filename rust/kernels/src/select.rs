//! Candidate selection of the greedy head screen (`ferrobatch.runner.greedy_head`).
//!
//! Row `i` of the screened scores `a` [rows, vocab] (bf16 bit patterns, f32, or the int8
//! screen's exact i32 accumulators) is within `eps_j = base[i] + gain[i] * per_token[j]` of
//! the token's fp32 logit. The tokens that may hold the row's fp32 argmax are found in two
//! stages, exactly as the screen's proof and its former numpy version state them:
//!
//! * stage 1: with `m` the row's screened best (first maximum, `numpy.argmax`),
//!   `lb1 = a_m - base - gain * per_token[m]` and `thr = lb1 - base - gain * max(per_token)`
//!   (f64), keep `a_j >= thr` with the threshold rounded down into the scores' type: for
//!   floats `nextafter(f32(thr), -inf)`, for i32 `max(floor(thr) - 1, i32::MIN)`;
//! * stage 2: with `lb2` the best `a_j - eps_j` among the stage-1 survivors (NaN
//!   propagating, as `numpy.maximum`), keep those with
//!   `a_j + eps_j >= lb2 - |lb2| 1e-12 - 1e-300`.
//!
//! None (the caller computes full logits) when a row's threshold is not finite (a NaN or an
//! infinite score, a non-finite bound) or when more than `max_stage1` (stage 1) or
//! `max_candidates` (stage 2) tokens per row on average survive.
//!
//! A row is read once in chunks (each chunk's maximum key kept), then only the chunks whose
//! maximum reaches the threshold are read again.
//!
//! Also for the screen: [`pick_best`] (each row's best candidate from their fp32 logits)
//! and [`row_norms`] (the rows' norms its bounds use).

use std::sync::Mutex;

use crate::error::KernelError;
use crate::parallel::{plan_threads, row_ranges, run_pieces};

/// Screened scores `[rows, vocab]`, row-major.
#[derive(Clone, Copy, Debug)]
pub enum Scores<'a> {
    /// bf16 bit patterns
    Bf16(&'a [u16]),
    F32(&'a [f32]),
    /// exact integer scores (the int8 screen's accumulators)
    I32(&'a [i32]),
}

/// The inputs of [`select_candidates`]: `rows = base.len()`, `vocab = per_token.len()`.
#[derive(Clone, Copy, Debug)]
pub struct SelectArgs<'a> {
    pub scores: Scores<'a>,
    /// `[rows]` the row's part of every token's bound
    pub base: &'a [f64],
    /// `[rows]` the factor of `per_token` in the row's bounds
    pub gain: &'a [f64],
    /// `[vocab]`
    pub per_token: &'a [f64],
    /// stage-1 survivors allowed per row on average
    pub max_stage1: usize,
    /// candidates allowed per row on average
    pub max_candidates: usize,
    /// threads of the kernel pool ([`crate::parallel`]) the rows are split between, from
    /// the pool's `min_split` scores on; 1 runs on the caller's thread
    pub threads: usize,
}

/// The selected (row, token) pairs, in row-major order (tokens ascending within a row).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Candidates {
    pub rows: Vec<u32>,
    pub cols: Vec<u32>,
}

impl Candidates {
    /// The distinct tokens (ascending) and, for each pair, the index of its token among them.
    pub fn columns(&self) -> (Vec<u32>, Vec<u32>) {
        let mut unique = self.cols.clone();
        unique.sort_unstable();
        unique.dedup();
        let inverse = self
            .cols
            .iter()
            .map(|c| unique.partition_point(|u| u < c) as u32)
            .collect();
        (unique, inverse)
    }
}

/// The pairs `(row, token)` that may hold each row's fp32 argmax (see the module docs), or
/// None when the screen cannot decide cheaply. An error when the lengths do not fit.
pub fn select_candidates(a: &SelectArgs<'_>) -> Result<Option<Candidates>, KernelError> {
    let (rows, vocab) = (a.base.len(), a.per_token.len());
    if a.gain.len() != rows {
        return Err(KernelError::Layout(format!(
            "gain has {} entries, base {rows}",
            a.gain.len()
        )));
    }
    if u32::try_from(rows).is_err() || u32::try_from(vocab).is_err() {
        return Err(KernelError::Layout(format!(
            "at most 2^32 - 1 rows and tokens, not {rows} x {vocab}"
        )));
    }
    let len = match a.scores {
        Scores::Bf16(s) => s.len(),
        Scores::F32(s) => s.len(),
        Scores::I32(s) => s.len(),
    };
    if Some(len) != rows.checked_mul(vocab) {
        return Err(KernelError::Layout(format!(
            "scores has {len} entries, not rows * vocab = {rows} * {vocab}"
        )));
    }
    Ok(match a.scores {
        Scores::Bf16(s) => run(s, a),
        Scores::F32(s) => run(s, a),
        Scores::I32(s) => run(s, a),
    })
}

/// The fp32 argmax of each of `n` rows among its candidates: `logits` `[n, width]` holds
/// the candidates' logits, pair `i` (row `rows[i]`, token `cols[i]`) at column
/// `inverse[i]`. Ties go to the lowest token. None when a candidate's logit is not finite
/// or a row has no candidate; an error when an index is out of range.
pub fn pick_best(
    logits: &[f32],
    width: usize,
    rows: &[i64],
    cols: &[i64],
    inverse: &[i64],
) -> Result<Option<Vec<i64>>, KernelError> {
    if width == 0 || !logits.len().is_multiple_of(width) {
        return Err(KernelError::Layout(format!(
            "logits has {} entries, not a positive multiple of width {width}",
            logits.len()
        )));
    }
    if cols.len() != rows.len() || inverse.len() != rows.len() {
        return Err(KernelError::Layout(format!(
            "rows, cols and inverse differ in length ({}, {}, {})",
            rows.len(),
            cols.len(),
            inverse.len()
        )));
    }
    let n = logits.len() / width;
    let mut best: Vec<Option<(f32, i64)>> = vec![None; n];
    for ((&r, &c), &w) in rows.iter().zip(cols).zip(inverse) {
        let (r, w) = match (usize::try_from(r), usize::try_from(w)) {
            (Ok(r), Ok(w)) if r < n && w < width => (r, w),
            _ => {
                return Err(KernelError::Layout(format!(
                    "candidate (row {r}, column {w}) outside logits [{n}, {width}]"
                )))
            }
        };
        let v = logits[r * width + w];
        if !v.is_finite() {
            return Ok(None);
        }
        let slot = &mut best[r];
        match *slot {
            Some((bv, bc)) if bv > v || (bv == v && bc <= c) => {}
            _ => *slot = Some((v, c)),
        }
    }
    Ok(best.into_iter().map(|b| b.map(|(_, c)| c)).collect())
}

/// Per row of `x` `[rows, k]`: `(||x||_2, ||x||_1, max |x|)`, summed in f64 (relative
/// error at most `k 2^-53`). `||x||_1` is finite iff the row is; `max |x|` is NaN when the
/// row holds a NaN. An error when `x` is not `rows * k` long.
pub fn row_norms(x: &[f32], k: usize) -> Result<[Vec<f64>; 3], KernelError> {
    if k == 0 || !x.len().is_multiple_of(k) {
        return Err(KernelError::Layout(format!(
            "x has {} entries, not a multiple of k = {k} > 0",
            x.len()
        )));
    }
    let rows = x.len() / k;
    let mut out = [vec![0.0; rows], vec![0.0; rows], vec![0.0; rows]];
    for (i, row) in x.chunks_exact(k).enumerate() {
        let (sq, abs, max) = norms_of(row);
        out[0][i] = sq.sqrt();
        out[1][i] = abs;
        out[2][i] = max;
    }
    Ok(out)
}

/// `(sum x^2, sum |x|, max |x|)` of one row in f64, over independent lanes.
fn norms_of(row: &[f32]) -> (f64, f64, f64) {
    const LANES: usize = 8;
    let (mut sq, mut abs, mut max) = ([0.0f64; LANES], [0.0f64; LANES], [0.0f64; LANES]);
    let mut parts = row.chunks_exact(LANES);
    for part in &mut parts {
        for j in 0..LANES {
            let a = (part[j] as f64).abs();
            sq[j] += a * a;
            abs[j] += a;
            max[j] = nan_max(max[j], a);
        }
    }
    for (j, &x) in parts.remainder().iter().enumerate() {
        let a = (x as f64).abs();
        sq[j] += a * a;
        abs[j] += a;
        max[j] = nan_max(max[j], a);
    }
    (
        sq.iter().sum(),
        abs.iter().sum(),
        max.iter().copied().fold(0.0, nan_max),
    )
}

/// One score type: a key that orders the values (NaNs aside; -0 below +0) and the rounding
/// of the stage-1 threshold into it.
trait Score: Copy + Sync {
    type Key: Copy + Ord + Send;
    /// at most every key
    const LOWEST: Self::Key;
    /// at least every key
    const HIGHEST: Self::Key;
    fn key(self) -> Self::Key;
    /// the exact value
    fn value(self) -> f64;
    /// whether a row whose keys span `lo ..= hi` holds a NaN
    fn has_nan(lo: Self::Key, hi: Self::Key) -> bool;
    /// the lowest key of a value equal to key `k`'s (that of -0 for +0)
    fn equal_floor(k: Self::Key) -> Self::Key;
    /// the key `t` with `x >= f(thr)` iff `key(x) >= t` for every non-NaN `x`, where `f`
    /// rounds the finite f64 threshold down into the score type as `_select` did
    fn threshold(thr: f64) -> Self::Key;
}

/// Orders f32 bit patterns as their values (positive NaNs above +inf, negative ones below
/// -inf, -0 just below +0).
#[inline(always)]
fn f32_key(bits: u32) -> i32 {
    let b = bits as i32;
    b ^ ((b >> 31) & 0x7fff_ffff)
}

/// `numpy.nextafter(x, -inf)` for f32.
fn next_down(x: f32) -> f32 {
    if x.is_nan() || x == f32::NEG_INFINITY {
        x
    } else if x == 0.0 {
        -f32::from_bits(1)
    } else if x > 0.0 {
        f32::from_bits(x.to_bits() - 1)
    } else {
        f32::from_bits(x.to_bits() + 1)
    }
}

/// `_select`'s float threshold: f32(thr) rounded down by one ulp; a zero as -0 (so that
/// both zeros pass, as `>=` on floats has it).
fn float_threshold(thr: f64) -> f32 {
    let t = next_down(thr as f32);
    if t == 0.0 {
        -0.0
    } else {
        t
    }
}

/// bf16 bit patterns.
impl Score for u16 {
    type Key = i16;
    const LOWEST: i16 = i16::MIN;
    const HIGHEST: i16 = i16::MAX;
    #[inline(always)]
    fn key(self) -> i16 {
        let b = self as i16;
        b ^ ((b >> 15) & 0x7fff)
    }
    #[inline(always)]
    fn value(self) -> f64 {
        f32::from_bits(u32::from(self) << 16) as f64
    }
    fn has_nan(lo: i16, hi: i16) -> bool {
        hi > 0x7f80u16.key() || lo < 0xff80u16.key()
    }
    fn equal_floor(k: i16) -> i16 {
        if k == 0 {
            0x8000u16.key()
        } else {
            k
        }
    }
    fn threshold(thr: f64) -> i16 {
        // the least bf16 at or above the f32 threshold t: bf16 values are f32 values, so
        // widen(x) >= t iff x >= that one
        let tb = float_threshold(thr).to_bits();
        let hi = (tb >> 16) as u16;
        let up = if tb & 0xffff == 0 || tb >> 31 == 1 {
            hi // exact, or negative: truncating the magnitude rounds up
        } else {
            hi + 1 // positive: the next bf16 (+inf above the largest finite)
        };
        if up == 0 {
            0x8000u16.key() // +0: -0 passes too
        } else {
            up.key()
        }
    }
}

impl Score for f32 {
    type Key = i32;
    const LOWEST: i32 = i32::MIN;
    const HIGHEST: i32 = i32::MAX;
    #[inline(always)]
    fn key(self) -> i32 {
        f32_key(self.to_bits())
    }
    #[inline(always)]
    fn value(self) -> f64 {
        self as f64
    }
    fn has_nan(lo: i32, hi: i32) -> bool {
        hi > f32::INFINITY.key() || lo < f32::NEG_INFINITY.key()
    }
    fn equal_floor(k: i32) -> i32 {
        if k == 0 {
            (-0.0f32).key()
        } else {
            k
        }
    }
    fn threshold(thr: f64) -> i32 {
        float_threshold(thr).key()
    }
}

impl Score for i32 {
    type Key = i32;
    const LOWEST: i32 = i32::MIN;
    const HIGHEST: i32 = i32::MAX;
    #[inline(always)]
    fn key(self) -> i32 {
        self
    }
    #[inline(always)]
    fn value(self) -> f64 {
        self as f64
    }
    fn has_nan(_: i32, _: i32) -> bool {
        false
    }
    fn equal_floor(k: i32) -> i32 {
        k
    }
    fn threshold(thr: f64) -> i32 {
        // with non-negative bounds thr <= a_m <= i32::MAX, so only the clamp from below acts
        // (`as` would saturate above too, where numpy's cast is undefined)
        (thr.floor() - 1.0).max(i32::MIN as f64) as i32
    }
}

/// Scores per chunk whose maximum key is kept.
const CHUNK: usize = 128;
/// Scores per bit mask of a chunk that reaches the threshold.
const MASK: usize = 64;

/// `numpy.maximum`: NaN when either is NaN.
fn nan_max(m: f64, x: f64) -> f64 {
    if m.is_nan() || x.is_nan() {
        f64::NAN
    } else {
        m.max(x)
    }
}

/// `numpy.max` of a slice (NaN when it holds one; -inf when empty), over independent lanes.
fn max_of(v: &[f64]) -> f64 {
    const LANES: usize = 8;
    let (mut max, mut nan) = ([f64::NEG_INFINITY; LANES], [false; LANES]);
    let mut parts = v.chunks_exact(LANES);
    for part in &mut parts {
        for j in 0..LANES {
            let x = part[j];
            max[j] = if x > max[j] { x } else { max[j] };
            nan[j] |= x.is_nan();
        }
    }
    let rest = parts.remainder();
    if nan.contains(&true) || rest.iter().any(|x| x.is_nan()) {
        return f64::NAN;
    }
    max.iter()
        .chain(rest)
        .fold(f64::NEG_INFINITY, |m, &x| m.max(x))
}

fn run<S: Score>(scores: &[S], a: &SelectArgs<'_>) -> Option<Candidates> {
    let (rows, vocab) = (a.base.len(), a.per_token.len());
    if rows == 0 {
        return Some(Candidates::default());
    }
    if vocab == 0 {
        return None; // no argmax to find
    }
    let vmax = max_of(a.per_token);
    let limits = Limits {
        stage1: a.max_stage1.saturating_mul(rows),
        kept: a.max_candidates.saturating_mul(rows),
    };
    let threads = plan_threads(a.threads, rows, rows.saturating_mul(vocab));
    if threads == 1 {
        return run_rows(scores, a, vmax, limits, 0..rows).map(|(c, _)| c);
    }
    // each piece's result in its own slot, the pieces on the kernel pool (torch's OpenMP
    // team once shared: no fresh threads competing with its spinning workers)
    let ranges = row_ranges(rows, threads);
    let slots: Vec<Mutex<Option<Piece>>> = ranges.iter().map(|_| Mutex::new(None)).collect();
    run_pieces(ranges.into_iter().zip(&slots).collect(), |range, slot| {
        let got = run_rows(scores, a, vmax, limits, range);
        *slot.lock().unwrap_or_else(|e| e.into_inner()) = Some(got);
    });
    let parts = slots.into_iter().map(|slot| {
        slot.into_inner()
            .unwrap_or_else(|e| e.into_inner())
            .expect("every piece ran")
    });
    let mut out = Candidates::default();
    let mut stage1 = 0;
    for part in parts {
        let (c, n1) = part?;
        stage1 += n1;
        out.rows.extend(c.rows);
        out.cols.extend(c.cols);
    }
    (stage1 <= limits.stage1 && out.rows.len() <= limits.kept).then_some(out)
}

/// One piece of rows' candidates and stage-1 count (None: too many, or not finite).
type Piece = Option<(Candidates, usize)>;

/// The whole call's survivor limits (over all rows).
#[derive(Clone, Copy)]
struct Limits {
    stage1: usize,
    kept: usize,
}

/// Rows `range`: their candidates and stage-1 survivor count, None as soon as a row's
/// threshold is not finite or these rows alone exceed a limit.
fn run_rows<S: Score>(
    scores: &[S],
    a: &SelectArgs<'_>,
    vmax: f64,
    limits: Limits,
    range: std::ops::Range<usize>,
) -> Option<(Candidates, usize)> {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: `run_rows_avx2` only needs AVX2, which was just detected.
            return unsafe { run_rows_avx2(scores, a, vmax, limits, range) };
        }
    }
    run_rows_impl(scores, a, vmax, limits, range)
}

/// `run_rows_impl` compiled for AVX2 (twice the lanes, and i32 minima / maxima).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn run_rows_avx2<S: Score>(
    scores: &[S],
    a: &SelectArgs<'_>,
    vmax: f64,
    limits: Limits,
    range: std::ops::Range<usize>,
) -> Option<(Candidates, usize)> {
    run_rows_impl(scores, a, vmax, limits, range)
}

#[inline(always)]
fn run_rows_impl<S: Score>(
    scores: &[S],
    a: &SelectArgs<'_>,
    vmax: f64,
    limits: Limits,
    range: std::ops::Range<usize>,
) -> Option<(Candidates, usize)> {
    let vocab = a.per_token.len();
    let mut maxes = Vec::with_capacity(vocab.div_ceil(CHUNK));
    let (mut cols, mut vals) = (Vec::new(), Vec::new());
    let mut out = Candidates::default();
    let mut stage1 = 0;
    for i in range {
        let row = &scores[i * vocab..(i + 1) * vocab];
        let (base, gain) = (a.base[i], a.gain[i]);
        cols.clear();
        vals.clear();
        let thr = row_threshold(row, base, gain, a.per_token, vmax, &mut maxes)?;
        stage1_survivors(row, &maxes, thr, &mut cols, &mut vals);
        stage1 += cols.len();
        if stage1 > limits.stage1 {
            return None;
        }
        out.cols
            .extend(stage2(base, gain, a.per_token, &cols, &vals));
        out.rows.resize(out.cols.len(), i as u32);
        if out.rows.len() > limits.kept {
            return None;
        }
    }
    Some((out, stage1))
}

/// The smallest and largest key of `chunk`.
#[inline(always)]
fn key_range<S: Score>(chunk: &[S]) -> (S::Key, S::Key) {
    chunk.iter().fold((S::HIGHEST, S::LOWEST), |(lo, hi), &x| {
        let k = x.key();
        (lo.min(k), hi.max(k))
    })
}

/// Stage 1's threshold key of a row (its chunk maxima left in `maxes`); None when the row
/// holds a NaN or the threshold is not finite.
#[inline(always)]
fn row_threshold<S: Score>(
    row: &[S],
    base: f64,
    gain: f64,
    per_token: &[f64],
    vmax: f64,
    maxes: &mut Vec<S::Key>,
) -> Option<S::Key> {
    maxes.clear();
    let (mut lo, mut hi) = (S::HIGHEST, S::LOWEST);
    for chunk in row.chunks(CHUNK) {
        let (l, h) = key_range(chunk);
        lo = lo.min(l);
        hi = hi.max(h);
        maxes.push(h);
    }
    if S::has_nan(lo, hi) {
        return None; // numpy's argmax is the first NaN: a NaN threshold
    }
    let best = first_at_least(row, maxes, S::equal_floor(hi))?;
    let lb1 = row[best].value() - base - gain * per_token[best];
    let thr = lb1 - base - gain * vmax;
    thr.is_finite().then(|| S::threshold(thr))
}

/// The first index of `row` whose key is at least `t` (`maxes`: its chunk maxima).
fn first_at_least<S: Score>(row: &[S], maxes: &[S::Key], t: S::Key) -> Option<usize> {
    let c = maxes.iter().position(|&m| m >= t)?;
    let chunk = &row[c * CHUNK..((c + 1) * CHUNK).min(row.len())];
    chunk
        .iter()
        .position(|x| x.key() >= t)
        .map(|j| c * CHUNK + j)
}

/// Pushes the tokens of `row` with a key at least `t`, and their scores.
#[inline(always)]
fn stage1_survivors<S: Score>(
    row: &[S],
    maxes: &[S::Key],
    t: S::Key,
    cols: &mut Vec<u32>,
    vals: &mut Vec<f64>,
) {
    for (c, (&m, chunk)) in maxes.iter().zip(row.chunks(CHUNK)).enumerate() {
        if m < t {
            continue;
        }
        for (s, part) in chunk.chunks(MASK).enumerate() {
            let start = c * CHUNK + s * MASK;
            let mut mask = passing(part, t);
            while mask != 0 {
                let j = mask.trailing_zeros() as usize;
                mask &= mask - 1;
                cols.push((start + j) as u32);
                vals.push(part[j].value());
            }
        }
    }
}

/// Bit `j` set iff `part[j]` (at most 64 scores) has a key at least `t`.
#[inline(always)]
fn passing<S: Score>(part: &[S], t: S::Key) -> u64 {
    part.iter()
        .enumerate()
        .fold(0u64, |m, (j, x)| m | (u64::from(x.key() >= t) << j))
}

/// The stage-1 survivors `cols` (scores `vals`) of one row that stage 2 keeps.
fn stage2<'a>(
    base: f64,
    gain: f64,
    per_token: &'a [f64],
    cols: &'a [u32],
    vals: &'a [f64],
) -> impl Iterator<Item = u32> + 'a {
    let eps = move |c: u32| base + gain * per_token[c as usize];
    let lb2 = cols
        .iter()
        .zip(vals)
        .fold(f64::NEG_INFINITY, |m, (&c, &a)| nan_max(m, a - eps(c)));
    let floor = lb2 - lb2.abs() * 1e-12 - 1e-300;
    cols.iter()
        .zip(vals)
        .filter(move |&(&c, &a)| a + eps(c) >= floor)
        .map(|(&c, _)| c)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// `_select` written out plainly: one row at a time, every score visited.
    fn reference(
        values: &[f64],
        int: bool,
        case: &Case,
        (max_stage1, max_candidates): (usize, usize),
    ) -> Option<Candidates> {
        let (rows, vocab) = (case.rows, case.vocab);
        let (base, gain, per_token) = (&case.base, &case.gain, &case.per_token);
        if rows == 0 {
            return Some(Candidates::default());
        }
        if vocab == 0 {
            return None;
        }
        let vmax = per_token.iter().copied().fold(f64::NEG_INFINITY, nan_max);
        let mut thrs = Vec::new();
        for i in 0..rows {
            let row = &values[i * vocab..(i + 1) * vocab];
            // numpy argmax: the first NaN, else the first maximum
            let best = row
                .iter()
                .position(|x| x.is_nan())
                .unwrap_or_else(|| (0..vocab).fold(0, |b, j| if row[j] > row[b] { j } else { b }));
            let lb1 = row[best] - base[i] - gain[i] * per_token[best];
            let thr = lb1 - base[i] - gain[i] * vmax;
            if !thr.is_finite() {
                return None;
            }
            thrs.push(if int {
                (thr.floor() - 1.0).max(i32::MIN as f64) as i32 as f64
            } else {
                next_down(thr as f32) as f64
            });
        }
        let mut survivors = vec![];
        for i in 0..rows {
            for j in 0..vocab {
                let x = values[i * vocab + j];
                let pass = if int {
                    x >= thrs[i]
                } else {
                    x as f32 >= thrs[i] as f32
                };
                if pass {
                    survivors.push((i, j, x));
                }
            }
        }
        if survivors.len() > max_stage1 * rows {
            return None;
        }
        let eps = |i: usize, j: usize| base[i] + gain[i] * per_token[j];
        let mut lb2 = vec![f64::NEG_INFINITY; rows];
        for &(i, j, x) in &survivors {
            lb2[i] = nan_max(lb2[i], x - eps(i, j));
        }
        let mut out = Candidates::default();
        for &(i, j, x) in &survivors {
            if x + eps(i, j) >= lb2[i] - lb2[i].abs() * 1e-12 - 1e-300 {
                out.rows.push(i as u32);
                out.cols.push(j as u32);
            }
        }
        (out.rows.len() <= max_candidates * rows).then_some(out)
    }

    fn bf16_value(b: u16) -> f64 {
        b.value()
    }

    #[derive(Clone)]
    struct Case {
        rows: usize,
        vocab: usize,
        base: Vec<f64>,
        gain: Vec<f64>,
        per_token: Vec<f64>,
    }

    impl Case {
        fn args<'a>(&'a self, scores: Scores<'a>, threads: usize) -> SelectArgs<'a> {
            SelectArgs {
                scores,
                base: &self.base,
                gain: &self.gain,
                per_token: &self.per_token,
                max_stage1: 1024,
                max_candidates: 64,
                threads,
            }
        }
    }

    fn lcg(seed: &mut u64) -> u64 {
        *seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        *seed >> 33
    }

    fn uniform(seed: &mut u64) -> f64 {
        lcg(seed) as f64 / (1u64 << 31) as f64
    }

    fn check_all(case: &Case, bf: &[u16], f: &[f32], ints: &[i32], limits: (usize, usize)) {
        let (s1, kept) = limits;
        let (vb, vf, vi): (Vec<f64>, Vec<f64>, Vec<f64>) = (
            bf.iter().map(|&b| bf16_value(b)).collect(),
            f.iter().map(|&x| x as f64).collect(),
            ints.iter().map(|&x| x as f64).collect(),
        );
        for threads in [1, 2, 3] {
            for (scores, values, int) in [
                (Scores::Bf16(bf), &vb, false),
                (Scores::F32(f), &vf, false),
                (Scores::I32(ints), &vi, true),
            ] {
                let mut args = case.args(scores, threads);
                args.max_stage1 = s1;
                args.max_candidates = kept;
                let got = select_candidates(&args).unwrap();
                let want = reference(values, int, case, limits);
                assert_eq!(got, want, "{scores:?} threads {threads}");
            }
        }
    }

    /// Scores drawn from a few levels (ties), some rows with a clear winner.
    fn random_case(seed: u64, rows: usize, vocab: usize, spread: f64) -> (Case, Vec<f64>) {
        let mut s = seed;
        let levels: Vec<f64> = (0..6).map(|_| (uniform(&mut s) - 0.5) * 200.0).collect();
        let values = (0..rows * vocab)
            .map(|_| {
                if lcg(&mut s).is_multiple_of(4) {
                    levels[(lcg(&mut s) % 6) as usize]
                } else {
                    (uniform(&mut s) - 0.5) * 200.0
                }
            })
            .collect();
        let case = Case {
            rows,
            vocab,
            base: (0..rows).map(|_| uniform(&mut s) * spread).collect(),
            gain: (0..rows).map(|_| uniform(&mut s) * spread * 0.1).collect(),
            per_token: (0..vocab).map(|_| uniform(&mut s) * 10.0).collect(),
        };
        (case, values)
    }

    fn typed(values: &[f64]) -> (Vec<u16>, Vec<f32>, Vec<i32>) {
        (
            values
                .iter()
                .map(|&v| half::bf16::from_f64(v).to_bits())
                .collect(),
            values.iter().map(|&v| v as f32).collect(),
            values.iter().map(|&v| v.round() as i32).collect(),
        )
    }

    #[test]
    fn matches_the_reference_on_random_rows() {
        for seed in 0..40 {
            let vocab = [1, 7, 127, 128, 129, 300, 1000][seed as usize % 7];
            let (case, values) = random_case(seed, 1 + seed as usize % 5, vocab, 20.0);
            let (bf, f, i) = typed(&values);
            check_all(&case, &bf, &f, &i, (1024, 64));
            check_all(&case, &bf, &f, &i, (3, 2)); // limits hit
        }
    }

    #[test]
    fn a_clear_winner_alone_survives() {
        let case = Case {
            rows: 2,
            vocab: 300,
            base: vec![0.5, 0.5],
            gain: vec![0.0, 0.0],
            per_token: vec![1.0; 300],
        };
        let mut values = vec![0.0; 600];
        values[17] = 10.0;
        values[300 + 299] = 5.0;
        values[300 + 3] = 4.5;
        let (bf, f, i) = typed(&values);
        let args = case.args(Scores::F32(&f), 1);
        let got = select_candidates(&args).unwrap().unwrap();
        assert_eq!(got.rows, vec![0, 1, 1]);
        assert_eq!(got.cols, vec![17, 3, 299]);
        assert_eq!(got.columns(), (vec![3, 17, 299], vec![1, 0, 2]));
        check_all(&case, &bf, &f, &i, (1024, 64));
    }

    #[test]
    fn stage2_keeps_its_relative_slack_and_no_more() {
        // lb2 = 100 (token 0); token 1 has a + eps = 100 - d
        for (d, kept) in [(0.0, true), (0.5e-10, true), (2e-10, false)] {
            let case = Case {
                rows: 1,
                vocab: 2,
                base: vec![0.0],
                gain: vec![1.0],
                per_token: vec![0.0, 10.0 - d],
            };
            let (f, i) = ([100.0f32, 90.0], [100i32, 90]);
            for scores in [Scores::F32(&f), Scores::I32(&i)] {
                let got = select_candidates(&case.args(scores, 1)).unwrap().unwrap();
                assert_eq!(got.cols, if kept { vec![0, 1] } else { vec![0] }, "{d}");
            }
        }
    }

    #[test]
    fn non_finite_scores_or_bounds_return_none() {
        let case = Case {
            rows: 2,
            vocab: 5,
            base: vec![0.1, 0.1],
            gain: vec![0.0, 0.0],
            per_token: vec![1.0; 5],
        };
        let nan_bf = |neg: bool| if neg { 0xffc0u16 } else { 0x7fc0 };
        for (j, x) in [(3, f32::NAN), (0, -f32::NAN), (2, f32::INFINITY)] {
            let mut f = vec![1.0f32; 10];
            f[5 + j] = x;
            let args = case.args(Scores::F32(&f), 1);
            assert_eq!(select_candidates(&args).unwrap(), None, "{x}");
            let mut b = vec![0x3f80u16; 10];
            b[5 + j] = if x.is_nan() {
                nan_bf(x.is_sign_negative())
            } else {
                0x7f80
            };
            let args = case.args(Scores::Bf16(&b), 2);
            assert_eq!(select_candidates(&args).unwrap(), None, "{x}");
        }
        // a -inf score is only a token that never survives
        let mut f = vec![1.0f32; 10];
        f[7] = f32::NEG_INFINITY;
        let got = select_candidates(&case.args(Scores::F32(&f), 1)).unwrap();
        assert_eq!(got.unwrap().cols, vec![0, 1, 2, 3, 4, 0, 1, 3, 4]);
        let ints = vec![1i32; 10];
        for (field, x) in [(0, f64::NAN), (1, f64::INFINITY), (2, f64::NAN)] {
            let mut c = case.clone();
            match field {
                0 => c.base[1] = x,
                1 => c.gain[0] = x,
                _ => c.per_token[4] = x,
            }
            assert_eq!(
                select_candidates(&c.args(Scores::I32(&ints), 1)).unwrap(),
                None
            );
        }
    }

    #[test]
    fn all_equal_rows_keep_every_token_up_to_the_limits() {
        let case = Case {
            rows: 3,
            vocab: 200,
            base: vec![0.0; 3],
            gain: vec![0.0; 3],
            per_token: vec![0.0; 200],
        };
        for v in [0.0, -0.0, 2.5, -7.0] {
            let values = vec![v; 600];
            let (bf, f, i) = typed(&values);
            check_all(&case, &bf, &f, &i, (1024, 64)); // too many: None
            check_all(&case, &bf, &f, &i, (200, 200)); // exactly at the limits: all
            let args = SelectArgs {
                max_candidates: 200,
                ..case.args(Scores::Bf16(&bf), 2)
            };
            assert_eq!(select_candidates(&args).unwrap().unwrap().rows.len(), 600);
        }
    }

    #[test]
    fn mixed_zeros_pick_the_first_zero_as_numpy_does() {
        // the best is the first zero, whatever its sign: its per-token bound sets the threshold
        let case = Case {
            rows: 1,
            vocab: 300,
            base: vec![0.0],
            gain: vec![1.0],
            per_token: (0..300).map(|j| if j == 200 { 3.0 } else { 0.0 }).collect(),
        };
        // best 200: threshold -6, token 100 survives stage 1; best 250 would give -3
        let mut values = vec![-10.0; 300];
        values[200] = -0.0;
        values[250] = 0.0;
        values[100] = -4.5;
        let (bf, f, i) = typed(&values);
        check_all(&case, &bf, &f, &i, (1024, 64));
        check_all(&case, &bf, &f, &i, (2, 64));
        for scores in [Scores::F32(&f), Scores::Bf16(&bf)] {
            let got = select_candidates(&case.args(scores, 1)).unwrap();
            assert_eq!(got.unwrap().cols, vec![200, 250]);
            let args = SelectArgs {
                max_stage1: 2,
                ..case.args(scores, 1)
            };
            assert_eq!(select_candidates(&args).unwrap(), None); // three in stage 1
        }
    }

    #[test]
    fn empty_shapes_and_bad_lengths() {
        let none = Case {
            rows: 0,
            vocab: 4,
            base: vec![],
            gain: vec![],
            per_token: vec![1.0; 4],
        };
        let got = select_candidates(&none.args(Scores::F32(&[]), 4)).unwrap();
        assert_eq!(got, Some(Candidates::default()));
        let mut case = Case {
            rows: 2,
            vocab: 0,
            base: vec![0.0; 2],
            gain: vec![0.0; 2],
            per_token: vec![],
        };
        assert_eq!(
            select_candidates(&case.args(Scores::I32(&[]), 1)).unwrap(),
            None
        );
        case.per_token = vec![0.0; 3];
        let err = select_candidates(&case.args(Scores::I32(&[1, 2]), 1)).unwrap_err();
        assert!(err.to_string().contains("scores has 2 entries"), "{err}");
        case.gain.pop();
        let err = select_candidates(&case.args(Scores::I32(&[0; 6]), 1)).unwrap_err();
        assert!(err.to_string().contains("gain has 1"), "{err}");
    }

    #[test]
    fn bf16_threshold_keys_agree_with_float_comparison() {
        // every bf16 pattern against thresholds across the range (zeros, subnormals, the
        // largest finite values, negatives)
        let mut thrs = vec![
            0.0,
            -0.0,
            1e-45,
            -1e-45,
            1.4e-45,
            3e-45,
            9.2e-41,
            -9.2e-41,
            1.0,
            -1.0,
            1.0 + 1e-9,
            3.3895e38,
            3.4e38,
            -3.4e38,
            1e39,
            -1e39,
        ];
        let mut s = 5;
        thrs.extend(
            (0..200).map(|_| (uniform(&mut s) - 0.5) * 10f64.powi((lcg(&mut s) % 80) as i32 - 40)),
        );
        for thr in thrs {
            let t = u16::threshold(thr);
            let tf = next_down(thr as f32);
            for b in 0..=u16::MAX {
                let x = f32::from_bits(u32::from(b) << 16);
                if x.is_nan() {
                    continue;
                }
                assert_eq!(b.key() >= t, x >= tf, "bits {b:#x} thr {thr:e}");
            }
        }
    }

    #[test]
    fn pick_best_takes_the_highest_then_the_lowest_token() {
        // logits [2, 3]; pairs (row, token, column)
        let logits = [1.0, 2.0, 2.0, -0.0, 0.0, -1.0];
        let (rows, cols, inverse) = ([0i64, 0, 0, 1, 1], [9i64, 4, 7, 5, 2], [0i64, 2, 1, 0, 1]);
        let got = pick_best(&logits, 3, &rows, &cols, &inverse).unwrap();
        assert_eq!(got, Some(vec![4, 2])); // 2.0 twice -> token 4; -0 == 0 -> token 2
        let got = pick_best(&logits, 3, &rows[..3], &cols[..3], &inverse[..3]).unwrap();
        assert_eq!(got, None); // row 1 has no candidate
        let bad = [f32::NAN, 0.0, 0.0, 0.0, 0.0, 0.0];
        assert_eq!(pick_best(&bad, 3, &rows, &cols, &inverse).unwrap(), None);
        assert!(pick_best(&logits, 3, &[2], &[0], &[0]).is_err());
        assert!(pick_best(&logits, 3, &[0], &[0], &[3]).is_err());
        assert!(pick_best(&logits, 3, &[0], &[0], &[-1]).is_err());
        assert!(pick_best(&logits, 4, &[0], &[0], &[0]).is_err());
        assert!(pick_best(&logits, 3, &[0], &[], &[0]).is_err());
    }

    #[test]
    fn row_norms_are_the_f64_norms() {
        let x = [3.0f32, -4.0, 0.0, 1.0, -1.0, 1.0, -1.0, 1.0, -1.0, 2.0, 0.5];
        let [l2, l1, max] = row_norms(&x, 11).unwrap();
        let want_sq: f64 = x.iter().map(|&v| (v as f64).powi(2)).sum();
        assert_eq!(l2, vec![want_sq.sqrt()]);
        assert_eq!(l1, vec![15.5]);
        assert_eq!(max, vec![4.0]);
        let [l2, l1, max] = row_norms(&[0.0, 0.0, f32::NAN, 1.0, f32::INFINITY, 1.0], 2).unwrap();
        assert_eq!((l2[0], l1[0], max[0]), (0.0, 0.0, 0.0));
        assert!(l1[1].is_nan() && max[1].is_nan() && l2[1].is_nan());
        assert!(l1[2].is_infinite() && max[2].is_infinite());
        assert!(row_norms(&[1.0; 5], 2).is_err());
        assert!(row_norms(&[], 0).is_err());
        assert_eq!(row_norms(&[], 3).unwrap(), [vec![], vec![], vec![]]);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(96))]
        #[test]
        fn random_calls_match_the_reference(seed in 0u64..100_000, rows in 1usize..6,
                                            vocab in 1usize..700, spread in 0.0f64..60.0,
                                            s1 in 1usize..50, kept in 1usize..20) {
            let (case, values) = random_case(seed, rows, vocab, spread);
            let (bf, f, i) = typed(&values);
            check_all(&case, &bf, &f, &i, (1024, 64));
            check_all(&case, &bf, &f, &i, (s1, kept));
        }

        #[test]
        fn f32_threshold_keys_agree_with_float_comparison(thr in proptest::num::f64::ANY,
                                                          x in proptest::num::f32::ANY) {
            prop_assume!(thr.is_finite() && !x.is_nan());
            prop_assert_eq!(x.key() >= f32::threshold(thr), x >= next_down(thr as f32));
        }
    }
}
