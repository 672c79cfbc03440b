//! bf16 matrix products on the AMX tiles with f32 outputs: `out = bf16(x) @ W.T (+ bias)`,
//! the products of bf16 pairs summed in f32 and never rounded to bf16 afterwards (oneDNN's
//! packed linears, as torch calls them, round their outputs to the input dtype).
//!
//! The weight `W` [n, k] (bf16 bits, row-major as `nn.Linear` keeps it) is packed once
//! ([`pack`]) into the B-tile layout: blocks of 16 output columns by 32 inputs, each 16
//! rows (pairs of inputs) of 16 columns x 2 bf16 (1 KiB), block `(nb, kb)` at
//! `(nb * k_blocks + kb) * 512`, zero beyond `n` (padded to an even number of blocks) and
//! `k`. [`linear`] rounds `x` to bf16 (round to nearest even) into a zero-padded scratch of
//! whole passes of 32 rows, splits the pairs of column blocks over the pool's threads and,
//! per pair, runs 32 rows at a time through 2 x 2 accumulator tiles (each input tile and
//! weight block loaded once for two products).
//!
//! On x86-64 CPUs with AMX-TILE and AMX-BF16 whose kernel granted this process the tile
//! data state, the tiles run the products; on those without AMX but with AVX-512 BF16
//! (AMD Zen 4, Intel Cooper Lake), [`crate::dpbf16`] runs the same sums on zmm registers
//! over the same packed weights ([`backend`]); elsewhere [`available`] is false.

use crate::fused::ArgError;
use crate::Elems;

/// Output columns of one tile.
pub const TILE_N: usize = 16;
/// bf16 inputs (the product's k) of one tile row.
pub const TILE_K: usize = 32;
/// Elements (u16) of one packed weight block.
const BLOCK: usize = TILE_N * TILE_K;
/// Rows of `x` per pass through the four accumulator tiles (2 x 2 tiles of 16 x 16).
const ROWS_PER_PASS: usize = 32;

fn round_up(v: usize, to: usize) -> usize {
    v.div_ceil(to) * to
}

/// An error about `field`; the message starts with its name.
fn err(field: &'static str, message: String) -> ArgError {
    ArgError {
        field,
        message: format!("{field} {message}"),
    }
}

/// Rows per chunk of a long call (a multiple of `ROWS_PER_PASS`): 256 rows of bf16 inputs
/// (288 KiB at k = 576) stay in the L2 cache while the weight streams past; each chunk
/// reads the weight once more.
const ROWS_PER_CHUNK: usize = 256;

/// Column blocks run in pairs (two accumulator columns per pass).
const COLS_PER_PASS: usize = 2 * TILE_N;

/// Elements of the packed form of an `[n, k]` weight (`n` padded to a pair of blocks).
pub fn packed_len(n: usize, k: usize) -> usize {
    round_up(n, COLS_PER_PASS) * round_up(k, TILE_K)
}

/// Packs `weight` [n, k] (bf16 bits) into `out` ([`packed_len`] elements; see the module
/// docs for the layout).
pub fn pack(weight: &[u16], n: usize, k: usize, out: &mut [u16]) -> Result<(), ArgError> {
    if weight.len() != n * k {
        return Err(err(
            "weight",
            format!("has {} elements, not n * k = {}", weight.len(), n * k),
        ));
    }
    if out.len() != packed_len(n, k) {
        return Err(err(
            "out",
            format!("has {} elements, not {}", out.len(), packed_len(n, k)),
        ));
    }
    let k_blocks = round_up(k, TILE_K) / TILE_K;
    for (b, block) in out.chunks_exact_mut(BLOCK).enumerate() {
        let (nb, kb) = (b / k_blocks, b % k_blocks);
        for (i, v) in block.iter_mut().enumerate() {
            // row p of the tile holds inputs 2p and 2p + 1 of each of its 16 columns
            let (p, j, e) = (i / (2 * TILE_N), (i / 2) % TILE_N, i % 2);
            let (col, kk) = (nb * TILE_N + j, kb * TILE_K + 2 * p + e);
            *v = if col < n && kk < k {
                weight[col * k + kk]
            } else {
                0
            };
        }
    }
    Ok(())
}

