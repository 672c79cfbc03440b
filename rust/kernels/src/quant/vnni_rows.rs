//! The products of many rows on AVX-512 VNNI: each panel's weights are unpacked once per
//! chunk of blocks into a small scratch ([`Line`]s of 64 bytes: the codes as `vpdpbusd`
//! operands, one line a quad; sub-block scales, factors and mins widened), and then every row
//! of the call passes over that scratch, [`TILE`] rows and [`PANELS`] panels (64 columns) at
//! a time in registers. [`super::vnni`]'s panel kernels unpack a panel again for every group of up to 8
//! rows; here the unpacking is paid once however many rows pass.
//!
//! Each lane follows the portable formula ([`super::portable`]) operation for operation, in
//! the same order as [`super::vnni`]: integer sums (exact), then `cvtdq2ps`, `mulps` and
//! fused multiply-adds, so every path gives the same bits. The running sums of the K-types
//! (one update a block of 256) live in the outputs; those of the 32-weight types stay
//! in registers through a chunk of [`CHUNK32`] blocks.
//!
//! Scratch lines of a block of one panel:
//!
//! | types | lines |
//! |---|---|
//! | Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL | codes 8 (quad `q` at `q`), d 1, m 1 (Q4_1, Q5_1) |
//! | Q4_K, Q5_K | codes 64, sc 8 (Q4_K f32, Q5_K i32), d 1, dmin 1, mins 4 (i16: `[pair][column][2]`) |
//! | Q6_K | codes 64, sc 16 (i32), d 1 |
//! | Q3_K | codes 64, sc 16 (f32), d 1 |
//! | Q2_K | codes 64, sc 16 (f32), d 1, dmin 1, mins 8 (i16: `[pair][column][2]`) |
//! | IQ4_XS | codes 64, sc 8 (f32), d 1 |
//!
//! On the AMX tiles ([`super::amx_rows`]), a Q4_K, Q5_K or Q6_K block has 128 lines more
//! ([`Layout::wlo`]).

use std::arch::x86_64::*;
use std::ops::Range;

use super::act::{sum_pair, A256, A32};
use super::blocks::{is_table32, table_codes};
use super::packing::{factor_streams, panel_block_bytes, stream_starts, streams, PANEL};
use super::{amx_rows, vnni};
use super::{ActRows, QType};
use crate::asm::dpwssd;

/// Rows a register tile holds at most (the dispatch's cases: 1 to 3).
pub(crate) const TILE: usize = 3;

/// Panels a pass takes at most (the dispatch's cases: 1 to 4). 3 rows x 4 panels: 12
/// independent `vpdpbusd` chains (enough to cover their latency at two a cycle), 12 sums
/// and the 4 panels' codes in registers, 3 broadcasts and 4 loads a quad; measured on a
/// Xeon with AVX-512 VNNI, on a par with 6 rows x 2 panels or slightly ahead.
const PANELS: usize = 4;

/// Panels a pass takes at most where its rows run on the AMX tiles: a Q4_K block's lines
/// with the AMX ones are 13 KiB a panel (Q6_K's 13.2), so 4 panels' scratch (53 KiB)
/// spilled out of a 48 KiB L1 and the tiles loaded the weights from the L2. With 2 (26 KiB), one core, Q4_K
/// 8960 x 1536 (`examples/quant_speed`): 16 rows 1660 -> 1210 us, 32 rows 2070 -> 1550-1710,
/// 64 rows 3000 -> 2470-2560; 512 rows unchanged (1 panel: 32 and 64 rows slower again).
const AMX_PANELS: usize = 2;

/// Blocks of a chunk for the 32-weight types (256 inputs: the running sums stay in
/// registers through it; 4 panels' scratch is 20 KiB, as the K-types' one block).
const CHUNK32: usize = 8;

/// One 64-byte line of scratch (aligned: one cache line, one zmm load).
#[derive(Clone, Copy)]
#[repr(C, align(64))]
pub(super) struct Line([u8; 64]);

/// Lines of a block of one panel, and the first line of each part after the codes.
#[derive(Clone, Copy)]
pub(super) struct Layout {
    /// lines a block
    pub(super) lines: usize,
    /// the scales (K-types)
    pub(super) sc: usize,
    /// d
    pub(super) d: usize,
    /// Q4_1's and Q5_1's m, the K-types' dmin
    pub(super) e: usize,
    /// Q4_K / Q5_K's mins
    pub(super) mins: usize,
    /// Q4_K, Q5_K and Q6_K on the AMX tiles ([`super::amx_rows`]): the codes times their
    /// sub-block's scale (`w = u * sc`; Q6_K's `(u - 32) * sc`), low bytes from line `wlo`
    /// and high bytes from `wlo + 64`, a line a quad as the codes. 0 elsewhere.
    pub(super) wlo: usize,
}

pub(super) fn layout(qt: QType, amx: bool) -> Layout {
    if amx && amx_rows::TYPES.contains(&qt) {
        let base = layout(qt, false);
        return Layout {
            lines: base.lines + 128,
            wlo: base.lines,
            ..base
        };
    }
    match qt {
        QType::Q8_0
        | QType::Q4_0
        | QType::Q4_1
        | QType::Q5_0
        | QType::Q5_1
        | QType::IQ4_NL
        | QType::MXFP4 => Layout {
            lines: 10,
            sc: 8,
            d: 8,
            e: 9,
            mins: 10,
            wlo: 0,
        },
        QType::Q4_K | QType::Q5_K => Layout {
            lines: 78,
            sc: 64,
            d: 72,
            e: 73,
            mins: 74,
            wlo: 0,
        },
        QType::Q6_K | QType::Q3_K => Layout {
            lines: 81,
            sc: 64,
            d: 80,
            e: 81,
            mins: 81,
            wlo: 0,
        },
        QType::Q2_K => Layout {
            lines: 90,
            sc: 64,
            d: 80,
            e: 81,
            mins: 82,
            wlo: 0,
        },
        QType::IQ4_XS => Layout {
            lines: 73,
            sc: 64,
            d: 72,
            e: 73,
            mins: 73,
            wlo: 0,
        },
    }
}

