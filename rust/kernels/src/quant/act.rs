//! Activations quantized per row to int8 blocks, so that a block's product with a weight
//! block is an exact integer sum: [`A32`] (one f32 scale per 32 inputs, for Q8_0 / Q4_0 /
//! Q4_1 / Q5_0 / Q5_1 / IQ4_NL) and [`A256`] (one f32 scale per 256 inputs and the block's partial sums, for the
//! K-types). A row's blocks depend on that row's values only.
//!
//! Each block of `x` maps to `d = max|x| / 127` and `q = rne(x * (127 / max|x|))` in
//! `-127..=127` (`d = 0`, `q = 0` for a zero block), so `|x - d q| <= d / 2` up to the
//! rounding of `x * (127 / max|x|)` (one f32 product: relative error 2^-24). Non-finite
//! inputs give non-finite scales (the row's outputs become NaN or infinite).

/// One block of 32 quantized inputs.
#[derive(Clone, Copy, Debug, PartialEq)]
#[repr(C)]
pub struct A32 {
    /// the inputs, `x ~ d * qs`
    pub qs: [i8; 32],
    /// the scale
    pub d: f32,
    /// `-offset * sum(qs)`, the start of the block's integer sum (weights coded `u = w +
    /// offset`: 128 for Q8_0 and IQ4_NL, 8 for Q4_0, 16 for Q5_0, 0 for Q4_1 and Q5_1)
    pub init: i32,
    /// `d * sum(qs)` (Q4_1's and Q5_1's `m` term)
    pub sd: f32,
}

/// One block of 256 quantized inputs.
#[derive(Clone, Copy, Debug, PartialEq)]
#[repr(C)]
pub struct A256 {
    /// the inputs, `x ~ d * qs`
    pub qs: [i8; 256],
    /// `-32 * sum(qs[16 j..16 j + 16])` (Q6_K's codes are `w + 32`)
    pub neg32_sum16: [i32; 16],
    /// `sum(qs[32 j..32 j + 32])` (Q4_K / Q5_K's mins, IQ4_XS's code offset; pairs read as
    /// one i32)
    pub sum32: [i16; 8],
    /// `sum(qs[16 j..16 j + 16])` (Q2_K's mins, Q3_K's code offset; pairs read as one i32)
    pub sum16: [i16; 16],
    /// the scale
    pub d: f32,
}

impl A32 {
    pub const ZERO: A32 = A32 {
        qs: [0; 32],
        d: 0.0,
        init: 0,
        sd: 0.0,
    };
}

impl A256 {
    pub const ZERO: A256 = A256 {
        qs: [0; 256],
        neg32_sum16: [0; 16],
        sum32: [0; 8],
        sum16: [0; 16],
        d: 0.0,
    };
}

/// Sums `2 p` and `2 p + 1` of `sums` (an [`A256`]'s `sum32` or `sum16`) as one i32, the
/// first in the low half: the operand a `pmaddwd` / `vpdpwssd` pairs with two mins.
#[inline(always)]
pub(crate) fn sum_pair(sums: &[i16], p: usize) -> i32 {
    i32::from(sums[2 * p] as u16) | (i32::from(sums[2 * p + 1]) << 16)
}

/// `rne(v)` (round to nearest, ties to even) for `|v| < 2^22`, in integer arithmetic:
/// adding 1.5 * 2^23 leaves no fraction bits, and the sum's bits less the constant's are the
/// rounded value. Branch-free (it vectorizes, unlike a saturating `as` or a libm call); any
/// other `v` (non-finite) gives some integer, never undefined behaviour.
#[inline(always)]
fn rne(v: f32) -> i32 {
    const MAGIC: f32 = 12_582_912.0;
    ((v + MAGIC).to_bits() as i32).wrapping_sub(MAGIC.to_bits() as i32)
}

/// `x` (a block of `N`) as `(d, q)`: `q` written into `q`.
#[inline(always)]
fn block<const N: usize>(x: &[f32; N], q: &mut [i8; N]) -> f32 {
    // max |x| as the largest bit pattern with the sign cleared: for floats that are not
    // NaN the patterns order as the values do, and a NaN's pattern is above infinity's,
    // so a NaN input makes the scale NaN (an integer maximum vectorizes; a float one,
    // which LLVM may not reorder, does not)
    let bits = x.iter().fold(0u32, |m, v| m.max(v.to_bits() & 0x7FFF_FFFF));
    let amax = f32::from_bits(bits);
    let d = amax / 127.0;
    let id = if amax > 0.0 && amax.is_finite() {
        127.0 / amax
    } else {
        0.0
    };
    for (q, &v) in q.iter_mut().zip(x) {
        *q = rne(v * id).clamp(-127, 127) as i8;
    }
    d
}

