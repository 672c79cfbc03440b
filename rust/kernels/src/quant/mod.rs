//! Products with GGUF quantized weights (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL, Q2_K, Q3_K,
//! Q4_K, Q5_K, Q6_K, IQ4_XS):
//! `y[m, n] = x[m, k] . W[n, k]^T`, `x` and `y` f32, `W` the GGUF rows (one row a weight
//! row, `k / block` blocks each) packed once ([`pack`]) into panels of 16 rows.
//!
//! * [`dequantize`]: GGUF rows to f32, bit for bit `gguf.quants.dequantize` (reference,
//!   embedding lookups);
//! * activations are quantized per row ([`act`]): int8 blocks of 32 with an f32 scale for
//!   the 32-weight types, of 256 with an f32 scale and partial sums for the K-types;
//! * [`linear`]: every block's product is an exact integer sum (`vpdpbusd` on AVX-512 VNNI,
//!   `vpmaddubsw` on AVX2, plain integer arithmetic on the portable path), then a fixed
//!   sequence of f32 operations per block in k order ([`portable`]'s docs): a row's outputs
//!   depend on nothing but the row (not on `m`, the thread count, nor the [`Backend`]: all
//!   three agree bit for bit).
//!   Threads split panels (output columns), never k; decode rows (up to 8) go through the
//!   weights together, which are read once; longer calls go panel by panel, each panel's
//!   weights staying in cache while the rows pass. On AVX-512 VNNI, calls of [`MANY_ROWS`]
//!   rows or more unpack each panel's weights once per chunk of blocks into a small scratch
//!   that every row then reads (`vnni_rows`); the panel kernels unpack them once per group of
//!   up to [`MAX_ROWS`] rows.
//!
//! * [`quantize`]: float weight rows to K-type GGUF rows (quantize-on-load; [`quantize`]'s
//!   module docs).
//!
//! [`TYPES`] is the table of the types' sizes and functions (as ggml's type traits).

/// `$go!($($args)*, K)` with `K` the type number (a const block) of `$qt`, one of the
/// 32-weight types (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL, MXFP4; any other as IQ4_NL): how a
/// backend's dispatch picks the `blocks32::<.., K>` kernel of a type.
#[cfg(target_arch = "x86_64")]
macro_rules! by_type32 {
    ($qt:expr, $go:ident!($($args:tt)*)) => {
        match $qt {
            QType::Q8_0 => $go!($($args)*, { QType::Q8_0 as u8 }),
            QType::Q4_0 => $go!($($args)*, { QType::Q4_0 as u8 }),
            QType::Q4_1 => $go!($($args)*, { QType::Q4_1 as u8 }),
            QType::Q5_0 => $go!($($args)*, { QType::Q5_0 as u8 }),
            QType::Q5_1 => $go!($($args)*, { QType::Q5_1 as u8 }),
            QType::MXFP4 => $go!($($args)*, { QType::MXFP4 as u8 }),
            _ => $go!($($args)*, { QType::IQ4_NL as u8 }),
        }
    };
}

pub mod act;
#[cfg(target_arch = "x86_64")]
mod amx_rows;
#[cfg(target_arch = "x86_64")]
mod avx2;
mod blocks;
mod packing;
mod portable;
mod quantize;
#[cfg(target_arch = "x86_64")]
mod vnni;
#[cfg(target_arch = "x86_64")]
mod vnni_rows;

#[cfg(test)]
mod quantize_tests;
#[cfg(test)]
mod tests;

use std::ops::Range;

pub use act::{Acts, A256, A32};
pub use packing::PANEL;
pub use quantize::{quantize, quantizes, RowError};

use crate::error::KernelError;
use crate::linear::LinearArgs;

/// A GGUF quantization type.
#[allow(non_camel_case_types)] // ggml's names
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum QType {
    Q8_0,
    Q4_0,
    Q4_1,
    Q4_K,
    Q5_K,
    Q6_K,
    Q5_0,
    Q5_1,
    IQ4_NL,
    Q3_K,
    Q2_K,
    IQ4_XS,
    MXFP4,
}

/// The activation blocks a type's products take.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ActFormat {
    /// [`A32`], weights coded `w + offset` (the start of a block's integer sum is
    /// `-offset * sum(q)`)
    A32 { offset: i32 },
    /// [`A256`]
    A256,
}

