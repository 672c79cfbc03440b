//! RMSNorm of rows, optionally after adding the residual into them.

use super::{
    check_len, dispatch, len, len_mut, plan_threads, product, row_ranges, run_pieces, split_mut,
    store_row, widen,
};
use crate::error::KernelError;
use crate::{Elems, ElemsMut};

/// The norm's parameters; `x` and `out` are `[rows, hidden]`, row-major.
#[derive(Clone, Copy, Debug)]
pub struct RmsNorm<'a> {
    /// `[hidden]`
    pub weight: Elems<'a>,
    pub rows: usize,
    pub hidden: usize,
    pub eps: f32,
    /// added to every weight (f32 add): 0 for Llama-style norms (the weight is then used as
    /// is), 1 for Gemma's `(1 + w)`
    pub weight_offset: f32,
    /// worker threads (rows are split between them) when the call is large enough
    /// ([`crate::parallel::Pool::min_split`] elements); 1 runs on the caller's thread
    pub threads: usize,
}

/// The rows to normalize.
#[derive(Debug)]
pub enum NormInput<'a> {
    /// `x` itself
    Plain(Elems<'a>),
    /// `x += residual` first (in place, one f32 add each), then the sum
    AddResidual {
        x: &'a mut [f32],
        residual: Elems<'a>,
    },
}

/// `out[t, j] = round((x[t, j] * r_t) * (w[j] + weight_offset))` with
/// `r_t = 1 / sqrt(mean_j(x[t, j]^2) + eps)`, all f32, after `x += residual` when asked.
///
/// The mean is `sum / hidden`, the sum of squares accumulated in 64 lanes (lane `j % 64`,
/// in order, over the first `hidden / 64 * 64` columns), the lanes added as a pairwise
/// tree, then the `hidden % 64` last squares in order. This equals transformers' `LlamaRMSNorm` on an f32 input followed by
/// `.to(out_dtype)`, up to that summation order.
pub fn rms_norm(a: &RmsNorm<'_>, x: NormInput<'_>, out: ElemsMut<'_>) -> Result<(), KernelError> {
    validate(a, &x, &out)?;
    let n = a.rows * a.hidden;
    if n == 0 {
        return Ok(());
    }
    let weight = weights(a);
    let threads = plan_threads(a.threads, a.rows, n);
    let ranges = row_ranges(a.rows, threads);
    let sizes: Vec<usize> = ranges.iter().map(|r| r.len() * a.hidden).collect();
    let outs = split_mut(out, &sizes);
    let ctx = Ctx {
        weight: &weight,
        eps: a.eps,
    };
    match x {
        NormInput::Plain(x) => {
            let pieces = ranges.into_iter().zip(outs).collect();
            run_pieces(pieces, |range, mut out| {
                norm_plain(&ctx, &x, range.start * a.hidden, range.len(), &mut out)
            });
        }
        NormInput::AddResidual { x, residual } => {
            let mut rest = x;
            let mut pieces = Vec::with_capacity(ranges.len());
            for ((range, out), &size) in ranges.into_iter().zip(outs).zip(&sizes) {
                let (head, tail) = std::mem::take(&mut rest).split_at_mut(size);
                rest = tail;
                pieces.push((range, (head, out)));
            }
            run_pieces(pieces, |range, (x, mut out)| {
                norm_residual(&ctx, x, &residual, range.start * a.hidden, &mut out)
            });
        }
    }
    Ok(())
}

fn validate(a: &RmsNorm<'_>, x: &NormInput<'_>, out: &ElemsMut<'_>) -> Result<(), KernelError> {
    let n = product("x", a.rows, a.hidden)?;
    match x {
        NormInput::Plain(x) => check_len("x", len(x), n)?,
        NormInput::AddResidual { x, residual } => {
            check_len("x", x.len(), n)?;
            check_len("residual", len(residual), n)?;
        }
    }
    check_len("weight", len(&a.weight), a.hidden)?;
    check_len("out", len_mut(out), n)?;
    if !(a.eps.is_finite() && a.eps >= 0.0) {
        return KernelError::invalid("eps", format!("eps must be finite and >= 0, not {}", a.eps));
    }
    if !a.weight_offset.is_finite() {
        return KernelError::invalid("weight_offset", "weight_offset must be finite".into());
    }
    Ok(())
}

