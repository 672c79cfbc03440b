//! Instructions written as inline assembly because LLVM lowers their intrinsic to something
//! slower: `vpdpwssd` (AVX-512 VNNI, i16 pairs into i32), which LLVM's generic tuning
//! often splits into `vpmaddwd` + `vpaddd`, twice the instructions (measured in
//! `i16_linear`'s 6 x 4 pass at ~55% of the peak).

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::__m512i;

/// `acc + x * w` by pairs of i16 into i32 lanes (`vpdpwssd`).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
#[inline]
pub(crate) fn dpwssd(mut acc: __m512i, x: __m512i, w: __m512i) -> __m512i {
    // SAFETY: one register-only instruction of AVX-512 VNNI, which this function's target
    // features require of the CPU; it reads `x`, `w` and `acc`, writes `acc`, and touches
    // no memory, stack or flags.
    unsafe {
        std::arch::asm!(
            "vpdpwssd {acc}, {x}, {w}",
            acc = inout(zmm_reg) acc,
            x = in(zmm_reg) x,
            w = in(zmm_reg) w,
            options(pure, nomem, nostack, preserves_flags),
        );
    }
    acc
}
