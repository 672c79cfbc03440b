//! GGUF blocks as stored in a file, decoded into one integer form ([`Block`]) that every
//! product path shares: unsigned weight codes, integer sub-block scales and mins, and the
//! block's fp16 factors widened to f32. The value of weight `t` of a block is
//!
//! | type | value |
//! |---|---|
//! | Q8_0 | `d * (u - 128)` (`u` = the int8 weight + 128) |
//! | Q4_0 | `d * (u - 8)` |
//! | Q4_1 | `d * u + e` (`e` = the fp16 `m`) |
//! | Q4_K, Q5_K | `(d * sc[j]) * u - e * mn[j]`, `j = t / 32` (`e` = `dmin`) |
//! | Q6_K | `(d * sc[j]) * (u - 32)`, `j = t / 16`, `sc` signed |
//! | Q5_0 | `d * (u - 16)` (`u`: 5 bits) |
//! | Q5_1 | `d * u + e` (`u`: 5 bits, `e` = the fp16 `m`) |
//! | IQ4_NL | `d * IQ4_VALUES[u]` (`u`: a 4-bit index) |
//! | Q3_K | `(d * sc[j]) * (u - 4)`, `j = t / 16`, `sc` signed |
//! | Q2_K | `(d * sc[j]) * u - e * mn[j]`, `j = t / 16` (`e` = `dmin`) |
//! | IQ4_XS | `(d * sc[j]) * IQ4_VALUES[u]`, `j = t / 32`, `sc` signed, `u` a 4-bit index |
//! | MXFP4 | `d * MXFP4_VALUES[u]`, `d = 2^(e - 128)` of the E8M0 byte `e` (`u`: a 4-bit index) |
//!
//! computed in f32 in exactly that order by [`dequantize_block`], the order of
//! `gguf.quants.dequantize` (so the two agree bit for bit).

use half::f16;

use super::QType;

/// One block in integer form (the first `block` codes used; `sc` / `mn` only for K-types).
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Block {
    /// unsigned weight codes in k order: 8, 4, 4, 4, 5, 6, 3 and 2 bits (Q5_0, Q5_1: 5;
    /// IQ4_NL and IQ4_XS: 4-bit indices into [`IQ4_VALUES`])
    pub(crate) codes: [u8; 256],
    /// integer sub-block scales (Q4_K / Q5_K: 8 six-bit; Q6_K: 16 int8; Q3_K: 16 in
    /// `-32..32`; Q2_K: 16 four-bit; IQ4_XS: 8 in `-32..32`)
    pub(crate) sc: [i32; 16],
    /// integer sub-block mins (Q4_K / Q5_K: 8 six-bit; Q2_K: 16 four-bit)
    pub(crate) mn: [i32; 16],
    /// the block scale `d`
    pub(crate) d: f32,
    /// the second factor: `m` (Q4_1, Q5_1) or `dmin` (Q4_K, Q5_K), else 0
    pub(crate) e: f32,
}

impl Block {
    pub(crate) const ZERO: Block = Block {
        codes: [0; 256],
        sc: [0; 16],
        mn: [0; 16],
        d: 0.0,
        e: 0.0,
    };
}

/// The values of IQ4_NL's (and IQ4_XS's) 4-bit indices (ggml's `kvalues_iq4nl`).
pub(crate) const IQ4_VALUES: [i8; 16] = [
    -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
];

/// The values of MXFP4's 4-bit codes (ggml's `kvalues_mxfp4`: the E2M1 values doubled), in
/// units of the block's `2^(e - 128)`.
pub(crate) const MXFP4_VALUES: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

/// A table's values as the unsigned codes of the products (`value + 128`, as Q8_0's codes).
const fn codes_of(values: [i8; 16]) -> [u8; 16] {
    let mut u = [0u8; 16];
    let mut i = 0;
    while i < 16 {
        u[i] = (values[i] as u8) ^ 0x80;
        i += 1;
    }
    u
}

/// IQ4_NL's values as the unsigned codes of the products.
pub(crate) const IQ4NL_U: [u8; 16] = codes_of(IQ4_VALUES);
/// MXFP4's values as the unsigned codes of the products.
pub(crate) const MXFP4_U: [u8; 16] = codes_of(MXFP4_VALUES);

/// Whether `qt` is a 32-weight table type (IQ4_NL, MXFP4: 4-bit indices into 16 values).
pub(crate) const fn is_table32(qt: QType) -> bool {
    matches!(qt, QType::IQ4_NL | QType::MXFP4)
}