/// The shapes of one [`linear`] call.
#[derive(Clone, Copy, Debug)]
pub struct LinearArgs {
    /// rows of `x` and `out`
    pub m: usize,
    /// output columns (the weight's rows)
    pub n: usize,
    /// inputs (the weight's columns)
    pub k: usize,
    /// at most this many threads (column blocks are split between them)
    pub threads: usize,
}

/// `out[i, j] = sum_l bf16(x[i, l]) * W[j, l] (+ bias[j])` in f32, `x` [m, k] (f32, or bf16
/// taken as it is), `packed` the [`pack`]ed `W` [n, k], `out` [m, n] f32. Fails with the
/// field at fault on a length mismatch, and with `"amx"` where [`available`] is false.
pub fn linear(
    args: &LinearArgs,
    x: Elems<'_>,
    packed: &[u16],
    bias: Option<&[f32]>,
    out: &mut [f32],
) -> Result<(), ArgError> {
    let LinearArgs { m, n, k, .. } = *args;
    let x_len = match x {
        Elems::F32(s) => s.len(),
        Elems::Bf16(s) => s.len(),
        Elems::F16(_) => return Err(err("x", "must be float32 or bfloat16, not float16".into())),
    };
    if x_len != m * k {
        return Err(err(
            "x",
            format!("has {x_len} elements, not m * k = {}", m * k),
        ));
    }
    if packed.len() != packed_len(n, k) {
        return Err(err(
            "packed",
            format!(
                "has {} elements, not {} for n = {n}, k = {k}",
                packed.len(),
                packed_len(n, k)
            ),
        ));
    }
    if out.len() != m * n {
        return Err(err(
            "out",
            format!("has {} elements, not m * n = {}", out.len(), m * n),
        ));
    }
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
    let backend = backend();
    if backend == Backend::None {
        return Err(err(
            "amx",
            "is not available: this CPU has neither AMX bf16 tiles nor AVX-512 BF16".into(),
        ));
    }
    linear_on(backend, args, x, packed, bias, out);
    Ok(())
}

/// [`linear`] on `backend` (arguments checked, `backend` available).
fn linear_on(
    backend: Backend,
    args: &LinearArgs,
    x: Elems<'_>,
    packed: &[u16],
    bias: Option<&[f32]>,
    out: &mut [f32],
) {
    let LinearArgs { m, n, k, threads } = *args;
    let lines: Vec<Line>;
    let a: &[u16] = match x {
        // rows read in place: `vdpbf16ps` broadcasts need no alignment nor whole passes
        Elems::Bf16(s) if backend == Backend::Avx512Bf16 && k.is_multiple_of(TILE_K) => s,
        _ => {
            lines = padded_rows(x, m, k);
            elements(&lines)
        }
    };
    let pairs = round_up(n, COLS_PER_PASS) / COLS_PER_PASS;
    let threads = threads.clamp(1, pairs);
    let per_task = pairs.div_ceil(threads);
    let bias: Option<Vec<f32>> = bias.map(|b| {
        let mut padded = b.to_vec();
        padded.resize(round_up(n, COLS_PER_PASS), 0.0);
        padded
    });
    let kp = round_up(k, TILE_K);
    // rows in chunks whose bf16 inputs stay in the L2 cache while every weight block passes
    for row0 in (0..m).step_by(ROWS_PER_CHUNK) {
        let rows = (m - row0).min(ROWS_PER_CHUNK);
        // (whole passes of 32 rows in the scratch; just the rows when read in place)
        let end = ((row0 + round_up(rows, ROWS_PER_PASS)) * kp).min(a.len());
        let a = &a[row0 * kp..end];
        // (row0 * n < out.len(): row0 < m)
        let dst = OutColumns {
            ptr: out[row0 * n..].as_mut_ptr(),
            m: rows,
            n,
        };
        let task = |t: usize| {
            let pairs = t * per_task..((t + 1) * per_task).min(pairs);
            match backend {
                Backend::Amx => tiles::run_pairs(a, kp, packed, pairs, bias.as_deref(), &dst),
                Backend::Avx512Bf16 => {
                    crate::dpbf16::run_pairs(a, kp, rows, packed, pairs, bias.as_deref(), &dst)
                }
                Backend::None => unreachable!("linear checked the backend"),
            }
        };
        crate::parallel::pool().run(threads, pairs.div_ceil(per_task), &task);
    }
}

