//! Tests of the quantized products: the table against the layout, decoding against a
//! direct reading of the block layouts, packing round trips, and every product path (the
//! GGUF-row `vec_dot`, portable and VNNI panels) equal bit for bit and within a stated bound
//! of the f64 product of the dequantized weights.

use super::blocks::{self, decode, Block, IQ4_VALUES};
use super::packing::{decode_panel, panel_block_bytes, streams};
use super::*;
use crate::isa::Isa;
use half::f16;
use proptest::prelude::*;

fn vnni() -> bool {
    crate::isa::require_or_skip(&[Isa::Avx512F, Isa::Avx512Bw, Isa::Avx512Vnni])
        && Backend::Avx512Vnni.available()
}

fn amx() -> bool {
    crate::isa::require_or_skip(&[Isa::Avx512F, Isa::Avx512Bw, Isa::Avx512Vnni, Isa::AmxInt8])
        && Backend::AmxInt8.available()
}

/// The many-rows backends this machine runs (AVX-512 VNNI's register tiles, the AMX int8
/// tiles), each skipped (or required) as [`crate::isa::require_or_skip`] says.
fn many_rows_backends() -> Vec<Backend> {
    let mut backends = Vec::new();
    if vnni() {
        backends.push(Backend::Avx512Vnni);
    }
    if amx() {
        backends.push(Backend::AmxInt8);
    }
    backends
}

thread_local! {
    static LEAST_MANY: std::cell::Cell<Option<usize>> = const { std::cell::Cell::new(None) };
}

/// The fewest rows of the many-rows kernels that this test thread set ([`ManyRowsFrom`]).
pub(super) fn least_many() -> Option<usize> {
    LEAST_MANY.with(|c| c.get())
}

/// While held, this thread's calls of [`linear`] take the many-rows kernels from the rows
/// it was set to, whatever the CPU's default ([`super::many_rows_least`]): the many-rows
/// tests run the many-rows kernels on every CPU.
struct ManyRowsFrom;

impl ManyRowsFrom {
    fn set(least: usize) -> ManyRowsFrom {
        LEAST_MANY.with(|c| c.set(Some(least)));
        ManyRowsFrom
    }
}

impl Drop for ManyRowsFrom {
    fn drop(&mut self) {
        LEAST_MANY.with(|c| c.set(None));
    }
}

fn avx2() -> bool {
    crate::isa::require_or_skip(&[Isa::Avx2, Isa::Fma]) && Backend::Avx2.available()
}

/// SplitMix64.
pub(crate) struct Rng(pub(crate) u64);

impl Rng {
    pub(super) fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// uniform in [lo, hi)
    pub(crate) fn uniform(&mut self, lo: f32, hi: f32) -> f32 {
        lo + (hi - lo) * ((self.next() >> 40) as f32 / (1u64 << 24) as f32)
    }
    pub(super) fn sign(&mut self) -> f32 {
        if self.next() & 1 == 0 {
            1.0
        } else {
            -1.0
        }
    }
}

fn put_half(b: &mut [u8], at: usize, v: f32) {
    b[at..at + 2].copy_from_slice(&f16::from_f32(v).to_le_bytes());
}

/// GGUF rows of `n` random blocks-rows: random bytes, then sane fp16 factors (`d` of
/// either sign in [1e-3, 5e-2), `dmin` / `m` in [0, 5e-2)).
pub(super) fn random_rows(qt: QType, n: usize, k: usize, seed: u64) -> Vec<u8> {
    let mut rng = Rng(seed);
    let bb = qt.block_bytes();
    let mut out: Vec<u8> = (0..n * k / qt.block() * bb)
        .map(|_| rng.next() as u8)
        .collect();
    for b in out.chunks_exact_mut(bb) {
        let d = rng.sign() * rng.uniform(1e-3, 5e-2);
        let e = rng.uniform(0.0, 5e-2);
        match qt {
            QType::Q8_0 | QType::Q4_0 | QType::Q5_0 | QType::IQ4_NL => put_half(b, 0, d),
            QType::Q4_1 | QType::Q5_1 => {
                put_half(b, 0, d);
                put_half(b, 2, -e);
            }
            QType::Q4_K | QType::Q5_K => {
                put_half(b, 0, d.abs());
                put_half(b, 2, e);
            }
            QType::Q6_K => put_half(b, 208, d),
            QType::Q3_K => put_half(b, 108, d),
            QType::Q2_K => {
                put_half(b, 80, d.abs());
                put_half(b, 82, e);
            }
            QType::IQ4_XS => put_half(b, 0, d),
            // (2^(e - 128) from 2^-18 to 2^-2: a d of [1e-3, 5e-2) at the middle)
            QType::MXFP4 => b[0] = 110 + (rng.next() % 27) as u8,
        }
    }
    out
}