/// Activation rows of a product, `rows * (k / block)` blocks.
#[derive(Clone, Copy, Debug)]
pub enum ActRows<'a> {
    A32(&'a [A32]),
    A256(&'a [A256]),
}

/// One type's sizes and functions (an entry of [`TYPES`]).
pub struct TypeTraits {
    pub qtype: QType,
    /// lower-case name, as `gguf`'s `GGMLQuantizationType` member lower-cased ("q4_k")
    pub name: &'static str,
    /// the `ggml_type` number in a GGUF file
    pub ggml_type: u32,
    /// weights a block
    pub block: usize,
    /// bytes a block in a GGUF file
    pub block_bytes: usize,
    /// bytes a block of a packed panel of [`PANEL`] rows
    pub panel_block_bytes: usize,
    /// the activation blocks it takes
    pub act: ActFormat,
    /// `(blocks, out)`: one GGUF row of `out.len() / block` blocks to f32
    pub dequantize_row: fn(&[u8], &mut [f32]),
    /// `(x, out)`: one row of `x` quantized into its activation blocks
    pub quantize_row: fn(&[f32], ActRowMut<'_>),
    /// `(x, blocks)`: one row of float weights to GGUF blocks ([`quantize`]); None for the
    /// types left to `gguf.quants`' quantizers (Q8_0, Q4_0, Q4_1) and those only read from
    /// GGUF files (Q3_K, Q2_K, IQ4_XS)
    pub quantize_weight_row: Option<WeightRowFn>,
    /// `(blocks, acts)`: one GGUF row times one activation row (as [`linear`] computes it)
    pub vec_dot: fn(&[u8], ActRows<'_>) -> f32,
    /// the portable panel product (see [`Backend`])
    pub(crate) panel_portable: PanelFn,
}

/// `(x, blocks)`: one row of float weights to GGUF blocks.
pub type WeightRowFn = fn(&[f32], &mut [u8]) -> Result<(), RowError>;

/// One activation row to write.
pub enum ActRowMut<'a> {
    A32(&'a mut [A32]),
    A256(&'a mut [A256]),
}

/// `(panel, next, blocks, acts, out)`: a panel's sums for `out.len()` activation rows,
/// fetching the bytes `next` into the cache on the way, spread evenly over the panel's
/// work (empty: none; [`linear`] passes the next [`fetch_panels`] panels).
pub(crate) type PanelFn = fn(&[u8], &[u8], usize, ActRows<'_>, &mut [[f32; PANEL]]);

const fn qtype(i: u8) -> QType {
    QType::ALL[i as usize]
}

fn dequantize_row<const T: u8>(b: &[u8], out: &mut [f32]) {
    let qt = qtype(T);
    for (src, dst) in b
        .chunks_exact(qt.block_bytes())
        .zip(out.chunks_exact_mut(qt.block()))
    {
        blocks::dequantize_block(qt, &blocks::decode(qt, src), dst);
    }
}

fn quantize_row<const T: u8>(x: &[f32], out: ActRowMut<'_>) {
    match (qtype(T).traits().act, out) {
        (ActFormat::A32 { offset }, ActRowMut::A32(o)) => act::quantize_a32(x, offset, o),
        (ActFormat::A256, ActRowMut::A256(o)) => act::quantize_a256(x, o),
        _ => panic!("{}: wrong activation format", qtype(T).name()),
    }
}

fn vec_dot<const T: u8>(b: &[u8], acts: ActRows<'_>) -> f32 {
    let qt = qtype(T);
    let blks = b
        .chunks_exact(qt.block_bytes())
        .map(|s| blocks::decode(qt, s));
    match acts {
        ActRows::A32(a) => {
            assert_eq!(a.len() * qt.block_bytes(), b.len(), "one row");
            blks.zip(a)
                .fold(0.0, |acc, (blk, a)| portable::dot_a32(qt, &blk, a, acc))
        }
        ActRows::A256(a) => {
            assert_eq!(a.len() * qt.block_bytes(), b.len(), "one row");
            blks.zip(a)
                .fold(0.0, |acc, (blk, a)| portable::dot_a256(qt, &blk, a, acc))
        }
    }
}

fn panel_portable<const T: u8>(
    p: &[u8],
    _next: &[u8],
    nb: usize,
    acts: ActRows<'_>,
    out: &mut [[f32; PANEL]],
) {
    portable::panel(qtype(T), p, nb, acts, out)
}

use quantize::quantize_row as k_row;

macro_rules! traits {
    ($t:ident, $name:literal, $ggml:literal, $block:literal, $bytes:literal, $panel:literal,
     $act:expr, $quantize:expr) => {
        TypeTraits {
            qtype: QType::$t,
            name: $name,
            ggml_type: $ggml,
            block: $block,
            block_bytes: $bytes,
            panel_block_bytes: $panel,
            act: $act,
            dequantize_row: dequantize_row::<{ QType::$t as u8 }>,
            quantize_row: quantize_row::<{ QType::$t as u8 }>,
            quantize_weight_row: $quantize,
            vec_dot: vec_dot::<{ QType::$t as u8 }>,
            panel_portable: panel_portable::<{ QType::$t as u8 }>,
        }
    };
}

/// The types' table, in [`QType`] order (`panel_block_bytes`: the streams of the packed
/// layout summed, checked against it in the tests).
pub static TYPES: [TypeTraits; 13] = [
    traits!(
        Q8_0,
        "q8_0",
        8,
        32,
        34,
        544,
        ActFormat::A32 { offset: 128 },
        None
    ),
    traits!(
        Q4_0,
        "q4_0",
        2,
        32,
        18,
        288,
        ActFormat::A32 { offset: 8 },
        None
    ),
    traits!(
        Q4_1,
        "q4_1",
        3,
        32,
        20,
        320,
        ActFormat::A32 { offset: 0 },
        None
    ),
    traits!(
        Q4_K,
        "q4_k",
        12,
        256,
        144,
        2368,
        ActFormat::A256,
        Some(k_row::<{ QType::Q4_K as u8 }>)
    ),
    traits!(
        Q5_K,
        "q5_k",
        13,
        256,
        176,
        2880,
        ActFormat::A256,
        Some(k_row::<{ QType::Q5_K as u8 }>)
    ),
    traits!(
        Q6_K,
        "q6_k",
        14,
        256,
        210,
        3360,
        ActFormat::A256,
        Some(k_row::<{ QType::Q6_K as u8 }>)
    ),
    traits!(
        Q5_0,
        "q5_0",
        6,
        32,
        22,
        352,
        ActFormat::A32 { offset: 16 },
        None
    ),
    traits!(
        Q5_1,
        "q5_1",
        7,
        32,
        24,
        384,
        ActFormat::A32 { offset: 0 },
        None
    ),
    traits!(
        IQ4_NL,
        "iq4_nl",
        20,
        32,
        18,
        288,
        ActFormat::A32 { offset: 128 },
        None
    ),
    traits!(Q3_K, "q3_k", 11, 256, 110, 1824, ActFormat::A256, None),
    traits!(Q2_K, "q2_k", 10, 256, 84, 1344, ActFormat::A256, None),
    traits!(IQ4_XS, "iq4_xs", 23, 256, 136, 2208, ActFormat::A256, None),
    traits!(
        MXFP4,
        "mxfp4",
        39,
        32,
        17,
        288,
        ActFormat::A32 { offset: 128 },
        None
    ),
];

impl QType {
    pub const ALL: [QType; 13] = [
        QType::Q8_0,
        QType::Q4_0,
        QType::Q4_1,
        QType::Q4_K,
        QType::Q5_K,
        QType::Q6_K,
        QType::Q5_0,
        QType::Q5_1,
        QType::IQ4_NL,
        QType::Q3_K,
        QType::Q2_K,
        QType::IQ4_XS,
        QType::MXFP4,
    ];

    pub fn traits(self) -> &'static TypeTraits {
        &TYPES[self as usize]
    }

    /// The lower-case name ("q8_0", "q4_k", ...).
    pub fn name(self) -> &'static str {
        self.traits().name
    }

    /// Weights a block.
    pub const fn block(self) -> usize {
        match self {
            QType::Q8_0 | QType::Q4_0 | QType::Q4_1 => 32,
            QType::Q5_0 | QType::Q5_1 | QType::IQ4_NL | QType::MXFP4 => 32,
            _ => 256,
        }
    }

    /// Bytes a block in a GGUF file.
    pub fn block_bytes(self) -> usize {
        self.traits().block_bytes
    }

    /// The type named `name` (case-insensitive: "q4_k", "Q4_K").
    pub fn from_name(name: &str) -> Option<QType> {
        QType::ALL
            .into_iter()
            .find(|t| t.name().eq_ignore_ascii_case(name))
    }

    /// The type of GGUF `ggml_type` number `id`.
    pub fn from_ggml(id: u32) -> Option<QType> {
        QType::ALL.into_iter().find(|t| t.traits().ggml_type == id)
    }
}

/// Which code runs a product.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    /// plain Rust, any CPU
    Portable,
    /// AVX-512 F + BW + VNNI (`vpdpbusd` on 512-bit registers)
    Avx512Vnni,
    /// AVX2 + FMA + F16C (`vpmaddubsw` on 256-bit registers)
    Avx2,
    /// [`Backend::Avx512Vnni`], with the Q4_K, Q5_K and Q6_K products of 24 rows or more
    /// on the AMX int8 tiles (`tdpbsud` / `tdpbssd`, 16 rows at a time; a block's integer
    /// sum in one product: the same bits)
    AmxInt8,
}

/// The environment variable that picks the backend of [`Backend::auto`]: `portable`,
/// `avx2`, `avx512vnni` or `amx_int8`.
pub const BACKEND_ENV: &str = "FERROBATCH_QUANT_BACKEND";

impl Backend {
    pub const ALL: [Backend; 4] = [
        Backend::Portable,
        Backend::Avx512Vnni,
        Backend::Avx2,
        Backend::AmxInt8,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Backend::Portable => "portable",
            Backend::Avx512Vnni => "avx512vnni",
            Backend::Avx2 => "avx2",
            Backend::AmxInt8 => "amx_int8",
        }
    }

    pub fn from_name(name: &str) -> Option<Backend> {
        Backend::ALL
            .into_iter()
            .find(|b| b.name().eq_ignore_ascii_case(name))
    }

    /// Whether this CPU runs it.
    pub fn available(self) -> bool {
        match self {
            Backend::Portable => true,
            #[cfg(target_arch = "x86_64")]
            Backend::Avx512Vnni => vnni::available(),
            #[cfg(target_arch = "x86_64")]
            Backend::Avx2 => avx2::available(),
            #[cfg(target_arch = "x86_64")]
            Backend::AmxInt8 => vnni::available() && crate::isa::amx_int8_usable(),
            #[cfg(not(target_arch = "x86_64"))]
            Backend::Avx512Vnni | Backend::Avx2 | Backend::AmxInt8 => false,
        }
    }

    /// The fastest backend this CPU runs, or the one [`BACKEND_ENV`] names (if available).
    pub fn auto() -> Backend {
        if let Some(b) = std::env::var(BACKEND_ENV)
            .ok()
            .and_then(|v| Backend::from_name(v.trim()))
        {
            if b.available() {
                return b;
            }
        }
        [Backend::AmxInt8, Backend::Avx512Vnni, Backend::Avx2]
            .into_iter()
            .find(|b| b.available())
            .unwrap_or(Backend::Portable)
    }
}

fn err(field: &'static str, message: String) -> KernelError {
    KernelError::Invalid {
        field,
        message: format!("{field}: {message}"),
    }
}

/// `k` as a whole number of `qt` blocks.
fn blocks_of(qt: QType, k: usize) -> Result<usize, KernelError> {
    if k.is_multiple_of(qt.block()) {
        Ok(k / qt.block())
    } else {
        Err(err(
            "k",
            format!(
                "must be a multiple of {} for {}, not {k}",
                qt.block(),
                qt.name()
            ),
        ))
    }
}

/// Checks that `got` bytes are the GGUF rows of an [n, k] weight of `qt`.
fn check_rows(
    field: &'static str,
    qt: QType,
    got: usize,
    n: usize,
    k: usize,
) -> Result<(), KernelError> {
    let nb = blocks_of(qt, k)?;
    let want = n * nb * qt.block_bytes();
    if got != want {
        return Err(err(
            field,
            format!(
                "expected {}*k/{} bytes per row for {} (n = {n}, k = {k}: {want} bytes), got {got}",
                qt.block_bytes(),
                qt.block(),
                qt.name()
            ),
        ));
    }
    Ok(())
}

/// Bytes of the packed form of an [n, k] weight of `qt` (`n` padded to whole panels).
pub fn packed_len(qt: QType, n: usize, k: usize) -> Result<usize, KernelError> {
    Ok(n.div_ceil(PANEL) * blocks_of(qt, k)? * qt.traits().panel_block_bytes)
}

/// `out` [n, k] = the GGUF rows `rows` of `qt` ([n, k / block] blocks) in f32.
pub fn dequantize(
    qt: QType,
    rows: &[u8],
    n: usize,
    k: usize,
    out: &mut [f32],
) -> Result<(), KernelError> {
    check_rows("blocks", qt, rows.len(), n, k)?;
    if out.len() != n * k {
        return Err(err(
            "out",
            format!("has {} elements, not n * k = {}", out.len(), n * k),
        ));
    }
    if k > 0 {
        (qt.traits().dequantize_row)(rows, out);
    }
    Ok(())
}

/// `ranges` of `items` split into at most `threads` near-equal consecutive pieces.
fn split(items: usize, threads: usize) -> Vec<Range<usize>> {
    let parts = threads.clamp(1, items.max(1));
    (0..parts)
        .map(|t| items * t / parts..items * (t + 1) / parts)
        .filter(|r| !r.is_empty())
        .collect()
}

/// Packs the GGUF rows `rows` ([n, k / block] blocks of `qt`) into `out` ([`packed_len`]
/// bytes), panels split over at most `threads` threads.
pub fn pack(
    qt: QType,
    rows: &[u8],
    n: usize,
    k: usize,
    out: &mut [u8],
    threads: usize,
) -> Result<(), KernelError> {
    check_rows("blocks", qt, rows.len(), n, k)?;
    let want = packed_len(qt, n, k)?;
    if out.len() != want {
        return Err(err(
            "out",
            format!("has {} bytes, not packed_len = {want}", out.len()),
        ));
    }
    if want == 0 {
        return Ok(());
    }
    if qt == QType::MXFP4 {
        blocks::check_mxfp4_scales(rows)?;
    }
    let panel_bytes = want / n.div_ceil(PANEL);
    let mut pieces = Vec::new();
    let mut rest = out;
    for r in split(n.div_ceil(PANEL), threads) {
        let (piece, tail) = rest.split_at_mut(r.len() * panel_bytes);
        rest = tail;
        pieces.push((r, piece));
    }
    crate::parallel::run_pieces(pieces, |panels, piece| {
        packing::pack_panels(qt, rows, n, k, panels, piece)
    });
    Ok(())
}

/// `x` [m, k] quantized per row into the activation blocks `qt`'s products take.
pub fn quantize_acts(qt: QType, x: &[f32], m: usize, k: usize) -> Result<Acts, KernelError> {
    let nb = blocks_of(qt, k)?;
    if x.len() != m * k {
        return Err(err(
            "x",
            format!("has {} elements, not m * k = {}", x.len(), m * k),
        ));
    }
    let t = qt.traits();
    Ok(match t.act {
        ActFormat::A32 { .. } => {
            let mut a = vec![A32::ZERO; m * nb];
            if nb > 0 {
                for (x, a) in x.chunks_exact(k).zip(a.chunks_exact_mut(nb)) {
                    (t.quantize_row)(x, ActRowMut::A32(a));
                }
            }
            Acts::A32(a)
        }
        ActFormat::A256 => {
            let mut a = vec![A256::ZERO; m * nb];
            if nb > 0 {
                for (x, a) in x.chunks_exact(k).zip(a.chunks_exact_mut(nb)) {
                    (t.quantize_row)(x, ActRowMut::A256(a));
                }
            }
            Acts::A256(a)
        }
    })
}

impl Acts {
    /// Rows `rows` of `nb` blocks each.
    pub fn rows(&self, rows: Range<usize>, nb: usize) -> ActRows<'_> {
        match self {
            Acts::A32(a) => ActRows::A32(&a[rows.start * nb..rows.end * nb]),
            Acts::A256(a) => ActRows::A256(&a[rows.start * nb..rows.end * nb]),
        }
    }
}