/// One cache line of bf16 inputs: tile rows are loaded 64 bytes at a time, and a row that
/// straddles two lines costs two.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Line([u16; TILE_K]);

/// `x` rounded to bf16 into whole passes: [round_up(m, 32), round_up(k, 32)], zero-padded,
/// each row starting a cache line.
fn padded_rows(x: Elems<'_>, m: usize, k: usize) -> Vec<Line> {
    let kp = round_up(k, TILE_K);
    let mut lines = vec![Line([0; TILE_K]); round_up(m, ROWS_PER_PASS) * kp / TILE_K];
    let a = elements_mut(&mut lines);
    for (i, row) in a.chunks_exact_mut(kp).take(m).enumerate() {
        match x {
            Elems::F32(s) => {
                for (d, &v) in row.iter_mut().zip(&s[i * k..(i + 1) * k]) {
                    *d = bf16_bits(v);
                }
            }
            Elems::Bf16(s) => row[..k].copy_from_slice(&s[i * k..(i + 1) * k]),
            Elems::F16(_) => unreachable!("checked by linear"),
        }
    }
    lines
}

fn elements(lines: &[Line]) -> &[u16] {
    // SAFETY: `Line` is `repr(C)` around `[u16; 32]` with size 64 and no padding, so the
    // lines are `32 * len` initialised, contiguous u16 (alignment only grows).
    unsafe { std::slice::from_raw_parts(lines.as_ptr().cast::<u16>(), lines.len() * TILE_K) }
}

fn elements_mut(lines: &mut [Line]) -> &mut [u16] {
    // SAFETY: as in `elements`; the borrow of `lines` is exclusive for the result's life.
    unsafe {
        std::slice::from_raw_parts_mut(lines.as_mut_ptr().cast::<u16>(), lines.len() * TILE_K)
    }
}

/// `v` rounded to the nearest bf16, ties to even (NaN stays a quiet NaN); the same bits as
/// `half::bf16::from_f32`, in a form the compiler vectorizes.
#[inline(always)]
fn bf16_bits(v: f32) -> u16 {
    let b = v.to_bits();
    let rounded = b.wrapping_add(0x7fff + ((b >> 16) & 1)) >> 16;
    if v.is_nan() {
        ((b >> 16) | 0x40) as u16
    } else {
        rounded as u16
    }
}

/// `out` [m, n] shared between tasks that each write only the columns of their own blocks.
pub(crate) struct OutColumns<T = f32> {
    ptr: *mut T,
    m: usize,
    n: usize,
}

// SAFETY: the pointer is only written through `OutColumns::write` / `write_row` /
// `write_cols` and by tile stores at the addresses `OutColumns::tile` returns (16 rows x 16
// columns inside `out`), always of the calling task's own column blocks; the tasks of one
// `linear` call (here or in `f32_linear`) get disjoint column blocks, so no element is
// written by two threads, and the slice it came from is borrowed mutably by that `linear`
// until every task has returned.
unsafe impl<T: Send> Sync for OutColumns<T> {}

