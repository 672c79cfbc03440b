//! f32 matrix products on AVX-512F over weights packed once: `out = x @ W.T (+ bias)`, every
//! output a plain f32 sum of f32 products in input order, the same whatever the number of
//! rows or threads (a row's result never depends on its batch; columns, not the k loop, are
//! split between threads).
//!
//! The weight `W` [n, k] (row-major, as `nn.Linear` keeps it) is packed ([`pack`]) into
//! column blocks of 16: block `nb` holds, for each input `l`, the 16 weights `W[16 nb + j,
//! l]` (one zmm register), `k` such rows one after the other, zero beyond `n`. A pass takes
//! up to 4 column blocks and up to 6 rows of `x` at a time, keeping their 6 x 4
//! accumulators in registers through the k loop: per input, 4 weight rows are loaded and
//! each row's input is broadcast into 4 fused multiply-adds. The rows' inputs stay in L1
//! and a pass's weights (k x 256 bytes) in L2 while the rows go past in groups.

use std::ops::Range;

use crate::amx::{LinearArgs, OutColumns};
use crate::fused::ArgError;

/// Output columns of one packed block (one zmm register of f32).
pub const BLOCK_N: usize = 16;
/// Column blocks per pass and rows per group when four blocks remain: 6 x 4 accumulators,
/// 4 weight rows and a broadcast input take 29 of the 32 zmm registers.
pub(crate) const PASS_BLOCKS: usize = 4;
const GROUP_ROWS: usize = 6;
/// Rows per chunk of a long call: 192 rows of f32 inputs (432 KiB at k = 576) stay in the
/// L2 cache while every weight block streams past; each chunk reads the weights once more.
const ROWS_PER_CHUNK: usize = 192;

/// Whether the CPU runs the AVX-512F kernel (else [`linear`] fails with `"f32_linear"`).
pub fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx512f")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Elements of the packed form of an `[n, k]` weight (`n` padded to whole blocks).
pub fn packed_len(n: usize, k: usize) -> usize {
    n.div_ceil(BLOCK_N) * BLOCK_N * k
}

pub(crate) fn err(field: &'static str, message: String) -> ArgError {
    ArgError {
        field,
        message: format!("{field} {message}"),
    }
}

/// The lengths [`pack`] (and [`crate::i16_linear::pack`]) expect of the weight [n, k] and
/// of the packed output.
pub(crate) fn check_pack(weight: usize, n: usize, k: usize, out: usize) -> Result<(), ArgError> {
    if weight != n * k {
        return Err(err(
            "weight",
            format!("has {weight} elements, not n * k = {}", n * k),
        ));
    }
    if out != packed_len(n, k) {
        return Err(err(
            "out",
            format!("has {out} elements, not {}", packed_len(n, k)),
        ));
    }
    Ok(())
}

/// The lengths a product over a packed weight expects of `x` [m, k], the packed weight
/// and `out` [m, n] (`args`' shapes).
pub(crate) fn check_product(
    args: &LinearArgs,
    x: usize,
    packed: usize,
    out: usize,
) -> Result<(), ArgError> {
    let LinearArgs { m, n, k, .. } = *args;
    for (field, got, want) in [
        ("x", x, m * k),
        ("packed", packed, packed_len(n, k)),
        ("out", out, m * n),
    ] {
        if got != want {
            return Err(err(field, format!("has {got} elements, not {want}")));
        }
    }
    Ok(())
}

/// Packs `weight` [n, k] into `out` ([`packed_len`] elements; layout in the module docs).
pub fn pack(weight: &[f32], n: usize, k: usize, out: &mut [f32]) -> Result<(), ArgError> {
    check_pack(weight.len(), n, k, out.len())?;
    if k == 0 {
        return Ok(());
    }
    let blocks = n.div_ceil(BLOCK_N);
    for nb in (0..blocks).step_by(PASS_BLOCKS) {
        let width = (blocks - nb).min(PASS_BLOCKS) * BLOCK_N;
        let panel = &mut out[nb * BLOCK_N * k..(nb * BLOCK_N + width) * k];
        for (l, row) in panel.chunks_exact_mut(width).enumerate() {
            for (j, v) in row.iter_mut().enumerate() {
                let col = nb * BLOCK_N + j;
                *v = if col < n { weight[col * k + l] } else { 0.0 };
            }
        }
    }
    Ok(())
}