/// `out` [m, n] = the `m` rows of `acts` (`nb` blocks each) times the [`super::pack`]ed
/// weight `packed` ([n, nb blocks] of `qt`): panels split over at most `threads` threads,
/// rows taken `chunk` at a time (each chunk's activations stay in cache while a thread's
/// panels pass); where `amx`, a call of [`amx_rows::TYPES`] of [`amx_rows::MIN_ROWS`] rows or
/// more runs its groups of 16 rows (the last one padded, [`amx_rows::groups`]) on the AMX
/// int8 tiles ([`super::amx_rows`]). Panics on a length that does not match, or where
/// [`super::vnni::available`] (or, with `amx`, [`crate::isa::amx_int8_usable`]) is false.
#[allow(clippy::too_many_arguments)] // the slices of one call of `linear` and their shapes
pub(crate) fn linear(
    qt: QType,
    packed: &[u8],
    nb: usize,
    n: usize,
    acts: ActRows<'_>,
    m: usize,
    chunk: usize,
    out: &mut [f32],
    threads: usize,
    amx: bool,
) {
    assert!(super::vnni::available(), "AVX-512 VNNI is not available");
    assert!(
        !amx || crate::isa::amx_int8_usable(),
        "AMX-INT8 is not usable"
    );
    let on_tiles = amx && amx_rows::takes(qt, m);
    let panels = n.div_ceil(PANEL);
    let acts_len = match acts {
        ActRows::A32(a) => a.len(),
        ActRows::A256(a) => a.len(),
    };
    assert!(nb > 0 && chunk > 0, "whole blocks, rows a chunk");
    assert_eq!(acts_len, m * nb, "{m} rows of {nb} blocks");
    assert_eq!(
        packed.len(),
        panels * nb * panel_block_bytes(qt),
        "the panels' bytes"
    );
    assert_eq!(out.len(), m * n, "m * n outputs");
    let o = Out(out.as_mut_ptr());
    let pieces = super::split(panels, threads)
        .into_iter()
        .map(|r| (r, o))
        .collect();
    crate::parallel::run_pieces(pieces, |range, o| {
        for row0 in (0..m).step_by(chunk) {
            let rows = row0..(row0 + chunk).min(m);
            // SAFETY: `o` is `out` ([m, n], borrowed until every piece has run), `packed`
            // and `acts` have the shapes asserted above, `range` is inside the `panels`
            // panels and `rows` inside the `m` rows; the pieces' panel ranges are disjoint
            // (`split`), so each thread writes only the columns of its own panels; AMX-INT8
            // is usable where `amx` (asserted).
            unsafe { pass(qt, packed, nb, n, range.clone(), acts, rows, o, on_tiles) };
        }
    });
}

/// `out`'s elements, written by threads that each write the columns of their own panels.
#[derive(Clone, Copy)]
struct Out(*mut f32);

// SAFETY: `Out` is only sent to the threads of one `linear` call, which returns after they
// are done (`run_pieces`) while it holds `out` mutably borrowed; each thread writes the
// columns of its own panels only (disjoint elements), and no thread reads another's.
unsafe impl Send for Out {}

/// The rows `rows` of `acts` times the panels `panels` into `out` (their columns of those
/// rows, overwritten).
///
/// # Safety
/// `out` points at `m * n` writable f32 ([m, n], `rows.end <= m`) that no other thread
/// reads or writes in the columns of `panels` (`panels.end <= n.div_ceil(16)`); `packed`
/// holds those panels of `nb` blocks of `qt`, and `acts` at least `rows.end * nb` blocks;
/// the CPU has AVX-512 F, BW and VNNI; where `on_tiles`, this process may use AMX-INT8 and
/// `qt` is one of [`amx_rows::TYPES`].
#[allow(clippy::too_many_arguments)] // one call of `linear`: its slices and shapes
unsafe fn pass(
    qt: QType,
    packed: &[u8],
    nb: usize,
    n: usize,
    panels: Range<usize>,
    acts: ActRows<'_>,
    rows: Range<usize>,
    out: Out,
    on_tiles: bool,
) {
    let panel_bytes = nb * panel_block_bytes(qt);
    let lay = layout(qt, on_tiles);
    let cb = if qt.block() == 32 { CHUNK32 } else { 1 };
    let mut scratch = vec![Line([0; 64]); PANELS * cb * lay.lines];
    let st = stream_starts(qt, nb);
    // groups of 16 rows on the AMX tiles (the types they take; a last group of at least
    // PAD_ROWS rows padded to 16 with zero rows), then the rest in register tiles of
    // near-equal size, at most TILE
    let (groups, padded) = match on_tiles {
        true => amx_rows::groups(rows.len()),
        false => (0, 0),
    };
    // the padded group's activations: its rows, then zero rows
    let pad = match (padded, acts) {
        (0, _) => Vec::new(),
        (_, ActRows::A256(a)) => {
            let start = (rows.start + (groups - 1) * amx_rows::ROWS) * nb;
            let mut pad = a[start..start + padded * nb].to_vec();
            pad.resize(amx_rows::ROWS * nb, A256::ZERO);
            pad
        }
        (_, ActRows::A32(_)) => unreachable!("the tiles take the K-types"),
    };
    // SAFETY: AMX-INT8 is usable where `on_tiles` (the caller's contract).
    let _tiles = (groups > 0).then(|| unsafe { amx_rows::Tiles::new() });
    let on_groups = (groups * amx_rows::ROWS).min(rows.len());
    let rest = rows.start + on_groups..rows.end;
    let (full, left) = (rest.len() / TILE, rest.len() % TILE);
    // the prefetch of the next chunk is spread over the groups and register tiles
    let parts = groups + full + usize::from(left > 0);
    let step = if on_tiles { AMX_PANELS } else { PANELS };
    for first in panels.clone().step_by(step) {
        let np = (panels.end - first).min(step);
        // the columns of the pass's last panel that are inside `n`
        let cols = (n - (first + np - 1) * PANEL).min(PANEL);
        for b0 in (0..nb).step_by(cb) {
            let c = (nb - b0).min(cb);
            // the chunk unpacked after this one: the next blocks of these panels, or the
            // first blocks of the next panels
            let ahead = if b0 + cb < nb {
                Ahead::of(
                    qt,
                    packed,
                    panel_bytes,
                    &st,
                    first..first + np,
                    b0 + cb,
                    cb.min(nb - b0 - cb),
                )
            } else if first + step < panels.end {
                let next = first + step..(first + 2 * step).min(panels.end);
                Ahead::of(qt, packed, panel_bytes, &st, next, 0, cb.min(nb))
            } else {
                Ahead::default()
            };
            for p in 0..np {
                let w = &packed[(first + p) * panel_bytes..][..panel_bytes];
                for b in 0..c {
                    let at = (p * cb + b) * lay.lines;
                    let out = &mut scratch[at..at + lay.lines];
                    // SAFETY: the CPU has AVX-512 F, BW and VNNI (the caller's contract);
                    // `w` is one panel of `nb` blocks of `qt` with stream starts `st`,
                    // `b0 + b < nb`, and `out` holds one block's lines of `qt`'s layout.
                    unsafe { unpack(qt, w.as_ptr(), &st, b0 + b, out.as_mut_ptr(), lay) };
                }
            }
            let tile = Tile {
                s: scratch.as_ptr(),
                lay,
                pstride: cb * lay.lines,
                cb: c,
                nb,
                // (inside `out`: row rows.start < m, column first * 16 < n)
                acc: out.0.wrapping_add(rows.start * n + first * PANEL),
                rstride: n,
                last: ((1u32 << cols) - 1) as u16,
                fresh: b0 == 0,
            };
            for g in 0..groups {
                ahead.part(g, parts);
                let tile = tile.down(amx_rows::ROWS * g);
                // SAFETY: the CPU as the caller's contract; `scratch` holds the `np` panels'
                // `c` blocks unpacked above; the lanes of `tile.mask(p, np)` of the group's
                // rows are the columns of panels `first + p` below `n` (`cols`), inside
                // `out` and this thread's alone (the caller's contract); the tiles are
                // configured and take `qt`; a padded group reads its 16 rows from `pad` and
                // writes only its first `padded` rows (inside `rows`).
                if g + 1 == groups && padded > 0 {
                    let pad = ActRows::A256(&pad);
                    unsafe { amx_rows::group(qt, &pad, 0..amx_rows::ROWS, padded, b0, np, tile) };
                } else {
                    let start = rows.start + amx_rows::ROWS * g;
                    let r = start..start + amx_rows::ROWS;
                    unsafe { amx_rows::group(qt, &acts, r, amx_rows::ROWS, b0, np, tile) };
                }
            }
            // the rest: whole register tiles of TILE rows, then one of the rows left over
            for (start, per, count) in [
                (rest.start, TILE, full),
                (rest.start + full * TILE, left, usize::from(left > 0)),
            ] {
                if count == 0 {
                    continue;
                }
                let run = Run {
                    tiles: count,
                    ahead: &ahead,
                    first: groups + (start - rest.start) / TILE,
                    parts,
                };
                let tile = tile.down(start - rows.start);
                // SAFETY: the CPU as the caller's contract; `scratch` holds the `np` panels'
                // `c` blocks unpacked above; the lanes of `tile.mask(p, np)` of rows `start
                // .. start + per * count` (inside `rows`) are the columns of panels `first
                // + p` below `n` (`cols`), inside `out` and this thread's alone (the
                // caller's contract).
                unsafe { tile_dispatch(qt, &acts, start, per, &run, b0, np, tile) };
            }
        }
    }
}