/// The weights widened, plus the offset when it is not 0.
fn weights(a: &RmsNorm<'_>) -> Vec<f32> {
    let mut w = vec![0f32; a.hidden];
    let widened = widen(&a.weight, 0, &mut w).to_vec();
    if a.weight_offset != 0.0 {
        widened.iter().map(|&v| v + a.weight_offset).collect()
    } else {
        widened
    }
}

struct Ctx<'a> {
    weight: &'a [f32],
    eps: f32,
}

dispatch!(norm_plain => norm_plain_impl(c: &Ctx<'_>, x: &Elems<'_>, start: usize, rows: usize,
                                        out: &mut ElemsMut<'_>));

dispatch!(norm_residual => norm_residual_impl(c: &Ctx<'_>, x: &mut [f32], residual: &Elems<'_>,
                                              start: usize, out: &mut ElemsMut<'_>));

/// Rows of `x` from element `start` on, written to `out` (which starts at that row).
#[inline(always)]
fn norm_plain_impl(c: &Ctx<'_>, x: &Elems<'_>, start: usize, rows: usize, out: &mut ElemsMut<'_>) {
    let h = c.weight.len();
    let (mut xbuf, mut scratch) = (vec![0f32; h], vec![0f32; h]);
    for i in 0..rows {
        let xs = widen(x, start + i * h, &mut xbuf);
        norm_row(c, xs, out, i * h, &mut scratch);
    }
}

/// `x += residual[start ..]` row by row, each row then normalized into `out`.
#[inline(always)]
fn norm_residual_impl(
    c: &Ctx<'_>,
    x: &mut [f32],
    residual: &Elems<'_>,
    start: usize,
    out: &mut ElemsMut<'_>,
) {
    let h = c.weight.len();
    let (mut rbuf, mut scratch) = (vec![0f32; h], vec![0f32; h]);
    for (i, xs) in x.chunks_exact_mut(h).enumerate() {
        let r = widen(residual, start + i * h, &mut rbuf);
        for (v, &d) in xs.iter_mut().zip(r) {
            *v += d;
        }
        norm_row(c, xs, out, i * h, &mut scratch);
    }
}

#[inline(always)]
fn norm_row(c: &Ctx<'_>, xs: &[f32], out: &mut ElemsMut<'_>, at: usize, scratch: &mut [f32]) {
    let var = sum_squares(xs) / xs.len() as f32;
    let r = 1.0 / (var + c.eps).sqrt();
    store_row!(out, at, scratch, |o, round| {
        for ((o, &v), &w) in o.iter_mut().zip(xs).zip(c.weight) {
            *o = round((v * r) * w);
        }
    });
}

/// Lanes of the sum of squares: four 16-float registers, so the adds overlap.
const LANES: usize = 64;

/// `sum x[i]^2`: [`LANES`] lanes (lane `i % LANES` over the first `len / LANES * LANES`
/// squares, in order), a pairwise tree over them, then the tail in order.
#[inline(always)]
pub(crate) fn sum_squares(xs: &[f32]) -> f32 {
    let mut lanes = [0f32; LANES];
    let (chunks, tail) = xs.as_chunks::<LANES>();
    for c in chunks {
        for j in 0..LANES {
            lanes[j] += c[j] * c[j];
        }
    }
    let mut sum = tree(lanes);
    for &v in tail {
        sum += v * v;
    }
    sum
}

/// `lanes[j] += lanes[j + h]` for `h` = 32, 16, .., 1; returns `lanes[0]`. Not inlined:
/// seeing this tree, the compiler would keep the lanes above in pairs, not registers.
#[inline(never)]
fn tree(mut lanes: [f32; LANES]) -> f32 {
    let mut half = LANES / 2;
    while half > 0 {
        for j in 0..half {
            lanes[j] += lanes[j + half];
        }
        half /= 2;
    }
    lanes[0]
}

#[cfg(test)]
mod tests {
    use super::super::testing::{round_bits, values, Buf, Ty, TYPES};
    use super::*;
    use proptest::prelude::*;

    /// Scalar reference: the same summation order (it is part of the contract), the rest
    /// written out plainly.
    fn reference(x: &[f32], w: &[f32], h: usize, eps: f32, off: f32) -> Vec<f32> {
        let mut out = Vec::with_capacity(x.len());
        for row in x.chunks(h) {
            let r = 1.0 / (sum_squares_plain(row) / h as f32 + eps).sqrt();
            for (j, &v) in row.iter().enumerate() {
                let wj = if off != 0.0 { w[j] + off } else { w[j] };
                out.push((v * r) * wj);
            }
        }
        out
    }

    fn sum_squares_plain(xs: &[f32]) -> f32 {
        let body = xs.len() / 64 * 64;
        let mut l = [0f32; 64];
        for (i, &v) in xs[..body].iter().enumerate() {
            l[i % 64] += v * v;
        }
        for half in [32, 16, 8, 4, 2, 1] {
            for j in 0..half {
                l[j] += l[j + half];
            }
        }
        let mut s = l[0];
        for &v in &xs[body..] {
            s += v * v;
        }
        s
    }

    #[allow(clippy::too_many_arguments)]
    fn check(
        seed: u64,
        rows: usize,
        h: usize,
        xt: Ty,
        wt: Ty,
        ot: Ty,
        residual: Option<Ty>,
        off: f32,
        threads: usize,
    ) {
        let x = Buf::new(xt, &values(seed, rows * h, 3.0));
        let w = Buf::new(wt, &values(seed + 1, h, 1.5));
        let r = residual.map(|t| Buf::new(t, &values(seed + 2, rows * h, 2.0)));
        let mut out = Buf::zeros(ot, rows * h);
        let a = RmsNorm {
            weight: w.elems(),
            rows,
            hidden: h,
            eps: 1e-5,
            weight_offset: off,
            threads,
        };
        let mut xs = x.f32s();
        let want_x: Vec<f32> = match &r {
            Some(r) => xs.iter().zip(r.f32s()).map(|(a, b)| a + b).collect(),
            None => xs.clone(),
        };
        let input = match &r {
            Some(r) => NormInput::AddResidual {
                x: &mut xs,
                residual: r.elems(),
            },
            None => NormInput::Plain(x.elems()),
        };
        rms_norm(&a, input, out.elems_mut()).unwrap();
        if r.is_some() {
            assert_eq!(xs, want_x, "x after the residual add");
        }
        let want = reference(&want_x, &w.f32s(), h, 1e-5, off);
        assert_eq!(
            out.bits(),
            round_bits(ot, &want),
            "{xt:?} {wt:?} {ot:?} {residual:?}"
        );
    }

    #[test]
    fn all_type_combinations_match_the_reference() {
        for (k, &xt) in TYPES.iter().enumerate() {
            for &wt in &TYPES {
                for &ot in &TYPES {
                    for (rows, h) in [(1, 1), (3, 17), (2, 64), (5, 576)] {
                        check(k as u64 + 10, rows, h, xt, wt, ot, None, 0.0, 1);
                        check(k as u64 + 20, rows, h, Ty::F32, wt, ot, Some(xt), 1.0, 1);
                    }
                }
            }
        }
    }

    #[test]
    fn threads_do_not_change_the_result() {
        for threads in [1, 2, 3] {
            check(
                5,
                1900,
                577,
                Ty::F32,
                Ty::Bf16,
                Ty::Bf16,
                Some(Ty::Bf16),
                0.0,
                threads,
            );
            check(
                6,
                1100,
                1031,
                Ty::Bf16,
                Ty::F32,
                Ty::F16,
                None,
                1.0,
                threads,
            );
        }
    }

    #[test]
    fn weight_offset_zero_keeps_negative_zero_weights() {
        let x = [1.0f32, -2.0];
        let w = [-0.0f32, 1.0];
        let mut out = [1f32; 2];
        let a = RmsNorm {
            weight: Elems::F32(&w),
            rows: 1,
            hidden: 2,
            eps: 0.0,
            weight_offset: 0.0,
            threads: 1,
        };
        rms_norm(
            &a,
            NormInput::Plain(Elems::F32(&x)),
            ElemsMut::F32(&mut out),
        )
        .unwrap();
        assert_eq!(out[0].to_bits(), (-0.0f32).to_bits());
    }

    #[test]
    fn bad_arguments_are_errors() {
        let x = vec![0f32; 12];
        let w = vec![1f32; 4];
        let mut out = vec![0f32; 12];
        let a = RmsNorm {
            weight: Elems::F32(&w),
            rows: 3,
            hidden: 4,
            eps: 1e-6,
            weight_offset: 0.0,
            threads: 1,
        };
        let field = |a: &RmsNorm<'_>, x: NormInput<'_>, out: &mut [f32]| {
            rms_norm(a, x, ElemsMut::F32(out))
                .unwrap_err()
                .field()
                .unwrap()
        };
        assert_eq!(
            field(&a, NormInput::Plain(Elems::F32(&x[1..])), &mut out),
            "x"
        );
        assert_eq!(
            field(&a, NormInput::Plain(Elems::F32(&x)), &mut out[1..]),
            "out"
        );
        let short = RmsNorm {
            weight: Elems::Bf16(&[0; 3]),
            ..a
        };
        assert_eq!(
            field(&short, NormInput::Plain(Elems::F32(&x)), &mut out),
            "weight"
        );
        let neg = RmsNorm { eps: -1.0, ..a };
        assert_eq!(
            field(&neg, NormInput::Plain(Elems::F32(&x)), &mut out),
            "eps"
        );
        let mut xm = x.clone();
        let res = NormInput::AddResidual {
            x: &mut xm,
            residual: Elems::F32(&x[..11]),
        };
        assert_eq!(field(&a, res, &mut out), "residual");
        let huge = RmsNorm {
            rows: usize::MAX,
            hidden: 2,
            ..a
        };
        assert_eq!(
            field(&huge, NormInput::Plain(Elems::F32(&x)), &mut out),
            "x"
        );
    }

    /// The baseline build of the loops (what a CPU without AVX2 runs) gives the same bits.
    #[test]
    fn portable_path_matches_the_dispatched_one() {
        let (rows, h) = (5, 203);
        let w = values(1, h, 1.0);
        let c = Ctx {
            weight: &w,
            eps: 1e-6,
        };
        for &xt in &TYPES {
            for &ot in &TYPES {
                let x = Buf::new(xt, &values(2, rows * h, 3.0));
                let (mut a, mut b) = (Buf::zeros(ot, rows * h), Buf::zeros(ot, rows * h));
                norm_plain(&c, &x.elems(), 0, rows, &mut a.elems_mut());
                norm_plain_impl(&c, &x.elems(), 0, rows, &mut b.elems_mut());
                assert_eq!(a.bits(), b.bits());
                let r = Buf::new(xt, &values(3, rows * h, 1.0));
                let (mut xa, mut xb) = (values(4, rows * h, 2.0), values(4, rows * h, 2.0));
                norm_residual(&c, &mut xa, &r.elems(), 0, &mut a.elems_mut());
                norm_residual_impl(&c, &mut xb, &r.elems(), 0, &mut b.elems_mut());
                assert_eq!((a.bits(), xa), (b.bits(), xb));
            }
        }
    }

    fn ty(i: u8) -> Ty {
        TYPES[i as usize % 3]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(96))]
        #[test]
        fn random_shapes_match_the_reference(seed in 0u64..10_000, rows in 1usize..9,
                                             h in 1usize..200, xt in 0u8..3, wt in 0u8..3,
                                             ot in 0u8..3, res in 0u8..4, gemma: bool,
                                             threads in 1usize..4) {
            let residual = (res < 3).then(|| ty(res));
            let xt = if residual.is_some() { Ty::F32 } else { ty(xt) };
            check(seed, rows, h, xt, ty(wt), ty(ot), residual, if gemma { 1.0 } else { 0.0 },
                  threads);
        }
    }
}