/// Inputs in [-1, 1), with a few blocks of large values.
fn random_x(m: usize, k: usize, seed: u64) -> Vec<f32> {
    let mut rng = Rng(seed);
    (0..m * k)
        .map(|i| {
            let big = if (i / 32) % 7 == 3 { 20.0 } else { 1.0 };
            big * rng.uniform(-1.0, 1.0)
        })
        .collect()
}

/// The weights of a block read directly from the layout tables of
/// `quantized-formats.md` (an independent reading of the bit positions).
fn direct(qt: QType, b: &[u8]) -> Vec<f64> {
    let h = |at: usize| f64::from(f16::from_bits(u16::from_le_bytes([b[at], b[at + 1]])).to_f32());
    let k4 = |s: &[u8], j: usize| -> (f64, f64) {
        if j < 4 {
            (f64::from(s[j] & 63), f64::from(s[j + 4] & 63))
        } else {
            (
                f64::from((s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4)),
                f64::from((s[j + 4] >> 4) | ((s[j] >> 6) << 4)),
            )
        }
    };
    match qt {
        QType::Q8_0 => (0..32).map(|t| h(0) * f64::from(b[2 + t] as i8)).collect(),
        QType::Q4_0 | QType::Q4_1 => {
            let (qs, m) = if qt == QType::Q4_0 {
                (&b[2..18], None)
            } else {
                (&b[4..20], Some(h(2)))
            };
            (0..32)
                .map(|t| {
                    let q = f64::from(if t < 16 { qs[t] & 0xF } else { qs[t - 16] >> 4 });
                    match m {
                        None => h(0) * (q - 8.0),
                        Some(m) => h(0) * q + m,
                    }
                })
                .collect()
        }
        QType::Q4_K | QType::Q5_K => {
            let q5 = qt == QType::Q5_K;
            let qs = if q5 { &b[48..176] } else { &b[16..144] };
            (0..256)
                .map(|t| {
                    let (sc, m) = k4(&b[4..16], t / 32);
                    // chunk of 64: low nibbles of 32 bytes, then high nibbles
                    let byte = qs[32 * (t / 64) + t % 32];
                    let mut q = if t % 64 < 32 { byte & 0xF } else { byte >> 4 };
                    if q5 {
                        q |= ((b[16 + t % 32] >> (t / 32)) & 1) << 4;
                    }
                    h(0) * sc * f64::from(q) - h(2) * m
                })
                .collect()
        }
        QType::Q5_0 | QType::Q5_1 | QType::IQ4_NL => {
            // d, [m], [qh: u32, bit t the fifth bit of weight t], qs (weight t: nibble
            // t % 16 of byte t % 16, low for t < 16)
            let (qh, qs, m) = match qt {
                QType::Q5_0 => (Some(&b[2..6]), &b[6..22], 0.0),
                QType::Q5_1 => (Some(&b[4..8]), &b[8..24], h(2)),
                _ => (None, &b[2..18], 0.0),
            };
            (0..32)
                .map(|t| {
                    let lo = if t < 16 { qs[t] & 0xF } else { qs[t - 16] >> 4 };
                    let hi = qh.map_or(0, |qh| (qh[t / 8] >> (t % 8)) & 1);
                    let q = f64::from(lo | (hi << 4));
                    match qt {
                        QType::Q5_0 => h(0) * (q - 16.0),
                        QType::Q5_1 => h(0) * q + m,
                        _ => {
                            const KV: [f64; 16] = [
                                -127.0, -104.0, -83.0, -65.0, -49.0, -35.0, -22.0, -10.0, 1.0,
                                13.0, 25.0, 38.0, 53.0, 69.0, 89.0, 113.0,
                            ];
                            h(0) * KV[usize::from(lo)]
                        }
                    }
                })
                .collect()
        }
        QType::Q6_K => (0..256)
            .map(|t| {
                let (half, r) = (t / 128, t % 128);
                let ql = b[64 * half + r % 64];
                let lo = if r < 64 { ql & 0xF } else { ql >> 4 };
                let hi = (b[128 + 32 * half + r % 32] >> (2 * (r / 32))) & 3;
                let q = f64::from(lo | (hi << 4)) - 32.0;
                h(208) * f64::from(b[192 + t / 16] as i8) * q
            })
            .collect(),
        QType::Q3_K => (0..256)
            .map(|t| {
                // scales: the 12 bytes as 16 six-bit values, low nibbles in bytes 0-7
                // (two a byte), top two bits in bytes 8-11 (four a byte)
                let j = t / 16;
                let s = &b[96..108];
                let sc =
                    (s[j % 8] >> (4 * (j / 8))) & 15 | ((s[8 + j % 4] >> (2 * (j / 4))) & 3) << 4;
                let lo = (b[32 + 32 * (t / 128) + t % 32] >> (2 * ((t / 32) % 4))) & 3;
                let high = (b[t % 32] >> (t / 32)) & 1;
                // the hmask bit set: no offset; clear: -4
                let q = f64::from(lo) - if high == 1 { 0.0 } else { 4.0 };
                h(108) * (f64::from(sc) - 32.0) * q
            })
            .collect(),
        QType::Q2_K => (0..256)
            .map(|t| {
                let s = b[t / 16];
                let q = (b[16 + 32 * (t / 128) + t % 32] >> (2 * ((t / 32) % 4))) & 3;
                h(80) * f64::from(s & 15) * f64::from(q) - h(82) * f64::from(s >> 4)
            })
            .collect(),
        QType::MXFP4 => (0..32)
            .map(|t| {
                // e8m0 byte 0, then weight t: nibble of byte 1 + t % 16, low for t < 16;
                // the value 2^(e - 128) times the doubled E2M1 value of the nibble
                const V: [f64; 16] = [
                    0., 1., 2., 3., 4., 6., 8., 12., 0., -1., -2., -3., -4., -6., -8., -12.,
                ];
                let byte = b[1 + t % 16];
                let idx = if t < 16 { byte & 15 } else { byte >> 4 };
                (f64::from(b[0]) - 128.0).exp2() * V[usize::from(idx)]
            })
            .collect(),
        QType::IQ4_XS => (0..256)
            .map(|t| {
                const V: [f64; 16] = [
                    -127., -104., -83., -65., -49., -35., -22., -10., 1., 13., 25., 38., 53., 69.,
                    89., 113.,
                ];
                let j = t / 32;
                let sh = u16::from_le_bytes([b[2], b[3]]);
                let sc = (b[4 + j / 2] >> (4 * (j % 2))) & 15 | (((sh >> (2 * j)) & 3) as u8) << 4;
                let byte = b[8 + 16 * j + t % 16];
                let idx = if t % 32 < 16 { byte & 15 } else { byte >> 4 };
                h(0) * (f64::from(sc) - 32.0) * V[usize::from(idx)]
            })
            .collect(),
    }
}

