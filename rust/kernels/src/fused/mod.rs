//! Fused elementwise kernels of a decoder layer's CPU forward, one call each where
//! transformers runs several torch ops (and their dtype copies):
//!
//! * [`rms_norm`]: optional residual add in place, then RMSNorm (Llama or Gemma weights);
//! * [`silu_mul`]: `silu(gate) * up` from the fused gate/up projection;
//! * [`rope`]: rotary embedding of some heads of a (fused q/k/v) projection;
//! * [`write_rows`]: rows of a projection into chosen slots of the paged KV cache.
//!
//! Numerics: inputs are widened exactly to f32 (bf16 / fp16 as `u16` bit patterns), all
//! math is f32 with the operations each kernel documents (no fused multiply-add in them: Rust
//! never contracts `a * b + c`; only the inside of `silu_mul`'s exp uses explicit FMAs), and
//! each result is rounded once, to nearest even, into the output type (bf16 NaN becomes
//! `0x7fc0`, as torch's scalar conversion).
//!
//! Every length, shape and index is checked before anything is read or written; an error
//! ([`KernelError`]) names the argument at fault. The loops are plain Rust, compiled a second
//! time for AVX-512 (F + BW) + FMA and AVX2 + FMA, picked at run time.

mod rms_norm;
mod rope;
mod silu_mul;
mod write_rows;

pub use rms_norm::{rms_norm, NormInput, RmsNorm};
pub use rope::{rope, Rope};
pub(crate) use silu_mul::exp;
pub use silu_mul::{gated_mul, silu_mul, Gate};
pub use write_rows::{write_rows, write_rows_int8, WriteRows};

use crate::error::{Expected, KernelError};
pub(crate) use crate::parallel::{plan_threads, row_ranges, run_pieces};
use crate::{Elems, ElemsMut};
use half::f16;
use half::slice::{HalfBitsSliceExt, HalfFloatSliceExt};

/// `Ok` when `got == want`, else an error naming `field`.
pub(crate) fn check_len(field: &'static str, got: usize, want: usize) -> Result<(), KernelError> {
    KernelError::check_len(field, got, want, Expected::ExpectedN)
}

/// `a * b`, an error naming `field` on overflow.
pub(crate) fn product(field: &'static str, a: usize, b: usize) -> Result<usize, KernelError> {
    a.checked_mul(b).ok_or(KernelError::Overflow { field })
}

pub(crate) fn len(e: &Elems<'_>) -> usize {
    match e {
        Elems::F32(s) => s.len(),
        Elems::Bf16(s) | Elems::F16(s) => s.len(),
        Elems::I8 { data, .. } => data.len(),
    }
}

pub(crate) fn len_mut(e: &ElemsMut<'_>) -> usize {
    match e {
        ElemsMut::F32(s) => s.len(),
        ElemsMut::Bf16(s) | ElemsMut::F16(s) => s.len(),
    }
}

/// Consecutive pieces of `out` holding `per[i]` elements each (the pieces' total must not
/// exceed the length).
pub(crate) fn split_mut<'a>(out: ElemsMut<'a>, per: &[usize]) -> Vec<ElemsMut<'a>> {
    fn cut<'a, T>(
        mut s: &'a mut [T],
        per: &[usize],
        f: fn(&'a mut [T]) -> ElemsMut<'a>,
    ) -> Vec<ElemsMut<'a>> {
        per.iter()
            .map(|&n| {
                let (head, tail) = std::mem::take(&mut s).split_at_mut(n);
                s = tail;
                f(head)
            })
            .collect()
    }
    match out {
        ElemsMut::F32(s) => cut(s, per, ElemsMut::F32),
        ElemsMut::Bf16(s) => cut(s, per, ElemsMut::Bf16),
        ElemsMut::F16(s) => cut(s, per, ElemsMut::F16),
    }
}

/// bf16 bits widened to f32 (exact).
#[inline(always)]
pub(crate) fn bf16_to_f32(b: u16) -> f32 {
    f32::from_bits((b as u32) << 16)
}

