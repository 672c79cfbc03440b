//! Rows of a projection into chosen slots of the paged KV cache.

use super::{check_len, dispatch, len, len_mut, narrow, product, widen};
use crate::error::KernelError;
use crate::{Elems, ElemsMut};

/// The source rows: `src` `[slots.len(), src_width]`; row `t`'s columns `col_offset ..
/// col_offset + width` go to slot `slots[t]`.
#[derive(Clone, Copy, Debug)]
pub struct WriteRows<'a> {
    pub src: Elems<'a>,
    pub src_width: usize,
    pub col_offset: usize,
    pub width: usize,
    pub slots: &'a [i64],
}

/// `dst[slots[t], :] = round(src[t, col_offset .. col_offset + width])`, `dst` `[S, width]`
/// (`S = dst.len() / width`): `dst.index_copy_(0, slots, src[:, off:off + width].to(dst))`.
/// Every slot is checked to be in `0 .. S` before anything is written. Rows are written in
/// order, so when a slot repeats the last row wins (as `index_copy_` on CPU in practice).
/// Same-type rows are copied bit for bit (NaN payloads included). Single-threaded: a call
/// moves a few tens of KiB.
pub fn write_rows(a: &WriteRows<'_>, mut dst: ElemsMut<'_>) -> Result<(), KernelError> {
    let rows = a.slots.len();
    check_len("src", len(&a.src), product("src", rows, a.src_width)?)?;
    match a.col_offset.checked_add(a.width) {
        Some(end) if end <= a.src_width => {}
        _ => {
            return KernelError::invalid(
                "col_offset",
                format!(
                    "col_offset + width = {} + {} exceeds src's {} columns",
                    a.col_offset, a.width, a.src_width
                ),
            )
        }
    }
    if a.width == 0 {
        return KernelError::invalid("width", "width must be >= 1".into());
    }
    let dst_len = len_mut(&dst);
    if !dst_len.is_multiple_of(a.width) {
        return KernelError::invalid(
            "dst",
            format!(
                "dst has {dst_len} elements, not a whole number of {}-wide rows",
                a.width
            ),
        );
    }
    let slots = dst_len / a.width;
    for (t, &s) in a.slots.iter().enumerate() {
        if s < 0 || s as u64 >= slots as u64 {
            return KernelError::invalid(
                "slots",
                format!("slots[{t}] = {s} is outside dst's {slots} rows"),
            );
        }
    }
    copy_rows(a, &mut dst);
    Ok(())
}

dispatch!(copy_rows => copy_rows_impl(a: &WriteRows<'_>, dst: &mut ElemsMut<'_>));

