//! The packed layout the products read: weight rows (output columns) in panels of 16, each
//! panel's blocks split into streams (codes, high bits, scales, factors), each stream the
//! panel's blocks one after the other. One 64-byte row of codes holds one quad of 4
//! consecutive inputs for the 16 columns (byte `4 c + i`: column `c`, input `4 q + i`), the
//! operand of one `vpdpbusd`, so the 16 columns' sums stay in the 16 lanes and no sum is ever
//! reduced across lanes.
//!
//! Streams, per block of a panel (bytes):
//!
//! | type | streams |
//! |---|---|
//! | Q8_0 | codes 512 (`w ^ 0x80`, quad `q` at `64 q`), d 32 |
//! | Q4_0 | nibbles 256, d 32 |
//! | Q4_1 | nibbles 256, d 32, m 32 |
//! | Q4_K | nibbles 2048, sc 128, mins 128, d 32, dmin 32 |
//! | Q5_K | nibbles 2048, fifth bits 512, sc 128, mins 128, d 32, dmin 32 |
//! | Q6_K | nibbles 2048, high bit pairs 1024, sc 256, d 32 |
//! | Q5_0 | nibbles 256, fifth bits 64, d 32 |
//! | Q5_1 | nibbles 256, fifth bits 64, d 32, m 32 |
//! | IQ4_NL, MXFP4 | nibbles 256 (the table indices), d 32 (MXFP4: `2^(e - 128)` in fp16) |
//! | Q3_K | low bit pairs 1024, third bits 512, sc 256, d 32 |
//! | Q2_K | bit pairs 1024, sc and mins 256, d 32, dmin 32 |
//! | IQ4_XS | nibbles 2048 (indices), sc 128, d 32 |
//!
//! * nibbles: 64-byte row `p` holds quad `2 p` in its low nibbles and quad `2 p + 1` in its
//!   high nibbles (inputs `8 p .. 8 p + 8`);
//! * fifth bits (Q5_K; Q5_0 and Q5_1: the one row of a block): row `j` (sub-block `j`,
//!   inputs `32 j ..`), byte `4 c + i`, bit `v`: bit 4 of the code of input `32 j + 4 v + i`;
//! * high bit pairs (Q6_K): row `j` (sub-block `j` of 16), byte `4 c + i`, bits `2 v, 2 v +
//!   1`: bits 4-5 of the code of input `16 j + 4 v + i`;
//! * low bit pairs (Q3_K), bit pairs (Q2_K): row `j` (sub-block `j` of 16), byte `4 c + i`,
//!   bits `2 v, 2 v + 1`: bits 0-1 of the code of input `16 j + 4 v + i`;
//! * third bits (Q3_K): row `j` (inputs `32 j ..`), byte `4 c + i`, bit `v`: bit 2 of the
//!   code of input `32 j + 4 v + i`;
//! * sc: `[sub-block][column]` bytes (Q6_K, Q3_K, IQ4_XS: int8; Q2_K: the scale in the low
//!   nibble, the min in the high one); mins: `[pair p][column][2]` bytes (the mins of
//!   sub-blocks `2 p`, `2 p + 1`);
//! * d, m, dmin: 16 fp16, one a column.
//!
//! Columns past `n` in the last panel are zero blocks. The packed form of Q8_0, Q4_0, Q4_1,
//! Q6_K, Q5_0, Q5_1, IQ4_NL and Q2_K is exactly as large as the GGUF rows (for `n` a multiple
//! of 16); Q4_K and Q5_K gain 4 bytes a block (their scales unpacked: +2.8% and +2.3%), Q3_K
//! 4 (+3.6%) and IQ4_XS 2 (+1.5%).

use half::f16;

use super::blocks::{decode, is_table32, Block};
use super::QType;

/// Output columns of a panel (one zmm register of i32 / f32 lanes).
pub const PANEL: usize = 16;

