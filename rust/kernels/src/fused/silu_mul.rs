//! `act(gate) * up` from the fused gate/up projection: SiLU (Llama-style MLPs) or the
//! tanh approximation of GELU (Gemma's).

use super::{
    check_len, dispatch, len, len_mut, plan_threads, product, row_ranges, run_pieces, split_mut,
    store_row, widen,
};
use crate::error::KernelError;
use crate::{Elems, ElemsMut};

/// The gate's activation of a gated MLP.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Gate {
    /// `g / (1 + exp(-g))`
    #[default]
    Silu,
    /// GELU's tanh approximation, `0.5 g (1 + tanh(u))` with `u = sqrt(2 / pi) (g + 0.044715
    /// g^3)`, computed as `g / (1 + exp(-2u))` (the same value: `0.5 (1 + tanh(u))` is the
    /// logistic function of `2u`)
    GeluTanh,
}

impl Gate {
    /// The gate named as transformers' `hidden_act` names it ("silu", "gelu_pytorch_tanh").
    pub fn from_name(name: &str) -> Option<Gate> {
        match name {
            "silu" => Some(Gate::Silu),
            "gelu_pytorch_tanh" => Some(Gate::GeluTanh),
            _ => None,
        }
    }
}

/// `out[t, i] = round(silu(g) * u)`, `g = gate_up[t, i]`, `u = gate_up[t, inter + i]`,
/// `silu(g) = g / (1 + exp(-g))` in f32, `exp` Cephes' single-precision polynomial
/// ([`exp`]: within 2 ulp of the exact value). `gate_up` is `[rows, 2 * inter]`, `out`
/// `[rows, inter]`. Rows are split over `threads` threads when the call has at least
/// the pool's [`crate::parallel::Pool::min_split`] output elements.
pub fn silu_mul(
    gate_up: Elems<'_>,
    out: ElemsMut<'_>,
    rows: usize,
    inter: usize,
    threads: usize,
) -> Result<(), KernelError> {
    gated_mul(gate_up, out, rows, inter, Gate::Silu, threads)
}

/// [`silu_mul`] with the activation `gate` ([`Gate::GeluTanh`]: `gelu_tanh(g) * u`, the
/// same exp).
pub fn gated_mul(
    gate_up: Elems<'_>,
    out: ElemsMut<'_>,
    rows: usize,
    inter: usize,
    gate: Gate,
    threads: usize,
) -> Result<(), KernelError> {
    let n = product("out", rows, inter)?;
    check_len("gate_up", len(&gate_up), product("gate_up", n, 2)?)?;
    check_len("out", len_mut(&out), n)?;
    if n == 0 {
        return Ok(());
    }
    let ranges = row_ranges(rows, plan_threads(threads, rows, n));
    let sizes: Vec<usize> = ranges.iter().map(|r| r.len() * inter).collect();
    let pieces = ranges.into_iter().zip(split_mut(out, &sizes)).collect();
    run_pieces(pieces, |range, mut out| match gate {
        Gate::Silu => silu_rows(&gate_up, range.start, range.len(), inter, &mut out),
        Gate::GeluTanh => gelu_rows(&gate_up, range.start, range.len(), inter, &mut out),
    });
    Ok(())
}