#[test]
fn the_table_matches_the_layout() {
    for (i, qt) in QType::ALL.into_iter().enumerate() {
        let t = qt.traits();
        assert_eq!(t.qtype, qt);
        assert_eq!(qt as usize, i);
        assert_eq!(t.block, qt.block());
        assert_eq!(t.panel_block_bytes, panel_block_bytes(qt));
        assert_eq!(
            streams(qt)[0] * 8,
            PANEL
                * qt.block()
                * match qt {
                    QType::Q8_0 => 8,
                    QType::Q3_K | QType::Q2_K => 2,
                    _ => 4,
                }
        );
        assert_eq!(QType::from_name(t.name), Some(qt));
        assert_eq!(QType::from_name(&t.name.to_uppercase()), Some(qt));
        assert_eq!(QType::from_ggml(t.ggml_type), Some(qt));
        // bits a weight: the GGUF size, and the packed size at most 4 bytes a block more
        let overhead = t.panel_block_bytes - PANEL * t.block_bytes;
        assert!(overhead <= 4 * PANEL, "{}", t.name);
    }
    assert_eq!(QType::from_name("q1_k"), None);
}

#[test]
fn decoding_matches_a_direct_reading_and_dequantize_rounds_it() {
    for qt in QType::ALL {
        let rows = random_rows(qt, 3, 2 * qt.block(), 7 + qt as u64);
        let mut out = vec![0f32; 3 * 2 * qt.block()];
        dequantize(qt, &rows, 3, 2 * qt.block(), &mut out).unwrap();
        for (b, o) in rows
            .chunks_exact(qt.block_bytes())
            .zip(out.chunks_exact(qt.block()))
        {
            for (t, (want, got)) in direct(qt, b).iter().zip(o).enumerate() {
                // f32 rounding of a product and a difference
                let tol = 4.0 * f64::from(f32::EPSILON) * (want.abs() + 1.0);
                assert!(
                    (want - f64::from(*got)).abs() <= tol,
                    "{} {t}: {want} {got}",
                    qt.name()
                );
            }
        }
    }
}

#[test]
fn packing_round_trips_and_pads_with_zero_blocks() {
    for qt in QType::ALL {
        for n in [1, 16, 17, 40] {
            let k = 3 * qt.block();
            let rows = random_rows(qt, n, k, 100 + n as u64);
            let mut packed = vec![0xAAu8; packed_len(qt, n, k).unwrap()];
            pack(qt, &rows, n, k, &mut packed, 2).unwrap();
            let nb = 3;
            let panel_bytes = nb * panel_block_bytes(qt);
            for (p, panel) in packed.chunks_exact(panel_bytes).enumerate() {
                for b in 0..nb {
                    let blks = decode_panel(qt, panel, nb, b);
                    for (c, blk) in blks.iter().enumerate() {
                        let col = p * PANEL + c;
                        let want = if col < n {
                            let bb = qt.block_bytes();
                            decode(qt, &rows[(col * nb + b) * bb..][..bb])
                        } else {
                            Block::ZERO
                        };
                        assert_eq!(*blk, want, "{} n {n} col {col} block {b}", qt.name());
                    }
                }
            }
        }
    }
}

