//! The panel layout and the pass over it that [`crate::f32_linear`] and
//! [`crate::i16_linear`] share (any [`PanelKernel`] can).
//!
//! Layout: the weight [n, k] in column blocks of 16 (`n` padded to whole blocks, zero
//! beyond it), in panels of up to 4 blocks; a panel holds, for each step of `step` inputs
//! (1 for f32, a pair for i16), the panel's columns one after the other, each with its
//! `step` weights side by side (one zmm register per block).
//!
//! Pass: the rows go in chunks whose inputs stay in L2; each chunk's panels are split over
//! the kernel pool's threads (columns, never the k loop, so a row's result depends neither
//! on its batch nor on the threads); per panel, groups of up to 6 rows run the kernel's
//! `dot` with their 6 x 4 accumulators in registers, the next panel's weights fetched into
//! L2 on the way.

use std::ops::Range;

use super::{LinearArgs, OutColumns};

/// Output columns of one packed block (one zmm register of 32-bit lanes).
pub const BLOCK_N: usize = 16;
/// Column blocks per pass and rows per group when four blocks remain: 6 x 4 accumulators,
/// 4 weight rows and a broadcast input take 29 of the 32 zmm registers.
pub(crate) const PASS_BLOCKS: usize = 4;
const GROUP_ROWS: usize = 6;
/// Rows per chunk of a long call: 192 rows of f32 inputs (432 KiB at k = 576) stay in the
/// L2 cache while every weight block streams past; each chunk reads the weights once more.
const ROWS_PER_CHUNK: usize = 192;

/// Elements of the packed form of an `[n, k]` weight (`n` padded to whole blocks).
pub fn packed_len(n: usize, k: usize) -> usize {
    n.div_ceil(BLOCK_N) * BLOCK_N * k
}

/// Packs `weight` [n, k] into `out` ([`packed_len`] elements), `step` inputs of a column
/// side by side (`k` a multiple of `step`; lengths checked by the caller).
pub(crate) fn pack_columns<T: Copy + Default>(
    weight: &[T],
    n: usize,
    k: usize,
    step: usize,
    out: &mut [T],
) {
    if k == 0 {
        return;
    }
    let blocks = n.div_ceil(BLOCK_N);
    for nb in (0..blocks).step_by(PASS_BLOCKS) {
        let width = (blocks - nb).min(PASS_BLOCKS) * BLOCK_N;
        let panel = &mut out[nb * BLOCK_N * k..(nb * BLOCK_N + width) * k];
        for (s, row) in panel.chunks_exact_mut(step * width).enumerate() {
            for (j, v) in row.chunks_exact_mut(step).enumerate() {
                let col = nb * BLOCK_N + j;
                for (h, v) in v.iter_mut().enumerate() {
                    *v = if col < n {
                        weight[col * k + step * s + h]
                    } else {
                        T::default()
                    };
                }
            }
        }
    }
}

/// Unpacks `packed` (laid out by [`pack_columns`] with `step` 1) back into `weight` [n, k],
/// row-major: the inverse of that packing, its padding columns dropped (lengths checked by
/// the caller).
pub(crate) fn unpack_columns<T: Copy>(packed: &[T], n: usize, k: usize, weight: &mut [T]) {
    if k == 0 {
        return;
    }
    let blocks = n.div_ceil(BLOCK_N);
    for nb in (0..blocks).step_by(PASS_BLOCKS) {
        let width = (blocks - nb).min(PASS_BLOCKS) * BLOCK_N;
        let panel = &packed[nb * BLOCK_N * k..(nb * BLOCK_N + width) * k];
        for (s, row) in panel.chunks_exact(width).enumerate() {
            for (j, v) in row.iter().enumerate() {
                let col = nb * BLOCK_N + j;
                if col < n {
                    weight[col * k + s] = *v;
                }
            }
        }
    }
}

/// A product over the panel layout: its element types and its k loop.
pub(crate) trait PanelKernel: super::Layout<Elem: Sync> {
    /// The inputs' element (`x` [m, k]).
    type X: Copy + Sync;
    /// What a row's products are summed into.
    type Sum: Copy + Default + Send + Sync;

    /// Packed elements of one column block (16 columns) of a weight of `k` inputs.
    fn block_len(k: usize) -> usize {
        BLOCK_N * k
    }

    /// `sums[i][..16 NB] = bias + a[i] . w` for the `R` rows of `a` ([R, k]) and the `NB`
    /// column blocks of `w` (a panel), fetching `pf`'s weights into L2 on the way.
    fn dot<const R: usize, const NB: usize>(
        a: &[Self::X],
        k: usize,
        w: &[Self::Elem],
        bias: Option<&[Self::Sum]>,
        pf: Option<Prefetch<'_, Self::Elem>>,
        sums: &mut [[Self::Sum; PASS_BLOCKS * BLOCK_N]],
    );
}