/// The packed bytes of the chunk a pass unpacks next (each panel's streams are separate
/// ranges), fetched into the L2 cache a part a register tile while the rows pass over the
/// chunk in hand: its unpacking then reads the L2, not memory (read from memory, at 32 rows
/// the unpacking was a fifth of a step's time, the loads waiting on memory).
struct Ahead {
    /// (start, bytes) of each panel's streams; the first `n` are used
    ranges: [(*const u8, usize); PANELS * 6],
    n: usize,
    total: usize,
}

impl Default for Ahead {
    fn default() -> Ahead {
        Ahead {
            ranges: [(std::ptr::null(), 0); PANELS * 6],
            n: 0,
            total: 0,
        }
    }
}

impl Ahead {
    /// Blocks `b .. b + c` of the panels `panels` of `packed` (panels of `panel_bytes`,
    /// streams starting at `st`).
    fn of(
        qt: QType,
        packed: &[u8],
        panel_bytes: usize,
        st: &[usize; 6],
        panels: Range<usize>,
        b: usize,
        c: usize,
    ) -> Ahead {
        let mut ahead = Ahead::default();
        for p in panels.take(PANELS) {
            for (s, &size) in streams(qt).iter().enumerate() {
                let at = p * panel_bytes + st[s] + size * b;
                if let Some(bytes) = packed.get(at..at + size * c) {
                    ahead.ranges[ahead.n] = (bytes.as_ptr(), bytes.len());
                    ahead.n += 1;
                    ahead.total += bytes.len();
                }
            }
        }
        ahead
    }

    /// Fetches part `t` of `parts` (near-equal shares of the bytes, one prefetch a line).
    #[inline]
    fn part(&self, t: usize, parts: usize) {
        let (from, to) = (self.total * t / parts, self.total * (t + 1) / parts);
        let mut base = 0;
        for &(at, len) in &self.ranges[..self.n] {
            let (lo, hi) = (from.max(base), to.min(base + len));
            if lo < hi {
                // the lines holding bytes lo .. hi of the range (formed with `wrapping_*`,
                // never dereferenced)
                let first = at.wrapping_add(lo - base);
                let mut line = first.wrapping_sub(first as usize % 64);
                let end = at.wrapping_add(hi - base);
                while line < end {
                    // SAFETY: `prefetcht1` (SSE, part of x86-64) reads nothing into the
                    // program and cannot fault, whatever the address.
                    unsafe { _mm_prefetch::<_MM_HINT_T1>(line.cast()) };
                    line = line.wrapping_add(64);
                }
            }
            base += len;
            if base >= to {
                break;
            }
        }
    }
}

/// The pointers and strides of one register tile.
#[derive(Clone, Copy)]
pub(super) struct Tile {
    /// the scratch: panel `p`'s block `b` at line `p * pstride + b * lay.lines`
    pub(super) s: *const Line,
    pub(super) lay: Layout,
    pub(super) pstride: usize,
    /// blocks of the chunk
    pub(super) cb: usize,
    /// blocks of an activation row
    pub(super) nb: usize,
    /// the outputs of the tile's first row, first panel: row `i`'s panel `p` at `i * rstride
    /// + 16 p`
    pub(super) acc: *mut f32,
    pub(super) rstride: usize,
    /// the lanes of the last panel that are outputs (the others lie past `n`)
    pub(super) last: u16,
    /// whether the chunk is the first of the row (its sums start at zero, not from `acc`)
    pub(super) fresh: bool,
}