/// The f64 product of the dequantized weights and the bound of `linear`'s distance to it
/// (module docs of `act` and `portable`): half an activation step per weight, plus f32
/// rounding of the weights' exact values and of `2 nb + 6` operations a block.
fn reference(
    qt: QType,
    rows: &[u8],
    x: &[f32],
    m: usize,
    n: usize,
    k: usize,
) -> (Vec<f64>, Vec<f64>) {
    let mut w = vec![0f32; n * k];
    dequantize(qt, rows, n, k, &mut w).unwrap();
    let bb = qt.block_bytes();
    // magnitude of each weight's terms (|d sc u| + |dmin m|), for cancellation
    let mag: Vec<f64> = rows
        .chunks_exact(bb)
        .flat_map(|b| {
            let blk = decode(qt, b);
            (0..qt.block()).map(move |t| {
                let u = f64::from(blk.codes[t]);
                let (d, e) = (f64::from(blk.d).abs(), f64::from(blk.e).abs());
                match qt {
                    QType::Q8_0 => d * (u - 128.0).abs(),
                    QType::Q4_0 => d * (u - 8.0).abs(),
                    QType::Q4_1 | QType::Q5_1 => d * u + e,
                    QType::Q5_0 => d * (u - 16.0).abs(),
                    QType::IQ4_NL => d * f64::from(IQ4_VALUES[usize::from(blk.codes[t])]).abs(),
                    QType::MXFP4 => {
                        d * f64::from(blocks::MXFP4_VALUES[usize::from(blk.codes[t])]).abs()
                    }
                    QType::Q4_K | QType::Q5_K => {
                        d * f64::from(blk.sc[t / 32]) * u + e * f64::from(blk.mn[t / 32])
                    }
                    QType::Q6_K => d * f64::from(blk.sc[t / 16]).abs() * (u - 32.0).abs(),
                    QType::Q3_K => d * f64::from(blk.sc[t / 16]).abs() * (u - 4.0).abs(),
                    QType::Q2_K => {
                        d * f64::from(blk.sc[t / 16]) * u + e * f64::from(blk.mn[t / 16])
                    }
                    QType::IQ4_XS => {
                        let v = blocks::IQ4_VALUES[usize::from(blk.codes[t])];
                        d * f64::from(blk.sc[t / 32]).abs() * f64::from(v).abs()
                    }
                }
            })
        })
        .collect();
    let nb = k / qt.block();
    let eps = f64::from(f32::EPSILON) / 2.0;
    let mut want = vec![0f64; m * n];
    let mut bound = vec![0f64; m * n];
    for i in 0..m {
        let xr = &x[i * k..(i + 1) * k];
        let dx: Vec<f64> = xr
            .chunks_exact(qt.block())
            .map(|b| f64::from(b.iter().fold(0f32, |a, v| a.max(v.abs()))) / 127.0)
            .collect();
        for j in 0..n {
            let (mut s, mut quant, mut round) = (0f64, 0f64, 0f64);
            for t in 0..k {
                let (wv, xv, d) = (
                    f64::from(w[j * k + t]),
                    f64::from(xr[t]),
                    dx[t / qt.block()],
                );
                s += wv * xv;
                quant += (wv.abs() + 4.0 * eps * mag[j * k + t]) * d;
                round += mag[j * k + t] * (xv.abs() + d);
            }
            want[i * n + j] = s;
            bound[i * n + j] = 0.5001 * quant + (2 * nb + 6) as f64 * eps * round;
        }
    }
    (want, bound)
}

/// Packs `rows` and runs `linear` on `backend` (`(m, n, k, threads)` the shape).
fn run(
    qt: QType,
    rows: &[u8],
    x: &[f32],
    (m, n, k, threads): (usize, usize, usize, usize),
    backend: Backend,
) -> Vec<f32> {
    let mut packed = vec![0u8; packed_len(qt, n, k).unwrap()];
    pack(qt, rows, n, k, &mut packed, threads).unwrap();
    let mut out = vec![f32::NAN; m * n];
    linear(
        qt,
        &LinearArgs { m, n, k, threads },
        x,
        &packed,
        &mut out,
        backend,
    )
    .unwrap();
    out
}

/// The GGUF-row `vec_dot` of every output.
fn by_vec_dot(qt: QType, rows: &[u8], x: &[f32], m: usize, n: usize, k: usize) -> Vec<f32> {
    let acts = quantize_acts(qt, x, m, k).unwrap();
    let nb = k / qt.block();
    let row_bytes = nb * qt.block_bytes();
    let mut out = vec![0f32; m * n];
    for i in 0..m {
        for j in 0..n {
            out[i * n + j] = (qt.traits().vec_dot)(
                &rows[j * row_bytes..(j + 1) * row_bytes],
                acts.rows(i..i + 1, nb),
            );
        }
    }
    out
}