/// The pieces of a product over a packed weight: each chunk of rows in turn, its panels
/// split over at most `args.threads` threads of the kernel pool (lengths checked by the
/// caller; `bias` padded to whole blocks; `args.k > 0`).
pub(crate) fn run_panels<K: PanelKernel>(
    args: &LinearArgs,
    x: &[K::X],
    packed: &[K::Elem],
    bias: Option<&[K::Sum]>,
    out: &mut [K::Sum],
) {
    let LinearArgs { m, n, k, threads } = *args;
    let blocks = n.div_ceil(BLOCK_N);
    let ranges = panel_ranges(blocks.div_ceil(PASS_BLOCKS), threads.max(1));
    for row0 in (0..m).step_by(ROWS_PER_CHUNK) {
        let rows = (m - row0).min(ROWS_PER_CHUNK);
        let a = &x[row0 * k..(row0 + rows) * k];
        // (row0 * n < out.len(): row0 < m)
        let dst = OutColumns::new(&mut out[row0 * n..(row0 + rows) * n], rows, n);
        let task = |t: usize| run_blocks::<K>(a, k, rows, packed, ranges[t].clone(), bias, &dst);
        crate::parallel::pool().run(ranges.len(), ranges.len(), &task);
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
fn run_blocks<K: PanelKernel>(
    a: &[K::X],
    k: usize,
    rows: usize,
    packed: &[K::Elem],
    panels: Range<usize>,
    bias: Option<&[K::Sum]>,
    out: &OutColumns<K::Sum>,
) {
    let block_len = K::block_len(k);
    let blocks = packed.len() / block_len;
    let panel_at = |panel: usize| {
        let nb = panel * PASS_BLOCKS;
        let nblocks = (blocks - nb).min(PASS_BLOCKS);
        (
            nb,
            nblocks,
            &packed[nb * block_len..(nb + nblocks) * block_len],
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
            let mut sums = [[K::Sum::default(); PASS_BLOCKS * BLOCK_N]; GROUP_ROWS];
            let pf = next.and_then(|(_, blocks, w)| {
                (g < blocks).then_some(Prefetch {
                    w,
                    blocks,
                    block: g,
                })
            });
            group::<K>(
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
/// column blocks, the panel layout), one cache line per input step.
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
fn group<K: PanelKernel>(
    a: &[K::X],
    k: usize,
    r: usize,
    nb: usize,
    w: &[K::Elem],
    bias: Option<&[K::Sum]>,
    pf: Option<Prefetch<'_, K::Elem>>,
    sums: &mut [[K::Sum; PASS_BLOCKS * BLOCK_N]],
) {
    // (const row and block counts let the compiler keep every accumulator in a register)
    macro_rules! rows {
        ($nb:literal) => {
            match r {
                1 => K::dot::<1, $nb>(a, k, w, bias, pf, sums),
                2 => K::dot::<2, $nb>(a, k, w, bias, pf, sums),
                3 => K::dot::<3, $nb>(a, k, w, bias, pf, sums),
                4 => K::dot::<4, $nb>(a, k, w, bias, pf, sums),
                5 => K::dot::<5, $nb>(a, k, w, bias, pf, sums),
                6 => K::dot::<6, $nb>(a, k, w, bias, pf, sums),
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn columns_are_packed_in_steps_per_panel() {
        // n = 70: panels of 64 and 16 (6 real columns) columns; k = 4 in pairs
        let (n, k) = (70, 4);
        let w: Vec<i32> = (0..(n * k) as i32).collect();
        let mut out = vec![-1; packed_len(n, k)];
        pack_columns(&w, n, k, 2, &mut out);
        // first panel, step 1 (inputs 2 and 3), column 5
        let at = 2 * 64 + 5 * 2;
        assert_eq!(out[at..at + 2], [w[5 * k + 2], w[5 * k + 3]]);
        // second panel starts at 64 * k, column 64 + 6 is padding
        let second = 64 * k;
        assert_eq!(out[second..second + 2], [w[64 * k], w[64 * k + 1]]);
        assert_eq!(out[second + 12..second + 14], [0, 0]);
        assert!(!out.contains(&-1));
    }

    #[test]
    fn panel_ranges_split_evenly() {
        assert_eq!(panel_ranges(5, 2), vec![0..2, 2..5]);
        assert_eq!(panel_ranges(2, 8), vec![0..1, 1..2]);
        assert_eq!(panel_ranges(3, 0), vec![0..3]);
    }
}
