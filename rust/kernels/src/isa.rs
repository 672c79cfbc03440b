//! The instruction sets the kernels use, detected at run time, and the one gate every test
//! that needs one goes through.
//!
//! An ISA is named as `/proc/cpuinfo` lists its flag; these are the recognised names (their
//! one list is `Isa::name`, which `tests/isa_helpers.py` and `.ci/run` read from this file):
//!
//! | name | what |
//! |---|---|
//! | `avx2`, `fma` | AVX2, FMA3 (the fused kernels' and the decode kernel's fallback paths) |
//! | `avx512f`, `avx512bw` | AVX-512 Foundation, Byte and Word |
//! | `avx512_bf16` | AVX-512 BF16 (`vdpbf16ps`: the bf16 products without AMX) |
//! | `avx512_vnni` | AVX-512 VNNI (`vpdpwssd`: the exact int16 products) |
//! | `amx_tile`, `amx_bf16` | AMX bf16 tiles this process may use ([`amx_usable`]) |
//! | `amx_int8` | AMX int8 tiles this process may use ([`amx_int8_usable`]: the quantized products of many rows) |
//!
//! A test that needs an ISA the machine lacks calls `require_or_skip`, which prints
//! `SKIPPED: needs <isa> (<test>)` to stderr and lets the test return (it passes, as skipped); where
//! the environment variable [`REQUIRE_ENV`] (`FERROBATCH_REQUIRE_ISA`, a comma list of the
//! names above) names a missing ISA, the skip is a failure instead: a machine that has the
//! ISA (CI sets the variable from its `/proc/cpuinfo`) cannot pass a test it never ran.

/// One instruction set of the table in the module docs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Isa {
    Avx2,
    Fma,
    Avx512F,
    Avx512Bw,
    Avx512Bf16,
    Avx512Vnni,
    AmxTile,
    AmxBf16,
    AmxInt8,
}

/// The environment variable that turns a skip for want of an ISA into a failure.
pub const REQUIRE_ENV: &str = "FERROBATCH_REQUIRE_ISA";

impl Isa {
    /// Every recognised ISA.
    pub const ALL: [Isa; 9] = [
        Isa::Avx2,
        Isa::Fma,
        Isa::Avx512F,
        Isa::Avx512Bw,
        Isa::Avx512Bf16,
        Isa::Avx512Vnni,
        Isa::AmxTile,
        Isa::AmxBf16,
        Isa::AmxInt8,
    ];

    /// The name (`/proc/cpuinfo`'s flag).
    pub fn name(self) -> &'static str {
        match self {
            Isa::Avx2 => "avx2",
            Isa::Fma => "fma",
            Isa::Avx512F => "avx512f",
            Isa::Avx512Bw => "avx512bw",
            Isa::Avx512Bf16 => "avx512_bf16",
            Isa::Avx512Vnni => "avx512_vnni",
            Isa::AmxTile => "amx_tile",
            Isa::AmxBf16 => "amx_bf16",
            Isa::AmxInt8 => "amx_int8",
        }
    }

    /// The ISA of a recognised name (case and surrounding blanks ignored).
    pub fn from_name(name: &str) -> Option<Isa> {
        let name = name.trim().to_ascii_lowercase();
        Isa::ALL.into_iter().find(|isa| isa.name() == name)
    }

    /// Whether this process can run it (asked once per process by the detection macros).
    pub fn detected(self) -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::is_x86_feature_detected as has;
            match self {
                Isa::Avx2 => has!("avx2"),
                Isa::Fma => has!("fma"),
                Isa::Avx512F => has!("avx512f"),
                Isa::Avx512Bw => has!("avx512bw"),
                Isa::Avx512Bf16 => has!("avx512bf16"),
                Isa::Avx512Vnni => has!("avx512vnni"),
                Isa::AmxTile | Isa::AmxBf16 => amx_usable(),
                Isa::AmxInt8 => amx_int8_usable(),
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            false
        }
    }
}

/// Whether this process can run every ISA of `isas`.
pub fn all_detected(isas: &[Isa]) -> bool {
    isas.iter().all(|isa| isa.detected())
}

/// Whether this process may run AMX bf16 tile products: the CPU has AMX-TILE and AMX-BF16,
/// the OS saves the tile state (XCR0 bits 17 and 18), and the kernel granted this process
/// the tile data (`arch_prctl(ARCH_REQ_XCOMP_PERM)`, asked once).
pub fn amx_usable() -> bool {
    amx_tiles().bf16
}

/// Whether this process may run AMX int8 tile products (`tdpbsud`): as [`amx_usable`], with
/// AMX-INT8 in place of AMX-BF16.
pub fn amx_int8_usable() -> bool {
    amx_tiles().int8
}

/// Whether the CPU runs each 512-bit vector operation as two 256-bit halves: AMD Zen 4
/// (vendor "AuthenticAMD", family 0x19 with AVX-512). There the many-rows quantized kernels,
/// which unpack the weights into a scratch of 512-bit lines, lose to the panel kernels
/// below ~128 rows (`quant::many_rows`). Zen 5 (family 0x1A) and Intel's cores answer false.
pub fn splits_512() -> bool {
    static SPLITS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *SPLITS.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::x86_64::__cpuid;
            let vendor = __cpuid(0);
            let amd = [vendor.ebx, vendor.edx, vendor.ecx]
                .iter()
                .flat_map(|r| r.to_le_bytes())
                .eq(*b"AuthenticAMD");
            let eax = __cpuid(1).eax;
            // the family: base (bits 8-11) plus extended (bits 20-27) where base is 0xF
            let family = ((eax >> 8) & 0xF)
                + if (eax >> 8) & 0xF == 0xF {
                    (eax >> 20) & 0xFF
                } else {
                    0
                };
            amd && family == 0x19 && Isa::Avx512F.detected()
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            false
        }
    })
}