/// The 16 values of a table type's indices (MXFP4's, else IQ4_NL's).
pub(crate) const fn table_values(qt: QType) -> &'static [i8; 16] {
    if matches!(qt, QType::MXFP4) {
        &MXFP4_VALUES
    } else {
        &IQ4_VALUES
    }
}

/// [`table_values`] as the products' unsigned codes.
pub(crate) const fn table_codes(qt: QType) -> &'static [u8; 16] {
    if matches!(qt, QType::MXFP4) {
        &MXFP4_U
    } else {
        &IQ4NL_U
    }
}

/// The E8M0 exponents of MXFP4 blocks whose `2^(e - 128)` fp16 holds exactly (the packed
/// panels keep `d` in fp16); below, `d` is 0 (every weight under 12 * 2^-25: fp16's
/// conversion rounds such a `d` to 0 too), above, the block is refused.
pub(crate) const MXFP4_E: std::ops::RangeInclusive<u8> = 104..=143;

/// An MXFP4 block's `d` from its exponent byte `e`: `2^(e - 128)`, 0 below [`MXFP4_E`].
fn mxfp4_d(e: u8) -> f32 {
    if e < *MXFP4_E.start() {
        0.0
    } else {
        f32::from_bits(u32::from(e - 1) << 23)
    }
}

/// `Invalid` ("blocks") naming the first MXFP4 block of `rows` whose exponent is above
/// [`MXFP4_E`] (weights of 2^16 and more, which the fp16 `d` of a packed panel cannot hold).
pub(crate) fn check_mxfp4_scales(rows: &[u8]) -> Result<(), crate::error::KernelError> {
    let bb = QType::MXFP4.block_bytes();
    match rows.chunks_exact(bb).position(|b| b[0] > *MXFP4_E.end()) {
        None => Ok(()),
        Some(i) => crate::error::KernelError::invalid(
            "blocks",
            format!(
                "blocks: MXFP4 block {i} has exponent {} (weights of 2^16 or more), above the \
                 range ferrobatch's kernels hold",
                rows[bb * i]
            ),
        ),
    }
}

fn half(b: &[u8], at: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([b[at], b[at + 1]])).to_f32()
}

/// The K-types' six-bit scale and min of sub-block `j` (of 8) from `s` (12 bytes).
fn scale_min_k4(s: &[u8], j: usize) -> (i32, i32) {
    if j < 4 {
        (i32::from(s[j] & 63), i32::from(s[j + 4] & 63))
    } else {
        (
            i32::from((s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4)),
            i32::from((s[j + 4] >> 4) | ((s[j] >> 6) << 4)),
        )
    }
}

