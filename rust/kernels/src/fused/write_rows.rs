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

/// Rows into an int8 KV cache: row `t` of `src` (`[slots.len(), width]`, `width` a multiple
/// of `group`) goes to slot `slots[t]` of `dst` (`[S, width]` int8), each `group` of it
/// (one KV head) quantized symmetrically with its own scale, stored in `scales`
/// (`[S, width / group]`): `scale = max|x| / 127`, `q = round_half_even(x * (1 / scale))`
/// clamped to +-127 (an all-zero group: scale 0, elements 0), all f32 (the same operations
/// as `ferrobatch.attention.kv_cache.quantize_int8`). Every slot is checked first.
pub fn write_rows_int8(
    src: Elems<'_>,
    width: usize,
    slots: &[i64],
    group: usize,
    dst: &mut [i8],
    scales: &mut [f32],
) -> Result<(), KernelError> {
    if group == 0 || width == 0 || !width.is_multiple_of(group) {
        return KernelError::invalid(
            "group",
            format!("group ({group}) must be >= 1 and divide width ({width} >= 1)"),
        );
    }
    if !dst.len().is_multiple_of(width) {
        return KernelError::invalid(
            "dst",
            format!("dst has {} elements, not whole rows of {width}", dst.len()),
        );
    }
    let n = dst.len() / width;
    check_len("scales", scales.len(), product("scales", n, width / group)?)?;
    if src.is_quantized() {
        return KernelError::invalid("src", "src must be float32, bfloat16 or float16".into());
    }
    check_len("src", len(&src), product("src", slots.len(), width)?)?;
    for (t, &s) in slots.iter().enumerate() {
        if s < 0 || s as u64 >= n as u64 {
            return KernelError::invalid(
                "slots",
                format!("slots[{t}] = {s} is outside dst's {n} rows"),
            );
        }
    }
    quantize_rows(&src, slots, group, width, dst, scales);
    Ok(())
}

/// 1.5 * 2^23: `(x + ROUND) - ROUND` is `x` rounded to an integer, ties to even, for
/// |x| < 2^22 (f32's round-to-nearest-even).
const ROUND: f32 = 12_582_912.0;

/// `max |x|` (0 for an empty slice), 16 running maxima at a time.
#[inline(always)]
fn abs_max(x: &[f32]) -> f32 {
    let mut lanes = [0f32; 16];
    let mut chunks = x.chunks_exact(16);
    for c in &mut chunks {
        for (m, &v) in lanes.iter_mut().zip(c) {
            *m = m.max(v.abs());
        }
    }
    let tail = chunks.remainder().iter().fold(0f32, |m, &v| m.max(v.abs()));
    lanes.iter().fold(tail, |m, &v| m.max(v))
}

dispatch!(quantize_rows => quantize_rows_impl(src: &Elems<'_>, slots: &[i64], group: usize,
                                               width: usize, dst: &mut [i8],
                                               scales: &mut [f32]));

#[inline(always)]
fn quantize_rows_impl(
    src: &Elems<'_>,
    slots: &[i64],
    group: usize,
    width: usize,
    dst: &mut [i8],
    scales: &mut [f32],
) {
    let mut buf = vec![0f32; width];
    let per_slot = width / group;
    for (t, &s) in slots.iter().enumerate() {
        let row = widen(src, t * width, &mut buf);
        let s = s as usize;
        for (h, x) in row.chunks_exact(group).enumerate() {
            let scale = abs_max(x) / 127.0;
            let inv = if scale > 0.0 { 1.0 / scale } else { 0.0 };
            let out = &mut dst[s * width + h * group..][..group];
            for (o, &v) in out.iter_mut().zip(x) {
                // |v * inv| <= 127 (+ rounding): adding and taking away 1.5 * 2^23 rounds
                // it to the nearest integer, ties to even (`round_ties_even`), vectorized
                let r = (v * inv + ROUND) - ROUND;
                *o = r.clamp(-127.0, 127.0) as i32 as i8; // (in range: exact)
            }
            scales[s * per_slot + h] = scale;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::{round_bits, values, Buf, Ty, TYPES};
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn int8_rows_are_quantized_per_group() {
        let src = [0.5f32, -1.0, 0.25, 0.0, 0.0, 0.0, 2.54, -0.01];
        let (mut dst, mut scales) = (vec![9i8; 3 * 4], vec![9f32; 3 * 2]);
        write_rows_int8(Elems::F32(&src), 4, &[2, 0], 2, &mut dst, &mut scales).unwrap();
        assert_eq!(&dst[8..], &[64, -127, 127, 0]);
        assert_eq!(&scales[4..], &[1.0 / 127.0, 0.25 / 127.0]);
        assert_eq!(&dst[..4], &[0, 0, 127, 0]); // -0.01 is half a step: to even
        assert_eq!(&scales[..2], &[0.0, 2.54 / 127.0]);
        assert_eq!(&dst[4..8], &[9; 4]); // slot 1 untouched
        let bad_slot = write_rows_int8(Elems::F32(&src), 4, &[0, 3], 2, &mut dst, &mut scales);
        assert!(bad_slot.is_err());
        let short = write_rows_int8(Elems::F32(&src), 4, &[0, 1], 2, &mut dst, &mut scales[..5]);
        assert!(short.is_err());
        let group = write_rows_int8(Elems::F32(&src), 4, &[0, 1], 3, &mut dst, &mut scales);
        assert!(group.is_err());
    }

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
