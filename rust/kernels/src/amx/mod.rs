//! bf16 matrix products on the AMX tiles with f32 outputs: `out = bf16(x) @ W.T (+ bias)`,
//! the products of bf16 pairs summed in f32 and never rounded to bf16 afterwards (oneDNN's
//! packed linears, as torch calls them, round their outputs to the input dtype).
//!
//! The weight `W` [n, k] (bf16 bits, row-major as `nn.Linear` keeps it) is packed once
//! ([`pack`]) into the B-tile layout of [`crate::linear::pair_blocks`]: blocks of 16 output
//! columns by 32 inputs, each 16 rows (pairs of inputs) of 16 columns x 2 bf16 (1 KiB),
//! block `(nb, kb)` at `(nb * k_blocks + kb) * 512`, zero beyond `n` (padded to an even
//! number of blocks) and `k`. [`linear`] rounds `x` to bf16 (round to nearest even) into a
//! zero-padded scratch of whole passes of 32 rows, splits the pairs of column blocks over
//! the pool's threads and, per pair, runs 32 rows at a time through 2 x 2 accumulator tiles
//! (each input tile and weight block loaded once for two products).
//!
//! On x86-64 CPUs with AMX-TILE and AMX-BF16 whose kernel granted this process the tile
//! data state, the tiles run the products; on those without AMX but with AVX-512 BF16
//! (AMD Zen 4, Intel Cooper Lake), `dpbf16` runs the same sums on zmm registers over the
//! same packed weights ([`backend`]); elsewhere [`available`] is false. The two backends
//! (`amx/tiles.rs`, `amx/dpbf16.rs`) are this module's own: they depend on
//! [`crate::linear`] and on nothing else of the crate.

mod dpbf16;
mod tiles;

use crate::error::KernelError;
use crate::linear::pair_blocks::{PairBlocks, COLS_PER_PASS};
use crate::linear::{self, round_up, Lengths, LinearArgs, OutColumns, Product, Spelling};
use crate::Elems;
use tiles::ROWS_PER_PASS;

/// Elements of the packed form of an `[n, k]` weight (`n` padded to a pair of blocks).
pub use crate::linear::pair_blocks::packed_len;
/// The block of the packed layout: output columns, and bf16 inputs of a row.
pub use crate::linear::pair_blocks::{TILE_K, TILE_N};

/// Rows per chunk of a long call (a multiple of `ROWS_PER_PASS`): 256 rows of bf16 inputs
/// (288 KiB at k = 576) stay in the L2 cache while the weight streams past; each chunk
/// reads the weight once more.
const ROWS_PER_CHUNK: usize = 256;

/// How this product names itself in its errors.
const PRODUCT: Product = Product {
    name: "amx",
    cpu_lacks: "neither AMX bf16 tiles nor AVX-512 BF16",
    spelling: Spelling::Formulas,
};