/// `b` (one block of `qt`, `qt.block_bytes()` bytes) in integer form.
pub(crate) fn decode(qt: QType, b: &[u8]) -> Block {
    assert_eq!(b.len(), qt.block_bytes(), "one {} block", qt.name());
    let mut out = Block::ZERO;
    match qt {
        QType::Q8_0 => {
            out.d = half(b, 0);
            for (u, &w) in out.codes.iter_mut().zip(&b[2..34]) {
                *u = w ^ 0x80;
            }
        }
        QType::Q4_0 | QType::Q4_1 => {
            out.d = half(b, 0);
            let qs = if qt == QType::Q4_1 {
                out.e = half(b, 2);
                &b[4..20]
            } else {
                &b[2..18]
            };
            for (l, &q) in qs.iter().enumerate() {
                out.codes[l] = q & 0xF;
                out.codes[l + 16] = q >> 4;
            }
        }
        QType::Q4_K | QType::Q5_K => {
            out.d = half(b, 0);
            out.e = half(b, 2);
            for j in 0..8 {
                (out.sc[j], out.mn[j]) = scale_min_k4(&b[4..16], j);
            }
            let (qh, qs) = if qt == QType::Q5_K {
                (Some(&b[16..48]), &b[48..176])
            } else {
                (None, &b[16..144])
            };
            // per 64 weights: the low nibbles of 32 bytes, then their high nibbles
            for g in 0..4 {
                for l in 0..32 {
                    let q = qs[32 * g + l];
                    out.codes[64 * g + l] = q & 0xF;
                    out.codes[64 * g + 32 + l] = q >> 4;
                }
            }
            if let Some(qh) = qh {
                // bit s of qh[l] is the fifth bit of weight 32 s + l
                for s in 0..8 {
                    for (c, &h) in out.codes[32 * s..32 * s + 32].iter_mut().zip(qh) {
                        *c |= ((h >> s) & 1) << 4;
                    }
                }
            }
        }
        QType::Q5_0 | QType::Q5_1 | QType::IQ4_NL => decode_32(qt, b, &mut out),
        QType::MXFP4 => {
            out.d = mxfp4_d(b[0]);
            for (l, &q) in b[1..17].iter().enumerate() {
                out.codes[l] = q & 0xF;
                out.codes[l + 16] = q >> 4;
            }
        }
        QType::Q6_K => {
            let (ql, qh, sc) = (&b[0..128], &b[128..192], &b[192..208]);
            out.d = half(b, 208);
            for (o, &s) in out.sc.iter_mut().zip(sc) {
                *o = i32::from(s as i8);
            }
            // per half h of 128 weights: weight 128 h + 64 n + t has nibble n of ql[64 h + t]
            // and, writing it 128 h + 32 s + l, bits 2 s of qh[32 h + l]
            for h in 0..2 {
                for w in 0..128 {
                    let q = ql[64 * h + w % 64] >> (4 * (w / 64)) & 0xF;
                    let hi = (qh[32 * h + w % 32] >> (2 * (w / 32))) & 3;
                    out.codes[128 * h + w] = q | (hi << 4);
                }
            }
        }
        QType::Q3_K => {
            let (hm, qs, s) = (&b[0..32], &b[32..96], &b[96..108]);
            out.d = half(b, 108);
            // scale j: a nibble of byte j % 8 (the high one for j >= 8) and bits 2 (j / 4)
            // of byte 8 + j % 4, stored + 32
            for (j, o) in out.sc.iter_mut().enumerate() {
                let lo = (s[j % 8] >> (4 * (j / 8))) & 0xF;
                let hi = (s[8 + j % 4] >> (2 * (j / 4))) & 3;
                *o = i32::from(lo | (hi << 4)) - 32;
            }
            // weight t: bits 2 s of qs[32 g + l] (t = 128 g + 32 s + l) and bit t / 32 of
            // hmask[t % 32] as bit 2
            for (t, c) in out.codes.iter_mut().enumerate() {
                *c = two_bits(qs, t) | (((hm[t % 32] >> (t / 32)) & 1) << 2);
            }
        }
        QType::Q2_K => {
            let (s, qs) = (&b[0..16], &b[16..80]);
            out.d = half(b, 80);
            out.e = half(b, 82);
            for (j, &v) in s.iter().enumerate() {
                out.sc[j] = i32::from(v & 0xF);
                out.mn[j] = i32::from(v >> 4);
            }
            for (t, c) in out.codes.iter_mut().enumerate() {
                *c = two_bits(qs, t);
            }
        }
        QType::IQ4_XS => {
            out.d = half(b, 0);
            let sh = u16::from_le_bytes([b[2], b[3]]);
            let (sl, qs) = (&b[4..8], &b[8..136]);
            for j in 0..8 {
                let lo = (sl[j / 2] >> (4 * (j % 2))) & 0xF;
                let hi = ((sh >> (2 * j)) & 3) as u8;
                out.sc[j] = i32::from(lo | (hi << 4)) - 32;
            }
            // sub-block j: the low nibbles of qs[16 j ..], then their high nibbles
            for j in 0..8 {
                for l in 0..16 {
                    let q = qs[16 * j + l];
                    out.codes[32 * j + l] = q & 0xF;
                    out.codes[32 * j + 16 + l] = q >> 4;
                }
            }
        }
    }
    out
}

/// Q5_0, Q5_1 and IQ4_NL: `d`, [`m`], [32 fifth bits, little-endian: bit `t` for weight
/// `t`], 16 bytes of nibbles (byte `l`: weight `l` low, weight `l + 16` high).
fn decode_32(qt: QType, b: &[u8], out: &mut Block) {
    out.d = half(b, 0);
    let (qh, qs) = match qt {
        QType::Q5_0 => (u32::from_le_bytes([b[2], b[3], b[4], b[5]]), &b[6..22]),
        QType::Q5_1 => {
            out.e = half(b, 2);
            (u32::from_le_bytes([b[4], b[5], b[6], b[7]]), &b[8..24])
        }
        _ => (0, &b[2..18]),
    };
    for (l, &q) in qs.iter().enumerate() {
        out.codes[l] = (q & 0xF) | (((qh >> l) & 1) as u8) << 4;
        out.codes[l + 16] = (q >> 4) | (((qh >> (l + 16)) & 1) as u8) << 4;
    }
}

/// Q3_K / Q2_K's two low bits of weight `t` (`t = 128 g + 32 s + l`: bits 2 s of
/// `qs[32 g + l]`).
fn two_bits(qs: &[u8], t: usize) -> u8 {
    (qs[32 * (t / 128) + t % 32] >> (2 * ((t % 128) / 32))) & 3
}