/// Every path on one shape: the same bits, within the bound of the f64 product.
fn check_all(qt: QType, m: usize, n: usize, k: usize, threads: usize, seed: u64) {
    let rows = random_rows(qt, n, k, seed);
    let x = random_x(m, k, seed ^ 0x55);
    let (want, bound) = reference(qt, &rows, &x, m, n, k);
    let dot = by_vec_dot(qt, &rows, &x, m, n, k);
    let portable = run(qt, &rows, &x, (m, n, k, threads), Backend::Portable);
    let name = qt.name();
    for (idx, ((p, w), b)) in portable.iter().zip(&want).zip(&bound).enumerate() {
        assert!(
            (f64::from(*p) - w).abs() <= *b,
            "{name} {m}x{n}x{k} [{idx}]: {p} vs {w} (bound {b})"
        );
    }
    assert!(
        portable
            .iter()
            .zip(&dot)
            .all(|(a, b)| a.to_bits() == b.to_bits()),
        "{name}: portable != vec_dot"
    );
    for backend in [Backend::Avx512Vnni, Backend::AmxInt8] {
        if backend.available() {
            let v = run(qt, &rows, &x, (m, n, k, threads), backend);
            let what = format!("{name} {m}x{n}x{k} {}", backend.name());
            same_bits(&v, &portable, &what);
        }
    }
}

#[test]
fn every_type_matches_the_reference_and_paths_agree() {
    for qt in QType::ALL {
        for (m, n, k) in [
            (1, 16, 256),
            (3, 33, 512),
            (9, 20, 768),
            (17, 5, 256),
            (35, 21, 512),
        ] {
            check_all(qt, m, n, k, 2, 11 * m as u64 + n as u64);
        }
    }
}

/// GGUF rows of `n` rows whose bytes are all `byte` (codes, scales and mins at the
/// extremes for 0xFF, 0x80, 0x7F), with the factors of [`random_rows`].
fn constant_rows(qt: QType, n: usize, k: usize, byte: u8) -> Vec<u8> {
    let mut rows = random_rows(qt, n, k, u64::from(byte));
    let bb = qt.block_bytes();
    let factors: &[usize] = match qt {
        QType::Q8_0 | QType::Q4_0 | QType::Q5_0 | QType::IQ4_NL => &[0],
        QType::Q4_1 | QType::Q4_K | QType::Q5_K | QType::Q5_1 => &[0, 2],
        QType::Q6_K => &[208],
        QType::Q3_K => &[108],
        QType::Q2_K => &[80, 82],
        QType::IQ4_XS | QType::MXFP4 => &[0],
    };
    for b in rows.chunks_exact_mut(bb) {
        for (i, v) in b.iter_mut().enumerate() {
            if !factors.iter().any(|&f| i == f || i == f + 1) {
                *v = byte;
            }
        }
    }
    rows
}