/// `out[i, j] = sum_l x[i, l] * W[j, l] (+ bias[j])` in f32, `x` [m, k], `packed` the
/// [`pack`]ed `W` [n, k], `out` [m, n] (`args`' shapes); panels of 64 columns split over at
/// most `args.threads` threads of the kernel pool. Fails with the field at fault on a length mismatch, and with
/// `"f32_linear"` where [`available`] is false.
pub fn linear(
    args: &LinearArgs,
    x: &[f32],
    packed: &[f32],
    bias: Option<&[f32]>,
    out: &mut [f32],
) -> Result<(), ArgError> {
    let LinearArgs { m, n, k, .. } = *args;
    check_product(args, x.len(), packed.len(), out.len())?;
    if let Some(b) = bias {
        if b.len() != n {
            return Err(err(
                "bias",
                format!("has {} elements, not n = {n}", b.len()),
            ));
        }
    }
    if m == 0 || n == 0 {
        return Ok(());
    }
    if !available() {
        return Err(err(
            "f32_linear",
            "is not available: this CPU has no AVX-512F".into(),
        ));
    }
    if k == 0 {
        for row in out.chunks_exact_mut(n) {
            match bias {
                Some(b) => row.copy_from_slice(b),
                None => row.fill(0.0),
            }
        }
        return Ok(());
    }
    let blocks = n.div_ceil(BLOCK_N);
    let bias: Option<Vec<f32>> = bias.map(|b| {
        let mut padded = b.to_vec();
        padded.resize(blocks * BLOCK_N, 0.0);
        padded
    });
    run_panels::<f32>(args, x, packed, bias.as_deref(), out);
    Ok(())
}

/// The pieces of a product over a packed weight: each chunk of rows in turn, its panels
/// split over at most `args.threads` threads of the kernel pool (lengths checked by the
/// caller; `bias` padded to whole blocks; `args.k > 0`).
pub(crate) fn run_panels<E: PanelKernel>(
    args: &LinearArgs,
    x: &[E],
    packed: &[E],
    bias: Option<&[E::Sum]>,
    out: &mut [E::Sum],
) {
    let LinearArgs { m, n, k, threads } = *args;
    let blocks = n.div_ceil(BLOCK_N);
    let ranges = panel_ranges(blocks.div_ceil(PASS_BLOCKS), threads.max(1));
    for row0 in (0..m).step_by(ROWS_PER_CHUNK) {
        let rows = (m - row0).min(ROWS_PER_CHUNK);
        let a = &x[row0 * k..(row0 + rows) * k];
        // (row0 * n < out.len(): row0 < m)
        let dst = OutColumns::new(&mut out[row0 * n..(row0 + rows) * n], rows, n);
        let task = |t: usize| run_blocks(a, k, rows, packed, ranges[t].clone(), bias, &dst);
        crate::parallel::pool().run(ranges.len(), ranges.len(), &task);
    }
}

/// The element type of a packed product and its k loop: 32 bits of input per lane, 16
/// lanes per zmm register, sums of type `Sum` (f32 here; i16 pairs into i32 in
/// [`crate::i16_linear`]).
pub(crate) trait PanelKernel: Copy + Send + Sync + Sized {
    /// What a row's products are summed into.
    type Sum: Copy + Default + Send + Sync;
    /// `sums[i][..16 NB] = bias + a[i] . w` for the `R` rows of `a` ([R, k]) and the `NB`
    /// column blocks of `w` (a panel), fetching `pf`'s weights into L2 on the way.
    fn dot<const R: usize, const NB: usize>(
        a: &[Self],
        k: usize,
        w: &[Self],
        bias: Option<&[Self::Sum]>,
        pf: Option<Prefetch<'_, Self>>,
        sums: &mut [[Self::Sum; PASS_BLOCKS * BLOCK_N]],
    );
}

impl PanelKernel for f32 {
    type Sum = f32;
    fn dot<const R: usize, const NB: usize>(
        a: &[f32],
        k: usize,
        w: &[f32],
        bias: Option<&[f32]>,
        pf: Option<Prefetch<'_, f32>>,
        sums: &mut [[f32; PASS_BLOCKS * BLOCK_N]],
    ) {
        kernel::run::<R, NB>(a, k, w, bias, pf, sums)
    }
}

