//! Exact integer products of i16 rows with an i16 weight packed once, on AVX-512 VNNI:
//! `out[i, j] = sum_l x[i, l] * W[j, l]` in i32 (`vpdpwssd`: two i16 products added to an
//! i32 lane per instruction, twice the f32 rate of multiply-adds per register), for the
//! greedy head's int16 screen. Every sum is exact as long as it fits an i32: the caller
//! keeps `k * max |x| * max |W| < 2^31` (partial sums are bounded by the same), else a sum
//! wraps.
//!
//! Layout and passes are [`crate::linear::panels`]' (as [`crate::f32_linear`]'s), with a
//! pair of inputs in place of one f32: the weight [n, k] (`k` even) is packed ([`pack`])
//! into column blocks of 16, block `nb` holding, for each input pair `(2l, 2l + 1)`, the 16
//! columns' two weights side by side (32 i16, one zmm register), in panels of up to 4
//! blocks; a pass keeps 6 rows x 4 blocks of i32 accumulators in registers, each row's pair
//! broadcast into 4 `vpdpwssd`.

use crate::error::KernelError;
use crate::isa::{self, Isa};
use crate::linear::panels::{
    pack_columns, run_panels, PanelKernel, Prefetch, BLOCK_N, PASS_BLOCKS,
};
use crate::linear::{self, Layout, Lengths, LinearArgs, Product, Spelling};

/// Elements of the packed form of an `[n, k]` weight (`n` padded to whole blocks; the same
/// count as [`crate::f32_linear::packed_len`]).
pub use crate::linear::panels::packed_len;

/// How this product names itself in its errors.
const PRODUCT: Product = Product {
    name: "i16_linear",
    cpu_lacks: "no AVX-512 VNNI",
    spelling: Spelling::Counts,
};

/// What the kernel needs of the CPU: AVX-512F, BW and VNNI.
pub(crate) const NEEDS: &[Isa] = &[Isa::Avx512F, Isa::Avx512Bw, Isa::Avx512Vnni];

/// Whether the CPU runs the kernel ([`NEEDS`]; else [`linear`] fails with `"i16_linear"`).
pub fn available() -> bool {
    isa::all_detected(NEEDS)
}

/// The panel layout of i16 weights, a pair of inputs per step (`k` even); its k loop
/// (`kernel`).
pub(crate) struct I16Pairs;

impl Layout for I16Pairs {
    type Elem = i16;

    fn packed_len(n: usize, k: usize) -> usize {
        packed_len(n, k)
    }

    fn check_k(k: usize) -> Result<(), KernelError> {
        if !k.is_multiple_of(2) {
            return KernelError::invalid(
                "k",
                format!("k must be even (inputs go in pairs: pad with a zero column), not {k}"),
            );
        }
        Ok(())
    }

    fn pack_into(weight: &[i16], n: usize, k: usize, out: &mut [i16]) {
        pack_columns(weight, n, k, 2, out);
    }
}

impl PanelKernel for I16Pairs {
    type X = i16;
    type Sum = i32;

    fn dot<const R: usize, const NB: usize>(
        a: &[i16],
        k: usize,
        w: &[i16],
        _: Option<&[i32]>,
        pf: Option<Prefetch<'_, i16>>,
        sums: &mut [[i32; PASS_BLOCKS * BLOCK_N]],
    ) {
        kernel::run::<R, NB>(a, k, w, pf, sums)
    }
}

/// Packs `weight` [n, k] (`k` even) into `out` ([`packed_len`] elements; layout in the
/// module docs).
pub fn pack(weight: &[i16], n: usize, k: usize, out: &mut [i16]) -> Result<(), KernelError> {
    linear::pack::<I16Pairs>(weight, n, k, out)
}

/// `out[i, j] = sum_l x[i, l] * W[j, l]` in i32, `x` [m, k], `packed` the [`pack`]ed `W`
/// [n, k], `out` [m, n] (`args`' shapes; `k` even); panels of 64 columns split over at most
/// `args.threads` threads of the kernel pool. Fails with the field at fault on a length
/// mismatch or an odd `k`, and with `"i16_linear"` where [`available`] is false.
pub fn linear(
    args: &LinearArgs,
    x: &[i16],
    packed: &[i16],
    out: &mut [i32],
) -> Result<(), KernelError> {
    let lens = Lengths {
        x: x.len(),
        packed: packed.len(),
        out: out.len(),
        bias: None,
    };
    if !PRODUCT.begin::<I16Pairs>(args, lens, available)? {
        return Ok(());
    }
    if args.k == 0 {
        out.fill(0);
        return Ok(());
    }
    run_panels::<I16Pairs>(args, x, packed, None, out);
    Ok(())
}

