//! f32 matrix products on AVX-512F over weights packed once: `out = x @ W.T (+ bias)`, every
//! output a plain f32 sum of f32 products in input order, the same whatever the number of
//! rows or threads (a row's result never depends on its batch; columns, not the k loop, are
//! split between threads).
//!
//! The weight `W` [n, k] (row-major, as `nn.Linear` keeps it) is packed ([`pack`]) in the
//! panel layout of [`crate::linear::panels`], one input per step: column blocks of 16,
//! block `nb` holding, for each input `l`, the 16 weights `W[16 nb + j, l]` (one zmm
//! register), zero beyond `n`, in panels of up to 4 blocks. A pass (the panels' driver)
//! takes up to 4 column blocks and up to 6 rows of `x` at a time, keeping their 6 x 4
//! accumulators in registers through the k loop (here): per input, 4 weight rows are loaded
//! and each row's input is broadcast into 4 fused multiply-adds. The rows' inputs stay in
//! L1 and a pass's weights (k x 256 bytes) in L2 while the rows go past in groups.
//!
//! Half-precision weights (bf16 or fp16 bits, `u16`) pack in the same layout at half the
//! bytes ([`pack_half`]; bf16 blocks interleaved by pairs, [`pair_blocks`]) and
//! [`linear_half`] widens each loaded block to f32 in registers (bf16: shifted left 16 bits
//! or masked to the high half; fp16: `vcvtph2ps`), both exact, then runs
//! the same fused multiply-adds in the same order: its outputs are bit for bit those of
//! [`linear`] over the weights widened to f32, at any rows or threads.

use crate::error::{Expected, KernelError};
use crate::isa::{self, Isa};
use crate::linear::panels::{
    pack_columns, run_panels, unpack_columns, PanelKernel, Prefetch, BLOCK_N, PASS_BLOCKS,
};
use crate::linear::{self, Layout, Lengths, LinearArgs, Product, Spelling};

/// Elements of the packed form of an `[n, k]` weight (`n` padded to whole blocks).
pub use crate::linear::panels::packed_len;

/// How this product names itself in its errors.
const PRODUCT: Product = Product {
    name: "f32_linear",
    cpu_lacks: "no AVX-512F",
    spelling: Spelling::Counts,
};

/// What the kernel needs of the CPU.
pub(crate) const NEEDS: &[Isa] = &[Isa::Avx512F];

/// Whether the CPU runs the AVX-512F kernel (else [`linear`] fails with `"f32_linear"`).
pub fn available() -> bool {
    isa::all_detected(NEEDS)
}

/// A half-precision weight format: how the stored `u16` bits widen to f32.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Half {
    /// bfloat16: the high 16 bits of an f32
    Bf16,
    /// IEEE binary16 (fp16)
    F16,
}

/// How a panel layout's stored element becomes the f32 its k loop multiplies.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Form {
    F32,
    Bf16,
    F16,
}

/// A panel layout of weights stored as `Elem`, one input per step, widened to f32 in the k
/// loop (`kernel`) as `FORM` says.
pub(crate) trait Widened {
    type Elem: Copy + Default + Sync;
    const FORM: Form;
}

/// f32 weights.
pub(crate) struct F32Panels;
/// bf16 weights (bits as `u16`).
pub(crate) struct Bf16Panels;
/// fp16 weights (bits as `u16`).
pub(crate) struct F16Panels;

impl Widened for F32Panels {
    type Elem = f32;
    const FORM: Form = Form::F32;
}
impl Widened for Bf16Panels {
    type Elem = u16;
    const FORM: Form = Form::Bf16;
}
impl Widened for F16Panels {
    type Elem = u16;
    const FORM: Form = Form::F16;
}