/// `panels` panels in `threads` near-equal consecutive ranges (none empty).
fn panel_ranges(panels: usize, threads: usize) -> Vec<Range<usize>> {
    let parts = threads.clamp(1, panels);
    (0..parts)
        .map(|t| panels * t / parts..panels * (t + 1) / parts)
        .collect()
}

/// The panels `panels` for rows `0..rows` of `a` ([rows, k]).
fn run_blocks<E: PanelKernel>(
    a: &[E],
    k: usize,
    rows: usize,
    packed: &[E],
    panels: Range<usize>,
    bias: Option<&[E::Sum]>,
    out: &OutColumns<E::Sum>,
) {
    let blocks = packed.len() / (BLOCK_N * k);
    let panel_at = |panel: usize| {
        let nb = panel * PASS_BLOCKS;
        let nblocks = (blocks - nb).min(PASS_BLOCKS);
        (
            nb,
            nblocks,
            &packed[nb * BLOCK_N * k..(nb + nblocks) * BLOCK_N * k],
        )
    };
    let end = panels.end;
    for panel in panels {
        let (nb, nblocks, w) = panel_at(panel);
        // the next panel's weights, fetched into L2 while this one's row groups run: group
        // g < 4 fetches that panel's column block g (a call streams its weights from memory
        // once, and without this the fetch stalls the first group of every panel)
        let next = (panel + 1 < end).then(|| panel_at(panel + 1));
        let b = bias.map(|b| &b[nb * BLOCK_N..(nb + nblocks) * BLOCK_N]);
        for (g, row0) in (0..rows).step_by(GROUP_ROWS).enumerate() {
            let r = (rows - row0).min(GROUP_ROWS);
            let mut sums = [[E::Sum::default(); PASS_BLOCKS * BLOCK_N]; GROUP_ROWS];
            let pf = next.and_then(|(_, blocks, w)| {
                (g < blocks).then_some(Prefetch {
                    w,
                    blocks,
                    block: g,
                })
            });
            group(
                &a[row0 * k..(row0 + r) * k],
                k,
                r,
                nblocks,
                w,
                b,
                pf,
                &mut sums[..r],
            );
            for (i, s) in sums[..r].iter().enumerate() {
                out.write_cols(row0 + i, nb * BLOCK_N, &s[..nblocks * BLOCK_N]);
            }
        }
    }
}

/// Which weights a group fetches ahead: column block `block` of the panel `w` (`blocks`
/// column blocks, [`pack`]'s panel layout), one cache line per input.
pub(crate) struct Prefetch<'a, E> {
    pub(crate) w: &'a [E],
    pub(crate) blocks: usize,
    pub(crate) block: usize,
}

// (derived Clone / Copy would ask `E: Copy`; a shared slice is Copy whatever `E`)
impl<E> Clone for Prefetch<'_, E> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<E> Copy for Prefetch<'_, E> {}

/// `sums[i][..16 nb] = bias + a[i] . w` for the `r` rows of `a` and the `nb` blocks of `w`,
/// fetching `pf`'s weights into L2 on the way.
#[allow(clippy::too_many_arguments)] // one group's operands
fn group<E: PanelKernel>(
    a: &[E],
    k: usize,
    r: usize,
    nb: usize,
    w: &[E],
    bias: Option<&[E::Sum]>,
    pf: Option<Prefetch<'_, E>>,
    sums: &mut [[E::Sum; PASS_BLOCKS * BLOCK_N]],
) {
    // (const row and block counts let the compiler keep every accumulator in a register)
    macro_rules! rows {
        ($nb:literal) => {
            match r {
                1 => E::dot::<1, $nb>(a, k, w, bias, pf, sums),
                2 => E::dot::<2, $nb>(a, k, w, bias, pf, sums),
                3 => E::dot::<3, $nb>(a, k, w, bias, pf, sums),
                4 => E::dot::<4, $nb>(a, k, w, bias, pf, sums),
                5 => E::dot::<5, $nb>(a, k, w, bias, pf, sums),
                6 => E::dot::<6, $nb>(a, k, w, bias, pf, sums),
                _ => unreachable!("1 to 6 rows per group"),
            }
        };
    }
    match nb {
        1 => rows!(1),
        2 => rows!(2),
        3 => rows!(3),
        4 => rows!(4),
        _ => unreachable!("1 to 4 column blocks per pass"),
    }
}