impl<T: Copy> OutColumns<T> {
    /// `out` [m, n] (its length checked), written only through this until it is dropped:
    /// the caller keeps `out` borrowed while the tasks run.
    pub(crate) fn new(out: &mut [T], m: usize, n: usize) -> Self {
        assert_eq!(out.len(), m * n, "out must hold m * n elements");
        OutColumns {
            ptr: out.as_mut_ptr(),
            m,
            n,
        }
    }

    /// Writes `sums` (row `row`, columns `col0..col0 + sums.len()`), keeping to the columns
    /// below `n`; a row at or past `m` is dropped.
    pub(crate) fn write_cols(&self, row: usize, col0: usize, sums: &[T]) {
        let cols = self.n.saturating_sub(col0).min(sums.len());
        if row >= self.m || cols == 0 {
            return;
        }
        let at = row * self.n + col0;
        debug_assert!(at + cols <= self.m * self.n);
        // SAFETY: `at + cols <= m * n` (row < m, col0 + cols <= n), inside the slice behind
        // `ptr`; the columns belong to this task alone (see `Sync` above).
        let dst = unsafe { std::slice::from_raw_parts_mut(self.ptr.add(at), cols) };
        dst.copy_from_slice(&sums[..cols]);
    }
}

impl OutColumns<f32> {
    /// Where the 16 x 16 tile of rows `row0..` and columns `col0..` starts in `out`, when
    /// all of it lies inside (else None: see `write`).
    fn tile(&self, row0: usize, col0: usize) -> Option<*mut f32> {
        (row0 + 16 <= self.m && col0 + TILE_N <= self.n)
            .then(|| self.ptr.wrapping_add(row0 * self.n + col0))
    }

    /// Writes `tile` (16 x 16 f32 accumulators of rows `row0..`, columns `col0..`), keeping
    /// to the rows below `m` and the columns below `n`.
    fn write(&self, row0: usize, col0: usize, tile: &[f32]) {
        let rows = self.m.saturating_sub(row0).min(16);
        let cols = self.n.saturating_sub(col0).min(TILE_N);
        if cols == 0 {
            return; // a padding block
        }
        for r in 0..rows {
            let src = &tile[r * TILE_N..r * TILE_N + cols];
            let at = (row0 + r) * self.n + col0;
            debug_assert!(at + cols <= self.m * self.n);
            // SAFETY: `at + cols <= m * n` (row0 + r < m, col0 + cols <= n), inside the
            // slice behind `ptr`; the columns belong to this task alone (see `Sync` above).
            let dst = unsafe { std::slice::from_raw_parts_mut(self.ptr.add(at), cols) };
            dst.copy_from_slice(src);
        }
    }

    /// Writes `sums` (the f32 sums of row `row`, columns `col0..col0 + 32`: a pair of
    /// column blocks), keeping to the columns below `n`; a row at or past `m` is dropped.
    pub(crate) fn write_row(&self, row: usize, col0: usize, sums: &[f32; 2 * TILE_N]) {
        self.write_cols(row, col0, sums);
    }
}

/// Which instructions run [`linear`] here.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    /// AMX tiles: the CPU has AMX-TILE and AMX-BF16, the OS saves the tile state (XCR0
    /// bits 17 and 18), and the kernel granted this process the tile data
    /// (`arch_prctl(ARCH_REQ_XCOMP_PERM)`, asked once).
    Amx,
    /// `vdpbf16ps` on zmm registers ([`crate::dpbf16`]): AVX-512F and AVX-512 BF16.
    Avx512Bf16,
    /// neither: [`linear`] fails.
    None,
}

impl Backend {
    /// The name Python sees: "amx", "avx512_bf16" or "none".
    pub fn name(self) -> &'static str {
        match self {
            Backend::Amx => "amx",
            Backend::Avx512Bf16 => "avx512_bf16",
            Backend::None => "none",
        }
    }
}