macro_rules! panels {
    ($($layout:ty),*) => {$(
        impl Layout for $layout {
            type Elem = <$layout as Widened>::Elem;

            fn packed_len(n: usize, k: usize) -> usize {
                packed_len(n, k)
            }

            fn pack_into(weight: &[Self::Elem], n: usize, k: usize, out: &mut [Self::Elem]) {
                pack_columns(weight, n, k, 1, out);
                if <$layout as Widened>::FORM == Form::Bf16 {
                    pair_blocks(n, k, out);
                }
            }
        }

        impl PanelKernel for $layout {
            type X = f32;
            type Sum = f32;

            fn dot<const R: usize, const NB: usize>(
                a: &[f32],
                k: usize,
                w: &[Self::Elem],
                bias: Option<&[f32]>,
                pf: Option<Prefetch<'_, Self::Elem>>,
                sums: &mut [[f32; PASS_BLOCKS * BLOCK_N]],
            ) {
                kernel::run::<$layout, R, NB>(a, k, w, bias, pf, sums)
            }
        }
    )*};
}
panels!(F32Panels, Bf16Panels, F16Panels);

/// Packs `weight` [n, k] into `out` ([`packed_len`] elements; layout in the module docs).
pub fn pack(weight: &[f32], n: usize, k: usize, out: &mut [f32]) -> Result<(), KernelError> {
    linear::pack::<F32Panels>(weight, n, k, out)
}

/// Packs a half-precision `weight` [n, k] (`half`'s bits) into `out` ([`packed_len`]
/// elements), the layout of [`pack`] at half the bytes (bf16: see [`pair_blocks`]).
pub fn pack_half(
    half: Half,
    weight: &[u16],
    n: usize,
    k: usize,
    out: &mut [u16],
) -> Result<(), KernelError> {
    match half {
        Half::Bf16 => linear::pack::<Bf16Panels>(weight, n, k, out),
        Half::F16 => linear::pack::<F16Panels>(weight, n, k, out),
    }
}

/// Packs an f32 `weight` [n, k] whose every value is a bf16 one (its low 16 bits zero, as
/// in a bf16 checkpoint read in f32) as [`pack_half`] packs that bf16 weight: the same
/// products at half the bytes. `Ok(false)`, with `out` untouched, where a value is not.
pub fn pack_bf16_exact(
    weight: &[f32],
    n: usize,
    k: usize,
    out: &mut [u16],
) -> Result<bool, KernelError> {
    if weight.iter().any(|w| w.to_bits() & 0xFFFF != 0) {
        return Ok(false);
    }
    let high: Vec<u16> = weight.iter().map(|w| (w.to_bits() >> 16) as u16).collect();
    pack_half(Half::Bf16, &high, n, k, out).map(|()| true)
}

/// The half-precision weight [n, k] (row-major bits) that [`pack_half`] packed into
/// `packed`, written into `weight`: the inverse of [`pack_half`], bit for bit (the padding
/// columns dropped). Fails naming `packed` or `weight` on a length mismatch.
pub fn unpack_half(
    half: Half,
    packed: &[u16],
    n: usize,
    k: usize,
    weight: &mut [u16],
) -> Result<(), KernelError> {
    KernelError::check_len("packed", packed.len(), packed_len(n, k), Expected::NotN)?;
    KernelError::check_len("weight", weight.len(), n * k, Expected::NotFormula("n * k"))?;
    if half == Half::Bf16 {
        let mut columns = packed.to_vec();
        unpair_blocks(n, k, &mut columns);
        unpack_columns(&columns, n, k, weight);
    } else {
        unpack_columns(packed, n, k, weight);
    }
    Ok(())
}

/// Interleaves the bf16 panels `packed` (of an [n, k] weight) by pairs of column blocks: per
/// input, blocks `2p` and `2p + 1` of a panel become one zmm register of 32-bit lanes, the
/// first block's weight in each lane's low half and the second's in its high half (a
/// panel's last block without a partner stays as it was). One load then widens to both
/// blocks with one instruction each (a shift left by 16, a mask of the high half) instead
/// of two (zero-extension, shift) per block: the widening shares the FMA ports.
fn pair_blocks<T: Copy + Default>(n: usize, k: usize, packed: &mut [T]) {
    for_each_pair(n, k, packed, |pair, both| {
        for (c, lane) in both.chunks_exact_mut(2).enumerate() {
            lane.copy_from_slice(&[pair[c], pair[BLOCK_N + c]]);
        }
    });
}