/// The register tiles one kernel call runs, one below the other, and the share of the next
/// chunk's prefetch each takes (`ahead`'s part `first + t` of `parts` before tile `t`).
pub(super) struct Run<'a> {
    tiles: usize,
    ahead: &'a Ahead,
    first: usize,
    parts: usize,
}

impl Run<'_> {
    /// Fetches tile `t`'s share of the next chunk.
    #[inline(always)]
    fn fetch(&self, t: usize) {
        self.ahead.part(self.first + t, self.parts);
    }
}

impl Tile {
    /// The same tile `rows` rows further down the outputs.
    #[inline(always)]
    pub(super) fn down(&self, rows: usize) -> Tile {
        Tile {
            acc: self.acc.wrapping_add(rows * self.rstride),
            ..*self
        }
    }

    /// The lanes of panel `p` of `np` that are outputs.
    #[inline(always)]
    fn mask(&self, p: usize, np: usize) -> __mmask16 {
        if p + 1 == np {
            self.last
        } else {
            0xFFFF
        }
    }
}

/// The running sums of row `i`, panel `p` (of `np`): zero where `fresh` (the first block),
/// else the outputs so far.
///
/// # Safety
/// As the kernels': the lanes of `t.mask(p, np)` at `t.acc + i * t.rstride + 16 p` are
/// readable.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
#[inline]
pub(super) unsafe fn acc_load(t: &Tile, i: usize, p: usize, np: usize, fresh: bool) -> __m512 {
    if fresh {
        _mm512_setzero_ps()
    } else {
        // (masked: the lanes past `n` are neither read nor able to fault)
        _mm512_maskz_loadu_ps(t.mask(p, np), t.acc.add(i * t.rstride + PANEL * p))
    }
}

/// Stores the sums of row `i`, panel `p` (of `np`) into the outputs.
///
/// # Safety
/// As the kernels': the lanes of `t.mask(p, np)` at `t.acc + i * t.rstride + 16 p` are
/// writable.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
#[inline]
pub(super) unsafe fn acc_store(t: &Tile, i: usize, p: usize, np: usize, v: __m512) {
    _mm512_mask_storeu_ps(t.acc.add(i * t.rstride + PANEL * p), t.mask(p, np), v)
}

/// Runs the kernel of `qt` over `run.tiles` register tiles of `per` rows (1 to [`TILE`]) of
/// `acts` from row `start`, blocks `b0 ..` (`tile.cb` of them), `np` panels (1 to
/// [`PANELS`]).
///
/// # Safety
/// The CPU has AVX-512 F, BW and VNNI; `t.s` holds `np` panels' `t.cb` blocks unpacked
/// ([`unpack`]) from `qt`'s panels; the lanes of `t.mask(p, np)` at `t.acc + i * t.rstride +
/// 16 p` are readable and writable by this thread alone for `i < per * run.tiles`, `p < np`.
#[allow(clippy::too_many_arguments)] // one tile run: its rows, blocks, panels and outputs
unsafe fn tile_dispatch(
    qt: QType,
    acts: &ActRows<'_>,
    start: usize,
    per: usize,
    run: &Run<'_>,
    b0: usize,
    np: usize,
    t: Tile,
) {
    macro_rules! by_rows {
        ($f:ident, $np:literal, $a:expr $(, $c:expr)?) => {
            match per {
                1 => $f::<1, $np $(, $c)?>($a, t, run),
                2 => $f::<2, $np $(, $c)?>($a, t, run),
                _ => $f::<3, $np $(, $c)?>($a, t, run),
            }
        };
    }
    macro_rules! go {
        ($f:ident, $a:expr $(, $c:expr)?) => {{
            let a = $a;
            let first = start * t.nb + b0;
            assert!(
                (start + per * run.tiles) * t.nb <= a.len() && b0 + t.cb <= t.nb,
                "the tiles' activation blocks"
            );
            let a = a[first..].as_ptr();
            // SAFETY: the CPU, `t.s` and `t.acc` as this function's contract requires;
            // `a` is row `start`'s block `b0` and the `per * run.tiles` rows from it hold
            // `t.cb` blocks from `b0` (asserted above): the contract of each kernel, the
            // one of `per` rows and `np` panels.
            unsafe {
                match np {
                    1 => by_rows!($f, 1, a $(, $c)?),
                    2 => by_rows!($f, 2, a $(, $c)?),
                    3 => by_rows!($f, 3, a $(, $c)?),
                    _ => by_rows!($f, 4, a $(, $c)?),
                }
            }
        }};
    }
    assert!(
        (1..=TILE).contains(&per) && (1..=PANELS).contains(&np),
        "a tile's shape"
    );
    match (qt, acts) {
        (QType::Q4_1 | QType::Q5_1, ActRows::A32(a)) => go!(tile32, a, true),
        (
            QType::Q8_0 | QType::Q4_0 | QType::Q5_0 | QType::IQ4_NL | QType::MXFP4,
            ActRows::A32(a),
        ) => {
            go!(tile32, a, false)
        }
        (QType::Q4_K, ActRows::A256(a)) => go!(tile_k, a, { QType::Q4_K as u8 }),
        (QType::Q5_K, ActRows::A256(a)) => go!(tile_k, a, { QType::Q5_K as u8 }),
        (QType::Q6_K, ActRows::A256(a)) => go!(tile_k, a, { QType::Q6_K as u8 }),
        (QType::Q3_K, ActRows::A256(a)) => go!(tile_small, a, { QType::Q3_K as u8 }),
        (QType::Q2_K, ActRows::A256(a)) => go!(tile_small, a, { QType::Q2_K as u8 }),
        (QType::IQ4_XS, ActRows::A256(a)) => go!(tile_small, a, { QType::IQ4_XS as u8 }),
        _ => panic!("{}: wrong activation format", qt.name()),
    }
}

/// Line `i` from `p`.
///
/// # Safety
/// `p .. p + i + 1` lines are readable.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
#[inline]
pub(super) unsafe fn line(p: *const Line, i: usize) -> __m512i {
    _mm512_load_si512(p.add(i).cast())
}