/// The fastest [`Backend`] this CPU and kernel allow (detected once).
pub fn backend() -> Backend {
    static BACKEND: std::sync::OnceLock<Backend> = std::sync::OnceLock::new();
    *BACKEND.get_or_init(|| {
        if tiles::detect() {
            Backend::Amx
        } else if crate::dpbf16::available() {
            Backend::Avx512Bf16
        } else {
            Backend::None
        }
    })
}

/// Whether [`linear`] can run here (on either [`Backend`]).
pub fn available() -> bool {
    backend() != Backend::None
}

#[cfg(target_arch = "x86_64")]
mod tiles {
    use super::{OutColumns, BLOCK, ROWS_PER_PASS, TILE_K, TILE_N};
    use std::arch::asm;
    use std::arch::x86_64::{__cpuid_count, _xgetbv};
    use std::ops::Range;

    unsafe extern "C" {
        fn syscall(number: i64, ...) -> i64;
    }
    const SYS_ARCH_PRCTL: i64 = 158;
    const ARCH_REQ_XCOMP_PERM: i64 = 0x1023;
    const XFEATURE_XTILEDATA: i64 = 18;

    pub(super) fn detect() -> bool {
        // cpuid leaf 7 reports zeros where a feature is missing
        let leaf7 = __cpuid_count(7, 0);
        let (tile, bf16) = (leaf7.edx & (1 << 24) != 0, leaf7.edx & (1 << 22) != 0);
        let osxsave = __cpuid_count(1, 0).ecx & (1 << 27) != 0;
        if !(tile && bf16 && osxsave) {
            return false;
        }
        // SAFETY: xgetbv is available because OSXSAVE is set (checked just above).
        let xcr0 = unsafe { _xgetbv(0) };
        if xcr0 & (0b11 << 17) != 0b11 << 17 {
            return false;
        }
        // SAFETY: arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA) only changes which XSAVE
        // features this process may use; it reads no memory of ours. 0 means granted (also
        // when torch's oneDNN asked first).
        unsafe { syscall(SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 }
    }

    /// The tile configuration: palette 1, tiles 0..=7 of 16 rows x 64 bytes (0-3 the
    /// accumulators of 2 x 2 tiles, 4 and 5 input rows, 6 and 7 weight blocks).
    #[repr(C, align(64))]
    struct Config([u8; 64]);

    fn config() -> Config {
        let mut c = Config([0; 64]);
        c.0[0] = 1;
        for t in 0..8 {
            c.0[16 + 2 * t] = 64; // bytes per row
            c.0[48 + t] = 16; // rows
        }
        c
    }

    /// Runs the column-block pairs `pairs` for every row of `a` ([rows, kp] bf16, whole
    /// passes of 32 rows).
    pub(super) fn run_pairs(
        a: &[u16],
        kp: usize,
        packed: &[u16],
        pairs: Range<usize>,
        bias: Option<&[f32]>,
        out: &OutColumns,
    ) {
        let k_blocks = kp / TILE_K;
        let rows = a.len() / kp;
        let cfg = config();
        let mut acc = [0f32; 4 * 16 * TILE_N];
        // bytes per row of `a`, and of a weight block
        let (a_stride, s64) = (kp * 2, 64usize);
        // SAFETY: AMX is available (`linear` checked `available()`, which also obtained the
        // tile permission); the config is 64 aligned bytes describing valid tiles.
        unsafe { asm!("ldtilecfg [{}]", in(reg) cfg.0.as_ptr(), options(nostack)) };
        for pair in pairs {
            let nb = 2 * pair;
            let w0 = &packed[nb * k_blocks * BLOCK..(nb + 1) * k_blocks * BLOCK];
            let w1 = &packed[(nb + 1) * k_blocks * BLOCK..(nb + 2) * k_blocks * BLOCK];
            for row0 in (0..rows).step_by(ROWS_PER_PASS) {
                let a0 = &a[row0 * kp..(row0 + 16) * kp];
                let a1 = &a[(row0 + 16) * kp..(row0 + 32) * kp];
                // SAFETY (the asm blocks): tiles 0..=7 are configured as 16 rows x 64 bytes.
                // Each load reads 16 rows of 64 bytes, `stride` apart, inside a 1 KiB block
                // of `w0` / `w1` (rows 64 bytes apart), inside `a0` / `a1` (16 rows of `kp`
                // elements; columns kb * 32 .. + 32 <= kp), or 64 bytes of `bias` (stride
                // 0: the same row 16 times; columns nb * 16 .. + 32 <= its padded length).
                // The stores write 16 rows x 64 bytes into `acc` (whole) or, through
                // `out.tile`, into a tile of `out` that lies inside it.
                unsafe {
                    match bias {
                        Some(b) => asm!(
                            "tileloadd tmm0, [{b0} + {z}*1]", "tileloadd tmm1, [{b1} + {z}*1]",
                            "tileloadd tmm2, [{b0} + {z}*1]", "tileloadd tmm3, [{b1} + {z}*1]",
                            b0 = in(reg) b[nb * TILE_N..nb * TILE_N + TILE_N].as_ptr(),
                            b1 = in(reg) b[(nb + 1) * TILE_N..(nb + 2) * TILE_N].as_ptr(),
                            z = in(reg) 0usize, options(nostack, readonly)),
                        None => asm!(
                            "tilezero tmm0",
                            "tilezero tmm1",
                            "tilezero tmm2",
                            "tilezero tmm3",
                            options(nostack)
                        ),
                    }
                }
                for kb in 0..k_blocks {
                    unsafe {
                        asm!(
                            "tileloadd tmm4, [{a0} + {sa}*1]",
                            "tileloadd tmm6, [{b0} + {s64}*1]",
                            "tdpbf16ps tmm0, tmm4, tmm6",
                            "tileloadd tmm7, [{b1} + {s64}*1]",
                            "tdpbf16ps tmm1, tmm4, tmm7",
                            "tileloadd tmm5, [{a1} + {sa}*1]",
                            "tdpbf16ps tmm2, tmm5, tmm6",
                            "tdpbf16ps tmm3, tmm5, tmm7",
                            a0 = in(reg) a0[kb * TILE_K..].as_ptr(),
                            a1 = in(reg) a1[kb * TILE_K..].as_ptr(),
                            b0 = in(reg) w0[kb * BLOCK..].as_ptr(),
                            b1 = in(reg) w1[kb * BLOCK..].as_ptr(),
                            sa = in(reg) a_stride, s64 = in(reg) s64,
                            options(nostack, readonly),
                        );
                    }
                }
                // accumulators: 0 rows row0.. cols nb, 1 cols nb + 1, 2 and 3 rows row0 + 16..
                let tile = 16 * TILE_N;
                let c = acc.as_mut_ptr();
                let place = [(0, 0), (0, 1), (16, 0), (16, 1)];
                let direct = place.map(|(dr, db)| out.tile(row0 + dr, (nb + db) * TILE_N));
                let dst = |t: usize| direct[t].unwrap_or(c.wrapping_add(t * tile));
                let stride = |t: usize| if direct[t].is_some() { out.n * 4 } else { s64 };
                unsafe {
                    asm!(
                        "tilestored [{c0} + {s0}*1], tmm0",
                        "tilestored [{c1} + {s1}*1], tmm1",
                        "tilestored [{c2} + {s2}*1], tmm2",
                        "tilestored [{c3} + {s3}*1], tmm3",
                        c0 = in(reg) dst(0), c1 = in(reg) dst(1), c2 = in(reg) dst(2),
                        c3 = in(reg) dst(3), s0 = in(reg) stride(0), s1 = in(reg) stride(1),
                        s2 = in(reg) stride(2), s3 = in(reg) stride(3), options(nostack),
                    );
                }
                for (t, (dr, db)) in place.into_iter().enumerate() {
                    if direct[t].is_none() {
                        out.write(row0 + dr, (nb + db) * TILE_N, &acc[t * tile..]);
                    }
                }
            }
        }
        // SAFETY: releases this thread's tile state (nothing is read from it afterwards).
        unsafe { asm!("tilerelease", options(nostack)) };
    }
}

#[cfg(not(target_arch = "x86_64"))]
mod tiles {
    use super::OutColumns;
    use std::ops::Range;