/// Rows a kernel call takes at most (the activations of 8 rows share each weight load).
pub const MAX_ROWS: usize = 8;

/// Panels a panel kernel fetches ahead while it runs: the next two (three for Q8_0), at
/// two (three) times the pace of its own loads, so each line of the weights is asked for
/// more than once, the first time about two (three) panels before its loads. Measured on
/// AMD Zen 4, one core, weights on huge pages past the L3, one row, against one panel
/// ahead: Q4_K 8960 x 1536 and 1536 x 8960 ~21 -> ~25 GB/s, Q6_K 151936 x 1536 22 -> 29,
/// Q4_0 8960 x 1536 22 -> 27.6; 2 rows 23 -> 25, level at 4 to 32. Three panels were slower
/// than two for Q4_K and Q4_0, faster for Q8_0 (which streams the most bytes a product:
/// 22.5 -> 25.0 and 21.3 -> 23.1 GB/s against two). One request a line at a longer
/// distance was no faster than one panel ahead (docs/benchmarks.md).
///
/// The AVX2 kernels fetch one panel ahead: on AMD Zen 3 (one core, past the L3, one to
/// eight rows) two and three panels were 10-20% slower than one for Q4_K, Q6_K and Q8_0.
fn fetch_panels(qt: QType, backend: Backend) -> usize {
    match (backend, qt) {
        (Backend::Avx2, _) => 1,
        (_, QType::Q8_0) => 3,
        _ => 2,
    }
}