/// Which AMX products this process may run (both false where the tiles are unusable).
#[derive(Clone, Copy, Debug, Default)]
struct AmxTiles {
    bf16: bool,
    int8: bool,
}

fn amx_tiles() -> AmxTiles {
    static USABLE: std::sync::OnceLock<AmxTiles> = std::sync::OnceLock::new();
    *USABLE.get_or_init(amx::detect)
}

#[cfg(target_arch = "x86_64")]
mod amx {
    use std::arch::x86_64::{__cpuid_count, _xgetbv};

    unsafe extern "C" {
        fn syscall(number: i64, ...) -> i64;
    }
    const SYS_ARCH_PRCTL: i64 = 158;
    const ARCH_REQ_XCOMP_PERM: i64 = 0x1023;
    const XFEATURE_XTILEDATA: i64 = 18;

    pub(super) fn detect() -> super::AmxTiles {
        // cpuid leaf 7 reports zeros where a feature is missing
        let leaf7 = __cpuid_count(7, 0);
        let tile = leaf7.edx & (1 << 24) != 0;
        let (bf16, int8) = (leaf7.edx & (1 << 22) != 0, leaf7.edx & (1 << 25) != 0);
        let osxsave = __cpuid_count(1, 0).ecx & (1 << 27) != 0;
        let none = super::AmxTiles::default();
        if !(tile && (bf16 || int8) && osxsave) {
            return none;
        }
        // SAFETY: xgetbv is available because OSXSAVE is set (checked just above).
        let xcr0 = unsafe { _xgetbv(0) };
        if xcr0 & (0b11 << 17) != 0b11 << 17 {
            return none;
        }
        // SAFETY: arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA) only changes which XSAVE
        // features this process may use; it reads no memory of ours. 0 means granted (also
        // when torch's oneDNN asked first).
        let granted =
            unsafe { syscall(SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 };
        super::AmxTiles {
            bf16: granted && bf16,
            int8: granted && int8,
        }
    }
}

#[cfg(not(target_arch = "x86_64"))]
mod amx {
    pub(super) fn detect() -> super::AmxTiles {
        super::AmxTiles::default()
    }
}

/// The ISAs `value` (a [`REQUIRE_ENV`] value) names, or the first name it does not
/// recognise.
pub fn parse_required(value: &str) -> Result<Vec<Isa>, String> {
    value
        .split(',')
        .filter(|name| !name.trim().is_empty())
        .map(|name| Isa::from_name(name).ok_or_else(|| name.trim().to_string()))
        .collect()
}

/// The gate of a test that needs every ISA of `needs`: true where this process has them
/// all. Otherwise prints `SKIPPED: needs <isa>, ...` to stderr and returns false (the test
/// returns, and passes as skipped), or panics (fails the test) where `FERROBATCH_REQUIRE_ISA`
/// names a missing one. Panics too where the variable names an ISA this module does not
/// recognise (a typo would otherwise require nothing).
#[cfg(test)]
pub(crate) fn require_or_skip(needs: &[Isa]) -> bool {
    use std::io::Write;
    let value = std::env::var(REQUIRE_ENV).unwrap_or_default();
    let required = parse_required(&value).unwrap_or_else(|name| {
        let known: Vec<&str> = Isa::ALL.iter().map(|isa| isa.name()).collect();
        panic!(
            "{REQUIRE_ENV} names {name:?}, not a recognised ISA ({})",
            known.join(", ")
        )
    });
    let missing: Vec<Isa> = needs
        .iter()
        .copied()
        .filter(|isa| !isa.detected())
        .collect();
    if missing.is_empty() {
        return true;
    }
    let names = |isas: &[Isa]| {
        isas.iter()
            .map(|isa| isa.name())
            .collect::<Vec<_>>()
            .join(", ")
    };
    let forced: Vec<Isa> = missing
        .iter()
        .copied()
        .filter(|isa| required.contains(isa))
        .collect();
    let test = std::thread::current()
        .name()
        .unwrap_or("a test")
        .to_string();
    assert!(
        forced.is_empty(),
        "{test} needs {} and {REQUIRE_ENV} requires it, but this process cannot run it",
        names(&forced)
    );
    // (straight to the stream: libtest keeps what `eprintln!` writes for failures only)
    let _ = writeln!(
        std::io::stderr().lock(),
        "SKIPPED: needs {} ({test})",
        names(&missing)
    );
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for isa in Isa::ALL {
            assert_eq!(Isa::from_name(isa.name()), Some(isa));
        }
        assert_eq!(Isa::from_name(" AVX512_BF16 "), Some(Isa::Avx512Bf16));
        assert_eq!(Isa::from_name("avx512"), None);
    }

    #[test]
    fn the_variable_is_a_comma_list_of_names() {
        assert_eq!(parse_required(""), Ok(vec![]));
        assert_eq!(
            parse_required("avx512f, avx512_vnni,,amx_tile"),
            Ok(vec![Isa::Avx512F, Isa::Avx512Vnni, Isa::AmxTile])
        );
        assert_eq!(parse_required("avx512f,avx512"), Err("avx512".into()));
    }

    #[test]
    fn amx_implies_its_bf16_and_nothing_is_needed_of_an_empty_list() {
        assert_eq!(Isa::AmxTile.detected(), Isa::AmxBf16.detected());
        assert!(require_or_skip(&[]));
    }
}