/// Line `i` from `p` as 16 f32.
///
/// # Safety
/// As [`line`].
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
#[inline]
pub(super) unsafe fn line_ps(p: *const Line, i: usize) -> __m512 {
    _mm512_load_ps(p.add(i).cast())
}

/// `s[i][p]` gains the products of quads `quads` of panel `p`'s unpacked codes (`blk[p]`,
/// a line a quad) with row `i`'s inputs (`qs[i]`), one `vpdpbusd` a quad, in quad order.
///
/// # Safety
/// The CPU has AVX-512 F, BW and VNNI; each `blk[p]` holds at least `quads.end` lines and
/// each `qs[i]` at least `4 * quads.end` readable bytes.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
#[inline]
unsafe fn dot_quads<const R: usize, const P: usize>(
    s: &mut [[__m512i; P]; R],
    blk: &[*const Line; P],
    qs: &[*const i8; R],
    quads: Range<usize>,
) {
    for q in quads {
        let c: [__m512i; P] = std::array::from_fn(|p| line(blk[p], q));
        for i in 0..R {
            let x = vnni::quad(qs[i].add(4 * q));
            for p in 0..P {
                s[i][p] = _mm512_dpbusd_epi32(s[i][p], c[p], x);
            }
        }
    }
}

/// Defines `$name`: the one-tile kernel `$one` run over `run.tiles` register tiles of `R`
/// rows, one below the other, each after fetching its share of the next chunk (one call
/// for every tile of a chunk: a call a tile cost ~3-5% of the 512-row K-type products).
macro_rules! tiles {
    ($(#[$doc:meta])* $name:ident, $one:ident, $act:ty, $c:ident: $ct:ty) => {
        $(#[$doc])*
        #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
        unsafe fn $name<const R: usize, const P: usize, const $c: $ct>(
            a: *const $act,
            t: Tile,
            run: &Run<'_>,
        ) {
            for i in 0..run.tiles {
                run.fetch(i);
                // SAFETY: tile `i`'s rows `R i .. R (i + 1)` lie inside the rows of this
                // function's contract; the rest of `$one`'s contract is this one's.
                unsafe { $one::<R, P, $c>(a.add(i * R * t.nb), t.down(i * R)) };
            }
        }
    };
}

tiles! {
    /// [`one32`] over `run.tiles` register tiles of `R` rows, one below the other.
    ///
    /// # Safety
    /// As [`one32`]'s, for the `R * run.tiles` rows from `a` (and `t.acc`).
    tile32, one32, A32, Q41: bool
}

/// The 32-weight types (`Q41`: Q4_1's or Q5_1's `m` term), `R` rows, `P` panels.
///
/// # Safety
/// The CPU has AVX-512 F, BW and VNNI; `t.s` holds `P` panels' `t.cb` unpacked blocks of a
/// 32-weight type (lines of [`layout`]); `a` points at the first row's first block of the
/// chunk, row `i`'s block `b` at `a + i * t.nb + b` readable for `i < R`, `b < t.cb`;
/// the lanes of `t.mask(p, P)` at `t.acc + i * t.rstride + 16 p` are readable and writable
/// (by this thread alone) for `p < P`, `i < R`.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
#[inline]
unsafe fn one32<const R: usize, const P: usize, const Q41: bool>(a: *const A32, t: Tile) {
    let lay = t.lay;
    let mut acc: [[__m512; P]; R] =
        std::array::from_fn(|i| std::array::from_fn(|p| acc_load(&t, i, p, P, t.fresh)));
    for b in 0..t.cb {
        let ab: [*const A32; R] = std::array::from_fn(|i| a.add(i * t.nb + b));
        let blk: [*const Line; P] = std::array::from_fn(|p| t.s.add(p * t.pstride + b * lay.lines));
        let mut s: [[__m512i; P]; R] =
            std::array::from_fn(|i| [_mm512_set1_epi32((*ab[i]).init); P]);
        dot_quads(
            &mut s,
            &blk,
            &std::array::from_fn(|i| (*ab[i]).qs.as_ptr()),
            0..8,
        );
        for p in 0..P {
            let d = line_ps(blk[p], lay.d);
            for i in 0..R {
                let dx = _mm512_mul_ps(d, _mm512_set1_ps((*ab[i]).d));
                acc[i][p] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[i][p]), dx, acc[i][p]);
            }
            if Q41 {
                let e = line_ps(blk[p], lay.e);
                for i in 0..R {
                    acc[i][p] = _mm512_fmadd_ps(e, _mm512_set1_ps((*ab[i]).sd), acc[i][p]);
                }
            }
        }
    }
    for (i, acc) in acc.iter().enumerate() {
        for (p, v) in acc.iter().enumerate() {
            acc_store(&t, i, p, P, *v);
        }
    }
}

tiles! {
    /// [`one_k`] over `run.tiles` register tiles of `R` rows, one below the other.
    ///
    /// # Safety
    /// As [`one_k`]'s, for the `R * run.tiles` rows from `a` (and `t.acc`).
    tile_k, one_k, A256, K: u8
}