#[cfg(target_arch = "x86_64")]
mod kernel {
    use super::{Prefetch, BLOCK_N, PASS_BLOCKS};
    use std::arch::x86_64::*;

    /// See [`super::group`]; `R` rows, `NB` column blocks.
    pub(super) fn run<const R: usize, const NB: usize>(
        a: &[f32],
        k: usize,
        w: &[f32],
        bias: Option<&[f32]>,
        pf: Option<Prefetch<'_, f32>>,
        sums: &mut [[f32; PASS_BLOCKS * BLOCK_N]],
    ) {
        assert!(NB <= PASS_BLOCKS && a.len() == R * k && w.len() == NB * k * BLOCK_N);
        assert!(sums.len() == R && bias.is_none_or(|b| b.len() == NB * BLOCK_N));
        assert!(pf.is_none_or(|p| p.block < p.blocks && p.w.len() == p.blocks * k * BLOCK_N));
        assert!(super::available(), "AVX-512F is not available");
        // SAFETY: the CPU has AVX-512F (asserted just above), the only target feature `dot`
        // enables; the lengths `dot` relies on are asserted above too.
        unsafe { dot::<R, NB>(a, k, w, bias, pf, sums) }
    }

    /// The k loop of [`run`] (lengths checked there).
    #[target_feature(enable = "avx512f")]
    fn dot<const R: usize, const NB: usize>(
        a: &[f32],
        k: usize,
        w: &[f32],
        bias: Option<&[f32]>,
        pf: Option<Prefetch<'_, f32>>,
        sums: &mut [[f32; PASS_BLOCKS * BLOCK_N]],
    ) {
        // (`w`'s start, never advanced, when nothing is fetched: the loop keeps one form)
        let (pf_ptr, pf_step) = match pf {
            Some(p) => (p.w[p.block * BLOCK_N..].as_ptr(), p.blocks * BLOCK_N),
            None => (w.as_ptr(), 0),
        };
        let start: [__m512; NB] = std::array::from_fn(|j| match bias {
            // SAFETY: bias has 16 NB elements (asserted in `run`); 16 are read from 16 j.
            Some(b) => unsafe { _mm512_loadu_ps(b.as_ptr().add(BLOCK_N * j)) },
            None => _mm512_setzero_ps(),
        });
        let mut acc = [start; R];
        let (wp, ap) = (w.as_ptr(), a.as_ptr());
        for l in 0..k {
            // (a prefetch never faults: the address is input l's line of the fetched column
            // block, inside the next panel, or `w`'s start)
            _mm_prefetch::<_MM_HINT_T1>(pf_ptr.wrapping_add(l * pf_step).cast::<i8>());
            // SAFETY: `(l * NB + j) * 16 + 16 <= NB * k * 16 = w.len()` (l < k, j < NB):
            // input l's weights of column block j, 16 f32, unaligned load.
            let wv: [__m512; NB] =
                std::array::from_fn(|j| unsafe { _mm512_loadu_ps(wp.add((l * NB + j) * BLOCK_N)) });
            for (i, acc) in acc.iter_mut().enumerate() {
                // SAFETY: `i * k + l < R * k = a.len()`: input l of row i.
                let x = _mm512_set1_ps(unsafe { *ap.add(i * k + l) });
                for (acc, wv) in acc.iter_mut().zip(&wv) {
                    *acc = _mm512_fmadd_ps(x, *wv, *acc);
                }
            }
        }
        for (s, acc) in sums.iter_mut().zip(&acc) {
            for (j, v) in acc.iter().enumerate() {
                // SAFETY: each row of `sums` has 64 f32 and j < NB <= 4: 16 stored at 16 j.
                unsafe { _mm512_storeu_ps(s.as_mut_ptr().add(BLOCK_N * j), *v) };
            }
        }
    }
}

#[cfg(not(target_arch = "x86_64"))]
mod kernel {
    use super::{Prefetch, BLOCK_N, PASS_BLOCKS};

