//! Q4_K, Q5_K and Q6_K products of many rows on the AMX int8 tiles, 16 rows at a time.
//!
//! The formula every path follows ([`super::portable`]) sums a block's sub-block products
//! as one integer, `S = sum_j sc[j] * t[j] = sum_l (sc * u)[l] * q[l]`, and rounds once, at
//! the block's end. On the tiles that is one product over the whole block of the codes
//! times their sub-block's scale (`w = sc * u`, Q6_K's `sc * (u - 32)`, unpacked once per
//! panel as a low and a high byte, [`super::vnni_rows`]' `Layout::wlo`): two tile sums a 64
//! inputs, `S = low + 256 high`, and no f32 step until the block's end, which is the
//! register tiles' ([`super::vnni_rows::k_block_end`]). The outputs are the same bits as
//! every other backend's. Calls of fewer than [`MIN_ROWS`] rows stay on the register
//! tiles; past a call's last whole group, [`PAD_ROWS`] rows or more run as one more group
//! padded with zero rows (whose outputs are dropped), fewer on the register tiles.
//!
//! The other types stay on the register tiles: with one f32 step a 32 inputs (their block
//! factors and sub-block scales are f32), a tile product's sums must be stored and read back
//! every 32 inputs, and on a Xeon with AMX that was no faster than `vpdpbusd`.
//!
//! Tiles (palette 1, all 16 rows x 64 bytes): 0 to 3 the 16 rows' inputs (64 each, loaded
//! once for every panel), 4 and 7 the low and high bytes of `w` (16 quads of 16 columns), 5
//! and 6 the two sums.

use std::arch::asm;
use std::arch::x86_64::*;
use std::mem::MaybeUninit;
use std::ops::Range;

use super::act::A256;
use super::vnni_rows::{acc_load, acc_store, k_block_end, Line, Tile};
use super::{ActRows, QType};

/// Blocks of 16 rows and one panel that ran on the tiles (tests check that they did).
#[cfg(test)]
pub(super) static RUNS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// The types the tiles take.
pub(super) const TYPES: [QType; 3] = [QType::Q4_K, QType::Q5_K, QType::Q6_K];

/// Rows one tile product takes.
pub(super) const ROWS: usize = 16;

/// The fewest rows of a call that run on the tiles: one group and a padded one of
/// [`PAD_ROWS`]. One core (`examples/quant_speed`, 8960 x 1536), against the same calls
/// before padding (one group, the rest on the register tiles, whose passes the tiles' 2
/// panels slow): Q4_K 1.3-1.4x at 24-28 rows, 1.15-1.3x at 40-47; Q6_K 1.3x at 24, 1.45x at
/// 47. One group alone (16 rows) ran as fast as the register tiles, and one group with 1-7
/// rows beside it on the register tiles 0.85-0.9x.
pub(super) const MIN_ROWS: usize = ROWS + PAD_ROWS;

/// Rows of a call's last group below which they run on the register tiles rather than in a
/// group padded to 16 rows with zero rows (which costs a whole group). One core, 8960 x
/// 1536: 8 rows on the register tiles beside 2 groups cost more than a third group.
pub(super) const PAD_ROWS: usize = 8;

/// The groups of a call of `m` rows on the tiles and the rows of its padded last group (0:
/// none, every group whole): whole groups, and one more where at least [`PAD_ROWS`] rows
/// are left.
pub(super) fn groups(m: usize) -> (usize, usize) {
    let left = m % ROWS;
    if left >= PAD_ROWS {
        (m / ROWS + 1, left)
    } else {
        (m / ROWS, 0)
    }
}

/// Whether a product of `m` rows of `qt` runs on the tiles (one of [`TYPES`], [`MIN_ROWS`]
/// or more).
pub(super) fn takes(qt: QType, m: usize) -> bool {
    TYPES.contains(&qt) && m >= MIN_ROWS
}

/// The low and high sums of one block of 16 rows and one panel (16 i32 a row).
#[repr(C, align(64))]
struct Sums([[[i32; 16]; ROWS]; 2]);

/// The tile configuration (64 bytes: palette, then 16 tiles' bytes a row as u16 at 16..,
/// and rows at 48..).
#[repr(C, align(64))]
struct Config([u8; 64]);