#[cfg(target_arch = "x86_64")]
mod kernel {
    use super::{Prefetch, BLOCK_N, PASS_BLOCKS};
    use crate::asm::dpwssd;
    use std::arch::x86_64::*;

    /// See [`PanelKernel::dot`](crate::linear::panels::PanelKernel::dot); `R` rows, `NB`
    /// column blocks, `k` even.
    pub(super) fn run<const R: usize, const NB: usize>(
        a: &[i16],
        k: usize,
        w: &[i16],
        pf: Option<Prefetch<'_, i16>>,
        sums: &mut [[i32; PASS_BLOCKS * BLOCK_N]],
    ) {
        assert!(k.is_multiple_of(2) && NB <= PASS_BLOCKS && a.len() == R * k);
        assert!(w.len() == NB * k * BLOCK_N && sums.len() == R);
        assert!(pf.is_none_or(|p| p.block < p.blocks && p.w.len() == p.blocks * k * BLOCK_N));
        assert!(super::available(), "AVX-512 VNNI is not available");
        // SAFETY: the CPU has AVX-512F, BW and VNNI (asserted just above), the only target
        // features `dot` enables; the lengths `dot` relies on are asserted above too.
        unsafe { dot::<R, NB>(a, k, w, pf, sums) }
    }

    /// The k loop of [`run`] (lengths checked there).
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    fn dot<const R: usize, const NB: usize>(
        a: &[i16],
        k: usize,
        w: &[i16],
        pf: Option<Prefetch<'_, i16>>,
        sums: &mut [[i32; PASS_BLOCKS * BLOCK_N]],
    ) {
        // one pair of a block: 16 columns x 2 inputs
        const PAIR: usize = 2 * BLOCK_N;
        // (`w`'s start, never advanced, when nothing is fetched: the loop keeps one form)
        let (pf_ptr, pf_step) = match pf {
            Some(p) => (p.w[p.block * PAIR..].as_ptr(), p.blocks * PAIR),
            None => (w.as_ptr(), 0),
        };
        let mut acc = [[_mm512_setzero_si512(); NB]; R];
        let (wp, ap) = (w.as_ptr(), a.as_ptr());
        for l in 0..k / 2 {
            // (a prefetch never faults: the address is pair l's line of the fetched column
            // block, inside the next panel, or `w`'s start)
            _mm_prefetch::<_MM_HINT_T1>(pf_ptr.wrapping_add(l * pf_step).cast::<i8>());
            // SAFETY: `(l * NB + j) * 32 + 32 <= NB * k * 16 = w.len()` (2 l < k, j < NB):
            // pair l's weights of column block j, 32 i16, unaligned load.
            let wv: [__m512i; NB] = std::array::from_fn(|j| unsafe {
                _mm512_loadu_si512(wp.add((l * NB + j) * PAIR).cast())
            });
            for (i, acc) in acc.iter_mut().enumerate() {
                // SAFETY: `i * k + 2 l + 2 <= R * k = a.len()`: inputs 2l and 2l + 1 of
                // row i, read as one unaligned 32-bit value.
                let pair = unsafe { ap.add(i * k + 2 * l).cast::<i32>().read_unaligned() };
                let x = _mm512_set1_epi32(pair);
                for (acc, wv) in acc.iter_mut().zip(&wv) {
                    *acc = dpwssd(*acc, x, *wv);
                }
            }
        }
        for (s, acc) in sums.iter_mut().zip(&acc) {
            for (j, v) in acc.iter().enumerate() {
                // SAFETY: each row of `sums` has 64 i32 and j < NB <= 4: 16 stored at 16 j.
                unsafe { _mm512_storeu_si512(s.as_mut_ptr().add(BLOCK_N * j).cast(), *v) };
            }
        }
    }
}

#[cfg(not(target_arch = "x86_64"))]
mod kernel {
    use super::{Prefetch, BLOCK_N, PASS_BLOCKS};