/// `out[t] = value(j, codes[t])` for `j = t / per` (the sub-block of weight `t`).
fn per_sub_block(out: &mut [f32], codes: &[u8], per: usize, value: impl Fn(usize, u8) -> f32) {
    for (j, (o, u)) in out
        .chunks_exact_mut(per)
        .zip(codes.chunks_exact(per))
        .enumerate()
    {
        for (o, &u) in o.iter_mut().zip(u) {
            *o = value(j, u);
        }
    }
}

/// The block's weights in f32 (`out`: `qt.block()` values), in `gguf.quants`' order of
/// operations (module docs).
pub(crate) fn dequantize_block(qt: QType, blk: &Block, out: &mut [f32]) {
    let (d, e) = (blk.d, blk.e);
    let codes = &blk.codes[..out.len()];
    match qt {
        // (Q8_0: u ^ 0x80 is the int8 weight)
        QType::Q8_0 => per_sub_block(out, codes, 32, |_, u| d * f32::from((u ^ 0x80) as i8)),
        QType::Q4_0 => per_sub_block(out, codes, 32, |_, u| d * f32::from(u as i8 - 8)),
        QType::Q4_1 | QType::Q5_1 => per_sub_block(out, codes, 32, |_, u| d * f32::from(u) + e),
        QType::Q5_0 => per_sub_block(out, codes, 32, |_, u| d * f32::from(u as i8 - 16)),
        QType::IQ4_NL | QType::MXFP4 => per_sub_block(out, codes, 32, |_, u| {
            d * f32::from(table_values(qt)[usize::from(u & 0xF)])
        }),
        QType::Q4_K | QType::Q5_K => per_sub_block(out, codes, 32, |j, u| {
            d * blk.sc[j] as f32 * f32::from(u) - e * blk.mn[j] as f32
        }),
        QType::Q6_K => per_sub_block(out, codes, 16, |j, u| {
            d * blk.sc[j] as f32 * f32::from(u as i8 - 32)
        }),
        QType::Q3_K => per_sub_block(out, codes, 16, |j, u| {
            d * blk.sc[j] as f32 * f32::from(u as i8 - 4)
        }),
        QType::Q2_K => per_sub_block(out, codes, 16, |j, u| {
            d * blk.sc[j] as f32 * f32::from(u) - e * blk.mn[j] as f32
        }),
        QType::IQ4_XS => per_sub_block(out, codes, 32, |j, u| {
            d * blk.sc[j] as f32 * f32::from(IQ4_VALUES[usize::from(u & 0xF)])
        }),
    }
}

fn put_half(b: &mut [u8], at: usize, v: f32) {
    b[at..at + 2].copy_from_slice(&f16::from_f32(v).to_le_bytes());
}