    pub(super) fn run<const R: usize, const NB: usize>(
        _: &[f32],
        _: usize,
        _: &[f32],
        _: Option<&[f32]>,
        _: Option<Prefetch<'_, f32>>,
        _: &mut [[f32; PASS_BLOCKS * BLOCK_N]],
    ) {
        unreachable!("AVX-512F is never available off x86-64")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fused::testing::values;
    use proptest::prelude::*;

    /// The f64 reference of `x @ W.T + b`.
    fn reference(
        x: &[f32],
        w: &[f32],
        b: Option<&[f32]>,
        m: usize,
        n: usize,
        k: usize,
    ) -> Vec<f64> {
        let mut out = vec![0f64; m * n];
        for i in 0..m {
            for j in 0..n {
                let mut s = b.map_or(0.0, |b| f64::from(b[j]));
                for l in 0..k {
                    s += f64::from(x[i * k + l]) * f64::from(w[j * k + l]);
                }
                out[i * n + j] = s;
            }
        }
        out
    }

    fn run(m: usize, n: usize, k: usize, threads: usize, bias: bool) -> (Vec<f32>, Vec<f64>) {
        let x = values(1, m * k, 1.0);
        let w = values(2, n * k, 1.0);
        let b = bias.then(|| values(3, n, 1.0));
        let mut packed = vec![0f32; packed_len(n, k)];
        pack(&w, n, k, &mut packed).unwrap();
        let mut out = vec![f32::NAN; m * n];
        linear(
            &LinearArgs { m, n, k, threads },
            &x,
            &packed,
            b.as_deref(),
            &mut out,
        )
        .unwrap();
        (out, reference(&x, &w, b.as_deref(), m, n, k))
    }

    #[test]
    fn matches_the_f64_reference_within_f32_rounding() {
        if !available() {
            return;
        }
        for (m, n, k) in [
            (1, 16, 1),
            (7, 70, 33),
            (13, 200, 64),
            (200, 40, 9),
            (6, 64, 576),
        ] {
            for bias in [false, true] {
                let (out, want) = run(m, n, k, 2, bias);
                for (o, w) in out.iter().zip(&want) {
                    // |error| <= k eps sum |terms| (values are within [-1, 1])
                    let bound = (k as f64 + 1.0) * f64::from(f32::EPSILON) * (k as f64 + 1.0);
                    assert!(
                        (f64::from(*o) - w).abs() <= bound,
                        "{m}x{n}x{k}: {o} vs {w}"
                    );
                }
            }
        }
    }

    #[test]
    fn rows_and_threads_do_not_change_a_row() {
        if !available() {
            return;
        }
        let (n, k) = (100, 37);
        let (all, _) = run(20, n, k, 3, true);
        for threads in [1, 2, 5] {
            let (again, _) = run(20, n, k, threads, true);
            assert_eq!(all, again);
        }
        // the first row alone, as one row of a call
        let (one, _) = run(1, n, k, 1, true);
        assert_eq!(one[..], all[..n]);
    }

    #[test]
    fn bad_lengths_name_the_field_and_write_nothing() {
        const ARGS: LinearArgs = LinearArgs {
            m: 2,
            n: 2,
            k: 3,
            threads: 1,
        };
        let mut out = vec![7f32; 4];
        let packed = vec![0f32; packed_len(2, 3)];
        let e = linear(&ARGS, &[0.0; 5], &packed, None, &mut out).unwrap_err();
        assert_eq!(e.field, "x");
        let e = linear(&ARGS, &[0.0; 6], &packed[1..], None, &mut out).unwrap_err();
        assert_eq!(e.field, "packed");
        let e = linear(&ARGS, &[0.0; 6], &packed, Some(&[0.0]), &mut out).unwrap_err();
        assert_eq!(e.field, "bias");
        let e = linear(&ARGS, &[0.0; 6], &packed, None, &mut out[..3]).unwrap_err();
        assert_eq!(e.field, "out");
        assert_eq!(out, vec![7f32; 4]);
        let e = pack(&[0.0; 5], 2, 3, &mut vec![0f32; packed_len(2, 3)]).unwrap_err();
        assert_eq!(e.field, "weight");
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]
        #[test]
        fn any_shape_matches_the_reference(m in 1usize..20, n in 1usize..90, k in 0usize..70,
                                           threads in 1usize..4, bias: bool) {
            prop_assume!(available());
            let (out, want) = run(m, n, k, threads, bias);
            for (o, w) in out.iter().zip(&want) {
                let bound = 2.0 * (k as f64 + 1.0).powi(2) * f64::from(f32::EPSILON);
                prop_assert!((f64::from(*o) - w).abs() <= bound, "{} vs {}", o, w);
            }
        }
    }
}