    pub(super) fn detect() -> bool {
        false
    }

    pub(super) fn run_pairs(
        _: &[u16],
        _: usize,
        _: &[u16],
        _: Range<usize>,
        _: Option<&[f32]>,
        _: &OutColumns,
    ) {
        unreachable!("AMX is never available off x86-64")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::bf16;

    fn bits(v: &[f32]) -> Vec<u16> {
        v.iter().map(|&x| bf16::from_f32(x).to_bits()).collect()
    }

    fn reference(x: &[f32], w: &[u16], m: usize, n: usize, k: usize) -> Vec<f64> {
        let mut out = vec![0f64; m * n];
        for i in 0..m {
            for j in 0..n {
                out[i * n + j] = (0..k)
                    .map(|l| {
                        let a = bf16::from_f32(x[i * k + l]).to_f64();
                        a * bf16::from_bits(w[j * k + l]).to_f64()
                    })
                    .sum();
            }
        }
        out
    }

    fn values(len: usize, seed: u32) -> Vec<f32> {
        let mut s = seed.wrapping_mul(2654435761).wrapping_add(1);
        (0..len)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 17;
                s ^= s << 5;
                (s % 2001) as f32 / 1000.0 - 1.0
            })
            .collect()
    }

    #[test]
    fn bf16_bits_is_halfs_rounding() {
        let specials = [
            0.0f32,
            -0.0,
            1.0,
            f32::MAX,
            f32::MIN,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            1.0e-40,
            3.0e38,
        ];
        let spread = values(10_000, 9).into_iter().map(|v| v * 1.0e3);
        let ties = (0..1000u32).map(|i| f32::from_bits(0x3f80_8000 + (i << 16)));
        for v in specials.into_iter().chain(spread).chain(ties) {
            let want = bf16::from_f32(v).to_bits();
            if v.is_nan() {
                assert!(bf16::from_bits(bf16_bits(v)).is_nan());
            } else {
                assert_eq!(bf16_bits(v), want, "{v:e}");
            }
        }
    }