/// f32 rounded to the nearest bf16, ties to even; NaN becomes `0x7fc0`.
#[inline(always)]
pub(crate) fn f32_to_bf16(x: f32) -> u16 {
    let b = x.to_bits();
    let rounded = (b.wrapping_add(0x7fff + ((b >> 16) & 1)) >> 16) as u16;
    if x.is_nan() {
        0x7fc0
    } else {
        rounded
    }
}

/// `src[start .. start + buf.len()]` widened to f32: `src`'s own slice when it is f32,
/// else `buf` filled with the widened values.
#[inline(always)]
pub(crate) fn widen<'c>(src: &Elems<'c>, start: usize, buf: &'c mut [f32]) -> &'c [f32] {
    let n = buf.len();
    match *src {
        Elems::F32(s) => &s[start..start + n],
        Elems::Bf16(s) => {
            for (o, &b) in buf.iter_mut().zip(&s[start..start + n]) {
                *o = bf16_to_f32(b);
            }
            buf
        }
        Elems::F16(s) => {
            s[start..start + n]
                .reinterpret_cast::<f16>()
                .convert_to_f32_slice(buf);
            buf
        }
        Elems::I8 { .. } => {
            src.load(start, buf);
            buf
        }
    }
}

/// `out[start + i] = vals[i]` rounded to `out`'s type.
#[inline(always)]
pub(crate) fn narrow(out: &mut ElemsMut<'_>, start: usize, vals: &[f32]) {
    let n = vals.len();
    match out {
        ElemsMut::F32(s) => s[start..start + n].copy_from_slice(vals),
        ElemsMut::Bf16(s) => {
            for (o, &v) in s[start..start + n].iter_mut().zip(vals) {
                *o = f32_to_bf16(v);
            }
        }
        ElemsMut::F16(s) => s[start..start + n]
            .reinterpret_cast_mut::<f16>()
            .convert_from_f32_slice(vals),
    }
}

/// Runs `$body`, a loop writing `$o[j] = $conv(value)` (`$conv` rounds an f32 to the
/// element type of `$o`), for `out[start .. start + scratch.len()]`: f32 and bf16 outputs
/// are written directly, fp16 goes through `scratch` and the `half` crate's slice
/// conversion. A macro, not a closure, so the loop is compiled inside the caller's
/// `#[target_feature]` function.
macro_rules! store_row {
    ($out:expr, $start:expr, $scratch:expr, |$o:ident, $conv:ident| $body:block) => {{
        let (out, start, scratch): (&mut ElemsMut<'_>, usize, &mut [f32]) =
            ($out, $start, $scratch);
        let n = scratch.len();
        match out {
            ElemsMut::F32(s) => {
                let $o = &mut s[start..start + n];
                let $conv = |v: f32| v;
                $body
            }
            ElemsMut::Bf16(s) => {
                let $o = &mut s[start..start + n];
                let $conv = $crate::fused::f32_to_bf16;
                $body
            }
            ElemsMut::F16(_) => {
                {
                    let $o = &mut *scratch;
                    let $conv = |v: f32| v;
                    $body
                }
                $crate::fused::narrow(out, start, scratch);
            }
        }
    }};
}
pub(crate) use store_row;

/// Defines `fn $name(args)` running `$body` (an `#[inline(always)]` function) compiled for
/// AVX-512 F + BW + FMA, or else AVX2 + FMA, when the CPU has them (detected at run time),
/// else for the build's baseline target. Enabling FMA contracts nothing: only explicit
/// `mul_add` calls become FMAs (in the baseline build they are libm's `fmaf`, same bits).
macro_rules! dispatch {
    ($name:ident => $body:ident($($arg:ident: $ty:ty),* $(,)?)) => {
        fn $name($($arg: $ty),*) {
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f,avx512bw,fma")]
                fn avx512($($arg: $ty),*) {
                    $body($($arg),*)
                }
                #[target_feature(enable = "avx2,fma")]
                fn avx2($($arg: $ty),*) {
                    $body($($arg),*)
                }
                if std::arch::is_x86_feature_detected!("avx512f")
                    && std::arch::is_x86_feature_detected!("avx512bw")
                    && std::arch::is_x86_feature_detected!("fma")
                {
                    // SAFETY: `avx512` is `$body` compiled with AVX-512F/BW and FMA allowed,
                    // and the CPU was just found to have all three.
                    unsafe { avx512($($arg),*) };
                    return;
                }
                if std::arch::is_x86_feature_detected!("avx2")
                    && std::arch::is_x86_feature_detected!("fma")
                {
                    // SAFETY: `avx2` is `$body` compiled with AVX2 and FMA allowed, both just
                    // detected.
                    unsafe { avx2($($arg),*) };
                    return;
                }
            }
            $body($($arg),*)
        }
    };
}
pub(crate) use dispatch;