#[test]
fn extreme_blocks_and_inputs_reach_no_limit() {
    // the largest sums each integer path must hold: every code, scale and min at an
    // extreme, every input at +-127 (a saturated or wrapped sum shows as a difference)
    for qt in QType::ALL {
        let (n, k) = (20, 512);
        for byte in [0x00, 0xFF, 0x80, 0x7F, 0x55, 0xAA] {
            let rows = constant_rows(qt, n, k, byte);
            let inputs: [Vec<f32>; 3] = [
                vec![1.0; 3 * k],
                vec![-1.0; 3 * k],
                (0..3 * k)
                    .map(|i| if i % 3 == 0 { -1.0 } else { 1.0 })
                    .collect(),
            ];
            for x in inputs {
                let (want, bound) = reference(qt, &rows, &x, 3, n, k);
                let p = run(qt, &rows, &x, (3, n, k, 1), Backend::Portable);
                for (idx, ((p, w), b)) in p.iter().zip(&want).zip(&bound).enumerate() {
                    let name = qt.name();
                    assert!(
                        (f64::from(*p) - w).abs() <= *b,
                        "{name} {byte:#x} [{idx}]: {p} vs {w}"
                    );
                }
                for backend in [Backend::Avx512Vnni, Backend::Avx2] {
                    if backend.available() {
                        let v = run(qt, &rows, &x, (3, n, k, 1), backend);
                        assert!(
                            v.iter().zip(&p).all(|(a, b)| a.to_bits() == b.to_bits()),
                            "{} {byte:#x} {}",
                            qt.name(),
                            backend.name()
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn vnni_equals_portable_bit_for_bit() {
    if !vnni() {
        return;
    }
    for qt in QType::ALL {
        let (m, n, k) = (13, 50, 1024);
        let rows = random_rows(qt, n, k, 3);
        let x = random_x(m, k, 4);
        let a = run(qt, &rows, &x, (m, n, k, 1), Backend::Portable);
        let b = run(qt, &rows, &x, (m, n, k, 2), Backend::Avx512Vnni);
        assert!(
            a.iter().zip(&b).all(|(a, b)| a.to_bits() == b.to_bits()),
            "{}",
            qt.name()
        );
    }
}

/// `a` and `b` the same bits, else the first index that differs.
fn same_bits(a: &[f32], b: &[f32], what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: lengths");
    if let Some(i) = (0..a.len()).find(|&i| a[i].to_bits() != b[i].to_bits()) {
        panic!("{what} [{i}]: {} vs {}", a[i], b[i]);
    }
}

#[test]
fn many_rows_equal_portable_and_single_rows_bit_for_bit() {
    // the many-rows kernels (m > MAX_ROWS): every type, row tiles of every size, 1 to 4
    // panels a pass (threads 1: passes of 4; threads 3: 4 panels as 1 + 1 + 2, 8 as
    // 2 + 3 + 3), 32-weight chunks that do not divide the blocks (k = 13 blocks of 32),
    // several row chunks (k = 4096 at 512); on the AMX tiles (Q4_K, Q5_K, Q6_K from 32
    // rows), groups of 16 rows in passes of at most 2 panels, and the register tiles for
    // the rest (100 rows: six groups and 4 rows)
    let _many = ManyRowsFrom::set(super::MANY_ROWS);
    for backend in many_rows_backends() {
        for qt in QType::ALL {
            for (i, m) in [9, 31, 32, 64, 100, 512].into_iter().enumerate() {
                let n = if i % 2 == 0 { 50 } else { 115 };
                let (n, k) = match (qt.block(), m) {
                    (32, 512) => (50, 4096),
                    (32, _) => (n, 416),
                    (_, 512) => (33, 4096),
                    _ => (n, 768),
                };
                let rows = random_rows(qt, n, k, 21 + i as u64);
                let x = random_x(m, k, 22 + i as u64);
                let what = format!("{} {} m {m}", qt.name(), backend.name());
                let p = run(qt, &rows, &x, (m, n, k, 1), Backend::Portable);
                for threads in [1, 3] {
                    let v = run(qt, &rows, &x, (m, n, k, threads), backend);
                    same_bits(&v, &p, &format!("{what} threads {threads}"));
                }
                for r in [0, m / 2, m - 1] {
                    let one = run(qt, &rows, &x[r * k..(r + 1) * k], (1, n, k, 1), backend);
                    same_bits(
                        &one,
                        &p[r * n..(r + 1) * n],
                        &format!("{what} row {r} alone"),
                    );
                }
            }
        }
    }
}

#[test]
fn many_rows_at_the_extremes_equal_portable() {
    let _many = ManyRowsFrom::set(super::MANY_ROWS);
    for backend in many_rows_backends() {
        for qt in QType::ALL {
            // (69 rows: four groups of the AMX tiles' 16 (Q4_K to Q6_K), then register tiles)
            for (m, byte) in [(12, 0x00), (12, 0xFF), (69, 0x80), (69, 0x7F), (69, 0xFF)] {
                let (n, k) = (40, 512);
                let rows = constant_rows(qt, n, k, byte);
                let x: Vec<f32> = (0..m * k)
                    .map(|i| if (i / k + i) % 3 == 0 { -1.0 } else { 1.0 })
                    .collect();
                let p = run(qt, &rows, &x, (m, n, k, 1), Backend::Portable);
                let v = run(qt, &rows, &x, (m, n, k, 2), backend);
                same_bits(
                    &v,
                    &p,
                    &format!("{} {} {byte:#x}", qt.name(), backend.name()),
                );
            }
        }
    }
}

#[test]
fn the_many_rows_kernels_start_where_the_cpu_says() {
    // the default route of each backend by rows, whether or not this CPU splits 512-bit
    // operations (AMD Zen 4: the panel kernels up to MANY_ROWS_SPLIT_512 - 1 rows); a
    // test's own setting wins
    let least = if crate::isa::splits_512() {
        super::MANY_ROWS_SPLIT_512
    } else {
        super::MANY_ROWS
    };
    if std::env::var(super::MANY_ROWS_ENV).is_err() {
        assert_eq!(super::many_rows_least(), least);
    }
    for m in [1, 8, 9, 32, 127, 128, 512] {
        let want = m > MAX_ROWS && m >= super::many_rows_least();
        assert_eq!(super::many_rows(m, Backend::Avx512Vnni), want, "{m}");
        assert!(!super::many_rows(m, Backend::Avx2) && !super::many_rows(m, Backend::Portable));
    }
    let _many = ManyRowsFrom::set(32);
    assert!(
        !super::many_rows(31, Backend::Avx512Vnni) && super::many_rows(32, Backend::Avx512Vnni)
    );
    drop(_many);
    assert_eq!(least_many(), None);
}

#[test]
fn k_type_block_sums_fit_i32() {
    // the largest whole-block sums: Q4_K, Q5_K (8 x 32 codes up to 15 / 31, scales up to
    // 63), Q6_K (16 x 16 codes - 32 in -32..=31, scales -128..=127)
    for s in [
        8 * 15 * 127 * 32 * 63i64,
        8 * 31 * 127 * 32 * 63,
        16 * 32 * 127 * 16 * 128,
    ] {
        assert!(s < i64::from(i32::MAX), "{s}");
    }
}

#[test]
fn k_types_on_the_amx_tiles_equal_portable_at_any_input() {
    // Q4_K, Q5_K and Q6_K blocks of 16 rows run as one integer product a block: small
    // inputs, inputs at +-1 (every q at +-127), groups that mix both, and weights of
    // constant bytes (the largest codes and scales, Q6_K's scales at -1 and -128)
    if !amx() {
        return;
    }
    use std::sync::atomic::Ordering::Relaxed;
    // (m at least amx_rows::MIN_ROWS, not whole groups of 16)
    let (m, n, k) = (69, 70, 1024);
    let small = random_x(m, k, 32);
    let extreme: Vec<f32> = (0..m * k)
        .map(|i| if i % 5 == 0 { -1.0 } else { 1.0 })
        .collect();
    let mixed: Vec<f32> = (0..m * k)
        .map(|i| {
            if (i / k) % 7 == 3 {
                extreme[i]
            } else {
                small[i]
            }
        })
        .collect();
    for qt in super::amx_rows::TYPES {
        let weights = [
            ("random", random_rows(qt, n, k, 31)),
            ("0xff", constant_rows(qt, n, k, 0xFF)),
            ("0x80", constant_rows(qt, n, k, 0x80)),
        ];
        for (wname, rows) in &weights {
            for (name, x) in [("small", &small), ("extreme", &extreme), ("mixed", &mixed)] {
                let before = super::amx_rows::RUNS.load(Relaxed);
                let p = run(qt, rows, x, (m, n, k, 1), Backend::Portable);
                for threads in [1, 2] {
                    let v = run(qt, rows, x, (m, n, k, threads), Backend::AmxInt8);
                    let what = format!("{} {wname} {name} threads {threads}", qt.name());
                    same_bits(&v, &p, &what);
                }
                assert!(
                    super::amx_rows::RUNS.load(Relaxed) > before,
                    "{} {wname} {name}: no block on the tiles",
                    qt.name()
                );
            }
        }
    }
}

#[test]
fn k_type_decode_batches_of_32_rows_or_more_run_on_the_amx_tiles() {
    // a group and a padded one (24: amx_rows::MIN_ROWS, 31), two groups (32), two groups and
    // a rest on the register tiles (39), two groups and a padded third (40: PAD_ROWS, 47):
    // every call puts blocks on the tiles; 16 and 23 rows none; all with the outputs of the
    // portable path
    if !amx() {
        return;
    }
    use std::sync::atomic::Ordering::Relaxed;
    let (n, k) = (72, 512);
    for qt in super::amx_rows::TYPES {
        let rows = random_rows(qt, n, k, 41);
        for m in [16, 23, 24, 31, 32, 39, 40, 47] {
            let x = random_x(m, k, 42);
            let before = super::amx_rows::RUNS.load(Relaxed);
            let v = run(qt, &rows, &x, (m, n, k, 1), Backend::AmxInt8);
            // (RUNS counts other tests' blocks too: only its growth says something)
            if m >= 24 {
                let grew = super::amx_rows::RUNS.load(Relaxed) > before;
                assert!(grew, "{} {m} rows: no block on the tiles", qt.name());
            }
            assert_eq!(super::amx_rows::takes(qt, m), m >= 24, "{} {m}", qt.name());
            let p = run(qt, &rows, &x, (m, n, k, 1), Backend::Portable);
            same_bits(&v, &p, &format!("{} m {m}", qt.name()));
        }
    }
}

#[test]
fn avx2_equals_portable_bit_for_bit() {
    if !avx2() {
        return;
    }
    for qt in QType::ALL {
        // rows 1 to 9: every group size of the kernel's four-row passes
        for (m, n, k) in [(1, 20, 512), (5, 33, 768), (9, 16, 256)] {
            let rows = random_rows(qt, n, k, 8);
            let x = random_x(m, k, 9);
            let a = run(qt, &rows, &x, (m, n, k, 1), Backend::Portable);
            let b = run(qt, &rows, &x, (m, n, k, 2), Backend::Avx2);
            assert!(
                a.iter().zip(&b).all(|(a, b)| a.to_bits() == b.to_bits()),
                "{}",
                qt.name()
            );
        }
    }
}

#[test]
fn a_row_does_not_depend_on_its_batch_nor_the_threads() {
    for backend in Backend::ALL {
        let skip = match backend {
            Backend::Portable => false,
            Backend::Avx512Vnni => !vnni(),
            Backend::Avx2 => !avx2(),
            Backend::AmxInt8 => !amx(),
        };
        if skip {
            continue;
        }
        for qt in QType::ALL {
            let (m, n, k) = (20, 70, 512);
            let rows = random_rows(qt, n, k, 5);
            let x = random_x(m, k, 6);
            let all = run(qt, &rows, &x, (m, n, k, 3), backend);
            for threads in [1, 2, 5] {
                assert_eq!(run(qt, &rows, &x, (m, n, k, threads), backend), all);
            }
            for i in [0, 7, 19] {
                let one = run(qt, &rows, &x[i * k..(i + 1) * k], (1, n, k, 1), backend);
                assert_eq!(one[..], all[i * n..(i + 1) * n], "{} row {i}", qt.name());
            }
        }
    }
}

#[test]
fn bad_arguments_name_the_field_and_write_nothing() {
    let qt = QType::Q8_0;
    let (m, n, k) = (2, 3, 64);
    let rows = random_rows(qt, n, k, 1);
    let mut packed = vec![0u8; packed_len(qt, n, k).unwrap()];
    pack(qt, &rows, n, k, &mut packed, 1).unwrap();
    let args = LinearArgs {
        m,
        n,
        k,
        threads: 1,
    };
    let x = vec![0.5f32; m * k];
    let mut out = vec![7f32; m * n];
    let e = linear(qt, &args, &x[1..], &packed, &mut out, Backend::Portable).unwrap_err();
    assert_eq!(e.field(), Some("x"));
    let e = linear(qt, &args, &x, &packed[1..], &mut out, Backend::Portable).unwrap_err();
    assert_eq!(e.field(), Some("weight"));
    let e = linear(qt, &args, &x, &packed, &mut out[1..], Backend::Portable).unwrap_err();
    assert_eq!(e.field(), Some("out"));
    let bad_k = LinearArgs { k: 48, ..args };
    let e = linear(qt, &bad_k, &x[..96], &packed, &mut out, Backend::Portable).unwrap_err();
    assert_eq!(e.field(), Some("k"));
    assert_eq!(out, vec![7f32; m * n]);
    let e = pack(qt, &rows[1..], n, k, &mut packed, 1).unwrap_err();
    assert_eq!(e.field(), Some("blocks"));
    assert!(
        e.to_string()
            .starts_with("blocks: expected 34*k/32 bytes per row for q8_0"),
        "{}",
        e.to_string()
    );
    let e = dequantize(qt, &rows, n, k, &mut [0f32; 5]).unwrap_err();
    assert_eq!(e.field(), Some("out"));
    if !Backend::Avx512Vnni.available() {
        let e = linear(qt, &args, &x, &packed, &mut out, Backend::Avx512Vnni).unwrap_err();
        assert_eq!(e.field(), Some("backend"));
    }
}

#[test]
fn zero_sizes() {
    for qt in QType::ALL {
        let mut out = vec![1f32; 0];
        linear(
            qt,
            &LinearArgs {
                m: 0,
                n: 4,
                k: 256,
                threads: 1,
            },
            &[],
            &vec![0; packed_len(qt, 4, 256).unwrap()],
            &mut out,
            Backend::Portable,
        )
        .unwrap();
        let mut out = vec![1f32; 6];
        linear(
            qt,
            &LinearArgs {
                m: 2,
                n: 3,
                k: 0,
                threads: 1,
            },
            &[],
            &[],
            &mut out,
            Backend::auto(),
        )
        .unwrap();
        assert_eq!(out, vec![0f32; 6]);
    }
}

fn qtype_strategy() -> impl Strategy<Value = QType> {
    (0usize..QType::ALL.len()).prop_map(|i| QType::ALL[i])
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(40))]
    #[test]
    fn any_shape_matches_the_reference(qt in qtype_strategy(), m in 1usize..40, n in 1usize..40,
                                       blocks in 1usize..5, threads in 1usize..4, seed: u64) {
        let k = blocks * qt.block();
        check_all(qt, m, n, k, threads, seed);
    }
}

#[test]
fn a_panel_fetches_the_next_panels_of_its_threads_range_only() {
    let range = 4..9;
    assert_eq!(fetch_ahead(4, &range, 2), 5..7);
    assert_eq!(fetch_ahead(6, &range, 2), 7..9);
    assert_eq!(fetch_ahead(6, &range, 3), 7..9);
    assert_eq!(fetch_ahead(5, &range, 3), 6..9);
    assert_eq!(fetch_ahead(7, &range, 2), 8..9);
    assert!(fetch_ahead(8, &range, 2).is_empty());
    assert!(fetch_ahead(0, &(0..1), 3).is_empty());
    assert_eq!(fetch_ahead(0, &(0..2), 2).len(), 1);
    for qt in QType::ALL {
        assert!((2..=3).contains(&fetch_panels(qt, Backend::Avx512Vnni)));
        assert_eq!(fetch_panels(qt, Backend::Avx2), 1);
    }
}