    #[test]
    fn pack_places_pairs_of_inputs_per_column() {
        let (n, k) = (17, 33);
        let w: Vec<u16> = (0..(n * k) as u16).collect();
        let mut p = vec![0u16; packed_len(n, k)];
        pack(&w, n, k, &mut p).unwrap();
        // block (0, 0), row 1, column 2: inputs 2 and 3 of weight row 2
        assert_eq!(&p[32 + 4..32 + 6], &[w[2 * k + 2], w[2 * k + 3]]);
        // block (0, 1) starts with input 32 of row 0, then zero padding (k = 33)
        assert_eq!(&p[BLOCK..BLOCK + 2], &[w[32], 0]);
        // block (1, 0): column 16 is weight row 16, columns 17.. are padding
        assert_eq!(
            &p[2 * BLOCK..2 * BLOCK + 4],
            &[w[16 * k], w[16 * k + 1], 0, 0]
        );
    }

    /// Every backend this machine runs (AMX and AVX-512 BF16 both, on an AMX CPU).
    fn backends_here() -> Vec<Backend> {
        let mut found = Vec::new();
        if backend() == Backend::Amx {
            found.push(Backend::Amx);
        }
        if crate::dpbf16::available() {
            found.push(Backend::Avx512Bf16);
        }
        found
    }

