//! Block arithmetic of the two allocators (pure: no allocation here; both draw chunks from
//! the same [`crate::pool::ChunkPool`] through [`crate::kv::KvManager`]).
//!
//! * **Full attention**: an append-only list of blocks; position `p` lives in block
//!   `p / page_size`. Holding `n` cached tokens needs `ceil(n / page_size)` blocks.
//! * **Sliding window** `w`: a ring of at most `R = ceil(w / page_size) + 1` chunks; position
//!   `p` lives in ring slot `(p / page_size) % R`. The ring holds `min(R, ceil(n / page))`
//!   chunks for `n` tokens. After a step ending at `end`, positions `end - w .. end` are in
//!   the ring; new tokens of a step below `end - w` are written to the scratch chunk, so no
//!   two tokens of a step write the same ring slot and no kept position is overwritten.

use crate::pool::SCRATCH_CHUNK;
use crate::ChunkId;

/// The block-table column that holds key `position`: `position / page_size` for full
/// attention (`ring` None), `(position / page_size) % ring` in a sliding ring of `ring` chunks.
#[inline]
pub fn table_column(position: usize, page_size: usize, ring: Option<usize>) -> usize {
    let block = position / page_size;
    match ring {
        Some(r) => block % r,
        None => block,
    }
}

/// Geometry shared by the allocators.
#[derive(Clone, Copy, Debug)]
pub struct Layout {
    pub page: usize,
    pub has_full: bool,
    pub has_sliding: bool,
    /// Sliding window `w` (0 when there are no sliding layers).
    pub window: usize,
    /// Ring size `R` (0 when there are no sliding layers).
    pub ring: usize,
}

impl Layout {
    pub fn new(page: usize, has_full: bool, window: Option<usize>) -> Self {
        let (has_sliding, window, ring) = match window {
            Some(w) => (true, w, w.div_ceil(page) + 1),
            None => (false, 0, 0),
        };
        Layout {
            page,
            has_full,
            has_sliding,
            window,
            ring,
        }
    }

    /// Full-attention blocks needed to hold `n` tokens.
    #[inline]
    pub fn full_blocks_for(&self, n: usize) -> usize {
        if self.has_full {
            n.div_ceil(self.page)
        } else {
            0
        }
    }

    /// Ring chunks needed to hold the window of `n` tokens.
    #[inline]
    pub fn ring_chunks_for(&self, n: usize) -> usize {
        if self.has_sliding {
            n.div_ceil(self.page).min(self.ring)
        } else {
            0
        }
    }

    /// New chunks to allocate so a request holding `full`/`ring` chunks can hold `end` tokens.
    #[inline]
    pub fn chunks_needed(&self, full: usize, ring: usize, end: usize) -> usize {
        self.full_blocks_for(end).saturating_sub(full)
            + self.ring_chunks_for(end).saturating_sub(ring)
    }

    /// Chunks a request with `n` tokens holds at most.
    pub fn max_chunks(&self, n: usize) -> usize {
        self.full_blocks_for(n) + self.ring_chunks_for(n)
    }

    /// Largest `q <= q_max` such that growing from `start` to `start + q` needs at most
    /// `free` new chunks (0 if even one token does not fit).
    pub fn fit(&self, full: usize, ring: usize, start: usize, q_max: usize, free: usize) -> usize {
        if self.chunks_needed(full, ring, start + q_max) <= free {
            return q_max;
        }
        let (mut lo, mut hi) = (0usize, q_max); // need(lo) fits, need(hi) does not
        while hi - lo > 1 {
            let mid = (lo + hi) / 2;
            if self.chunks_needed(full, ring, start + mid) <= free {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        lo
    }

    /// Full-attention slot of position `p`.
    #[inline]
    pub fn full_slot(&self, blocks: &[ChunkId], p: usize) -> i32 {
        (blocks[table_column(p, self.page, None)] as usize * self.page + p % self.page) as i32
    }

    /// The ring floor (see `Request::ring_floor`) after a step writes positions
    /// `start..end` over a ring whose floor was `floor`: new keys below `end - w` go to
    /// scratch, and each new key overwrites the one `R * page` positions back.
    #[inline]
    pub fn ring_floor_after(&self, floor: usize, start: usize, end: usize) -> usize {
        let kept_from = end.saturating_sub(self.window);
        if start < kept_from {
            kept_from
        } else {
            floor.max(end.saturating_sub(self.ring * self.page))
        }
    }

    /// Sliding slot of new position `p` in a step ending at `end` (scratch when the ring
    /// will not keep it).
    #[inline]
    pub fn sliding_slot(&self, ring: &[ChunkId], p: usize, end: usize) -> i32 {
        let c = if p + self.window >= end {
            ring[table_column(p, self.page, Some(self.ring))]
        } else {
            SCRATCH_CHUNK
        };
        (c as usize * self.page + p % self.page) as i32
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ring_geometry() {
        let l = Layout::new(4, false, Some(6));
        assert_eq!(l.ring, 3);
        assert_eq!(l.ring_chunks_for(1), 1);
        assert_eq!(l.ring_chunks_for(100), 3);
        assert_eq!(l.full_blocks_for(100), 0);
        // Step 0..20: positions >= 14 kept.
        let ring = [10, 11, 12];
        assert_eq!(l.sliding_slot(&ring, 13, 20), 4 + 1);
        assert_eq!(l.sliding_slot(&ring, 14, 20), 10 * 4 + 2);
        let mut seen = std::collections::HashSet::new();
        for p in 0..20 {
            let s = l.sliding_slot(&ring, p, 20);
            if s >= 8 {
                assert!(seen.insert(s), "slot {s} written twice");
            }
        }
    }

    #[test]
    fn table_columns() {
        assert_eq!(table_column(0, 4, None), 0);
        assert_eq!(table_column(3, 4, None), 0);
        assert_eq!(table_column(4, 4, None), 1);
        assert_eq!(table_column(41, 4, None), 10);
        // Ring of 3: blocks 0, 1, 2, 3, 4 -> columns 0, 1, 2, 0, 1.
        let cols: Vec<_> = (0..20)
            .step_by(4)
            .map(|p| table_column(p, 4, Some(3)))
            .collect();
        assert_eq!(cols, vec![0, 1, 2, 0, 1]);
        assert_eq!(table_column(15, 4, Some(3)), 0);
        // The allocator's slots agree with the column arithmetic.
        let l = Layout::new(4, true, Some(6));
        let blocks: Vec<ChunkId> = (10..20).collect();
        for p in 0..40 {
            assert_eq!(
                l.full_slot(&blocks, p),
                (blocks[table_column(p, 4, None)] as usize * 4 + p % 4) as i32
            );
        }
    }

    #[test]
    fn fit_is_max() {
        let l = Layout::new(4, true, None);
        assert_eq!(l.fit(1, 0, 3, 100, 2), 9); // 3+9 = 12 tokens = 3 blocks
        assert_eq!(l.fit(1, 0, 4, 100, 0), 0);
        assert_eq!(l.fit(1, 0, 3, 1, 0), 1);
    }
}