/// Q4_K, Q5_K or Q6_K (`K`: the type's number), `R` rows, `P` panels: the block's sum in
/// i32, or Q4_K's as two exact f32 halves ([`vnni::Q4K_HALF_MAX`]).
///
/// # Safety
/// As [`one32`], with [`A256`] activation blocks and blocks of the type.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
#[inline]
unsafe fn one_k<const R: usize, const P: usize, const K: u8>(a: *const A256, t: Tile) {
    let qt = QType::ALL[K as usize];
    let (q4, q6) = (qt == QType::Q4_K, qt == QType::Q6_K);
    let lay = t.lay;
    let (subs, per) = if q6 { (16, 4) } else { (8, 8) };
    for b in 0..t.cb {
        let ab: [*const A256; R] = std::array::from_fn(|i| a.add(i * t.nb + b));
        let blk: [*const Line; P] = std::array::from_fn(|p| t.s.add(p * t.pstride + b * lay.lines));
        let qs: [*const i8; R] = std::array::from_fn(|i| (*ab[i]).qs.as_ptr());
        let mut s1 = [[_mm512_setzero_si512(); P]; R];
        let mut first = [[_mm512_setzero_ps(); P]; R];
        let mut s1f = [[_mm512_setzero_ps(); P]; R];
        for j in 0..subs {
            if q4 && j == 4 {
                // Q4_K's first half waits in memory (volatile: in registers, with the
                // second half's sums and the sub-block sums, 3 x 4 tiles spilled inside
                // the quad loop, ~15% slower)
                for i in 0..R {
                    for p in 0..P {
                        // SAFETY: `first[i][p]` is a live local, aligned, written whole.
                        std::ptr::write_volatile(&mut first[i][p], s1f[i][p]);
                        s1f[i][p] = _mm512_setzero_ps();
                    }
                }
            }
            let mut s: [[__m512i; P]; R] = std::array::from_fn(|i| {
                [if q6 {
                    _mm512_set1_epi32((*ab[i]).neg32_sum16[j])
                } else {
                    _mm512_setzero_si512()
                }; P]
            });
            dot_quads(&mut s, &blk, &qs, per * j..per * (j + 1));
            for p in 0..P {
                // (Q4_K's scales are f32 lines, the others' i32)
                let sc = line(blk[p], lay.sc + j);
                for i in 0..R {
                    if q4 {
                        let t = _mm512_cvtepi32_ps(s[i][p]);
                        let sc = _mm512_castsi512_ps(sc);
                        s1f[i][p] = _mm512_fmadd_ps(t, sc, s1f[i][p]);
                    } else {
                        s1[i][p] = _mm512_add_epi32(s1[i][p], _mm512_mullo_epi32(s[i][p], sc));
                    }
                }
            }
        }
        if q6 {
            for p in 0..P {
                for i in 0..R {
                    let v = acc_load(&t, i, p, P, t.fresh && b == 0);
                    let v = k_block_end(qt, &*ab[i], blk[p], lay, _mm512_cvtepi32_ps(s1[i][p]), v);
                    acc_store(&t, i, p, P, v);
                }
            }
            continue;
        }
        // Q4_K, Q5_K: `k_block_end`'s operations, in its order for each output, but the
        // mins sums of every row and panel first (12 independent `vpdpwssd` chains), then
        // the f32 updates (`quant_speed q4_k 8960 1536 512` on a Zen 4: 288-313 -> 320-328
        // GOP/s against each output's end in turn)
        let mut s2 = [[_mm512_setzero_si512(); P]; R];
        for pp in 0..4 {
            let mins: [__m512i; P] = std::array::from_fn(|p| line(blk[p], lay.mins + pp));
            for i in 0..R {
                let pair = sum_pair(&(*ab[i]).sum32, pp);
                let pair = _mm512_set1_epi32(pair);
                for p in 0..P {
                    s2[i][p] = dpwssd(s2[i][p], mins[p], pair);
                }
            }
        }
        for p in 0..P {
            let d = line_ps(blk[p], lay.d);
            let e = line_ps(blk[p], lay.e);
            for i in 0..R {
                let v = acc_load(&t, i, p, P, t.fresh && b == 0);
                let s1 = if q4 {
                    // SAFETY: as the write above (written at j = 4, before this read).
                    _mm512_add_ps(std::ptr::read_volatile(&first[i][p]), s1f[i][p])
                } else {
                    _mm512_cvtepi32_ps(s1[i][p])
                };
                let dx = (*ab[i]).d;
                let v = mins_sub(scaled_add(v, s1, d, dx), s2[i][p], e, dx);
                acc_store(&t, i, p, P, v);
            }
        }
    }
}

tiles! {
    /// [`one_small`] over `run.tiles` register tiles of `R` rows, one below the other.
    ///
    /// # Safety
    /// As [`one_small`]'s, for the `R * run.tiles` rows from `a` (and `t.acc`).
    tile_small, one_small, A256, K: u8
}

/// Q3_K, Q2_K or IQ4_XS (`K`: the type's number), `R` rows, `P` panels: [`one_k`]'s
/// order with the starts of the sub-block sums and Q2_K's mins of `vnni::small_k`.
///
/// # Safety
/// As [`one32`], with [`A256`] activation blocks and blocks of the type.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
#[inline]
unsafe fn one_small<const R: usize, const P: usize, const K: u8>(a: *const A256, t: Tile) {
    let qt = QType::ALL[K as usize];
    let lay = t.lay;
    let (subs, per) = vnni::small_shape(qt);
    for b in 0..t.cb {
        let ab: [*const A256; R] = std::array::from_fn(|i| a.add(i * t.nb + b));
        let blk: [*const Line; P] = std::array::from_fn(|p| t.s.add(p * t.pstride + b * lay.lines));
        let qs: [*const i8; R] = std::array::from_fn(|i| (*ab[i]).qs.as_ptr());
        let mut s1 = [[_mm512_setzero_ps(); P]; R];
        for j in 0..subs {
            let mut s: [[__m512i; P]; R] = std::array::from_fn(|i| {
                let init = match qt {
                    QType::Q3_K => -4 * i32::from((*ab[i]).sum16[j]),
                    QType::IQ4_XS => -128 * i32::from((*ab[i]).sum32[j]),
                    _ => 0,
                };
                [_mm512_set1_epi32(init); P]
            });
            dot_quads(&mut s, &blk, &qs, per * j..per * (j + 1));
            for p in 0..P {
                let sc = line_ps(blk[p], lay.sc + j);
                for i in 0..R {
                    // (exact product, < 2^24: rounds as the portable `s1 += t * sc`)
                    s1[i][p] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[i][p]), sc, s1[i][p]);
                }
            }
        }
        for p in 0..P {
            for i in 0..R {
                let v = acc_load(&t, i, p, P, t.fresh && b == 0);
                let v = k_block_end(qt, &*ab[i], blk[p], lay, s1[i][p], v);
                acc_store(&t, i, p, P, v);
            }
        }
    }
}