    pub(super) fn run<const R: usize, const NB: usize>(
        _: &[i16],
        _: usize,
        _: &[i16],
        _: Option<Prefetch<'_, i16>>,
        _: &mut [[i32; PASS_BLOCKS * BLOCK_N]],
    ) {
        unreachable!("AVX-512 VNNI is never available off x86-64")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::isa::require_or_skip;
    use proptest::prelude::*;

    /// Deterministic i16 values in `-amp..=amp`.
    fn ints(seed: u64, len: usize, amp: i16) -> Vec<i16> {
        let mut state = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (0..len)
            .map(|_| {
                state = state
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                let span = 2 * i64::from(amp) + 1;
                ((state >> 33) as i64 % span - i64::from(amp)) as i16
            })
            .collect()
    }

    fn run(m: usize, n: usize, k: usize, threads: usize, amp: i16) -> (Vec<i32>, Vec<i64>) {
        let x = ints(1, m * k, amp);
        let w = ints(2, n * k, amp);
        let mut packed = vec![0i16; packed_len(n, k)];
        pack(&w, n, k, &mut packed).unwrap();
        let mut out = vec![i32::MIN; m * n];
        linear(&LinearArgs { m, n, k, threads }, &x, &packed, &mut out).unwrap();
        let want = (0..m * n)
            .map(|ij| {
                let (i, j) = (ij / n, ij % n);
                (0..k)
                    .map(|l| i64::from(x[i * k + l]) * i64::from(w[j * k + l]))
                    .sum()
            })
            .collect();
        (out, want)
    }

    #[test]
    fn sums_are_exact() {
        if !require_or_skip(NEEDS) {
            return;
        }
        // k max^2 < 2^31 in each: 576 * 1929^2 (the greedy head's ranges at SmolLM2's k)
        for (m, n, k, amp) in [
            (1, 16, 2, 7),
            (7, 70, 34, 300),
            (64, 200, 576, 1929),
            (13, 5, 8, 16383),
        ] {
            let (out, want) = run(m, n, k, 2, amp);
            let out: Vec<i64> = out.into_iter().map(i64::from).collect();
            assert_eq!(out, want, "{m}x{n}x{k}");
        }
    }

    #[test]
    fn rows_and_threads_do_not_change_a_row() {
        if !require_or_skip(NEEDS) {
            return;
        }
        let (all, _) = run(20, 300, 38, 3, 1000);
        for threads in [1, 2, 5] {
            assert_eq!(run(20, 300, 38, threads, 1000).0, all);
        }
        assert_eq!(run(1, 300, 38, 1, 1000).0[..], all[..300]);
    }

    #[test]
    fn bad_arguments_name_the_field_and_write_nothing() {
        const ARGS: LinearArgs = LinearArgs {
            m: 2,
            n: 2,
            k: 4,
            threads: 1,
        };
        let mut out = vec![7i32; 4];
        let packed = vec![0i16; packed_len(2, 4)];
        let e = linear(&ARGS, &[0; 7], &packed, &mut out).unwrap_err();
        assert_eq!(e.field(), Some("x"));
        let e = linear(&ARGS, &[0; 8], &packed[1..], &mut out).unwrap_err();
        assert_eq!(e.field(), Some("packed"));
        let e = linear(&ARGS, &[0; 8], &packed, &mut out[..3]).unwrap_err();
        assert_eq!(e.field(), Some("out"));
        assert_eq!(e.to_string(), "out has 3 elements, not 4");
        let odd = LinearArgs { k: 3, ..ARGS };
        let e = linear(&odd, &[0; 6], &packed, &mut out).unwrap_err();
        assert_eq!(e.field(), Some("k"));
        assert_eq!(
            e.to_string(),
            "k must be even (inputs go in pairs: pad with a zero column), not 3"
        );
        assert_eq!(out, vec![7i32; 4]);
        let e = pack(&[0; 7], 2, 4, &mut vec![0i16; packed_len(2, 4)]).unwrap_err();
        assert_eq!(e.field(), Some("weight"));
        let e = pack(&[0; 6], 2, 3, &mut [0i16; 6 * 16]).unwrap_err();
        assert_eq!(e.field(), Some("k"));
    }

    #[test]
    fn any_shape_is_exact() {
        if !require_or_skip(NEEDS) {
            return;
        }
        proptest!(ProptestConfig::with_cases(48), |(m in 1usize..20, n in 1usize..90,
                                                    half_k in 0usize..40,
                                                    threads in 1usize..4)| {
            let (out, want) = run(m, n, 2 * half_k, threads, 2000);
            let out: Vec<i64> = out.into_iter().map(i64::from).collect();
            prop_assert_eq!(out, want);
        });
    }
}
