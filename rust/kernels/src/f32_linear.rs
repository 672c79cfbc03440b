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

use crate::error::KernelError;
use crate::isa::{self, Isa};
use crate::linear::panels::{
    pack_columns, run_panels, PanelKernel, Prefetch, BLOCK_N, PASS_BLOCKS,
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

/// The panel layout of f32 weights, one input per step; its k loop (`kernel`).
pub(crate) struct F32Panels;

impl Layout for F32Panels {
    type Elem = f32;

    fn packed_len(n: usize, k: usize) -> usize {
        packed_len(n, k)
    }

    fn pack_into(weight: &[f32], n: usize, k: usize, out: &mut [f32]) {
        pack_columns(weight, n, k, 1, out);
    }
}

impl PanelKernel for F32Panels {
    type X = f32;
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

/// Packs `weight` [n, k] into `out` ([`packed_len`] elements; layout in the module docs).
pub fn pack(weight: &[f32], n: usize, k: usize, out: &mut [f32]) -> Result<(), KernelError> {
    linear::pack::<F32Panels>(weight, n, k, out)
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
    let LinearArgs { n, k, .. } = *args;
    let lens = Lengths {
        x: x.len(),
        packed: packed.len(),
        out: out.len(),
        bias: bias.map(<[f32]>::len),
    };
    if !PRODUCT.begin::<F32Panels>(args, lens, available)? {
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
    run_panels::<F32Panels>(args, x, packed, bias.as_deref(), out);
    Ok(())
}

#[cfg(target_arch = "x86_64")]
mod kernel {
    use super::{Prefetch, BLOCK_N, PASS_BLOCKS};
    use std::arch::x86_64::*;

    /// See [`PanelKernel::dot`](crate::linear::panels::PanelKernel::dot); `R` rows, `NB`
    /// column blocks.
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