/// The running sums `v` after a block of the K-type `qt` whose sub-block sums came to `s1`:
/// `s1` times `d * dx`, less the mins' term of Q4_K, Q5_K and Q2_K ([`super::portable`]'s
/// formula, the end of every many-rows kernel's block).
///
/// # Safety
/// The CPU has AVX-512 F, BW and VNNI; `blk` holds one unpacked block of `qt` (lines of
/// `lay`).
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
#[inline]
pub(super) unsafe fn k_block_end(
    qt: QType,
    ab: &A256,
    blk: *const Line,
    lay: Layout,
    s1: __m512,
    v: __m512,
) -> __m512 {
    let dx = ab.d;
    let v = scaled_add(v, s1, line_ps(blk, lay.d), dx);
    let sums: &[i16] = match qt {
        QType::Q4_K | QType::Q5_K => &ab.sum32,
        QType::Q2_K => &ab.sum16,
        _ => return v,
    };
    let mut s2 = _mm512_setzero_si512();
    for pp in 0..sums.len() / 2 {
        let pair = _mm512_set1_epi32(sum_pair(sums, pp));
        s2 = dpwssd(s2, line(blk, lay.mins + pp), pair);
    }
    mins_sub(v, s2, line_ps(blk, lay.e), dx)
}

/// `v + s1 * (d * dx)`: a K-type block's sub-block sums `s1` scaled by the weights' `d` and
/// the inputs' `dx` ([`k_block_end`]'s first update).
///
/// # Safety
/// The CPU has AVX-512 F.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
#[inline]
unsafe fn scaled_add(v: __m512, s1: __m512, d: __m512, dx: f32) -> __m512 {
    _mm512_fmadd_ps(s1, _mm512_mul_ps(d, _mm512_set1_ps(dx)), v)
}

/// `v - s2 * (e * dx)`: the mins' term of Q4_K, Q5_K and Q2_K (`s2` the mins' integer sums,
/// `e` the weights' dmin; [`k_block_end`]'s second update).
///
/// # Safety
/// The CPU has AVX-512 F.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
#[inline]
unsafe fn mins_sub(v: __m512, s2: __m512i, e: __m512, dx: f32) -> __m512 {
    _mm512_fnmadd_ps(
        _mm512_cvtepi32_ps(s2),
        _mm512_mul_ps(e, _mm512_set1_ps(dx)),
        v,
    )
}