#[cfg(test)]
pub(crate) mod testing {
    use super::*;
    use half::bf16;

    /// The storage types, by name.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub enum Ty {
        F32,
        Bf16,
        F16,
    }

    pub const TYPES: [Ty; 3] = [Ty::F32, Ty::Bf16, Ty::F16];

    /// Values stored as `ty`, kept as bits or floats.
    #[derive(Clone, Debug)]
    pub enum Buf {
        F32(Vec<f32>),
        U16(Vec<u16>, Ty),
    }

    impl Buf {
        /// `vals` rounded to `ty` (scalar conversions of the `half` crate).
        pub fn new(ty: Ty, vals: &[f32]) -> Buf {
            match ty {
                Ty::F32 => Buf::F32(vals.to_vec()),
                Ty::Bf16 => Buf::U16(
                    vals.iter().map(|&v| bf16::from_f32(v).to_bits()).collect(),
                    ty,
                ),
                Ty::F16 => Buf::U16(
                    vals.iter().map(|&v| f16::from_f32(v).to_bits()).collect(),
                    ty,
                ),
            }
        }
        pub fn zeros(ty: Ty, n: usize) -> Buf {
            Buf::new(ty, &vec![0.0; n])
        }
        pub fn elems(&self) -> Elems<'_> {
            match self {
                Buf::F32(v) => Elems::F32(v),
                Buf::U16(v, Ty::Bf16) => Elems::Bf16(v),
                Buf::U16(v, _) => Elems::F16(v),
            }
        }
        pub fn elems_mut(&mut self) -> ElemsMut<'_> {
            match self {
                Buf::F32(v) => ElemsMut::F32(v),
                Buf::U16(v, Ty::Bf16) => ElemsMut::Bf16(v),
                Buf::U16(v, _) => ElemsMut::F16(v),
            }
        }
        /// The values widened to f32.
        pub fn f32s(&self) -> Vec<f32> {
            match self {
                Buf::F32(v) => v.clone(),
                Buf::U16(v, Ty::Bf16) => v.iter().map(|&b| bf16::from_bits(b).to_f32()).collect(),
                Buf::U16(v, _) => v.iter().map(|&b| f16::from_bits(b).to_f32()).collect(),
            }
        }
        /// The stored bits, as u32 (f32 bits or u16 bits), for exact comparisons.
        pub fn bits(&self) -> Vec<u32> {
            match self {
                Buf::F32(v) => v.iter().map(|x| x.to_bits()).collect(),
                Buf::U16(v, _) => v.iter().map(|&b| b as u32).collect(),
            }
        }
    }

    /// `vals` rounded to `ty` by the `half` crate's scalar conversions, as bits.
    pub fn round_bits(ty: Ty, vals: &[f32]) -> Vec<u32> {
        Buf::new(ty, vals).bits()
    }

    /// `n` values in about `-scale .. scale` from `seed` (an LCG).
    pub fn values(seed: u64, n: usize, scale: f32) -> Vec<f32> {
        let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
        (0..n)
            .map(|_| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::bf16;

    #[test]
    fn bf16_rounding_matches_the_half_crate() {
        let mut vals = testing::values(1, 5000, 1e3);
        vals.extend([
            0.0,
            -0.0,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::MAX,
            f32::MIN_POSITIVE,
            1e-40,
            f32::from_bits(0x3f80_8000), // a tie, rounds to even (down)
            f32::from_bits(0x3f81_8000), // a tie, rounds up
            f32::from_bits(0x7f7f_ffff),
        ]);
        for v in vals {
            assert_eq!(f32_to_bf16(v), bf16::from_f32(v).to_bits(), "{v:e}");
            assert_eq!(bf16_to_f32(f32_to_bf16(v)), bf16::from_f32(v).to_f32());
        }
        assert_eq!(f32_to_bf16(f32::NAN), 0x7fc0);
    }
}

/// Wall time per call at the decode sizes of SmolLM2-135M (batch 64), on this thread:
/// `cargo test -p ferrobatch-kernels --release kernel_times -- --ignored --nocapture`.
#[cfg(test)]
mod timing {
    use super::testing::{values, Buf, Ty};
    use super::*;

    fn time(name: &str, mut f: impl FnMut()) {
        let mut best = f64::MAX;
        for _ in 0..7 {
            let t = std::time::Instant::now();
            for _ in 0..500 {
                f();
            }
            best = best.min(t.elapsed().as_secs_f64() / 500.0 * 1e6);
        }
        eprintln!("{name}: {best:.2} us");
    }

    #[test]
    #[ignore]
    fn kernel_times() {
        let (t, h, i) = (64, 576, 1536);
        let x = values(1, t * h, 2.0);
        let w = Buf::new(Ty::Bf16, &values(2, h, 1.0));
        let mut out = Buf::zeros(Ty::Bf16, t * h);
        let mut outf = Buf::zeros(Ty::F32, t * h);
        let a = RmsNorm {
            weight: w.elems(),
            rows: t,
            hidden: h,
            eps: 1e-5,
            weight_offset: 0.0,
            threads: 1,
        };
        time("norm f32->bf16", || {
            rms_norm(&a, NormInput::Plain(Elems::F32(&x)), out.elems_mut()).unwrap()
        });
        time("norm f32->f32", || {
            rms_norm(&a, NormInput::Plain(Elems::F32(&x)), outf.elems_mut()).unwrap()
        });
        let gu = Buf::new(Ty::Bf16, &values(3, t * 2 * i, 4.0));
        let mut so = Buf::zeros(Ty::Bf16, t * i);
        time("silu bf16->bf16", || {
            silu_mul(gu.elems(), so.elems_mut(), t, i, 1).unwrap()
        });
        let guf = Buf::new(Ty::F32, &values(3, t * 2 * i, 4.0));
        let mut sof = Buf::zeros(Ty::F32, t * i);
        time("silu f32->f32", || {
            silu_mul(guf.elems(), sof.elems_mut(), t, i, 1).unwrap()
        });
        let src = Buf::new(Ty::Bf16, &values(4, t * 960, 2.0));
        let cs = values(5, t * 64, 1.0);
        let mut ro = Buf::zeros(Ty::Bf16, t * 576);
        let r = Rope {
            src: src.elems(),
            cos: &cs,
            sin: &cs,
            rows: t,
            src_width: 960,
            col_offset: 0,
            heads: 9,
            dim: 64,
            rot: 64,
            threads: 1,
        };
        time("rope q bf16->bf16", || rope(&r, ro.elems_mut()).unwrap());
        let mut cache = Buf::zeros(Ty::Bf16, 4096 * 192);
        let slots: Vec<i64> = (0..t as i64).map(|k| k * 61 % 4096).collect();
        let wr = WriteRows {
            src: src.elems(),
            src_width: 960,
            col_offset: 768,
            width: 192,
            slots: &slots,
        };
        time("write_rows bf16", || {
            write_rows(&wr, cache.elems_mut()).unwrap()
        });
    }
}
