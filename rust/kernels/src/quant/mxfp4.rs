//! MXFP4 blocks (gpt-oss's experts) rewritten as Q5_0 blocks of the same values, so the Q5_0
//! products compute MXFP4 products exactly.
//!
//! An MXFP4 block (17 bytes) is an E8M0 exponent `e` and 32 four-bit codes (`qs[j]`'s low
//! nibble weight `j`, high nibble weight `j + 16`), weight = `MXFP4_VALUES[code] * 2^(e -
//! 128)`. A Q5_0 block (22 bytes) is `d` (fp16), `qh` (the 32 fifth bits) and the 32 low
//! nibbles in the same order, weight = `d * (q - 16)`. `d = 2^(e - 128)`, `q =
//! MXFP4_VALUES[code] + 16` (4 ..= 28) say the same number; `d` is exact in fp16 for `e` in
//! 104 ..= 143. A block whose codes are all zero (0 and 8) is zero whatever its `e`; a
//! smaller `e` with a nonzero code (every weight below 12 * 2^-25) becomes zero, and is
//! counted; a larger `e` is refused.

use std::sync::Mutex;

use crate::error::KernelError;
use crate::parallel::{plan_threads, row_ranges, run_pieces};

/// MXFP4's code -> weight in units of 2^(e - 128) (the doubled E2M1 values)
pub const MXFP4_VALUES: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];
/// Bytes of an MXFP4 block and of a Q5_0 block (32 weights each)
pub const MXFP4_BYTES: usize = 17;
pub const Q5_0_BYTES: usize = 22;
/// The exponents whose 2^(e - 128) fp16 holds exactly
const E_MIN: u8 = 104;
const E_MAX: u8 = 143;

/// For each byte of two codes (low nibble: weight `j`, high: weight `j + 16`): the Q5_0 low
/// nibbles byte (bits 0-7), the fifth bit of the low code's `q` (bit 8) and of the high
/// code's (bit 9)
const PAIRS: [u16; 256] = pairs();

const fn pairs() -> [u16; 256] {
    let mut out = [0u16; 256];
    let mut b = 0;
    while b < 256 {
        let lo = (MXFP4_VALUES[b & 15] + 16) as u16;
        let hi = (MXFP4_VALUES[b >> 4] + 16) as u16;
        out[b] = (lo & 15) | ((hi & 15) << 4) | ((lo >> 4) << 8) | ((hi >> 4) << 9);
        b += 1;
    }
    out
}

/// fp16 bits of 2^(e - 128), `e` in `E_MIN ..= E_MAX` (subnormal below 2^-14)
fn scale_bits(e: u8) -> u16 {
    let p = i32::from(e) - 128;
    if p >= -14 {
        ((p + 15) as u16) << 10
    } else {
        1 << (p + 24)
    }
}

/// Rewrites the MXFP4 blocks `src` as Q5_0 blocks into `dst` (22 bytes for every 17) on up
/// to `threads` threads and returns how many blocks were below fp16's range and became
/// zero. `Invalid` ("blocks") for a length that is not whole blocks, or naming the first
/// block whose exponent is above 143 (`dst` is then partly written); `Length` ("out") for a
/// `dst` of the wrong size.
pub fn mxfp4_to_q5_0(src: &[u8], dst: &mut [u8], threads: usize) -> Result<usize, KernelError> {
    if !src.len().is_multiple_of(MXFP4_BYTES) {
        return KernelError::invalid(
            "blocks",
            format!(
                "blocks has {} bytes, not whole {MXFP4_BYTES}-byte MXFP4 blocks",
                src.len()
            ),
        );
    }
    let blocks = src.len() / MXFP4_BYTES;
    KernelError::check_len(
        "out",
        dst.len(),
        blocks * Q5_0_BYTES,
        crate::error::Expected::NotN,
    )?;
    let threads = plan_threads(threads, blocks, dst.len());
    let ranges = row_ranges(blocks, threads);
    let mut pieces = Vec::with_capacity(ranges.len());
    let mut rest = dst;
    for r in ranges {
        let (mine, more) = rest.split_at_mut(r.len() * Q5_0_BYTES);
        pieces.push((r, mine));
        rest = more;
    }
    // per piece: (its flushed count, its first block above the range)
    let results = Mutex::new(Vec::new());
    run_pieces(pieces, |range, out| {
        let start = range.start;
        let part = &src[range.start * MXFP4_BYTES..range.end * MXFP4_BYTES];
        let r = rewrite(part, out).map_err(|(b, e)| (start + b, e));
        results.lock().unwrap_or_else(|p| p.into_inner()).push(r);
    });
    let results = results.into_inner().unwrap_or_else(|p| p.into_inner());
    if let Some((b, e)) = results.iter().filter_map(|r| r.err()).min() {
        return KernelError::invalid(
            "blocks",
            format!(
                "blocks: MXFP4 block {b} has exponent {e} (weights of 2^16 or more), which Q5_0 \
                 cannot hold"
            ),
        );
    }
    Ok(results.iter().map(|r| r.unwrap_or(0)).sum())
}