dispatch!(silu_rows => silu_rows_impl(gate_up: &Elems<'_>, first: usize, rows: usize,
                                      inter: usize, out: &mut ElemsMut<'_>));
dispatch!(gelu_rows => gelu_rows_impl(gate_up: &Elems<'_>, first: usize, rows: usize,
                                      inter: usize, out: &mut ElemsMut<'_>));

#[inline(always)]
fn silu_rows_impl(
    gate_up: &Elems<'_>,
    first: usize,
    rows: usize,
    inter: usize,
    out: &mut ElemsMut<'_>,
) {
    gated_rows(gate_up, first, rows, inter, out, silu)
}

#[inline(always)]
fn gelu_rows_impl(
    gate_up: &Elems<'_>,
    first: usize,
    rows: usize,
    inter: usize,
    out: &mut ElemsMut<'_>,
) {
    gated_rows(gate_up, first, rows, inter, out, gelu_tanh)
}

#[inline(always)]
fn gated_rows(
    gate_up: &Elems<'_>,
    first: usize,
    rows: usize,
    inter: usize,
    out: &mut ElemsMut<'_>,
    act: impl Fn(f32) -> f32 + Copy,
) {
    let (mut gbuf, mut ubuf, mut scratch) =
        (vec![0f32; inter], vec![0f32; inter], vec![0f32; inter]);
    for i in 0..rows {
        let at = (first + i) * 2 * inter;
        let g = widen(gate_up, at, &mut gbuf);
        let u = widen(gate_up, at + inter, &mut ubuf);
        store_row!(out, i * inter, &mut scratch, |o, round| {
            for ((o, &g), &u) in o.iter_mut().zip(g).zip(u) {
                *o = round(act(g) * u);
            }
        });
    }
}

/// `g / (1 + exp(-2u))`, `u = sqrt(2 / pi) * (g + 0.044715 * g^3)`: GELU's tanh
/// approximation (see [`Gate::GeluTanh`]).
#[inline(always)]
pub(crate) fn gelu_tanh(g: f32) -> f32 {
    const TWO_SQRT_2_OVER_PI: f32 = 1.595_769_2; // 2 * sqrt(2 / pi), rounded to f32
    let u2 = TWO_SQRT_2_OVER_PI * (g + 0.044_715 * (g * g * g));
    g / (1.0 + exp(-u2))
}

/// `g / (1 + exp(-g))`.
#[inline(always)]
pub(crate) fn silu(g: f32) -> f32 {
    g / (1.0 + exp(-g))
}

/// `e^x` in f32, Cephes' `expf` (range reduction by `ln 2` in two parts, degree-6
/// polynomial), the reduction and the polynomial as fused multiply-adds (a third fewer
/// instructions: silu_mul [64, 2 x 1536] f32 42 -> 29 us): within 2 ulp over the normal
/// range; `+inf` above `ln(f32::MAX)`; below
/// -86.5 it returns `e^-86.5` (about 2.7e-38) instead of smaller values or 0 (in `silu`,
/// `1 + e` is 1 long before); NaN stays NaN.
/// Branch-free, so the loops calling it vectorize.
#[inline(always)]
pub(crate) fn exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const C1: f32 = 0.693_359_4; // ln 2 in two parts: C1 exact in 9 bits
    const C2: f32 = -2.121_944_4e-4;
    const ROUND: f32 = 12_582_912.0; // 1.5 * 2^23: adding it rounds to an integer
    const MAX: f32 = 88.722_84; // ln(f32::MAX), rounded up
    let v = x.clamp(-86.5, MAX);
    let shifted = v * LOG2E + ROUND;
    // the integer n = round(v * log2(e)) sits in the low mantissa bits of `shifted`
    let n = (shifted.to_bits() as i32).wrapping_sub(ROUND.to_bits() as i32);
    let fx = shifted - ROUND;
    let r = (-fx).mul_add(C2, (-fx).mul_add(C1, v));
    let mut y = 1.987_569_1e-4_f32;
    y = y.mul_add(r, 1.398_2e-3);
    y = y.mul_add(r, 8.333_452e-3);
    y = y.mul_add(r, 4.166_579_6e-2);
    y = y.mul_add(r, 1.666_666_5e-1);
    y = y.mul_add(r, 0.5);
    y = (y * r).mul_add(r, r) + 1.0;
    // 2^n as 2^(n-1) * 2: n is in -125 ..= 128 (it reaches 128 just below MAX)
    let pow2 = f32::from_bits((n.wrapping_add(126) as u32) << 23);
    let e = y * pow2 * 2.0;
    if x > MAX {
        f32::INFINITY
    } else if x.is_nan() {
        x
    } else {
        e
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::{round_bits, values, Buf, Ty, TYPES};
    use super::*;
    use proptest::prelude::*;

    fn ulps(a: f32, b: f64) -> f64 {
        let b32 = b as f32;
        let ulp = (f32::from_bits(b32.abs().to_bits() + 1) - b32.abs()) as f64;
        (a as f64 - b).abs() / ulp
    }

    #[test]
    fn exp_is_within_2_ulp() {
        let mut worst = 0f64;
        for i in -86_500..88_700 {
            let x = i as f32 * 1e-3 + 3.1e-4;
            let u = ulps(exp(x), (x as f64).exp());
            worst = worst.max(u);
        }
        assert!(worst <= 2.0, "worst {worst} ulp");
        assert_eq!(exp(89.0), f32::INFINITY);
        assert_eq!(exp(f32::INFINITY), f32::INFINITY);
        assert!(exp(88.72).is_finite());
        assert!(exp(f32::NAN).is_nan());
        assert!(exp(-1e30) < 3e-38 && exp(f32::NEG_INFINITY) >= 0.0);
    }

    #[test]
    fn silu_edges_match_torch() {
        assert_eq!(silu(0.0), 0.0);
        assert_eq!(silu(f32::INFINITY), f32::INFINITY);
        assert!(silu(f32::NEG_INFINITY).is_nan()); // -inf / (1 + inf), as torch
        assert_eq!(silu(-100.0), -0.0);
        assert_eq!(silu(100.0), 100.0);
        assert!(silu(f32::NAN).is_nan());
    }

    /// Plain scalar reference: `f64` exp rounded to f32 stands in for a correctly rounded
    /// one, then the same f32 operations.
    fn reference(gu: &[f32], inter: usize) -> Vec<f32> {
        let mut out = Vec::new();
        for row in gu.chunks(2 * inter) {
            for i in 0..inter {
                let g = row[i];
                let e = (-(g as f64)).exp() as f32;
                out.push(g / (1.0 + e) * row[inter + i]);
            }
        }
        out
    }

    fn check(seed: u64, rows: usize, inter: usize, it: Ty, ot: Ty, threads: usize) {
        let gu = Buf::new(it, &values(seed, rows * 2 * inter, 8.0));
        let mut out = Buf::zeros(ot, rows * inter);
        silu_mul(gu.elems(), out.elems_mut(), rows, inter, threads).unwrap();
        let want = reference(&gu.f32s(), inter);
        let got = out.f32s();
        let want_r = Buf::new(ot, &want).f32s();
        let tol = match ot {
            Ty::F32 => 4e-7,
            Ty::Bf16 => 1.0 / 128.0,
            Ty::F16 => 1.0 / 1024.0,
        };
        for (k, (g, w)) in got.iter().zip(&want_r).enumerate() {
            assert!(
                (g - w).abs() <= tol * w.abs().max(1e-30) || g == w,
                "{it:?}->{ot:?} elem {k}: {g} vs {w}"
            );
        }
        // the f32 result rounds to the output exactly as the half crate does
        let mut f = Buf::zeros(Ty::F32, rows * inter);
        silu_mul(gu.elems(), f.elems_mut(), rows, inter, 1).unwrap();
        assert_eq!(out.bits(), round_bits(ot, &f.f32s()));
    }

    #[test]
    fn all_type_combinations_match_the_reference() {
        for &it in &TYPES {
            for &ot in &TYPES {
                for (rows, inter) in [(1, 1), (3, 17), (2, 1536), (4, 33)] {
                    check(7, rows, inter, it, ot, 1);
                }
            }
        }
    }

    #[test]
    fn threads_do_not_change_the_result() {
        for threads in [1, 2, 3] {
            check(3, 700, 1537, Ty::Bf16, Ty::Bf16, threads);
            check(4, 683, 1537, Ty::F32, Ty::F16, threads);
        }
    }

    /// The baseline build of the loop (what a CPU without AVX2 runs) gives the same bits.
    #[test]
    fn portable_path_matches_the_dispatched_one() {
        let (rows, inter) = (4, 301);
        for &it in &TYPES {
            for &ot in &TYPES {
                let gu = Buf::new(it, &values(5, rows * 2 * inter, 10.0));
                let (mut a, mut b) = (Buf::zeros(ot, rows * inter), Buf::zeros(ot, rows * inter));
                silu_rows(&gu.elems(), 0, rows, inter, &mut a.elems_mut());
                silu_rows_impl(&gu.elems(), 0, rows, inter, &mut b.elems_mut());
                assert_eq!(a.bits(), b.bits());
            }
        }
    }

    #[test]
    fn bad_arguments_are_errors() {
        let gu = vec![0u16; 12];
        let mut out = vec![0u16; 6];
        let e = silu_mul(Elems::Bf16(&gu[1..]), ElemsMut::Bf16(&mut out), 2, 3, 1).unwrap_err();
        assert_eq!(e.field().unwrap(), "gate_up");
        let e = silu_mul(Elems::Bf16(&gu), ElemsMut::Bf16(&mut out[1..]), 2, 3, 1).unwrap_err();
        assert_eq!(e.field().unwrap(), "out");
        let e = silu_mul(Elems::Bf16(&gu), ElemsMut::Bf16(&mut out), usize::MAX, 3, 1);
        assert_eq!(e.unwrap_err().field().unwrap(), "out");
    }

    /// `gelu_tanh(g) * u` in f64 by the tanh formula transformers' `GELUTanh` writes.
    fn gelu_reference(gu: &[f32], inter: usize) -> Vec<f64> {
        let c = (2.0 / std::f64::consts::PI).sqrt();
        let mut out = Vec::new();
        for row in gu.chunks(2 * inter) {
            for i in 0..inter {
                let g = row[i] as f64;
                let t = (c * (g + 0.044715 * g * g * g)).tanh();
                out.push(0.5 * g * (1.0 + t) * row[inter + i] as f64);
            }
        }
        out
    }

    #[test]
    fn gelu_tanh_matches_the_tanh_formula() {
        for &it in &TYPES {
            for (rows, inter, threads) in [(1, 1, 1), (3, 17, 1), (2, 1536, 2), (700, 97, 3)] {
                let gu = Buf::new(it, &values(11, rows * 2 * inter, 12.0));
                let mut out = Buf::zeros(Ty::F32, rows * inter);
                let g = Gate::GeluTanh;
                gated_mul(gu.elems(), out.elems_mut(), rows, inter, g, threads).unwrap();
                let (x, want) = (gu.f32s(), gelu_reference(&gu.f32s(), inter));
                for (k, (&got, w)) in out.f32s().iter().zip(want).enumerate() {
                    let (r, i) = (k / inter, k % inter);
                    let scale = (x[r * 2 * inter + i] * x[r * 2 * inter + inter + i]).abs();
                    let err = (got as f64 - w).abs();
                    assert!(err <= 1e-6 * scale as f64 + 1e-30, "elem {k}: {got} vs {w}");
                }
            }
        }
        assert_eq!(gelu_tanh(0.0), 0.0);
        assert_eq!(gelu_tanh(f32::INFINITY), f32::INFINITY);
        assert_eq!(gelu_tanh(100.0), 100.0);
        assert_eq!(gelu_tanh(-100.0), -0.0);
        assert!(gelu_tanh(f32::NAN).is_nan());
        assert_eq!(Gate::from_name("gelu_pytorch_tanh"), Some(Gate::GeluTanh));
        assert_eq!(Gate::from_name("silu"), Some(Gate::Silu));
        assert_eq!(Gate::from_name("relu"), None);
    }

    #[test]
    fn gelu_portable_path_matches_the_dispatched_one() {
        let (rows, inter) = (4, 301);
        for &it in &TYPES {
            for &ot in &TYPES {
                let gu = Buf::new(it, &values(6, rows * 2 * inter, 10.0));
                let (mut a, mut b) = (Buf::zeros(ot, rows * inter), Buf::zeros(ot, rows * inter));
                gelu_rows(&gu.elems(), 0, rows, inter, &mut a.elems_mut());
                gelu_rows_impl(&gu.elems(), 0, rows, inter, &mut b.elems_mut());
                assert_eq!(a.bits(), b.bits());
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(96))]
        #[test]
        fn random_shapes_match_the_reference(seed in 0u64..10_000, rows in 1usize..9,
                                             inter in 1usize..300, it in 0u8..3, ot in 0u8..3,
                                             threads in 1usize..4) {
            check(seed, rows, inter, TYPES[it as usize], TYPES[ot as usize], threads);
        }
    }
}