/// Whether the row quantizers run their AVX-512 build (the same operations: the same
/// values).
fn wide() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512bw")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Row `x` (`32 * out.len()` values) quantized into `out`, weights coded `w + offset`.
pub(crate) fn quantize_a32(x: &[f32], offset: i32, out: &mut [A32]) {
    assert_eq!(x.len(), 32 * out.len(), "32 inputs a block");
    #[cfg(target_arch = "x86_64")]
    if wide() {
        // SAFETY: the CPU has AVX-512 F and BW (`wide`), the target features enabled.
        unsafe { a32_avx512(x, offset, out) };
        return;
    }
    a32_body(x, offset, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
fn a32_avx512(x: &[f32], offset: i32, out: &mut [A32]) {
    a32_body(x, offset, out)
}

#[inline(always)]
fn a32_body(x: &[f32], offset: i32, out: &mut [A32]) {
    for (a, x) in out.iter_mut().zip(x.chunks_exact(32)) {
        a.d = block(x.try_into().expect("32 inputs"), &mut a.qs);
        let s: i32 = a.qs.iter().map(|&q| i32::from(q)).sum();
        a.init = -offset * s;
        a.sd = a.d * s as f32;
    }
}

/// Row `x` (`256 * out.len()` values) quantized into `out`.
pub(crate) fn quantize_a256(x: &[f32], out: &mut [A256]) {
    assert_eq!(x.len(), 256 * out.len(), "256 inputs a block");
    #[cfg(target_arch = "x86_64")]
    if wide() {
        // SAFETY: the CPU has AVX-512 F and BW (`wide`), the target features enabled.
        unsafe { a256_avx512(x, out) };
        return;
    }
    a256_body(x, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
fn a256_avx512(x: &[f32], out: &mut [A256]) {
    a256_body(x, out)
}

#[inline(always)]
fn a256_body(x: &[f32], out: &mut [A256]) {
    for (a, x) in out.iter_mut().zip(x.chunks_exact(256)) {
        a.d = block(x.try_into().expect("256 inputs"), &mut a.qs);
        for j in 0..16 {
            let s: i32 = a.qs[16 * j..16 * j + 16]
                .iter()
                .map(|&q| i32::from(q))
                .sum();
            a.neg32_sum16[j] = -32 * s;
            // |s| <= 16 * 127 fits an i16
            a.sum16[j] = s as i16;
        }
        for j in 0..8 {
            let s: i32 = a.qs[32 * j..32 * j + 32]
                .iter()
                .map(|&q| i32::from(q))
                .sum();
            // |s| <= 32 * 127 fits an i16
            a.sum32[j] = s as i16;
        }
    }
}

/// The quantized rows of a product: `m` rows of `k / block` blocks each.
#[derive(Clone, Debug)]
pub enum Acts {
    A32(Vec<A32>),
    A256(Vec<A256>),
}

impl Acts {
    /// Blocks in all.
    pub fn len(&self) -> usize {
        match self {
            Acts::A32(v) => v.len(),
            Acts::A256(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rne_rounds_ties_to_even() {
        for (v, want) in [
            (0.5, 0),
            (1.5, 2),
            (2.5, 2),
            (-0.5, 0),
            (-1.5, -2),
            (126.5, 126),
            (-127.0, -127),
            (0.49999997, 0),
            (3.7, 4),
            (-3.7, -4),
            (4_194_303.0, 4_194_303),
        ] {
            assert_eq!(rne(v), want, "{v}");
        }
    }

    #[test]
    fn blocks_are_within_half_a_step() {
        let x: Vec<f32> = (0..256)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.013)
            .collect();
        let mut a = vec![A256::ZERO];
        quantize_a256(&x, &mut a);
        let d = a[0].d;
        for (v, q) in x.iter().zip(a[0].qs) {
            assert!(
                (v - d * f32::from(q)).abs() <= d * 0.5 * (1.0 + 1e-6),
                "{v} {q}"
            );
        }
        assert_eq!(a[0].qs.iter().map(|q| q.unsigned_abs()).max(), Some(127));
        let mut b = vec![A32::ZERO; 8];
        quantize_a32(&x, 8, &mut b);
        let s: i32 = b[0].qs.iter().map(|&q| i32::from(q)).sum();
        assert_eq!(b[0].init, -8 * s);
        assert_eq!(
            a[0].sum32[0] as i32,
            a[0].qs[..32].iter().map(|&q| i32::from(q)).sum()
        );
        assert_eq!(
            a[0].sum16[3] as i32,
            a[0].qs[48..64].iter().map(|&q| i32::from(q)).sum()
        );
    }

    #[test]
    fn zero_and_nan_blocks() {
        let mut a = vec![A32::ZERO];
        quantize_a32(&[0.0; 32], 128, &mut a);
        assert_eq!((a[0].d, a[0].qs, a[0].init), (0.0, [0; 32], 0));
        let mut x = [1.0f32; 32];
        x[5] = f32::NAN;
        quantize_a32(&x, 128, &mut a);
        assert!(a[0].d.is_nan());
    }
}
