//! Tests of the K-type weight quantizers ([`super::quantize`]): the block encoder against
//! the decoder, exact round trips of rows that are themselves K-type values, error bounds
//! on random rows, edge cases and refusals.

use super::blocks::{decode, encode, Block};
use super::tests::{random_rows, Rng};
use super::*;
use proptest::prelude::*;

const K_TYPES: [QType; 3] = [QType::Q4_K, QType::Q5_K, QType::Q6_K];

/// Rows of `n * k` weights: normal with standard deviation `sigma`, one in 64 five times
/// larger (the outliers of real weight rows).
fn normal_rows(n: usize, k: usize, sigma: f32, seed: u64) -> Vec<f32> {
    let mut rng = Rng(seed);
    (0..n * k)
        .map(|_| {
            // Box-Muller
            let (u, v) = (rng.uniform(1e-7, 1.0), rng.uniform(0.0, 1.0));
            let z = (-2.0 * u.ln()).sqrt() * (std::f32::consts::TAU * v).cos();
            let big = if rng.next().is_multiple_of(64) {
                5.0
            } else {
                1.0
            };
            sigma * big * z
        })
        .collect()
}

fn quantized(qt: QType, w: &[f32], n: usize, k: usize, threads: usize) -> Vec<u8> {
    let mut out = vec![0u8; n * k / 256 * qt.block_bytes()];
    quantize(qt, w, n, k, &mut out, threads).unwrap();
    out
}

fn dequantized(qt: QType, rows: &[u8], n: usize, k: usize) -> Vec<f32> {
    let mut out = vec![f32::NAN; n * k];
    dequantize(qt, rows, n, k, &mut out).unwrap();
    out
}

/// `sqrt(sum (y - x)^2 / sum x^2)`.
fn relative_rms(x: &[f32], y: &[f32]) -> f64 {
    let (e, s) = x.iter().zip(y).fold((0f64, 0f64), |(e, s), (&a, &b)| {
        let (a, b) = (f64::from(a), f64::from(b));
        (e + (b - a).powi(2), s + a * a)
    });
    (e / s).sqrt()
}

/// Relative RMS error bounds on [`normal_rows`]. A uniform code grid of step `D` has RMS
/// error `D / sqrt(12)`. Q4_K / Q5_K span a sub-block's range (about 4.1 sigma for 32
/// normal weights, more with an outlier) with 15 / 31 steps: about 0.08 / 0.04 sigma, the
/// weighted search a little less in RMS; Q6_K spans twice the largest magnitude of 16
/// weights (about 2 sigma each side, more with an outlier) with 63 steps: about 0.02
/// sigma. The 6-bit / 8-bit coded scales add little (codes are recomputed against them).
/// Measured: 0.086, 0.043, 0.023 for sigma 1e-4 .. 1e4. Bounds: a sixth to a quarter
/// above. (Below sigma 1e-5 the fp16 factors lose precision: module docs.)
fn bound(qt: QType) -> f64 {
    match qt {
        QType::Q4_K => 0.10,
        QType::Q5_K => 0.05,
        _ => 0.028,
    }
}

#[test]
fn encoding_inverts_decoding() {
    for qt in QType::ALL {
        let rows = random_rows(qt, 4, 2 * qt.block(), 31 + qt as u64);
        let mut again = vec![0u8; rows.len()];
        for (b, o) in rows
            .chunks_exact(qt.block_bytes())
            .zip(again.chunks_exact_mut(qt.block_bytes()))
        {
            encode(qt, &decode(qt, b), o);
        }
        assert_eq!(rows, again, "{}", qt.name());
    }
}

#[test]
fn random_rows_stay_within_the_error_bound_whatever_the_threads() {
    let (n, k) = (24, 1024);
    for qt in K_TYPES {
        for sigma in [2e-2f32, 1.0, 3e3] {
            let w = normal_rows(n, k, sigma, 5 + qt as u64);
            let rows = quantized(qt, &w, n, k, 1);
            assert_eq!(rows, quantized(qt, &w, n, k, 3), "{}", qt.name());
            let err = relative_rms(&w, &dequantized(qt, &rows, n, k));
            assert!(err < bound(qt), "{} sigma {sigma}: {err}", qt.name());
        }
    }
}