/// Runs `rearrange(pair, into)` over each pair of column blocks of the bf16 panels
/// `packed` (per input, 2 x 16 elements; a panel's last block without a partner is left
/// alone), then writes `into` over the pair.
fn for_each_pair<T: Copy + Default>(
    n: usize,
    k: usize,
    packed: &mut [T],
    rearrange: impl Fn(&[T], &mut [T; 2 * BLOCK_N]),
) {
    let blocks = n.div_ceil(BLOCK_N);
    for nb in (0..blocks).step_by(PASS_BLOCKS) {
        let width = (blocks - nb).min(PASS_BLOCKS) * BLOCK_N;
        let panel = &mut packed[nb * BLOCK_N * k..(nb * BLOCK_N + width) * k];
        for row in panel.chunks_exact_mut(width) {
            for pair in row.chunks_exact_mut(2 * BLOCK_N) {
                let mut into = [T::default(); 2 * BLOCK_N];
                rearrange(pair, &mut into);
                pair.copy_from_slice(&into);
            }
        }
    }
}

/// The inverse of [`pair_blocks`]: each pair of column blocks back to one block after the
/// other.
fn unpair_blocks<T: Copy + Default>(n: usize, k: usize, packed: &mut [T]) {
    for_each_pair(n, k, packed, |pair, apart| {
        for (c, lane) in pair.chunks_exact(2).enumerate() {
            (apart[c], apart[BLOCK_N + c]) = (lane[0], lane[1]);
        }
    });
}

/// `out[i, j] = sum_l x[i, l] * W[j, l] (+ bias[j])` in f32, `x` [m, k], `packed` the
/// [`pack`]ed `W` [n, k], `out` [m, n] (`args`' shapes); panels of 64 columns split over at
/// most `args.threads` threads of the kernel pool. Fails with the field at fault on a length
/// mismatch, and with `"f32_linear"` where [`available`] is false.
pub fn linear(
    args: &LinearArgs,
    x: &[f32],
    packed: &[f32],
    bias: Option<&[f32]>,
    out: &mut [f32],
) -> Result<(), KernelError> {
    product::<F32Panels>(args, x, packed, bias, out)
}

/// [`linear`] over a [`pack_half`]ed weight of `half`'s format: bit for bit [`linear`]
/// over the same weight widened to f32 (same checks and errors).
pub fn linear_half(
    half: Half,
    args: &LinearArgs,
    x: &[f32],
    packed: &[u16],
    bias: Option<&[f32]>,
    out: &mut [f32],
) -> Result<(), KernelError> {
    match half {
        Half::Bf16 => product::<Bf16Panels>(args, x, packed, bias, out),
        Half::F16 => product::<F16Panels>(args, x, packed, bias, out),
    }
}