/// Writes `blk` as one GGUF block of `qt` into `b` (`qt.block_bytes()` bytes): the inverse
/// of [`decode`] for a block whose codes, scales and mins fit their bits and whose factors
/// are fp16 values.
pub(crate) fn encode(qt: QType, blk: &Block, b: &mut [u8]) {
    assert_eq!(b.len(), qt.block_bytes(), "one {} block", qt.name());
    let c = &blk.codes;
    match qt {
        QType::Q8_0 => {
            put_half(b, 0, blk.d);
            for (w, &u) in b[2..34].iter_mut().zip(c) {
                *w = u ^ 0x80;
            }
        }
        QType::Q4_0 | QType::Q4_1 => {
            put_half(b, 0, blk.d);
            let qs = if qt == QType::Q4_1 {
                put_half(b, 2, blk.e);
                &mut b[4..20]
            } else {
                &mut b[2..18]
            };
            for (l, q) in qs.iter_mut().enumerate() {
                *q = (c[l] & 0xF) | (c[l + 16] << 4);
            }
        }
        QType::Q4_K | QType::Q5_K => {
            put_half(b, 0, blk.d);
            put_half(b, 2, blk.e);
            // six-bit scale / min j < 4 in the low bits of bytes j / j + 4, j >= 4 split
            // into a nibble of byte j + 4 and the top two bits of byte j - 4 / j
            let (sc, mn) = (&blk.sc, &blk.mn);
            let s = &mut b[4..16];
            for j in 0..4 {
                let (hs, hm) = (sc[j + 4] as u8, mn[j + 4] as u8);
                s[j] = sc[j] as u8 | ((hs >> 4) << 6);
                s[j + 4] = mn[j] as u8 | ((hm >> 4) << 6);
                s[j + 8] = (hs & 0xF) | ((hm & 0xF) << 4);
            }
            let qs_at = if qt == QType::Q5_K {
                let qh = &mut b[16..48];
                qh.fill(0);
                for s in 0..8 {
                    for (h, &u) in qh.iter_mut().zip(&c[32 * s..32 * s + 32]) {
                        *h |= ((u >> 4) & 1) << s;
                    }
                }
                48
            } else {
                16
            };
            let qs = &mut b[qs_at..qs_at + 128];
            for g in 0..4 {
                for l in 0..32 {
                    qs[32 * g + l] = (c[64 * g + l] & 0xF) | ((c[64 * g + 32 + l] & 0xF) << 4);
                }
            }
        }
        QType::Q5_0 | QType::Q5_1 | QType::IQ4_NL => {
            put_half(b, 0, blk.d);
            let qs_at = match qt {
                QType::Q5_0 => 6,
                QType::Q5_1 => 8,
                _ => 2,
            };
            if qt != QType::IQ4_NL {
                let qh = (0..32).fold(0u32, |h, t| h | (u32::from(c[t] >> 4) & 1) << t);
                b[qs_at - 4..qs_at].copy_from_slice(&qh.to_le_bytes());
            }
            if qt == QType::Q5_1 {
                put_half(b, 2, blk.e);
            }
            for (l, q) in b[qs_at..qs_at + 16].iter_mut().enumerate() {
                *q = (c[l] & 0xF) | (c[l + 16] << 4);
            }
        }
        QType::Q6_K => {
            let (ql, rest) = b.split_at_mut(128);
            let (qh, rest) = rest.split_at_mut(64);
            ql.fill(0);
            qh.fill(0);
            for h in 0..2 {
                for w in 0..128 {
                    let u = c[128 * h + w];
                    ql[64 * h + w % 64] |= (u & 0xF) << (4 * (w / 64));
                    qh[32 * h + w % 32] |= ((u >> 4) & 3) << (2 * (w / 32));
                }
            }
            for (o, &s) in rest[..16].iter_mut().zip(&blk.sc) {
                *o = s as i8 as u8;
            }
            put_half(b, 208, blk.d);
        }
        QType::Q3_K => {
            let (hm, rest) = b.split_at_mut(32);
            let (qs, rest) = rest.split_at_mut(64);
            hm.fill(0);
            put_two_bits(qs, c);
            for (t, &u) in c.iter().enumerate() {
                hm[t % 32] |= ((u >> 2) & 1) << (t / 32);
            }
            let s = &mut rest[..12];
            s.fill(0);
            for (j, &v) in blk.sc.iter().enumerate() {
                let v = (v + 32) as u8;
                s[j % 8] |= (v & 0xF) << (4 * (j / 8));
                s[8 + j % 4] |= (v >> 4) << (2 * (j / 4));
            }
            put_half(b, 108, blk.d);
        }
        QType::Q2_K => {
            for (j, o) in b[0..16].iter_mut().enumerate() {
                *o = blk.sc[j] as u8 | ((blk.mn[j] as u8) << 4);
            }
            put_two_bits(&mut b[16..80], c);
            put_half(b, 80, blk.d);
            put_half(b, 82, blk.e);
        }
        QType::IQ4_XS => {
            put_half(b, 0, blk.d);
            let mut sh = 0u16;
            b[4..8].fill(0);
            for j in 0..8 {
                let v = (blk.sc[j] + 32) as u8;
                b[4 + j / 2] |= (v & 0xF) << (4 * (j % 2));
                sh |= u16::from(v >> 4) << (2 * j);
            }
            b[2..4].copy_from_slice(&sh.to_le_bytes());
            for j in 0..8 {
                for l in 0..16 {
                    b[8 + 16 * j + l] = (c[32 * j + l] & 0xF) | (c[32 * j + 16 + l] << 4);
                }
            }
        }
        QType::MXFP4 => {
            // (d: 0, or a power of two 2^(e - 128) with e in MXFP4_E)
            b[0] = if blk.d == 0.0 {
                0
            } else {
                ((blk.d.to_bits() >> 23) + 1) as u8
            };
            for (l, q) in b[1..17].iter_mut().enumerate() {
                *q = (c[l] & 0xF) | (c[l + 16] << 4);
            }
        }
    }
}

/// Writes Q3_K / Q2_K's two low bits of the codes `c` into `qs` (64 bytes; [`two_bits`]).
fn put_two_bits(qs: &mut [u8], c: &[u8; 256]) {
    qs.fill(0);
    for (t, &u) in c.iter().enumerate() {
        qs[32 * (t / 128) + t % 32] |= (u & 3) << (2 * ((t % 128) / 32));
    }
}