/// The panels fetched while panel `p` of a thread's `range` runs: the next `panels`, not
/// past the range's end.
fn fetch_ahead(p: usize, range: &Range<usize>, panels: usize) -> Range<usize> {
    (p + 1).min(range.end)..(p + 1 + panels).min(range.end)
}

/// Activation bytes of a chunk of rows: a chunk's rows stay in the L2 cache while every
/// panel of a thread passes them.
const CHUNK_BYTES: usize = 1 << 20;

/// `out[i, j] = sum_l x[i, l] * W[j, l]` in f32 (through the activations' quantization),
/// `x` [m, k], `packed` the [`pack`]ed `W` [n, k] of `qt`, `out` [m, n] (`args`' shapes);
/// panels split over at most `args.threads` threads of the kernel pool. Fails naming the
/// field at fault on a length mismatch or a `k` that is not whole blocks, and naming
/// `backend` when this CPU does not run `backend`.
pub fn linear(
    qt: QType,
    args: &LinearArgs,
    x: &[f32],
    packed: &[u8],
    out: &mut [f32],
    backend: Backend,
) -> Result<(), KernelError> {
    let LinearArgs { m, n, k, threads } = *args;
    let nb = blocks_of(qt, k)?;
    let want = packed_len(qt, n, k)?;
    if packed.len() != want {
        return Err(err(
            "weight",
            format!(
                "packed {} weight [n = {n}, k = {k}] has {want} bytes, got {}",
                qt.name(),
                packed.len()
            ),
        ));
    }
    if x.len() != m * k {
        return Err(err(
            "x",
            format!("has {} elements, not m * k = {}", x.len(), m * k),
        ));
    }
    if out.len() != m * n {
        return Err(err(
            "out",
            format!("has {} elements, not m * n = {}", out.len(), m * n),
        ));
    }
    if !backend.available() {
        return Err(err(
            "backend",
            format!("{} is not available on this CPU", backend.name()),
        ));
    }
    if m == 0 || n == 0 {
        return Ok(());
    }
    if nb == 0 {
        out.fill(0.0);
        return Ok(());
    }
    let acts = quantize_acts(qt, x, m, k)?;
    let run = kernel(qt, backend);
    let panels = n.div_ceil(PANEL);
    let panel_bytes = nb * qt.traits().panel_block_bytes;
    let act_row_bytes = nb
        * match acts {
            Acts::A32(_) => std::mem::size_of::<A32>(),
            Acts::A256(_) => std::mem::size_of::<A256>(),
        };
    let chunk = (CHUNK_BYTES / act_row_bytes).max(MAX_ROWS) / MAX_ROWS * MAX_ROWS;
    #[cfg(target_arch = "x86_64")]
    if many_rows(m, backend) {
        let a = acts.rows(0..m, nb);
        let amx = backend == Backend::AmxInt8;
        vnni_rows::linear(qt, packed, nb, n, a, m, chunk, out, threads, amx);
        return Ok(());
    }
    // sums by panel: [panel][row][16], each thread's panels one slice
    let mut sums = vec![[0f32; PANEL]; panels * m];
    let mut pieces = Vec::new();
    let mut rest = &mut sums[..];
    for r in split(panels, threads) {
        let (piece, tail) = rest.split_at_mut(r.len() * m);
        rest = tail;
        pieces.push((r, piece));
    }
    crate::parallel::run_pieces(pieces, |range, piece| {
        for row0 in (0..m).step_by(chunk) {
            let rows = (m - row0).min(chunk);
            // groups of near-equal size, at most MAX_ROWS
            let per = rows.div_ceil(rows.div_ceil(MAX_ROWS));
            for (p, sums) in range.clone().zip(piece.chunks_exact_mut(m)) {
                let w = &packed[p * panel_bytes..(p + 1) * panel_bytes];
                // the first group of rows fetches the thread's next panels on the way (a
                // decode call streams its weights from memory once: without this, the
                // loads stall on memory and the work between them does not overlap)
                let ahead = fetch_ahead(p, &range, fetch_panels(qt, backend));
                let next = &packed[ahead.start * panel_bytes..ahead.end * panel_bytes];
                for g in (row0..row0 + rows).step_by(per) {
                    let end = (g + per).min(row0 + rows);
                    let next = if g == row0 { next } else { &[] };
                    run(w, next, nb, acts.rows(g..end, nb), &mut sums[g..end]);
                }
            }
        }
    });
    for (p, sums) in sums.chunks_exact(m).enumerate() {
        let cols = (n - p * PANEL).min(PANEL);
        for (i, s) in sums.iter().enumerate() {
            let o = &mut out[i * n + p * PANEL..][..cols];
            match <&mut [f32; PANEL]>::try_from(&mut *o) {
                // (a whole panel: a copy of known size, no call of memcpy)
                Ok(o) => *o = *s,
                Err(_) => o.copy_from_slice(&s[..cols]),
            }
        }
    }
    Ok(())
}