/// [`linear`] over weights packed in the layout `L`.
fn product<L: Widened + PanelKernel<X = f32, Sum = f32, Elem = <L as Widened>::Elem>>(
    args: &LinearArgs,
    x: &[f32],
    packed: &[<L as Widened>::Elem],
    bias: Option<&[f32]>,
    out: &mut [f32],
) -> Result<(), KernelError> {
    let LinearArgs { n, k, .. } = *args;
    let lens = Lengths {
        x: x.len(),
        packed: packed.len(),
        out: out.len(),
        bias: bias.map(<[f32]>::len),
    };
    if !PRODUCT.begin::<L>(args, lens, available)? {
        return Ok(());
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
    run_panels::<L>(args, x, packed, bias.as_deref(), out);
    Ok(())
}

#[cfg(target_arch = "x86_64")]
mod kernel {
    use super::{Form, Prefetch, Widened, BLOCK_N, PASS_BLOCKS};
    use std::arch::x86_64::*;

    /// See [`PanelKernel::dot`](crate::linear::panels::PanelKernel::dot); weights stored as
    /// `L` says, `R` rows, `NB` column blocks.
    pub(super) fn run<L: Widened, const R: usize, const NB: usize>(
        a: &[f32],
        k: usize,
        w: &[L::Elem],
        bias: Option<&[f32]>,
        pf: Option<Prefetch<'_, L::Elem>>,
        sums: &mut [[f32; PASS_BLOCKS * BLOCK_N]],
    ) {
        assert!(NB <= PASS_BLOCKS && a.len() == R * k && w.len() == NB * k * BLOCK_N);
        assert!(sums.len() == R && bias.is_none_or(|b| b.len() == NB * BLOCK_N));
        assert!(pf.is_none_or(|p| p.block < p.blocks && p.w.len() == p.blocks * k * BLOCK_N));
        // (the element's size is the one its form loads: 4 bytes for f32, 2 for half)
        let size = if L::FORM == Form::F32 { 4 } else { 2 };
        assert_eq!(std::mem::size_of::<L::Elem>(), size);
        assert!(super::available(), "AVX-512F is not available");
        // SAFETY: the CPU has AVX-512F (asserted just above), the only target feature `dot`
        // enables; the lengths and the element size `dot` relies on are asserted above too.
        unsafe { dot::<L, R, NB>(a, k, w, bias, pf, sums) }
    }

    /// Column block `j` of input `l`'s weights in the panel at `w` (`NB` blocks; elements
    /// of `form`), as 16 f32.
    ///
    /// # Safety
    /// `w` points at a panel of at least `(l + 1) * NB * 16` elements of `form`'s size (4
    /// bytes for [`Form::F32`], 2 for the half forms), `j < NB`.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn block<const NB: usize>(form: Form, w: *const u8, l: usize, j: usize) -> __m512 {
        let at = (l * NB + j) * BLOCK_N; // the block's first element
                                         // SAFETY: the caller's contract: `at + 16 <= (l + 1) * NB * 16` elements; a pair's
                                         // 32 elements start 16 before `at` for an odd `j` and end within block `j | 1 < NB`.
                                         // Every load is unaligned.
        unsafe {
            match form {
                Form::F32 => _mm512_loadu_ps(w.cast::<f32>().add(at)),
                // (vcvtph2ps is exact: every fp16 value, subnormals included, is an f32)
                Form::F16 => _mm512_cvtph_ps(_mm256_loadu_si256(w.cast::<u16>().add(at).cast())),
                // a pair (`pair_blocks`): the even block's bits in each lane's low half,
                // shifted up, or the odd one's in its high half, kept: the same numbers in f32
                Form::Bf16 if j | 1 < NB => {
                    let pair =
                        _mm512_loadu_si512(w.cast::<u16>().add(at - (j & 1) * BLOCK_N).cast());
                    _mm512_castsi512_ps(if j & 1 == 0 {
                        _mm512_slli_epi32::<16>(pair)
                    } else {
                        _mm512_and_si512(pair, _mm512_set1_epi32(-65536))
                    })
                }
                Form::Bf16 => {
                    let h = _mm256_loadu_si256(w.cast::<u16>().add(at).cast());
                    _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)))
                }
            }
        }
    }

    /// The k loop of [`run`] (lengths checked there).
    #[target_feature(enable = "avx512f")]
    fn dot<L: Widened, const R: usize, const NB: usize>(
        a: &[f32],
        k: usize,
        w: &[L::Elem],
        bias: Option<&[f32]>,
        pf: Option<Prefetch<'_, L::Elem>>,
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
            // SAFETY: `(l + 1) * NB * 16 <= NB * k * 16 = w.len()` (l < k) elements of the
            // form's size (asserted in `run`), j < NB; AVX-512F is enabled here.
            let wv: [__m512; NB] =
                std::array::from_fn(|j| unsafe { block::<NB>(L::FORM, wp.cast::<u8>(), l, j) });
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
    use super::{Prefetch, Widened, BLOCK_N, PASS_BLOCKS};

    pub(super) fn run<L: Widened, const R: usize, const NB: usize>(
        _: &[f32],
        _: usize,
        _: &[L::Elem],
        _: Option<&[f32]>,
        _: Option<Prefetch<'_, L::Elem>>,
        _: &mut [[f32; PASS_BLOCKS * BLOCK_N]],
    ) {
        unreachable!("AVX-512F is never available off x86-64")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fused::testing::values;
    use crate::isa::require_or_skip;
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
        if !require_or_skip(NEEDS) {
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
        if !require_or_skip(NEEDS) {
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

    /// An fp16 number's f32 value (never infinite or NaN here).
    fn f16_value(h: u16) -> f32 {
        let sign = if h >> 15 == 1 { -1.0 } else { 1.0 };
        let (e, m) = (i32::from((h >> 10) & 0x1f), f32::from(h & 0x3ff));
        match e {
            0 => sign * m * 2f32.powi(-24),
            _ => sign * (1.0 + m / 1024.0) * 2f32.powi(e - 15),
        }
    }

    /// Half bits of `len` values of `half`'s format (fp16 below 2 in magnitude, subnormals
    /// included; bf16 the values in [-1, 1] truncated) and the same numbers in f32.
    fn half_values(half: Half, seed: u64, len: usize) -> (Vec<u16>, Vec<f32>) {
        let bits: Vec<u16> = values(seed, len, 1.0)
            .iter()
            .map(|v| match half {
                Half::Bf16 => (v.to_bits() >> 16) as u16,
                // (exponent field at most 15: finite, magnitude below 2)
                Half::F16 => (v.to_bits() as u16) & 0xbfff,
            })
            .collect();
        let wide = bits
            .iter()
            .map(|&b| match half {
                Half::Bf16 => f32::from_bits(u32::from(b) << 16),
                Half::F16 => f16_value(b),
            })
            .collect();
        (bits, wide)
    }

    /// `linear_half` over half weights and `linear` over them widened, bits of both.
    fn half_and_wide(half: Half, m: usize, n: usize, k: usize, threads: usize, bias: bool) {
        let x = values(4, m * k, 1.0);
        let (w, wide) = half_values(half, 5, n * k);
        let b = bias.then(|| values(6, n, 1.0));
        let args = LinearArgs { m, n, k, threads };
        let mut packed = vec![0u16; packed_len(n, k)];
        pack_half(half, &w, n, k, &mut packed).unwrap();
        let mut got = vec![f32::NAN; m * n];
        linear_half(half, &args, &x, &packed, b.as_deref(), &mut got).unwrap();
        let mut wide_packed = vec![0f32; packed_len(n, k)];
        pack(&wide, n, k, &mut wide_packed).unwrap();
        let mut want = vec![f32::NAN; m * n];
        let one = LinearArgs { threads: 1, ..args };
        linear(&one, &x, &wide_packed, b.as_deref(), &mut want).unwrap();
        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        assert_eq!(
            bits(&got),
            bits(&want),
            "{half:?} {m}x{n}x{k} t{threads} b{bias}"
        );
    }

    #[test]
    fn half_weights_give_the_bits_of_their_f32_widening() {
        if !require_or_skip(NEEDS) {
            return;
        }
        for half in [Half::Bf16, Half::F16] {
            for (m, n, k, threads) in [(1, 70, 33, 1), (300, 45, 17, 4), (13, 200, 1, 2)] {
                half_and_wide(half, m, n, k, threads, true);
                half_and_wide(half, m, n, k, threads, false);
            }
            half_and_wide(half, 3, 20, 0, 1, true);
        }
    }

    #[test]
    fn any_shape_of_half_weights_matches_its_widening() {
        if !require_or_skip(NEEDS) {
            return;
        }
        proptest!(ProptestConfig::with_cases(32), |(m in 1usize..300, n in 1usize..150,
                                                    k in 0usize..40, threads in 1usize..5,
                                                    bias in any::<bool>(), f16 in any::<bool>())| {
            let half = if f16 { Half::F16 } else { Half::Bf16 };
            half_and_wide(half, m, n, 2 * k + 1, threads, bias);
        });
    }

    #[test]
    fn bf16_valued_f32_weights_pack_as_their_bf16_and_others_do_not() {
        let (n, k) = (37, 21);
        let (bits, wide) = half_values(Half::Bf16, 7, n * k);
        let mut want = vec![0u16; packed_len(n, k)];
        pack_half(Half::Bf16, &bits, n, k, &mut want).unwrap();
        let mut got = vec![1u16; packed_len(n, k)];
        assert!(pack_bf16_exact(&wide, n, k, &mut got).unwrap());
        assert_eq!(got, want);
        let mut off = wide.clone();
        off[n * k - 1] = f32::from_bits(off[n * k - 1].to_bits() | 1);
        let mut untouched = vec![9u16; packed_len(n, k)];
        assert!(!pack_bf16_exact(&off, n, k, &mut untouched).unwrap());
        assert!(untouched.iter().all(|&u| u == 9));
        let e = pack_bf16_exact(&wide[1..], n, k, &mut got).unwrap_err();
        assert_eq!(e.field(), Some("weight"));
    }

    proptest! {
        #[test]
        fn unpacking_half_panels_gives_the_weight_back(n in 1usize..150, k in 1usize..40,
                                                        f16 in any::<bool>(), seed in 0u64..99) {
            let half = if f16 { Half::F16 } else { Half::Bf16 };
            let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
            let bits: Vec<u16> = (0..n * k).map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                (state >> 24) as u16
            }).collect();
            let mut packed = vec![0u16; packed_len(n, k)];
            pack_half(half, &bits, n, k, &mut packed).unwrap();
            let mut back = vec![0u16; n * k];
            unpack_half(half, &packed, n, k, &mut back).unwrap();
            prop_assert_eq!(back, bits);
        }
    }

    #[test]
    fn unpacking_checks_both_lengths() {
        let packed = vec![0u16; packed_len(3, 5)];
        let e = unpack_half(Half::Bf16, &packed[1..], 3, 5, &mut [0u16; 15]).unwrap_err();
        assert_eq!(e.field(), Some("packed"));
        let e = unpack_half(Half::F16, &packed, 3, 5, &mut [0u16; 14]).unwrap_err();
        assert_eq!(e.field(), Some("weight"));
    }

    #[test]
    fn bad_half_lengths_name_the_field() {
        let args = LinearArgs {
            m: 2,
            n: 2,
            k: 3,
            threads: 1,
        };
        let mut out = vec![7f32; 4];
        let packed = vec![0u16; packed_len(2, 3)];
        let e = linear_half(Half::F16, &args, &[0.0; 6], &packed[1..], None, &mut out);
        assert_eq!(e.unwrap_err().to_string(), "packed has 47 elements, not 48");
        let e = pack_half(Half::Bf16, &[0; 5], 2, 3, &mut vec![0u16; packed_len(2, 3)]);
        let e = e.unwrap_err();
        assert_eq!(e.field(), Some("weight"));
        assert_eq!(out, vec![7f32; 4]);
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
        assert_eq!(e.field(), Some("x"));
        assert_eq!(e.to_string(), "x has 5 elements, not 6");
        let e = linear(&ARGS, &[0.0; 6], &packed[1..], None, &mut out).unwrap_err();
        assert_eq!(e.field(), Some("packed"));
        assert_eq!(e.to_string(), "packed has 47 elements, not 48");
        let e = linear(&ARGS, &[0.0; 6], &packed, Some(&[0.0]), &mut out).unwrap_err();
        assert_eq!(e.field(), Some("bias"));
        assert_eq!(e.to_string(), "bias has 1 elements, not n = 2");
        let e = linear(&ARGS, &[0.0; 6], &packed, None, &mut out[..3]).unwrap_err();
        assert_eq!(e.field(), Some("out"));
        assert_eq!(out, vec![7f32; 4]);
        let e = pack(&[0.0; 5], 2, 3, &mut vec![0f32; packed_len(2, 3)]).unwrap_err();
        assert_eq!(e.field(), Some("weight"));
    }

    #[test]
    fn any_shape_matches_the_reference() {
        if !require_or_skip(NEEDS) {
            return;
        }
        proptest!(ProptestConfig::with_cases(48), |(m in 1usize..20, n in 1usize..90,
                                                    k in 0usize..70, threads in 1usize..4,
                                                    bias in any::<bool>())| {
            let (out, want) = run(m, n, k, threads, bias);
            for (o, w) in out.iter().zip(&want) {
                let bound = 2.0 * (k as f64 + 1.0).powi(2) * f64::from(f32::EPSILON);
                prop_assert!((f64::from(*o) - w).abs() <= bound, "{} vs {}", o, w);
            }
        });
    }
}
