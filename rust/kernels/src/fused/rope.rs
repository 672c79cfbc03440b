//! Rotary embedding of some heads of a projection's rows.

use super::{
    check_len, dispatch, len, len_mut, plan_threads, product, row_ranges, run_pieces, split_mut,
    store_row, widen,
};
use crate::error::KernelError;
use crate::{Elems, ElemsMut};

/// The inputs: `src` `[rows, src_width]`, `cos` / `sin` `[rows, rot]`; the heads are
/// `src[t, col_offset + h * dim ..][.. dim]` for `h < heads`, each rotated over its first
/// `rot` columns (all of them but where the rotary embedding covers part of each head,
/// Phi-4-mini's 0.75) and copied past them.
#[derive(Clone, Copy, Debug)]
pub struct Rope<'a> {
    pub src: Elems<'a>,
    pub cos: &'a [f32],
    pub sin: &'a [f32],
    pub rows: usize,
    pub src_width: usize,
    pub col_offset: usize,
    pub heads: usize,
    /// even
    pub dim: usize,
    /// the rotated columns of each head: even, at most `dim`
    pub rot: usize,
    /// worker threads when the call has at least the pool's [`crate::parallel::Pool::min_split`] output elements
    pub threads: usize,
}

/// `out[t, h, j] = round(x[j] * cos[t, j] + rot[j] * sin[t, j])` for `j < a.rot` (`out`
/// `[rows, heads, dim]`), `x` the head widened, `rot[j] = -x[j + rot/2]` for `j < rot/2`,
/// else `x[j - rot/2]`: two rounded f32 products and a rounded f32 add, bit-equal to
/// transformers' `q * cos + rotate_half(q) * sin` in f32; `out[t, h, j] = round(x[j])`
/// for the columns past `a.rot` (transformers' `q_pass`).
pub fn rope(a: &Rope<'_>, out: ElemsMut<'_>) -> Result<(), KernelError> {
    validate(a, &out)?;
    let row = a.heads * a.dim;
    let n = a.rows * row;
    if n == 0 {
        return Ok(());
    }
    let ranges = row_ranges(a.rows, plan_threads(a.threads, a.rows, n));
    let sizes: Vec<usize> = ranges.iter().map(|r| r.len() * row).collect();
    let pieces = ranges.into_iter().zip(split_mut(out, &sizes)).collect();
    run_pieces(pieces, |range, mut out| {
        rope_rows(a, range.start, range.len(), &mut out)
    });
    Ok(())
}

fn validate(a: &Rope<'_>, out: &ElemsMut<'_>) -> Result<(), KernelError> {
    if !a.dim.is_multiple_of(2) {
        return KernelError::invalid("dim", format!("dim must be even, not {}", a.dim));
    }
    if !a.rot.is_multiple_of(2) || a.rot > a.dim {
        return KernelError::invalid(
            "rot",
            format!(
                "rot must be even and at most dim = {}, not {}",
                a.dim, a.rot
            ),
        );
    }
    check_len("src", len(&a.src), product("src", a.rows, a.src_width)?)?;
    let cols = product("heads", a.heads, a.dim)?;
    match a.col_offset.checked_add(cols) {
        Some(end) if end <= a.src_width => {}
        _ => {
            return KernelError::invalid(
                "col_offset",
                format!(
                    "col_offset + heads * dim = {} + {cols} exceeds src's {} columns",
                    a.col_offset, a.src_width
                ),
            )
        }
    }
    let table = product("cos", a.rows, a.rot)?;
    check_len("cos", a.cos.len(), table)?;
    check_len("sin", a.sin.len(), table)?;
    check_len("out", len_mut(out), product("out", a.rows, cols)?)
}

