//! Chained content hash of full blocks.
//!
//! `hash(block i) = xxh3_64(tokens of block i, seed = hash(block i-1))`, with a fixed seed
//! for block 0, so a block's hash names its whole prefix. Hashes only *find* candidates:
//! [`crate::pool::ChunkPool::lookup`] verifies tokens and the parent link, so a collision
//! ("twin hash") is a miss, never a wrong hit.

use xxhash_rust::xxh3::xxh3_64_with_seed;

use crate::Token;

/// Seed of block 0's hash.
pub const ROOT_SEED: u64 = 0x6665_7272_6f62_6174; // "ferrobat"

/// Hashes blocks (no allocation).
#[derive(Clone, Debug, Default)]
pub struct BlockHasher {
    /// Mask applied to every hash (all ones normally; tests shrink it to force twins).
    pub mask: u64,
}

impl BlockHasher {
    pub fn new() -> Self {
        BlockHasher { mask: u64::MAX }
    }

    /// Hash of a full block given its parent's hash (None for block 0).
    pub fn hash(&mut self, parent: Option<u64>, tokens: &[Token]) -> u64 {
        // SAFETY: viewing `[u32]` as bytes is always sound: the pointer is valid for
        // `size_of_val(tokens)` bytes for the lifetime of `tokens` (borrowed, not mutated
        // meanwhile), `u8` has alignment 1 and every byte pattern is a valid `u8`. (Byte
        // order is the machine's: hashes never leave the process.)
        let bytes = unsafe {
            std::slice::from_raw_parts(tokens.as_ptr().cast::<u8>(), std::mem::size_of_val(tokens))
        };
        xxh3_64_with_seed(bytes, parent.unwrap_or(ROOT_SEED)) & self.mask
    }

    /// Extend `hashes` so it covers the first `n_blocks` full blocks of `tokens`, computed
    /// under the cache `salt` (0: none; another salt seeds block 0 differently, so every
    /// hash of the chain differs).
    pub fn extend(
        &mut self,
        hashes: &mut Vec<u64>,
        tokens: &[Token],
        page: usize,
        n_blocks: usize,
        salt: u64,
    ) {
        while hashes.len() < n_blocks {
            let i = hashes.len();
            let parent = if i > 0 {
                Some(hashes[i - 1])
            } else if salt != 0 {
                Some(xxh3_64_with_seed(&salt.to_le_bytes(), ROOT_SEED))
            } else {
                None
            };
            let h = self.hash(parent, &tokens[i * page..(i + 1) * page]);
            hashes.push(h);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chained() {
        let mut h = BlockHasher::new();
        let mut a = Vec::new();
        h.extend(&mut a, &[1, 2, 3, 4], 2, 2, 0);
        let mut b = Vec::new();
        h.extend(&mut b, &[9, 9, 3, 4], 2, 2, 0);
        assert_ne!(a[1], b[1], "same block content, different prefix");
        assert_eq!(a[0], h.hash(None, &[1, 2]));
    }
}