/// [`mxfp4_to_q5_0`] of whole blocks on this thread: the flushed count, or (block, exponent)
/// of the first block above the range.
fn rewrite(src: &[u8], dst: &mut [u8]) -> Result<usize, (usize, u8)> {
    let mut flushed = 0;
    for (b, (s, d)) in src
        .chunks_exact(MXFP4_BYTES)
        .zip(dst.chunks_exact_mut(Q5_0_BYTES))
        .enumerate()
    {
        let (e, codes) = (s[0], &s[1..]);
        if e > E_MAX {
            return Err((b, e));
        }
        if e < E_MIN {
            flushed += usize::from(codes.iter().any(|&c| c & 0x77 != 0));
            d.fill(0);
            continue;
        }
        d[0..2].copy_from_slice(&scale_bits(e).to_le_bytes());
        let mut qh = 0u32;
        for (j, (&c, n)) in codes.iter().zip(&mut d[6..]).enumerate() {
            let t = PAIRS[usize::from(c)];
            *n = t as u8;
            qh |= u32::from((t >> 8) & 1) << j | u32::from(t >> 9) << (j + 16);
        }
        d[2..6].copy_from_slice(&qh.to_le_bytes());
    }
    Ok(flushed)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::{dequantize, QType};
    use half::f16;

    #[test]
    fn scale_bits_are_fp16_powers_of_two() {
        for e in E_MIN..=E_MAX {
            let want = f16::from_f32((f32::from(e) - 128.0).exp2());
            assert_eq!(scale_bits(e), want.to_bits(), "e = {e}");
            assert_eq!(f64::from(want.to_f32()), (f64::from(e) - 128.0).exp2());
        }
    }

    /// MXFP4 weights of `src` as the format defines them (f64, exact).
    fn mxfp4_values(src: &[u8]) -> Vec<f64> {
        let mut out = vec![];
        for blk in src.chunks_exact(MXFP4_BYTES) {
            let scale = (f64::from(blk[0]) - 128.0).exp2();
            let mut w = [0.0; 32];
            for j in 0..16 {
                w[j] = f64::from(MXFP4_VALUES[usize::from(blk[1 + j] & 15)]) * scale;
                w[j + 16] = f64::from(MXFP4_VALUES[usize::from(blk[1 + j] >> 4)]) * scale;
            }
            out.extend(w);
        }
        out
    }

    #[test]
    fn every_exponent_in_range_keeps_every_value() {
        let mut src = vec![];
        for e in E_MIN..=E_MAX {
            for k in 0..16u8 {
                src.push(e);
                src.extend((0..16).map(|j| k.wrapping_mul(17).wrapping_add(j * 31)));
            }
        }
        let blocks = src.len() / MXFP4_BYTES;
        let mut q5 = vec![0; blocks * Q5_0_BYTES];
        assert_eq!(mxfp4_to_q5_0(&src, &mut q5, 2), Ok(0));
        let mut got = vec![0.0f32; blocks * 32];
        dequantize(QType::Q5_0, &q5, blocks, 32, &mut got).unwrap();
        for (g, w) in got.iter().zip(mxfp4_values(&src)) {
            assert_eq!(f64::from(*g), w);
        }
    }

    #[test]
    fn threads_give_the_same_bytes_and_the_first_bad_block() {
        let blocks = 100_000;
        let src: Vec<u8> = (0..blocks * MXFP4_BYTES)
            .map(|i| {
                if i % MXFP4_BYTES == 0 {
                    E_MIN + (i / MXFP4_BYTES % 40) as u8
                } else {
                    (i * 7919 % 251) as u8
                }
            })
            .collect();
        let (mut one, mut two) = (vec![0; blocks * Q5_0_BYTES], vec![1; blocks * Q5_0_BYTES]);
        assert_eq!(mxfp4_to_q5_0(&src, &mut one, 1), Ok(0));
        assert_eq!(mxfp4_to_q5_0(&src, &mut two, 2), Ok(0));
        assert!(one == two);
        let mut bad = src.clone();
        bad[90_000 * MXFP4_BYTES] = 200;
        bad[70_000 * MXFP4_BYTES] = 150;
        let err = mxfp4_to_q5_0(&bad, &mut two, 2).unwrap_err().to_string();
        assert!(err.contains("block 70000 has exponent 150"), "{err}");
    }

    #[test]
    fn zero_tiny_and_huge_blocks() {
        let mut src = vec![0u8; 3 * MXFP4_BYTES];
        src[1..17].fill(0x88); // e = 0, codes 8: zero
        src[17] = 103; // below range, a nonzero code: flushed
        src[18] = 0x01;
        src[34] = 120; // in range, zero codes
        let mut q5 = vec![0xAA; 3 * Q5_0_BYTES];
        assert_eq!(mxfp4_to_q5_0(&src, &mut q5, 1), Ok(1));
        let mut got = vec![1.0f32; 96];
        dequantize(QType::Q5_0, &q5, 3, 32, &mut got).unwrap();
        assert!(got.iter().all(|&v| v == 0.0));
        src[0] = 144;
        let err = mxfp4_to_q5_0(&src, &mut q5, 2).unwrap_err();
        assert!(err.to_string().contains("exponent 144"), "{err}");
        assert!(mxfp4_to_q5_0(&src[..16], &mut q5, 1).is_err());
        assert!(mxfp4_to_q5_0(&src, &mut q5[..21], 1).is_err());
    }
}