/// The fewest rows [`linear`] runs through the many-rows kernels (each panel's weights
/// unpacked once for all the rows) on [`Backend::Avx512Vnni`] and [`Backend::AmxInt8`];
/// fewer go through the panel kernels, up to [`MAX_ROWS`] rows a pass over the weights.
pub const MANY_ROWS: usize = 9;

/// [`MANY_ROWS`] on a CPU that splits 512-bit operations in two ([`crate::isa::splits_512`],
/// AMD Zen 4). There the scratch lines the many-rows kernels store and load cost twice an
/// operation, and the panel kernels are faster up to about this many rows (2 threads, the
/// 1.5B model's Q4_K and Q6_K shapes: 1.06-1.38x at 16-64 rows, 0.98-1.19x at 96-128, the
/// many-rows kernels ahead only on wide matrices from ~256 rows; docs/benchmarks.md).
pub const MANY_ROWS_SPLIT_512: usize = 128;

/// The environment variable that overrides the fewest rows of the many-rows kernels (a
/// number of rows, at least [`MAX_ROWS`] + 1; 0 or anything unparsable: the CPU's default)
/// for A/B measurements.
pub const MANY_ROWS_ENV: &str = "FERROBATCH_QUANT_MANY_ROWS";

/// The fewest rows of the many-rows kernels on this CPU: [`MANY_ROWS_ENV`] where set, else
/// [`MANY_ROWS_SPLIT_512`] where [`crate::isa::splits_512`], else [`MANY_ROWS`]. The two
/// routes give the same bits; only the time differs.
pub fn many_rows_least() -> usize {
    #[cfg(test)]
    if let Some(least) = tests::least_many() {
        return least;
    }
    std::env::var(MANY_ROWS_ENV)
        .ok()
        .and_then(|v| v.trim().parse::<usize>().ok())
        .filter(|&v| v > 0)
        .unwrap_or(if crate::isa::splits_512() {
            MANY_ROWS_SPLIT_512
        } else {
            MANY_ROWS
        })
}

/// Whether a call of `m` rows on `backend` runs the many-rows kernels.
fn many_rows(m: usize, backend: Backend) -> bool {
    matches!(backend, Backend::Avx512Vnni | Backend::AmxInt8)
        && m > MAX_ROWS
        && m >= many_rows_least()
}

/// The panel product of `qt` on `backend` (available).
fn kernel(qt: QType, backend: Backend) -> PanelFn {
    match backend {
        Backend::Portable => qt.traits().panel_portable,
        #[cfg(target_arch = "x86_64")]
        Backend::Avx512Vnni | Backend::AmxInt8 => vnni::panel_fn(qt),
        #[cfg(target_arch = "x86_64")]
        Backend::Avx2 => avx2::panel_fn(qt),
        #[cfg(not(target_arch = "x86_64"))]
        Backend::Avx512Vnni | Backend::Avx2 | Backend::AmxInt8 => {
            unreachable!("never available off x86-64")
        }
    }
}