    #[test]
    fn backend_is_the_first_one_here() {
        assert_eq!(
            backends_here().first().copied().unwrap_or(Backend::None),
            backend()
        );
        assert_eq!(available(), backend() != Backend::None);
    }

    #[test]
    fn linear_is_the_f32_sum_of_bf16_products() {
        let backends = backends_here();
        if backends.is_empty() {
            eprintln!("neither AMX nor AVX-512 BF16 here: skipped");
            return;
        }
        for backend in backends {
            products_match_reference(backend);
        }
    }

    fn products_match_reference(backend: Backend) {
        for &(m, n, k, threads) in &[
            (1, 16, 32, 1),
            (5, 40, 70, 2),
            (64, 48, 96, 3),
            (77, 33, 64, 2),
            (130, 20, 31, 1),
            (300, 40, 70, 2),
            (9, 70, 100, 2),
            (8, 32, 32, 1),
            (3, 1, 5, 1),
        ] {
            check_shape(backend, m, n, k, threads);
        }
    }

    /// `linear_on(backend)` of one shape against the f64 reference: f32 and bf16 inputs,
    /// with and without a bias.
    fn check_shape(backend: Backend, m: usize, n: usize, k: usize, threads: usize) {
        let x = values(m * k, m as u32);
        let w = bits(&values(n * k, n as u32 + 7));
        let bias = values(n, 3);
        let mut p = vec![0u16; packed_len(n, k)];
        pack(&w, n, k, &mut p).unwrap();
        let mut out = vec![f32::NAN; m * n];
        let args = LinearArgs { m, n, k, threads };
        linear_on(backend, &args, Elems::F32(&x), &p, Some(&bias), &mut out);
        let want = reference(&x, &w, m, n, k);
        for (i, (&got, &r)) in out.iter().zip(&want).enumerate() {
            let r = r + f64::from(bias[i % n]);
            assert!(
                (f64::from(got) - r).abs() <= 1e-5 * (1.0 + r.abs()),
                "{backend:?} m {m} n {n} k {k}: out[{i}] = {got}, want {r}"
            );
        }
        // bf16 inputs are taken as they are; no bias is no bias
        let xb = bits(&x);
        let mut out2 = vec![0f32; m * n];
        linear_on(backend, &args, Elems::Bf16(&xb), &p, Some(&bias), &mut out2);
        assert_eq!(out, out2);
        linear_on(backend, &args, Elems::Bf16(&xb), &p, None, &mut out2);
        for (i, (&got, &r)) in out2.iter().zip(&want).enumerate() {
            assert!(
                (f64::from(got) - r).abs() <= 1e-5 * (1.0 + r.abs()),
                "{backend:?} no bias m {m} n {n} k {k}: out[{i}] = {got}, want {r}"
            );
        }
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(48))]
        #[test]
        fn random_shapes_match_the_reference(m in 1usize..70, n in 1usize..150,
                                             k in 1usize..130, threads in 1usize..4) {
            for backend in backends_here() {
                check_shape(backend, m, n, k, threads);
            }
        }
    }

    #[test]
    fn linear_names_the_argument_of_the_wrong_length() {
        let p = vec![0u16; packed_len(16, 32)];
        let mut out = vec![0f32; 16];
        let args = LinearArgs {
            m: 1,
            n: 16,
            k: 32,
            threads: 1,
        };
        let e = linear(&args, Elems::F32(&[0.0; 31]), &p, None, &mut out).unwrap_err();
        assert_eq!(e.field, "x");
        let e = linear(&args, Elems::F32(&[0.0; 32]), &p[1..], None, &mut out).unwrap_err();
        assert_eq!(e.field, "packed");
        let e = linear(&args, Elems::F32(&[0.0; 32]), &p, Some(&[0.0; 3]), &mut out).unwrap_err();
        assert_eq!(e.field, "bias");
        let e = pack(&[0; 5], 16, 32, &mut vec![0; 512]).unwrap_err();
        assert_eq!(e.field, "weight");
    }
}