/// Packs `weight` [n, k] (bf16 bits) into `out` ([`packed_len`] elements; see the module
/// docs for the layout).
pub fn pack(weight: &[u16], n: usize, k: usize, out: &mut [u16]) -> Result<(), KernelError> {
    linear::pack::<PairBlocks>(weight, n, k, out)
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
) -> Result<(), KernelError> {
    let x_len = match x {
        Elems::F32(s) => s.len(),
        Elems::Bf16(s) => s.len(),
        Elems::F16(_) => {
            return KernelError::invalid("x", "x must be float32 or bfloat16, not float16".into())
        }
        Elems::I8 { .. } => {
            return KernelError::invalid("x", "x must be float32 or bfloat16, not int8".into())
        }
    };
    let lens = Lengths {
        x: x_len,
        packed: packed.len(),
        out: out.len(),
        bias: bias.map(<[f32]>::len),
    };
    if !PRODUCT.begin::<PairBlocks>(args, lens, available)? {
        return Ok(());
    }
    linear_on(backend(), args, x, packed, bias, out);
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
        let dst = OutColumns::new(&mut out[row0 * n..(row0 + rows) * n], rows, n);
        let task = |t: usize| {
            let pairs = t * per_task..((t + 1) * per_task).min(pairs);
            match backend {
                Backend::Amx => tiles::run_pairs(a, kp, packed, pairs, bias.as_deref(), &dst),
                Backend::Avx512Bf16 => {
                    dpbf16::run_pairs(a, kp, rows, packed, pairs, bias.as_deref(), &dst)
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
            Elems::F16(_) | Elems::I8 { .. } => unreachable!("checked by linear"),
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

/// Which instructions run [`linear`] here.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    /// AMX tiles: the CPU has AMX-TILE and AMX-BF16, the OS saves the tile state (XCR0
    /// bits 17 and 18), and the kernel granted this process the tile data
    /// (`arch_prctl(ARCH_REQ_XCOMP_PERM)`, asked once).
    Amx,
    /// `vdpbf16ps` on zmm registers (`amx/dpbf16.rs`): AVX-512F and AVX-512 BF16.
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
        if crate::isa::amx_usable() {
            Backend::Amx
        } else if dpbf16::available() {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::isa::{require_or_skip, Isa};
    use crate::linear::pair_blocks::BLOCK;
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
        if dpbf16::available() {
            found.push(Backend::Avx512Bf16);
        }
        found
    }

    /// What `backend` needs of the CPU.
    fn needs(backend: Backend) -> &'static [Isa] {
        match backend {
            Backend::Amx => &[Isa::AmxTile, Isa::AmxBf16],
            Backend::Avx512Bf16 => dpbf16::NEEDS,
            Backend::None => &[],
        }
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
    fn linear_is_the_f32_sum_of_bf16_products_on_amx_tiles() {
        if require_or_skip(needs(Backend::Amx)) {
            products_match_reference(Backend::Amx);
        }
    }

    #[test]
    fn linear_is_the_f32_sum_of_bf16_products_on_avx512_bf16() {
        if require_or_skip(needs(Backend::Avx512Bf16)) {
            products_match_reference(Backend::Avx512Bf16);
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

    /// `check_shape` of 48 random shapes on `backend`, where this machine runs it.
    fn random_shapes(backend: Backend) {
        if !require_or_skip(needs(backend)) {
            return;
        }
        let config = proptest::prelude::ProptestConfig::with_cases(48);
        proptest::proptest!(config, |(m in 1usize..70, n in 1usize..150, k in 1usize..130,
                                      threads in 1usize..4)| {
            check_shape(backend, m, n, k, threads);
        });
    }

    #[test]
    fn random_shapes_match_the_reference_on_amx_tiles() {
        random_shapes(Backend::Amx);
    }

    #[test]
    fn random_shapes_match_the_reference_on_avx512_bf16() {
        random_shapes(Backend::Avx512Bf16);
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
        assert_eq!(e.field(), Some("x"));
        assert_eq!(e.to_string(), "x has 31 elements, not m * k = 32");
        let e = linear(&args, Elems::F32(&[0.0; 32]), &p[1..], None, &mut out).unwrap_err();
        assert_eq!(e.field(), Some("packed"));
        assert_eq!(
            e.to_string(),
            "packed has 1023 elements, not 1024 for n = 16, k = 32"
        );
        let e = linear(&args, Elems::F32(&[0.0; 32]), &p, Some(&[0.0; 3]), &mut out).unwrap_err();
        assert_eq!(e.field(), Some("bias"));
        assert_eq!(e.to_string(), "bias has 3 elements, not n = 16");
        let e = linear(&args, Elems::F32(&[0.0; 32]), &p, None, &mut out[1..]).unwrap_err();
        assert_eq!(e.to_string(), "out has 15 elements, not m * n = 16");
        let e = linear(&args, Elems::F16(&[0; 32]), &p, None, &mut out).unwrap_err();
        assert_eq!(e.field(), Some("x"));
        assert_eq!(e.to_string(), "x must be float32 or bfloat16, not float16");
        let e = pack(&[0; 5], 16, 32, &mut vec![0; 512]).unwrap_err();
        assert_eq!(e.field(), Some("weight"));
        assert_eq!(e.to_string(), "weight has 5 elements, not n * k = 512");
        let e = pack(&[0; 512], 16, 32, &mut vec![0; 511]).unwrap_err();
        assert_eq!(e.to_string(), "out has 511 elements, not 1024");
    }
}