dispatch!(rope_rows => rope_rows_impl(a: &Rope<'_>, first: usize, rows: usize,
                                      out: &mut ElemsMut<'_>));

#[inline(always)]
fn rope_rows_impl(a: &Rope<'_>, first: usize, rows: usize, out: &mut ElemsMut<'_>) {
    let (d, r, half) = (a.dim, a.rot, a.rot / 2);
    let row = a.heads * d;
    let (mut xbuf, mut scratch) = (vec![0f32; row], vec![0f32; row]);
    for i in 0..rows {
        let t = first + i;
        let xs = widen(&a.src, t * a.src_width + a.col_offset, &mut xbuf);
        let (cos, sin) = (&a.cos[t * r..(t + 1) * r], &a.sin[t * r..(t + 1) * r]);
        store_row!(out, i * row, &mut scratch, |o, round| {
            for (o, x) in o.chunks_exact_mut(d).zip(xs.chunks_exact(d)) {
                let (o, pass) = o.split_at_mut(r);
                for (o, &x) in pass.iter_mut().zip(&x[r..]) {
                    *o = round(x);
                }
                // all eight halves resliced to `half`, so the loop has no bounds checks
                let (o1, o2) = o.split_at_mut(half);
                let (o1, o2) = (&mut o1[..half], &mut o2[..half]);
                let (x1, x2) = (&x[..half], &x[half..2 * half]);
                let (c1, c2) = (&cos[..half], &cos[half..2 * half]);
                let (s1, s2) = (&sin[..half], &sin[half..2 * half]);
                for j in 0..half {
                    o1[j] = round(x1[j] * c1[j] + (-x2[j]) * s1[j]);
                    o2[j] = round(x2[j] * c2[j] + x1[j] * s2[j]);
                }
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::{round_bits, values, Buf, Ty, TYPES};
    use super::*;
    use proptest::prelude::*;

    /// The formula written out per element.
    #[allow(clippy::too_many_arguments)]
    fn reference(
        src: &[f32],
        cos: &[f32],
        sin: &[f32],
        rows: usize,
        w: usize,
        off: usize,
        heads: usize,
        (d, r): (usize, usize),
    ) -> Vec<f32> {
        let mut out = Vec::new();
        for t in 0..rows {
            for h in 0..heads {
                let x = |j: usize| src[t * w + off + h * d + j];
                for j in 0..d {
                    if j >= r {
                        out.push(x(j));
                        continue;
                    }
                    let rot = if j < r / 2 {
                        -x(j + r / 2)
                    } else {
                        x(j - r / 2)
                    };
                    out.push(x(j) * cos[t * r + j] + rot * sin[t * r + j]);
                }
            }
        }
        out
    }

    #[allow(clippy::too_many_arguments)]
    fn check(
        seed: u64,
        rows: usize,
        w: usize,
        off: usize,
        heads: usize,
        d: usize,
        st: Ty,
        ot: Ty,
        threads: usize,
    ) {
        check_rot(seed, rows, w, off, heads, (d, d), st, ot, threads)
    }

    /// [`check`] with `rot` of each head's `d` columns rotated.
    #[allow(clippy::too_many_arguments)]
    fn check_rot(
        seed: u64,
        rows: usize,
        w: usize,
        off: usize,
        heads: usize,
        (d, rot): (usize, usize),
        st: Ty,
        ot: Ty,
        threads: usize,
    ) {
        let src = Buf::new(st, &values(seed, rows * w, 4.0));
        let cos = values(seed + 1, rows * rot, 1.0);
        let sin = values(seed + 2, rows * rot, 1.0);
        let mut out = Buf::zeros(ot, rows * heads * d);
        let a = Rope {
            src: src.elems(),
            cos: &cos,
            sin: &sin,
            rows,
            src_width: w,
            col_offset: off,
            heads,
            dim: d,
            rot,
            threads,
        };
        rope(&a, out.elems_mut()).unwrap();
        let want = reference(&src.f32s(), &cos, &sin, rows, w, off, heads, (d, rot));
        assert_eq!(out.bits(), round_bits(ot, &want), "{st:?} -> {ot:?}");
    }

    #[test]
    fn part_of_each_head_rotated_matches_the_reference() {
        for &st in &TYPES {
            for &ot in &TYPES {
                // Phi-4-mini: 96 of 128 columns; and none at all
                check_rot(5, 3, 3 * 128 + 8, 8, 3, (128, 96), st, ot, 1);
                check_rot(6, 2, 40, 0, 2, (20, 0), st, ot, 1);
                check_rot(7, 700, 3 * 128, 0, 3, (128, 96), st, ot, 3);
            }
        }
    }

    #[test]
    fn all_type_combinations_match_the_reference() {
        for &st in &TYPES {
            for &ot in &TYPES {
                // q, k of a fused qkv [64 x (9 + 3 + 3) * 64], offsets at the row's end
                check(1, 5, 960, 0, 9, 64, st, ot, 1);
                check(2, 5, 960, 576, 3, 64, st, ot, 1);
                check(3, 1, 21, 13, 2, 4, st, ot, 1);
                check(4, 3, 2, 0, 1, 2, st, ot, 1);
            }
        }
    }

    #[test]
    fn threads_do_not_change_the_result() {
        for threads in [1, 2, 3] {
            check(9, 1900, 960, 0, 9, 64, Ty::Bf16, Ty::Bf16, threads);
        }
    }

    /// The baseline build of the loop (what a CPU without AVX2 runs) gives the same bits.
    #[test]
    fn portable_path_matches_the_dispatched_one() {
        let (rows, w, heads, d) = (3, 100, 3, 30);
        let cs = values(6, rows * d, 1.0);
        for &st in &TYPES {
            for &ot in &TYPES {
                let src = Buf::new(st, &values(7, rows * w, 3.0));
                let r = Rope {
                    src: src.elems(),
                    cos: &cs,
                    sin: &cs,
                    rows,
                    src_width: w,
                    col_offset: 7,
                    heads,
                    dim: d,
                    rot: d,
                    threads: 1,
                };
                let n = rows * heads * d;
                let (mut a, mut b) = (Buf::zeros(ot, n), Buf::zeros(ot, n));
                rope_rows(&r, 0, rows, &mut a.elems_mut());
                rope_rows_impl(&r, 0, rows, &mut b.elems_mut());
                assert_eq!(a.bits(), b.bits());
            }
        }
    }

    #[test]
    fn bad_arguments_are_errors() {
        let src = vec![0f32; 2 * 20];
        let cs = vec![0f32; 2 * 4];
        let mut out = vec![0f32; 2 * 3 * 4];
        let a = Rope {
            src: Elems::F32(&src),
            cos: &cs,
            sin: &cs,
            rows: 2,
            src_width: 20,
            col_offset: 8,
            heads: 3,
            dim: 4,
            rot: 4,
            threads: 1,
        };
        let field = |a: Rope<'_>, out: &mut [f32]| {
            rope(&a, ElemsMut::F32(out)).unwrap_err().field().unwrap()
        };
        assert!(rope(&a, ElemsMut::F32(&mut out)).is_ok());
        assert_eq!(field(Rope { col_offset: 9, ..a }, &mut out), "col_offset");
        assert_eq!(
            field(
                Rope {
                    col_offset: usize::MAX,
                    ..a
                },
                &mut out
            ),
            "col_offset"
        );
        assert_eq!(field(Rope { dim: 3, ..a }, &mut out), "dim");
        assert_eq!(field(Rope { rot: 3, ..a }, &mut out), "rot");
        assert_eq!(field(Rope { rot: 6, ..a }, &mut out), "rot");
        assert_eq!(field(Rope { cos: &cs[1..], ..a }, &mut out), "cos");
        assert_eq!(field(Rope { sin: &cs[1..], ..a }, &mut out), "sin");
        assert_eq!(
            field(
                Rope {
                    src: Elems::F32(&src[1..]),
                    ..a
                },
                &mut out
            ),
            "src"
        );
        assert_eq!(field(a, &mut out[1..]), "out");
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(96))]
        #[test]
        fn random_shapes_match_the_reference(seed in 0u64..10_000, rows in 1usize..7,
                                             heads in 1usize..5, half in 1usize..40,
                                             extra in 0usize..20, at_end: bool,
                                             st in 0u8..3, ot in 0u8..3, threads in 1usize..4) {
            let d = 2 * half;
            let w = heads * d + extra;
            let off = if at_end { extra } else { extra / 2 };
            check(seed, rows, w, off, heads, d, TYPES[st as usize], TYPES[ot as usize], threads);
        }
    }
}