/// The tile state of one thread's pass: configured by [`Tiles::new`], released when
/// dropped.
pub(super) struct Tiles(std::marker::PhantomData<*const ()>);

impl Tiles {
    /// Configures this thread's tiles: all eight 16 rows x 64 bytes.
    ///
    /// # Safety
    /// The CPU has AMX-TILE and AMX-INT8 and this process may use them
    /// ([`crate::isa::amx_int8_usable`]).
    pub(super) unsafe fn new() -> Tiles {
        let mut c = Config([0; 64]);
        c.0[0] = 1;
        for t in 0..8 {
            c.0[16 + 2 * t] = 64;
            c.0[48 + t] = 16;
        }
        // SAFETY: the caller's contract (AMX usable); `c` is 64 aligned bytes describing
        // eight valid tiles.
        unsafe { asm!("ldtilecfg [{}]", in(reg) c.0.as_ptr(), options(nostack, readonly)) };
        Tiles(std::marker::PhantomData)
    }
}

impl Drop for Tiles {
    fn drop(&mut self) {
        // SAFETY: a `Tiles` exists only after `ldtilecfg` ran on this thread (it is neither
        // Send nor Clone: a raw pointer's marker inside, built by `new` alone); this releases
        // the tile state, which nothing reads afterwards.
        unsafe { asm!("tilerelease", options(nostack, nomem)) };
    }
}

/// Rows `r` (16 of them) of `acts`, block `b0` (the chunk's one block), `np` panels: the
/// chunk [`super::vnni_rows`]' register tiles would run, for the first `valid` rows (the
/// outputs of `t`; the others are a padded group's zero rows, computed and dropped).
///
/// # Safety
/// [`Tiles::new`] configured this thread's tiles; `qt` is one of [`TYPES`]; the CPU has
/// AVX-512 F, BW and VNNI; `t` and the scratch (unpacked with the AMX lines) as
/// [`super::vnni_rows`]' `tile_dispatch` requires.
pub(super) unsafe fn group(
    qt: QType,
    acts: &ActRows<'_>,
    r: Range<usize>,
    valid: usize,
    b0: usize,
    np: usize,
    t: Tile,
) {
    assert!(r.len() == ROWS && t.cb == 1, "a tile's rows, one block");
    assert!((1..=ROWS).contains(&valid), "a group's rows");
    assert!(
        TYPES.contains(&qt) && t.lay.wlo != 0,
        "a type of the tiles, with its AMX lines"
    );
    let ActRows::A256(a) = acts else {
        panic!("the K-types take A256 blocks")
    };
    assert!(r.end * t.nb <= a.len() && b0 < t.nb, "the tile's blocks");
    let first = a[r.start * t.nb + b0..].as_ptr();
    // (each written whole by its product before it is read)
    let mut sums = [const { MaybeUninit::<Sums>::uninit() }; 2];
    let stride = t.nb * size_of::<A256>();
    // SAFETY: `first` is row r.start's block b0, the rows `stride` bytes apart (inside `a`,
    // asserted); the tiles are configured (the caller's contract).
    unsafe { load_inputs((*first).qs.as_ptr(), stride) };
    let lines = |p: usize| t.s.wrapping_add(p * t.pstride + t.lay.wlo);
    let signed = qt == QType::Q6_K;
    for p in 0..np {
        if p == 0 {
            // SAFETY: the panel's AMX lines are unpacked (the caller's contract).
            unsafe { products(lines(0), sums[0].as_mut_ptr(), signed) };
        }
        if p + 1 < np {
            // SAFETY: as above, for the next panel; its sums go to the other buffer.
            unsafe { products(lines(p + 1), sums[(p + 1) % 2].as_mut_ptr(), signed) };
        }
        // SAFETY: the sums of panel p are stored, all 2 KiB (its products ran above); the
        // outputs as the caller's contract.
        unsafe { block_out(qt, first, sums[p % 2].assume_init_ref(), p, np, valid, t) };
    }
    #[cfg(test)]
    RUNS.fetch_add(np, std::sync::atomic::Ordering::Relaxed);
}