/// A valid block of `qt` whose values re-quantize to the same bytes: random codes with
/// both ends of the code range in every sub-block, random scales (and mins) with the
/// largest at the top of its range, random fp16 factors.
fn exact_block(qt: QType, rng: &mut Rng) -> Vec<u8> {
    let mut blk = Block::ZERO;
    let half = |v: f32| half::f16::from_f32(v).to_f32();
    let pick = |rng: &mut Rng, n: u64| (rng.next() % n) as i32;
    if qt == QType::Q6_K {
        for (j, sub) in blk.codes.chunks_exact_mut(16).enumerate() {
            for c in sub.iter_mut() {
                *c = pick(rng, 64) as u8;
            }
            sub[pick(rng, 16) as usize] = 0; // the code of largest magnitude, -32
            blk.sc[j] = (1 + pick(rng, 127)) * if rng.next() & 1 == 0 { 1 } else { -1 };
        }
        blk.sc[pick(rng, 16) as usize] = -128;
        blk.d = half(rng.sign() * rng.uniform(1e-3, 5e-2));
    } else {
        let nmax = if qt == QType::Q4_K { 15 } else { 31 };
        for (j, sub) in blk.codes.chunks_exact_mut(32).enumerate() {
            for c in sub.iter_mut() {
                *c = pick(rng, nmax + 1) as u8;
            }
            let at = pick(rng, 16) as usize;
            (sub[at], sub[at + 16]) = (0, nmax as u8);
            blk.sc[j] = 1 + pick(rng, 63);
            blk.mn[j] = pick(rng, 64);
        }
        blk.sc[pick(rng, 8) as usize] = 63;
        blk.mn[pick(rng, 8) as usize] = 63;
        blk.d = half(rng.uniform(1e-3, 5e-2));
        blk.e = half(rng.uniform(1e-3, 5e-2));
    }
    let mut b = vec![0u8; qt.block_bytes()];
    encode(qt, &blk, &mut b);
    b
}

