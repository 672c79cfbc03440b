//! The packed layout of the bf16 products ([`crate::amx`]: AMX tiles, or AVX-512 BF16 on
//! zmm registers): the weight `W` [n, k] (bf16 bits) in blocks of 16 output columns by 32
//! inputs, each 16 rows (pairs of inputs) of 16 columns x 2 bf16 (1 KiB, one B tile), block
//! `(nb, kb)` at `(nb * k_blocks + kb) * 512`, zero beyond `n` (padded to an even number of
//! blocks: the products take column blocks in pairs) and `k`.

use super::{round_up, Layout};

/// Output columns of one block (one tile).
pub const TILE_N: usize = 16;
/// bf16 inputs (the product's k) of one block row.
pub const TILE_K: usize = 32;
/// Elements (u16) of one packed weight block.
pub(crate) const BLOCK: usize = TILE_N * TILE_K;
/// Column blocks run in pairs (two accumulator columns per pass).
pub(crate) const COLS_PER_PASS: usize = 2 * TILE_N;

/// Elements of the packed form of an `[n, k]` weight (`n` padded to a pair of blocks).
pub fn packed_len(n: usize, k: usize) -> usize {
    round_up(n, COLS_PER_PASS) * round_up(k, TILE_K)
}

/// The layout, for [`super::pack`] and [`super::Product::begin`].
pub(crate) struct PairBlocks;

impl Layout for PairBlocks {
    type Elem = u16;

    fn packed_len(n: usize, k: usize) -> usize {
        packed_len(n, k)
    }

    fn pack_into(weight: &[u16], n: usize, k: usize, out: &mut [u16]) {
        let k_blocks = round_up(k, TILE_K) / TILE_K;
        for (b, block) in out.chunks_exact_mut(BLOCK).enumerate() {
            let (nb, kb) = (b / k_blocks, b % k_blocks);
            for (i, v) in block.iter_mut().enumerate() {
                // row p of the tile holds inputs 2p and 2p + 1 of each of its 16 columns
                let (p, j, e) = (i / (2 * TILE_N), (i / 2) % TILE_N, i % 2);
                let (col, kk) = (nb * TILE_N + j, kb * TILE_K + 2 * p + e);
                *v = if col < n && kk < k {
                    weight[col * k + kk]
                } else {
                    0
                };
            }
        }
    }
}
