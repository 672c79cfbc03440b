//! The one-core peak of the dot-product instructions the products run on: `vpdpbusd`
//! (AVX-512 VNNI, int8: 128 operations a zmm instruction), `vdpbf16ps` (AVX-512 BF16: 64
//! flops) and `vfmadd231ps` (AVX-512 F: 32 flops), each as 12 independent chains of zmm
//! registers (no memory operands), the best of `repeats` timings. The figure a product's
//! GOP/s or GFLOP/s is compared with (docs/benchmarks.md). Instructions the CPU lacks are
//! reported as absent, not timed.
//!
//!     taskset -c 1 cargo run --release -p ferrobatch-kernels --example isa_peak [repeats]

#[cfg(target_arch = "x86_64")]
mod probe {
    use std::arch::asm;
    use std::time::Instant;

    /// Loop iterations a timing (12 instructions each).
    const ITERS: u64 = 20_000_000;

    /// Seconds of `ITERS` iterations of 12 independent `$op zmm13, zmm14, zmmI` chains.
    macro_rules! chains {
        ($name:ident, $op:literal) => {
            /// # Safety
            /// The CPU has the instruction (checked by the caller).
            unsafe fn $name() -> f64 {
                let start = Instant::now();
                let mut n = ITERS;
                // SAFETY: register-only arithmetic on zmm0-11, 13, 14 (declared clobbered)
                // and a loop counter; no memory is read or written, and the caller checked
                // that the CPU has the instruction.
                unsafe {
                    asm!(
                        "vpxord zmm13, zmm13, zmm13",
                        "vpxord zmm14, zmm14, zmm14",
                        "2:",
                        concat!($op, " zmm0, zmm13, zmm14"),
                        concat!($op, " zmm1, zmm13, zmm14"),
                        concat!($op, " zmm2, zmm13, zmm14"),
                        concat!($op, " zmm3, zmm13, zmm14"),
                        concat!($op, " zmm4, zmm13, zmm14"),
                        concat!($op, " zmm5, zmm13, zmm14"),
                        concat!($op, " zmm6, zmm13, zmm14"),
                        concat!($op, " zmm7, zmm13, zmm14"),
                        concat!($op, " zmm8, zmm13, zmm14"),
                        concat!($op, " zmm9, zmm13, zmm14"),
                        concat!($op, " zmm10, zmm13, zmm14"),
                        concat!($op, " zmm11, zmm13, zmm14"),
                        "dec {n}",
                        "jnz 2b",
                        n = inout(reg) n,
                        out("zmm0") _, out("zmm1") _, out("zmm2") _, out("zmm3") _,
                        out("zmm4") _, out("zmm5") _, out("zmm6") _, out("zmm7") _,
                        out("zmm8") _, out("zmm9") _, out("zmm10") _, out("zmm11") _,
                        out("zmm13") _, out("zmm14") _,
                        options(nomem, nostack),
                    );
                }
                let _ = n;
                start.elapsed().as_secs_f64()
            }
        };
    }

    chains!(dpbusd, "vpdpbusd");
    chains!(dpbf16, "vdpbf16ps");
    chains!(fmadd, "vfmadd231ps");

    /// One probe: its name, what it counts, operations an instruction, whether the CPU has
    /// it, its timing.
    type Probe = (&'static str, &'static str, f64, bool, unsafe fn() -> f64);

    pub fn run(repeats: usize) {
        let probes: [Probe; 3] = [
            (
                "vpdpbusd zmm (int8)",
                "GOP/s",
                128.0,
                is_x86_feature_detected!("avx512vnni"),
                dpbusd,
            ),
            (
                "vdpbf16ps zmm (bf16)",
                "GFLOP/s",
                64.0,
                is_x86_feature_detected!("avx512bf16"),
                dpbf16,
            ),
            (
                "vfmadd231ps zmm (fp32)",
                "GFLOP/s",
                32.0,
                is_x86_feature_detected!("avx512f"),
                fmadd,
            ),
        ];
        for (name, unit, ops, present, time) in probes {
            if !present {
                println!("{name:<24} absent on this CPU");
                continue;
            }
            // SAFETY: the CPU has the instruction (`present`).
            let best = (0..repeats)
                .map(|_| unsafe { time() })
                .fold(f64::INFINITY, f64::min);
            let rate = (ITERS * 12) as f64 * ops / best / 1e9;
            println!("{name:<24} {rate:8.1} {unit} (one core, best of {repeats})");
        }
    }
}

fn main() {
    let repeats = std::env::args()
        .nth(1)
        .map_or(5, |s| s.parse().expect("repeats: a number"));
    #[cfg(target_arch = "x86_64")]
    probe::run(repeats);
    #[cfg(not(target_arch = "x86_64"))]
    println!("isa_peak probes x86-64 instructions only ({repeats} repeats asked)");
}