/// Rows dequantized from random valid blocks with generic scales come back close: the
/// grid has spacings near the blocks' own, so the error stays well under the bound of
/// random rows, though the blocks' scales need not come back.
#[test]
fn values_of_generic_blocks_come_back_close() {
    let (n, k) = (8, 512);
    for qt in K_TYPES {
        let rows = random_rows(qt, n, k, 77 + qt as u64);
        let w = dequantized(qt, &rows, n, k);
        let again = dequantized(qt, &quantized(qt, &w, n, k, 2), n, k);
        let err = relative_rms(&w, &again);
        assert!(err < bound(qt) / 2.0, "{}: {err}", qt.name());
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// The values of an [`exact_block`] re-quantize to its very bytes.
    #[test]
    fn values_of_blocks_on_the_grid_requantize_exactly(t in 0usize..3, seed in any::<u64>(),
                                                       blocks in 1usize..4) {
        let qt = K_TYPES[t];
        let mut rng = Rng(seed);
        let rows: Vec<u8> = (0..blocks).flat_map(|_| exact_block(qt, &mut rng)).collect();
        let w = dequantized(qt, &rows, 1, 256 * blocks);
        prop_assert_eq!(quantized(qt, &w, 1, 256 * blocks, 1), rows);
    }

    /// Any scale, any shape: within the bound, a quarter more (a row of a few blocks
    /// varies more than the average: a 5-sigma outlier widens its sub-block's range).
    #[test]
    fn scaled_random_rows_stay_within_the_bound(t in 0usize..3, seed in any::<u64>(),
                                                n in 1usize..5, nb in 1usize..4,
                                                scale in -4f32..4.0) {
        let qt = K_TYPES[t];
        let k = 256 * nb;
        let w = normal_rows(n, k, 10f32.powf(scale), seed);
        let err = relative_rms(&w, &dequantized(qt, &quantized(qt, &w, n, k, 2), n, k));
        prop_assert!(err < 1.25 * bound(qt), "{} {}", qt.name(), err);
    }
}

#[test]
fn zero_and_constant_rows() {
    for qt in K_TYPES {
        let zero = quantized(qt, &[0f32; 512], 2, 256, 1);
        assert!(dequantized(qt, &zero, 2, 256).iter().all(|&v| v == 0.0));
        for c in [1.0f32, -1.0, 0.37, -2.5e-3, 7.0e3] {
            let got = dequantized(qt, &quantized(qt, &[c; 256], 1, 256, 1), 1, 256);
            // the largest integer scale within half a step of its value (1/256 relative
            // for Q6_K's 128) after the fp16 factor's rounding
            for v in got {
                assert!((v - c).abs() <= 4e-3 * c.abs(), "{} {c}: {v}", qt.name());
            }
        }
    }
}

#[test]
fn tiny_weights_come_back_small_and_large_ones_are_refused() {
    for qt in K_TYPES {
        // factors below fp16's range: zeros, or values no larger than the fp16 steps
        let w = normal_rows(1, 256, 1e-9, 3);
        let got = dequantized(qt, &quantized(qt, &w, 1, 256, 1), 1, 256);
        let step = 2f32.powi(-24)
            * if qt == QType::Q6_K {
                128.0 * 32.0
            } else {
                63.0 * 31.0
            };
        assert!(got.iter().all(|v| v.abs() <= step), "{}", qt.name());
        // within fp16's range (sigma 1e4: factors near 1e3) the bound holds
        let w = normal_rows(2, 256, 1e4, 4);
        let got = dequantized(qt, &quantized(qt, &w, 2, 256, 1), 2, 256);
        assert!(relative_rms(&w, &got) < bound(qt), "{}", qt.name());
        // beyond it: refused, naming the row and block
        let mut w = vec![0.5f32; 3 * 512];
        w[2 * 512 + 300] = 3e12;
        let mut out = vec![0u8; 3 * 2 * qt.block_bytes()];
        let e = quantize(qt, &w, 3, 512, &mut out, 2).unwrap_err();
        assert_eq!(e.field(), Some("w"));
        assert!(
            e.to_string().contains("row 2, columns 256..512"),
            "{}",
            e.to_string()
        );
    }
}

#[test]
fn non_finite_weights_and_bad_arguments_are_refused_naming_the_field() {
    for qt in K_TYPES {
        let mut out = vec![0u8; 2 * qt.block_bytes()];
        for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            let mut w = vec![0.1f32; 512];
            w[256 + 5] = bad;
            let e = quantize(qt, &w, 2, 256, &mut out, 1).unwrap_err();
            assert_eq!(e.field(), Some("w"));
            let msg = e.to_string();
            assert!(
                msg.contains("row 1, column 5 is") && msg.contains("finite"),
                "{msg}"
            );
        }
        let w = vec![0.1f32; 512];
        let e = quantize(qt, &w[1..], 2, 256, &mut out, 1).unwrap_err();
        assert_eq!(e.field(), Some("w"));
        let e = quantize(qt, &w, 2, 256, &mut out[1..], 1).unwrap_err();
        assert_eq!(e.field(), Some("out"));
        let e = quantize(qt, &w, 4, 128, &mut out, 1).unwrap_err();
        assert_eq!(e.field(), Some("k"));
        assert!(quantizes(qt));
    }
    for qt in [
        QType::Q8_0,
        QType::Q4_0,
        QType::Q4_1,
        QType::Q5_0,
        QType::Q5_1,
        QType::IQ4_NL,
    ] {
        assert!(!quantizes(qt));
        let e = quantize(qt, &[0.0; 32], 1, 32, &mut [0u8; 34], 1).unwrap_err();
        assert_eq!(e.field(), Some("qtype"));
    }
    // the types only read from GGUF files
    for qt in [QType::Q3_K, QType::Q2_K, QType::IQ4_XS, QType::MXFP4] {
        assert!(!quantizes(qt));
        let mut out = vec![0u8; qt.block_bytes()];
        let e = quantize(qt, &[0.0; 256], 1, 256, &mut out, 1).unwrap_err();
        assert_eq!(e.field(), Some("qtype"));
    }
    let mut none: [u8; 0] = [];
    quantize(QType::Q4_K, &[], 0, 256, &mut none, 2).unwrap();
    quantize(QType::Q6_K, &[], 3, 0, &mut none, 2).unwrap();
}