/// The streams of a block of a panel, in bytes, in order.
pub(crate) fn streams(qt: QType) -> &'static [usize] {
    match qt {
        QType::Q8_0 => &[512, 32],
        QType::Q4_0 => &[256, 32],
        QType::Q4_1 => &[256, 32, 32],
        QType::Q4_K => &[2048, 128, 128, 32, 32],
        QType::Q5_K => &[2048, 512, 128, 128, 32, 32],
        QType::Q6_K => &[2048, 1024, 256, 32],
        QType::Q5_0 => &[256, 64, 32],
        QType::Q5_1 => &[256, 64, 32, 32],
        QType::IQ4_NL | QType::MXFP4 => &[256, 32],
        QType::Q3_K => &[1024, 512, 256, 32],
        QType::Q2_K => &[1024, 256, 32, 32],
        QType::IQ4_XS => &[2048, 128, 32],
    }
}

/// The streams of a 32-weight type's `d` and `m` (Q4_1, Q5_1; else None) in a panel.
pub(crate) fn factor_streams(qt: QType) -> (usize, Option<usize>) {
    match qt {
        QType::Q4_1 => (1, Some(2)),
        QType::Q5_0 => (2, None),
        QType::Q5_1 => (2, Some(3)),
        _ => (1, None),
    }
}

/// Bytes of a block of a panel (all streams).
pub(crate) fn panel_block_bytes(qt: QType) -> usize {
    streams(qt).iter().sum()
}

/// Where each stream of a panel of `nb` blocks starts, from the panel's start.
pub(crate) fn stream_starts(qt: QType, nb: usize) -> [usize; 6] {
    let mut at = [0; 6];
    let mut off = 0;
    for (a, s) in at.iter_mut().zip(streams(qt)) {
        *a = off;
        off += s * nb;
    }
    at
}

#[cfg(test)]
/// Stream `s`, block `b` of the panel `panel` (`nb` blocks).
fn stream(qt: QType, panel: &[u8], nb: usize, s: usize, b: usize) -> &[u8] {
    let len = streams(qt)[s];
    let at = stream_starts(qt, nb)[s] + b * len;
    &panel[at..at + len]
}

fn stream_mut(qt: QType, panel: &mut [u8], nb: usize, s: usize, b: usize) -> &mut [u8] {
    let len = streams(qt)[s];
    let at = stream_starts(qt, nb)[s] + b * len;
    &mut panel[at..at + len]
}

fn put_halves(out: &mut [u8], vals: impl Iterator<Item = f32>) {
    for (o, v) in out.chunks_exact_mut(2).zip(vals) {
        o.copy_from_slice(&f16::from_f32(v).to_le_bytes());
    }
}

#[cfg(test)]
fn get_halves(b: &[u8]) -> impl Iterator<Item = f32> + '_ {
    b.chunks_exact(2)
        .map(|h| f16::from_bits(u16::from_le_bytes([h[0], h[1]])).to_f32())
}

/// Writes quads of 16 columns' codes: row `q` (64 bytes) of `out` holds inputs `4 q ..`.
fn put_bytes(out: &mut [u8], blks: &[Block; PANEL], len: usize, code: impl Fn(u8) -> u8) {
    for q in 0..len / 4 {
        for (c, blk) in blks.iter().enumerate() {
            for i in 0..4 {
                out[64 * q + 4 * c + i] = code(blk.codes[4 * q + i]);
            }
        }
    }
}

fn put_nibbles(out: &mut [u8], blks: &[Block; PANEL], len: usize) {
    for p in 0..len / 8 {
        for (c, blk) in blks.iter().enumerate() {
            for i in 0..4 {
                let (lo, hi) = (blk.codes[8 * p + i], blk.codes[8 * p + 4 + i]);
                out[64 * p + 4 * c + i] = (lo & 0xF) | ((hi & 0xF) << 4);
            }
        }
    }
}

#[cfg(test)]
fn get_nibbles(src: &[u8], blks: &mut [Block; PANEL], len: usize) {
    for p in 0..len / 8 {
        for (c, blk) in blks.iter_mut().enumerate() {
            for i in 0..4 {
                let v = src[64 * p + 4 * c + i];
                blk.codes[8 * p + i] = v & 0xF;
                blk.codes[8 * p + 4 + i] = v >> 4;
            }
        }
    }
}