/// `a | (b & c)` bitwise.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
#[inline]
unsafe fn or_and(a: __m512i, b: __m512i, c: __m512i) -> __m512i {
    _mm512_ternarylogic_epi32::<0xF8>(a, b, c)
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

/// The AMX lines of an unpacked Q4_K, Q5_K (`q5`) or Q6_K (`q6`) block ([`Layout::wlo`]): each
/// code times its sub-block's scale (`w = u * sc < 2^11`; Q6_K's `(u - 32) * sc`, `|w| <=
/// 2^12`) split into a low byte (unsigned) and a high byte (Q6_K's signed: `w >> 8`).
///
/// # Safety
/// The CPU has AVX-512 F and BW; `out` holds `lay.lines` lines, its codes and sub-block
/// scales written.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
unsafe fn scaled_codes(out: *mut Line, lay: Layout, q5: bool, q6: bool) {
    // a u16 lane holds two codes of one column (a line: 16 columns x 4 codes), so both
    // take that column's scale: lane l gets column l / 2's
    let lane: [u16; 32] = std::array::from_fn(|l| (l / 2) as u16);
    let cols = _mm512_loadu_si512(lane.as_ptr().cast());
    let even = _mm512_set1_epi16(0x00FF);
    let offset = _mm512_set1_epi16(if q6 { 32 } else { 0 });
    // the odd bytes of a line (the high byte of each u16 lane)
    const ODD: __mmask64 = 0xAAAA_AAAA_AAAA_AAAA;
    let (subs, per) = if q6 { (16, 4) } else { (8, 8) };
    for j in 0..subs {
        // the 16 scales as i16 in the low 256 bits, then each lane its column's
        let mut sc32 = line(out, lay.sc + j);
        if !q6 && !q5 {
            // (Q4_K's scale lines are f32)
            sc32 = _mm512_cvtps_epi32(_mm512_castsi512_ps(sc32));
        }
        let sc16 = _mm512_castsi256_si512(_mm512_cvtepi32_epi16(sc32));
        let sc = _mm512_permutexvar_epi16(cols, sc16);
        for q in per * j..per * j + per {
            let codes = _mm512_load_si512(out.add(q).cast());
            let u_even = _mm512_sub_epi16(_mm512_and_si512(codes, even), offset);
            let u_odd = _mm512_sub_epi16(_mm512_srli_epi16::<8>(codes), offset);
            // w of the even and of the odd codes, one in each 16-bit lane
            let w_even = _mm512_mullo_epi16(u_even, sc);
            let w_odd = _mm512_mullo_epi16(u_odd, sc);
            // low bytes: the even codes' in place, the odd codes' moved up a byte; high
            // bytes: the even codes' moved down a byte, the odd codes' in place
            let lo = _mm512_mask_blend_epi8(ODD, w_even, _mm512_slli_epi16::<8>(w_odd));
            let hi = _mm512_mask_blend_epi8(ODD, _mm512_srli_epi16::<8>(w_even), w_odd);
            _mm512_store_si512(out.add(lay.wlo + q).cast(), lo);
            _mm512_store_si512(out.add(lay.wlo + 64 + q).cast(), hi);
        }
    }
}

/// Block `b` of the panel `w` (streams at `st`) unpacked into the lines at `out`
/// ([`layout`]).
///
/// # Safety
/// The CPU has AVX-512 F, BW and VNNI; `w` points at one packed panel of `nb > b` blocks of
/// `qt` whose streams start at `st` (`stream_starts(qt, nb)`); `out` at `lay.lines`
/// writable lines.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
unsafe fn unpack(qt: QType, w: *const u8, st: &[usize; 6], b: usize, out: *mut Line, lay: Layout) {
    let ld = |p: *const u8| _mm512_loadu_si512(p.cast());
    let put = |i: usize, v: __m512i| _mm512_store_si512(out.add(i).cast(), v);
    let put_ps = |i: usize, v: __m512| _mm512_store_ps(out.add(i).cast(), v);
    let m4 = _mm512_set1_epi8(0x0F);
    let lo_hi = |v: __m512i| {
        (
            _mm512_and_si512(v, m4),
            _mm512_and_si512(_mm512_srli_epi16::<4>(v), m4),
        )
    };
    // (every offset below stays inside stream `s`'s `nb` blocks: the sizes of
    // `packing::streams`, block b < nb)
    match qt {
        QType::Q8_0 => {
            for q in 0..8 {
                put(q, ld(w.add(st[0] + 512 * b + 64 * q)));
            }
            put_ps(lay.d, halves(w.add(st[1] + 32 * b)));
        }
        QType::Q4_0 | QType::Q4_1 => {
            for p in 0..4 {
                let (lo, hi) = lo_hi(ld(w.add(st[0] + 256 * b + 64 * p)));
                put(2 * p, lo);
                put(2 * p + 1, hi);
            }
            put_ps(lay.d, halves(w.add(st[1] + 32 * b)));
            if qt == QType::Q4_1 {
                put_ps(lay.e, halves(w.add(st[2] + 32 * b)));
            }
        }
        QType::Q5_0 | QType::Q5_1 | QType::IQ4_NL | QType::MXFP4 => {
            let (ds, ms) = factor_streams(qt);
            let bit4 = _mm512_set1_epi8(0x10);
            let table = _mm512_broadcast_i32x4(_mm_loadu_si128(table_codes(qt).as_ptr().cast()));
            // fifth bits (Q5_0, Q5_1): bit v of a byte for quad v
            let mut h = if is_table32(qt) {
                _mm512_setzero_si512()
            } else {
                ld(w.add(st[1] + 64 * b))
            };
            for p in 0..4 {
                let (mut lo, mut hi) = lo_hi(ld(w.add(st[0] + 256 * b + 64 * p)));
                if is_table32(qt) {
                    lo = _mm512_shuffle_epi8(table, lo);
                    hi = _mm512_shuffle_epi8(table, hi);
                } else {
                    lo = or_and(lo, _mm512_slli_epi16::<4>(h), bit4);
                    hi = or_and(hi, _mm512_slli_epi16::<3>(h), bit4);
                    h = _mm512_srli_epi16::<2>(h);
                }
                put(2 * p, lo);
                put(2 * p + 1, hi);
            }
            put_ps(lay.d, halves(w.add(st[ds] + 32 * b)));
            if let Some(ms) = ms {
                put_ps(lay.e, halves(w.add(st[ms] + 32 * b)));
            }
        }
        QType::Q4_K | QType::Q5_K => {
            let q5 = qt == QType::Q5_K;
            // (stream numbers: nibbles, [fifth bits], sc, mins, d, dmin)
            let (qh, sc, mins, dd, dmin) = if q5 {
                (st[1], st[2], st[3], st[4], st[5])
            } else {
                (0, st[1], st[2], st[3], st[4])
            };
            let bit4 = _mm512_set1_epi8(0x10);
            for j in 0..8 {
                // fifth bits of sub-block j: bit v of a byte for quad v
                let mut h = if q5 {
                    ld(w.add(qh + 512 * b + 64 * j))
                } else {
                    _mm512_setzero_si512()
                };
                for l in 0..4 {
                    let (mut lo, mut hi) = lo_hi(ld(w.add(st[0] + 2048 * b + 64 * (4 * j + l))));
                    if q5 {
                        lo = or_and(lo, _mm512_slli_epi16::<4>(h), bit4);
                        hi = or_and(hi, _mm512_slli_epi16::<3>(h), bit4);
                        h = _mm512_srli_epi16::<2>(h);
                    }
                    put(8 * j + 2 * l, lo);
                    put(8 * j + 2 * l + 1, hi);
                }
                // (f32 for Q4_K's sub-block sums in f32 halves, i32 for Q5_K's `vpmulld`)
                let v = _mm512_cvtepu8_epi32(_mm_loadu_si128(w.add(sc + 128 * b + 16 * j).cast()));
                if q5 {
                    put(lay.sc + j, v);
                } else {
                    put_ps(lay.sc + j, _mm512_cvtepi32_ps(v));
                }
            }
            for p in 0..4 {
                put(
                    lay.mins + p,
                    _mm512_cvtepu8_epi16(_mm256_loadu_si256(w.add(mins + 128 * b + 32 * p).cast())),
                );
            }
            put_ps(lay.d, halves(w.add(dd + 32 * b)));
            put_ps(lay.e, halves(w.add(dmin + 32 * b)));
            if lay.wlo != 0 {
                // SAFETY: the codes and scales of the block are written just above, and
                // the layout holds the AMX lines (`wlo != 0`).
                unsafe { scaled_codes(out, lay, q5, false) };
            }
        }
        QType::Q6_K => {
            let bits45 = _mm512_set1_epi8(0x30);
            for j in 0..16 {
                // sub-block j (quads 4 j ..): nibble rows 2 j, 2 j + 1, bit pairs row j
                let h = ld(w.add(st[1] + 1024 * b + 64 * j));
                let (l0, h0) = lo_hi(ld(w.add(st[0] + 2048 * b + 128 * j)));
                let (l1, h1) = lo_hi(ld(w.add(st[0] + 2048 * b + 128 * j + 64)));
                put(4 * j, or_and(l0, _mm512_slli_epi16::<4>(h), bits45));
                put(4 * j + 1, or_and(h0, _mm512_slli_epi16::<2>(h), bits45));
                put(4 * j + 2, or_and(l1, h, bits45));
                put(4 * j + 3, or_and(h1, _mm512_srli_epi16::<2>(h), bits45));
                put(
                    lay.sc + j,
                    _mm512_cvtepi8_epi32(_mm_loadu_si128(w.add(st[2] + 256 * b + 16 * j).cast())),
                );
            }
            put_ps(lay.d, halves(w.add(st[3] + 32 * b)));
            if lay.wlo != 0 {
                // SAFETY: as Q4_K's above.
                unsafe { scaled_codes(out, lay, false, true) };
            }
        }
        QType::Q3_K | QType::Q2_K | QType::IQ4_XS => {
            let (subs, per) = vnni::small_shape(qt);
            let table = vnni::iq4_table();
            for j in 0..subs {
                let c = vnni::small_codes(qt, w, st, b, j, table);
                for (v, c) in c.iter().enumerate().take(per) {
                    put(per * j + v, *c);
                }
                put_ps(lay.sc + j, vnni::small_scale(qt, w, st, b, j));
            }
            put_ps(lay.d, halves(w.add(st[vnni::small_streams(qt).1] + 32 * b)));
            if qt == QType::Q2_K {
                put_ps(lay.e, halves(w.add(st[3] + 32 * b)));
                for p in 0..8 {
                    put(lay.mins + p, vnni::q2_min_pair(w, st, b, p));
                }
            }
        }
    }
}