#[inline(always)]
fn copy_rows_impl(a: &WriteRows<'_>, dst: &mut ElemsMut<'_>) {
    let w = a.width;
    let mut buf = vec![0f32; w];
    for (t, &s) in a.slots.iter().enumerate() {
        let (from, to) = (t * a.src_width + a.col_offset, s as usize * w);
        match (&a.src, &mut *dst) {
            (Elems::F32(x), ElemsMut::F32(y)) => {
                y[to..to + w].copy_from_slice(&x[from..from + w]);
            }
            (Elems::Bf16(x), ElemsMut::Bf16(y)) | (Elems::F16(x), ElemsMut::F16(y)) => {
                y[to..to + w].copy_from_slice(&x[from..from + w]);
            }
            (src, dst) => {
                let vals = widen(src, from, &mut buf);
                narrow(dst, to, vals);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::{round_bits, values, Buf, Ty, TYPES};
    use super::*;
    use proptest::prelude::*;

    /// Row by row, element by element, into a copy of `dst`'s values.
    fn reference(a: &WriteRows<'_>, src: &[f32], dst: &Buf, dt: Ty) -> Vec<u32> {
        let mut bits = dst.bits();
        for (t, &s) in a.slots.iter().enumerate() {
            let row: Vec<f32> = (0..a.width)
                .map(|j| src[t * a.src_width + a.col_offset + j])
                .collect();
            let r = round_bits(dt, &row);
            bits[s as usize * a.width..][..a.width].copy_from_slice(&r);
        }
        bits
    }

    #[allow(clippy::too_many_arguments)]
    fn check(
        seed: u64,
        slots: &[i64],
        s: usize,
        w: usize,
        off: usize,
        width: usize,
        st: Ty,
        dt: Ty,
    ) {
        let src = Buf::new(st, &values(seed, slots.len() * w, 5.0));
        let mut dst = Buf::new(dt, &values(seed + 1, s * width, 1.0));
        let before = dst.clone();
        let a = WriteRows {
            src: src.elems(),
            src_width: w,
            col_offset: off,
            width,
            slots,
        };
        write_rows(&a, dst.elems_mut()).unwrap();
        assert_eq!(
            dst.bits(),
            reference(&a, &src.f32s(), &before, dt),
            "{st:?} -> {dt:?}"
        );
    }

    #[test]
    fn all_type_combinations_match_the_reference() {
        for &st in &TYPES {
            for &dt in &TYPES {
                check(1, &[3, 0, 7, 2], 8, 960, 768, 192, st, dt); // v of a fused qkv
                check(2, &[5], 6, 17, 4, 13, st, dt); // ends at the row's end
                check(3, &[1, 1, 0, 1], 2, 5, 0, 5, st, dt); // repeats: the last wins
            }
        }
    }

    #[test]
    fn same_type_rows_are_copied_bit_for_bit() {
        let src = [0x7fa1u16, 0xffff, 0x0001, 0x8000];
        let mut dst = [0u16; 4];
        let a = WriteRows {
            src: Elems::Bf16(&src),
            src_width: 4,
            col_offset: 0,
            width: 4,
            slots: &[0],
        };
        write_rows(&a, ElemsMut::Bf16(&mut dst)).unwrap();
        assert_eq!(dst, src);
    }

    /// The baseline build of the loop (what a CPU without AVX2 runs) gives the same bits.
    #[test]
    fn portable_path_matches_the_dispatched_one() {
        let slots = [4i64, 0, 2];
        for &st in &TYPES {
            for &dt in &TYPES {
                let src = Buf::new(st, &values(8, 3 * 50, 3.0));
                let wr = WriteRows {
                    src: src.elems(),
                    src_width: 50,
                    col_offset: 9,
                    width: 41,
                    slots: &slots,
                };
                let (mut a, mut b) = (Buf::zeros(dt, 5 * 41), Buf::zeros(dt, 5 * 41));
                copy_rows(&wr, &mut a.elems_mut());
                copy_rows_impl(&wr, &mut b.elems_mut());
                assert_eq!(a.bits(), b.bits());
            }
        }
    }

    #[test]
    fn bad_arguments_are_errors_before_any_write() {
        let src = vec![1f32; 3 * 8];
        let mut dst = vec![0f32; 4 * 6];
        let a = WriteRows {
            src: Elems::F32(&src),
            src_width: 8,
            col_offset: 2,
            width: 6,
            slots: &[0, 1, 2],
        };
        let mut field = |a: WriteRows<'_>| {
            write_rows(&a, ElemsMut::F32(&mut dst))
                .unwrap_err()
                .field()
                .unwrap()
        };
        assert_eq!(
            field(WriteRows {
                slots: &[0, 1, 4],
                ..a
            }),
            "slots"
        );
        assert_eq!(
            field(WriteRows {
                slots: &[0, -1, 2],
                ..a
            }),
            "slots"
        );
        assert_eq!(
            field(WriteRows {
                slots: &[0, 1],
                ..a
            }),
            "src"
        );
        assert_eq!(field(WriteRows { col_offset: 3, ..a }), "col_offset");
        assert_eq!(
            field(WriteRows {
                col_offset: usize::MAX,
                ..a
            }),
            "col_offset"
        );
        assert_eq!(
            field(WriteRows {
                width: 5,
                col_offset: 0,
                ..a
            }),
            "dst"
        );
        assert_eq!(field(WriteRows { width: 0, ..a }), "width");
        assert!(dst.iter().all(|&v| v == 0.0), "nothing written");
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(96))]
        #[test]
        fn random_shapes_match_the_reference(seed in 0u64..10_000,
                                             slots in proptest::collection::vec(0i64..9, 1..8),
                                             width in 1usize..70, extra in 0usize..20,
                                             at_end: bool, st in 0u8..3, dt in 0u8..3) {
            let w = width + extra;
            let off = if at_end { extra } else { extra / 3 };
            check(seed, &slots, 9, w, off, width, TYPES[st as usize], TYPES[dt as usize]);
        }
    }
}