/// Bits `shift .. shift + bits` of the codes: `bits` bits a quad, `quads` quads a 64-byte
/// row (row `r`, byte `4 c + i`, bits `bits * q ..`: input `4 (quads r + q) + i`).
fn put_field(out: &mut [u8], blks: &[Block; PANEL], shift: u32, bits: u32, quads: usize) {
    let mask = (1u8 << bits) - 1;
    for (row, out) in out.chunks_exact_mut(64).enumerate() {
        for (c, blk) in blks.iter().enumerate() {
            for i in 0..4 {
                let mut v = 0u8;
                for q in 0..quads {
                    let code = blk.codes[4 * (quads * row + q) + i];
                    v |= ((code >> shift) & mask) << (bits as usize * q);
                }
                out[4 * c + i] = v;
            }
        }
    }
}

#[cfg(test)]
fn get_field(src: &[u8], blks: &mut [Block; PANEL], shift: u32, bits: u32, quads: usize) {
    let mask = (1u8 << bits) - 1;
    for (row, src) in src.chunks_exact(64).enumerate() {
        for (c, blk) in blks.iter_mut().enumerate() {
            for i in 0..4 {
                for q in 0..quads {
                    let h = (src[4 * c + i] >> (bits as usize * q)) & mask;
                    blk.codes[4 * (quads * row + q) + i] |= h << shift;
                }
            }
        }
    }
}

/// Writes `[sub-block][column]` bytes `f(block, sub-block)` of `subs` sub-blocks.
fn put_subs(out: &mut [u8], blks: &[Block; PANEL], subs: usize, f: impl Fn(&Block, usize) -> u8) {
    for j in 0..subs {
        for (c, blk) in blks.iter().enumerate() {
            out[16 * j + c] = f(blk, j);
        }
    }
}