/// Loads 16 rows of a block's inputs at `a` (`stride` bytes apart) into tiles 0 to 3 (64
/// inputs each).
///
/// # Safety
/// [`Tiles::new`] configured this thread's tiles; 16 rows of 256 bytes at `a`, `stride`
/// apart, are readable.
#[inline(always)]
unsafe fn load_inputs(a: *const i8, stride: usize) {
    // SAFETY: the caller's contract: each load reads 16 rows of 64 bytes at `a + 64 c`.
    unsafe {
        asm!(
            "tileloadd tmm0, [{a} + {sa}*1]",
            "tileloadd tmm1, [{a} + {sa}*1 + 64]",
            "tileloadd tmm2, [{a} + {sa}*1 + 128]",
            "tileloadd tmm3, [{a} + {sa}*1 + 192]",
            a = in(reg) a,
            sa = in(reg) stride,
            options(nostack, readonly),
        )
    }
}

/// The block's two sums (low and high bytes of `w`) for the inputs in tiles 0 to 3
/// ([`load_inputs`]) and one panel's AMX lines at `w` (64 low, then 64 high; the high bytes
/// signed where `signed`), into `sums` (codes in tiles 4 and 7, sums in 5 and 6).
///
/// # Safety
/// [`Tiles::new`] configured this thread's tiles and [`load_inputs`] filled 0 to 3; 128
/// lines at `w` are readable and `sums` writable.
#[inline(always)]
unsafe fn products(w: *const Line, sums: *mut Sums, signed: bool) {
    // (the low bytes: `tdpbsud`, signed inputs times unsigned bytes; the high ones the
    // same, or `tdpbssd` where they are signed)
    macro_rules! block {
        ($hi:literal) => {
            asm!(
                "tilezero tmm5",
                "tilezero tmm6",
                "tileloadd tmm4, [{w} + {s64}*1]",
                "tdpbsud tmm5, tmm0, tmm4",
                "tileloadd tmm7, [{w} + {s64}*1 + 4096]",
                concat!($hi, " tmm6, tmm0, tmm7"),
                "tileloadd tmm4, [{w} + {s64}*1 + 1024]",
                "tdpbsud tmm5, tmm1, tmm4",
                "tileloadd tmm7, [{w} + {s64}*1 + 5120]",
                concat!($hi, " tmm6, tmm1, tmm7"),
                "tileloadd tmm4, [{w} + {s64}*1 + 2048]",
                "tdpbsud tmm5, tmm2, tmm4",
                "tileloadd tmm7, [{w} + {s64}*1 + 6144]",
                concat!($hi, " tmm6, tmm2, tmm7"),
                "tileloadd tmm4, [{w} + {s64}*1 + 3072]",
                "tdpbsud tmm5, tmm3, tmm4",
                "tileloadd tmm7, [{w} + {s64}*1 + 7168]",
                concat!($hi, " tmm6, tmm3, tmm7"),
                "tilestored [{c} + {s64}*1], tmm5",
                "tilestored [{c} + {s64}*1 + 1024], tmm6",
                w = in(reg) w,
                s64 = in(reg) 64usize,
                c = in(reg) sums,
                options(nostack),
            )
        };
    }
    // SAFETY: the caller's contract: every tile is 16 rows x 64 bytes; the loads read 16
    // lines at `w + 16 c` and `w + 64 + 16 c` (64 bytes apart), the stores write the 2 KiB
    // of `sums`.
    unsafe {
        if signed {
            block!("tdpbssd")
        } else {
            block!("tdpbsud")
        }
    }
}

/// The outputs of panel `p` (of `np`) for the block: `S = low + 256 high` is `s1`, then the
/// block's end as the register tiles'.
///
/// # Safety
/// As [`group`]; `a` is the first row's block, `sums` holds the panel's stored sums.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
unsafe fn block_out(
    qt: QType,
    a: *const A256,
    sums: &Sums,
    p: usize,
    np: usize,
    valid: usize,
    t: Tile,
) {
    let blk = t.s.add(p * t.pstride);
    for i in 0..valid {
        let lo = _mm512_load_si512(sums.0[0][i].as_ptr().cast());
        let hi = _mm512_load_si512(sums.0[1][i].as_ptr().cast());
        let s1 = _mm512_cvtepi32_ps(_mm512_add_epi32(lo, _mm512_slli_epi32::<8>(hi)));
        let v = acc_load(&t, i, p, np, t.fresh);
        let v = k_block_end(qt, &*a.add(i * t.nb), blk, t.lay, s1, v);
        acc_store(&t, i, p, np, v);
    }
}