/// Encodes 16 columns' block `b` into the panel `panel` (`nb` blocks).
pub(crate) fn encode(qt: QType, blks: &[Block; PANEL], panel: &mut [u8], nb: usize, b: usize) {
    let bl = qt.block();
    match qt {
        QType::Q8_0 => {
            put_bytes(stream_mut(qt, panel, nb, 0, b), blks, bl, |u| u);
            put_halves(stream_mut(qt, panel, nb, 1, b), blks.iter().map(|k| k.d));
        }
        QType::Q4_0 | QType::Q4_1 => {
            put_nibbles(stream_mut(qt, panel, nb, 0, b), blks, bl);
            put_halves(stream_mut(qt, panel, nb, 1, b), blks.iter().map(|k| k.d));
            if qt == QType::Q4_1 {
                put_halves(stream_mut(qt, panel, nb, 2, b), blks.iter().map(|k| k.e));
            }
        }
        QType::Q4_K | QType::Q5_K => {
            put_nibbles(stream_mut(qt, panel, nb, 0, b), blks, bl);
            let mut next = 1;
            if qt == QType::Q5_K {
                put_field(stream_mut(qt, panel, nb, 1, b), blks, 4, 1, 8);
                next = 2;
            }
            let sc = stream_mut(qt, panel, nb, next, b);
            for j in 0..8 {
                for (c, blk) in blks.iter().enumerate() {
                    sc[16 * j + c] = blk.sc[j] as u8;
                }
            }
            let mins = stream_mut(qt, panel, nb, next + 1, b);
            for p in 0..4 {
                for (c, blk) in blks.iter().enumerate() {
                    mins[32 * p + 2 * c] = blk.mn[2 * p] as u8;
                    mins[32 * p + 2 * c + 1] = blk.mn[2 * p + 1] as u8;
                }
            }
            put_halves(
                stream_mut(qt, panel, nb, next + 2, b),
                blks.iter().map(|k| k.d),
            );
            put_halves(
                stream_mut(qt, panel, nb, next + 3, b),
                blks.iter().map(|k| k.e),
            );
        }
        QType::Q5_0 | QType::Q5_1 | QType::IQ4_NL | QType::MXFP4 => {
            put_nibbles(stream_mut(qt, panel, nb, 0, b), blks, bl);
            let mut next = 1;
            if !is_table32(qt) {
                put_field(stream_mut(qt, panel, nb, 1, b), blks, 4, 1, 8);
                next = 2;
            }
            put_halves(stream_mut(qt, panel, nb, next, b), blks.iter().map(|k| k.d));
            if qt == QType::Q5_1 {
                put_halves(stream_mut(qt, panel, nb, 3, b), blks.iter().map(|k| k.e));
            }
        }
        QType::Q6_K => {
            put_nibbles(stream_mut(qt, panel, nb, 0, b), blks, bl);
            put_field(stream_mut(qt, panel, nb, 1, b), blks, 4, 2, 4);
            let sc = stream_mut(qt, panel, nb, 2, b);
            for j in 0..16 {
                for (c, blk) in blks.iter().enumerate() {
                    sc[16 * j + c] = blk.sc[j] as i8 as u8;
                }
            }
            put_halves(stream_mut(qt, panel, nb, 3, b), blks.iter().map(|k| k.d));
        }
        QType::Q3_K => {
            put_field(stream_mut(qt, panel, nb, 0, b), blks, 0, 2, 4);
            put_field(stream_mut(qt, panel, nb, 1, b), blks, 2, 1, 8);
            put_subs(stream_mut(qt, panel, nb, 2, b), blks, 16, |k, j| {
                k.sc[j] as i8 as u8
            });
            put_halves(stream_mut(qt, panel, nb, 3, b), blks.iter().map(|k| k.d));
        }
        QType::Q2_K => {
            put_field(stream_mut(qt, panel, nb, 0, b), blks, 0, 2, 4);
            put_subs(stream_mut(qt, panel, nb, 1, b), blks, 16, |k, j| {
                k.sc[j] as u8 | ((k.mn[j] as u8) << 4)
            });
            put_halves(stream_mut(qt, panel, nb, 2, b), blks.iter().map(|k| k.d));
            put_halves(stream_mut(qt, panel, nb, 3, b), blks.iter().map(|k| k.e));
        }
        QType::IQ4_XS => {
            put_nibbles(stream_mut(qt, panel, nb, 0, b), blks, bl);
            put_subs(stream_mut(qt, panel, nb, 1, b), blks, 8, |k, j| {
                k.sc[j] as i8 as u8
            });
            put_halves(stream_mut(qt, panel, nb, 2, b), blks.iter().map(|k| k.d));
        }
    }
}

/// The 16 columns' block `b` of the panel `panel` (`nb` blocks) in integer form (the
/// tests' inverse of [`encode`]).
#[cfg(test)]
pub(crate) fn decode_panel(qt: QType, panel: &[u8], nb: usize, b: usize) -> [Block; PANEL] {
    let bl = qt.block();
    let mut blks = [Block::ZERO; PANEL];
    let st = |i: usize| stream(qt, panel, nb, i, b);
    let set = |blks: &mut [Block; PANEL], src: &[u8], f: fn(&mut Block, f32)| {
        for (blk, v) in blks.iter_mut().zip(get_halves(src)) {
            f(blk, v);
        }
    };
    match qt {
        QType::Q8_0 => {
            let src = st(0);
            for q in 0..bl / 4 {
                for (c, blk) in blks.iter_mut().enumerate() {
                    blk.codes[4 * q..4 * q + 4].copy_from_slice(&src[64 * q + 4 * c..][..4]);
                }
            }
            set(&mut blks, st(1), |k, v| k.d = v);
        }
        QType::Q4_0 | QType::Q4_1 => {
            get_nibbles(st(0), &mut blks, bl);
            set(&mut blks, st(1), |k, v| k.d = v);
            if qt == QType::Q4_1 {
                set(&mut blks, st(2), |k, v| k.e = v);
            }
        }
        QType::Q4_K | QType::Q5_K => {
            get_nibbles(st(0), &mut blks, bl);
            let mut next = 1;
            if qt == QType::Q5_K {
                get_field(st(1), &mut blks, 4, 1, 8);
                next = 2;
            }
            let (sc, mins) = (st(next), st(next + 1));
            for (c, blk) in blks.iter_mut().enumerate() {
                for j in 0..8 {
                    blk.sc[j] = i32::from(sc[16 * j + c]);
                    blk.mn[j] = i32::from(mins[32 * (j / 2) + 2 * c + j % 2]);
                }
            }
            set(&mut blks, st(next + 2), |k, v| k.d = v);
            set(&mut blks, st(next + 3), |k, v| k.e = v);
        }
        QType::Q5_0 | QType::Q5_1 | QType::IQ4_NL | QType::MXFP4 => {
            get_nibbles(st(0), &mut blks, bl);
            let mut next = 1;
            if !is_table32(qt) {
                get_field(st(1), &mut blks, 4, 1, 8);
                next = 2;
            }
            set(&mut blks, st(next), |k, v| k.d = v);
            if qt == QType::Q5_1 {
                set(&mut blks, st(3), |k, v| k.e = v);
            }
        }
        QType::Q6_K => {
            get_nibbles(st(0), &mut blks, bl);
            get_field(st(1), &mut blks, 4, 2, 4);
            let sc = st(2);
            for (c, blk) in blks.iter_mut().enumerate() {
                for j in 0..16 {
                    blk.sc[j] = i32::from(sc[16 * j + c] as i8);
                }
            }
            set(&mut blks, st(3), |k, v| k.d = v);
        }
        QType::Q3_K | QType::Q2_K => {
            get_field(st(0), &mut blks, 0, 2, 4);
            let q3 = qt == QType::Q3_K;
            if q3 {
                get_field(st(1), &mut blks, 2, 1, 8);
            }
            let sc = st(if q3 { 2 } else { 1 });
            for (c, blk) in blks.iter_mut().enumerate() {
                for j in 0..16 {
                    let v = sc[16 * j + c];
                    if q3 {
                        blk.sc[j] = i32::from(v as i8);
                    } else {
                        (blk.sc[j], blk.mn[j]) = (i32::from(v & 0xF), i32::from(v >> 4));
                    }
                }
            }
            set(&mut blks, st(if q3 { 3 } else { 2 }), |k, v| k.d = v);
            if !q3 {
                set(&mut blks, st(3), |k, v| k.e = v);
            }
        }
        QType::IQ4_XS => {
            get_nibbles(st(0), &mut blks, bl);
            let sc = st(1);
            for (c, blk) in blks.iter_mut().enumerate() {
                for j in 0..8 {
                    blk.sc[j] = i32::from(sc[16 * j + c] as i8);
                }
            }
            set(&mut blks, st(2), |k, v| k.d = v);
        }
    }
    blks
}

/// Packs panels `panels` of the GGUF rows `rows` ([n, k / block] blocks) into `out`
/// (those panels' bytes, in order).
pub(crate) fn pack_panels(
    qt: QType,
    rows: &[u8],
    n: usize,
    k: usize,
    panels: std::ops::Range<usize>,
    out: &mut [u8],
) {
    let nb = k / qt.block();
    let (bb, row_bytes) = (qt.block_bytes(), nb * qt.block_bytes());
    let panel_bytes = nb * panel_block_bytes(qt);
    for (p, panel) in panels.zip(out.chunks_exact_mut(panel_bytes)) {
        for b in 0..nb {
            let mut blks = [Block::ZERO; PANEL];
            for (c, blk) in blks.iter_mut().enumerate() {
                let col = PANEL * p + c;
                if col < n {
                    *blk = decode(qt, &rows[col * row_bytes + b * bb..][..bb]);
                }
            }
            encode(qt, &blks, panel, nb, b);
        }
    }
}
