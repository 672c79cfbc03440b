//! The chunk pool: one free side shared by every allocator.
//!
//! Narrow API in the style of vLLM v1's block pool: [`ChunkPool::allocate`],
//! [`ChunkPool::free`], [`ChunkPool::touch`] (take a reference on a prefix-cache hit),
//! [`ChunkPool::pin`] (take a reference on any data chunk, free or used, keeping its
//! content: O(1) for a used or cached chunk, O(free) for an uninitialized one, found by a
//! search of the uninitialized stack; only used for the swap-out sources of an outstanding
//! plan), [`ChunkPool::cache`] (register a full block's content hash),
//! [`ChunkPool::lookup`] (the token-verified prefix lookup of one block) and eviction, which
//! happens inside `allocate` only when the uninitialized list is empty. Only
//! [`crate::kv::KvManager`] calls the mutating ones.
//!
//! Invariants (checked by [`ChunkPool::check`]):
//! * Chunks `0` (zero) and `1` (scratch) are reserved: refcount 0, in no list, never hashed.
//! * Every data chunk (`2 .. num_blocks + 2`) is in exactly one place:
//!   `Uninit` (free, no content), `Cached` (free, keeps content and hash, in the LRU list)
//!   or `Used` (refcount > 0).
//! * `num_free() = uninit + cached` and `num_used() + num_free() = num_blocks`.
//! * A chunk is hashed iff the hash table maps its hash to it; only `Used` or `Cached`
//!   chunks are hashed; every `Cached` chunk is hashed.
//! * The cached list is in LRU order: the head is evicted first. Freeing appends at the
//!   tail; a hit removes the chunk from the list (O(1), intrusive doubly-linked list).

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

/// Identity hasher for the prefix table: its keys are already xxh3 hashes.
#[derive(Default, Clone, Copy, Debug)]
pub struct IdentityHasher(u64);

impl Hasher for IdentityHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        // Only u64 keys are hashed; fold anything else for completeness.
        for &b in bytes {
            self.0 = self.0.rotate_left(8) ^ b as u64;
        }
    }
    fn write_u64(&mut self, v: u64) {
        self.0 = v;
    }
}

type HashTable = HashMap<u64, ChunkId, BuildHasherDefault<IdentityHasher>>;

use crate::{ChunkId, Token};

/// The zero chunk: never written, padding reads point here.
pub const ZERO_CHUNK: ChunkId = 0;
/// The scratch chunk: padding writes and discarded sliding-window writes go here.
pub const SCRATCH_CHUNK: ChunkId = 1;
/// First data chunk.
pub const FIRST_DATA_CHUNK: ChunkId = 2;

const NIL: u32 = u32::MAX;

/// Where a chunk currently lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Place {
    Reserved,
    Uninit,
    Cached,
    Used,
}

/// Prefix-cache metadata of a hashed chunk.
#[derive(Clone, Copy, Debug)]
struct HashMeta {
    hash: u64,
    /// Chunk holding the previous block when this one was computed (`NIL` for block 0).
    parent: u32,
    /// `epoch[parent]` at that time: the parent's content was unchanged iff still equal.
    parent_epoch: u32,
    /// The cache salt of the request that computed it (0: none): blocks computed under
    /// different salts (another LoRA adapter, say) are never shared.
    salt: u64,
}

/// The device chunk pool.
#[derive(Clone, Debug)]
pub struct ChunkPool {
    num_blocks: usize,
    page_size: usize,
    refcount: Vec<u32>,
    place: Vec<Place>,
    uninit: Vec<ChunkId>,
    // Intrusive LRU list of cached chunks.
    prev: Vec<u32>,
    next: Vec<u32>,
    head: u32,
    tail: u32,
    num_cached: usize,
    // Prefix cache.
    meta: Vec<Option<HashMeta>>,
    /// Bumped whenever a chunk is handed out (its content may change from then on).
    epoch: Vec<u32>,
    /// `page_size` tokens per chunk: the content of hashed chunks (for verification).
    tokens: Vec<Token>,
    table: HashTable,
    num_evictions: u64,
}

impl ChunkPool {
    /// A pool of `num_blocks` data chunks (plus the two reserved ones).
    pub fn new(num_blocks: usize, page_size: usize, prefix_cache: bool) -> Self {
        let n = num_blocks + 2;
        let mut place = vec![Place::Uninit; n];
        place[ZERO_CHUNK as usize] = Place::Reserved;
        place[SCRATCH_CHUNK as usize] = Place::Reserved;
        // Stack: pop gives the lowest ids first.
        let uninit: Vec<ChunkId> = (FIRST_DATA_CHUNK..n as u32).rev().collect();
        ChunkPool {
            num_blocks,
            page_size,
            refcount: vec![0; n],
            place,
            uninit,
            prev: vec![NIL; n],
            next: vec![NIL; n],
            head: NIL,
            tail: NIL,
            num_cached: 0,
            meta: vec![None; n],
            epoch: vec![0; n],
            tokens: if prefix_cache {
                vec![0; n * page_size]
            } else {
                Vec::new()
            },
            // At most one hash per chunk: sized once, never rehashed.
            table: if prefix_cache {
                HashTable::with_capacity_and_hasher(n, Default::default())
            } else {
                HashTable::default()
            },
            num_evictions: 0,
        }
    }

    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }
    pub fn page_size(&self) -> usize {
        self.page_size
    }
    /// Chunks that `allocate` can hand out (uninitialized + cached).
    #[inline]
    pub fn num_free(&self) -> usize {
        self.uninit.len() + self.num_cached
    }
    /// Free chunks that still hold a hashed block (reclaimable, in LRU order).
    pub fn num_cached(&self) -> usize {
        self.num_cached
    }
    pub fn num_uninit(&self) -> usize {
        self.uninit.len()
    }
    pub fn num_used(&self) -> usize {
        self.num_blocks - self.num_free()
    }
    pub fn num_evictions(&self) -> u64 {
        self.num_evictions
    }
    pub fn refcount(&self, c: ChunkId) -> u32 {
        self.refcount[c as usize]
    }
    pub fn refcounts(&self) -> &[u32] {
        &self.refcount
    }
    pub fn place(&self, c: ChunkId) -> Place {
        self.place[c as usize]
    }
    /// The uninitialized free chunks (the next one handed out is the last).
    pub fn uninit_chunks(&self) -> &[ChunkId] {
        &self.uninit
    }
    /// The cached free chunks in eviction order (first = evicted first).
    pub fn cached_chunks(&self) -> Vec<ChunkId> {
        let mut out = Vec::with_capacity(self.num_cached);
        let mut c = self.head;
        while c != NIL {
            out.push(c);
            c = self.next[c as usize];
        }
        out
    }
    pub fn is_hashed(&self, c: ChunkId) -> bool {
        self.meta[c as usize].is_some()
    }
    pub fn hash_of(&self, c: ChunkId) -> Option<u64> {
        self.meta[c as usize].map(|m| m.hash)
    }

    fn unlink(&mut self, c: ChunkId) {
        let (p, n) = (self.prev[c as usize], self.next[c as usize]);
        if p == NIL {
            self.head = n;
        } else {
            self.next[p as usize] = n;
        }
        if n == NIL {
            self.tail = p;
        } else {
            self.prev[n as usize] = p;
        }
        self.prev[c as usize] = NIL;
        self.next[c as usize] = NIL;
        self.num_cached -= 1;
    }

    fn push_tail(&mut self, c: ChunkId) {
        self.prev[c as usize] = self.tail;
        self.next[c as usize] = NIL;
        if self.tail == NIL {
            self.head = c;
        } else {
            self.next[self.tail as usize] = c;
        }
        self.tail = c;
        self.num_cached += 1;
    }

    fn unhash(&mut self, c: ChunkId) {
        if let Some(m) = self.meta[c as usize].take() {
            let removed = self.table.remove(&m.hash);
            debug_assert_eq!(removed, Some(c));
        }
    }

    /// Take one free chunk (refcount becomes 1). Uses the uninitialized list first; when it
    /// is empty, evicts the least recently used cached chunk (dropping its hash).
    pub fn allocate(&mut self) -> Option<ChunkId> {
        let c = if let Some(c) = self.uninit.pop() {
            c
        } else if self.head != NIL {
            let c = self.head;
            self.unlink(c);
            self.unhash(c);
            self.num_evictions += 1;
            c
        } else {
            return None;
        };
        debug_assert_eq!(self.refcount[c as usize], 0);
        // New owner, new content: children hashed on top of the old content no longer match.
        self.epoch[c as usize] = self.epoch[c as usize].wrapping_add(1);
        self.refcount[c as usize] = 1;
        self.place[c as usize] = Place::Used;
        Some(c)
    }

    /// Drop one reference. At zero the chunk becomes free: cached (tail of the LRU list)
    /// when it is hashed, uninitialized otherwise.
    pub fn free(&mut self, c: ChunkId) {
        let i = c as usize;
        debug_assert!(c >= FIRST_DATA_CHUNK && self.refcount[i] > 0);
        self.refcount[i] -= 1;
        if self.refcount[i] == 0 {
            if self.meta[i].is_some() {
                self.place[i] = Place::Cached;
                self.push_tail(c);
            } else {
                self.place[i] = Place::Uninit;
                self.uninit.push(c);
            }
        }
    }

    /// Take one more reference on any data chunk, free or used, without changing its
    /// content, hash or epoch (a free chunk leaves its free list; the KV manager pins the
    /// swap-out sources of an outstanding plan this way, so nothing reallocates them before
    /// the copy ran). Released with [`ChunkPool::free`]. O(1) unless the chunk is
    /// uninitialized: then a search of the uninitialized stack, O(free chunks) (rare: the
    /// order of that stack decides which chunk is handed out next, so it is kept).
    pub fn pin(&mut self, c: ChunkId) {
        let i = c as usize;
        debug_assert!(c >= FIRST_DATA_CHUNK);
        if self.refcount[i] == 0 {
            match self.place[i] {
                Place::Cached => self.unlink(c),
                Place::Uninit => {
                    let pos = self
                        .uninit
                        .iter()
                        .rposition(|&u| u == c)
                        .expect("free chunk in the uninitialized list");
                    self.uninit.remove(pos);
                }
                p => unreachable!("pin: free chunk {c} in place {p:?}"),
            }
            self.place[i] = Place::Used;
        }
        self.refcount[i] += 1;
    }

    /// Allocation epoch of a chunk: bumped every time it is handed out by `allocate`.
    pub fn epoch(&self, c: ChunkId) -> u32 {
        self.epoch[c as usize]
    }

    /// Take a reference on a hashed chunk found by a prefix lookup (removing it from the
    /// cached list when it was free).
    pub fn touch(&mut self, c: ChunkId) {
        let i = c as usize;
        debug_assert!(self.meta[i].is_some());
        if self.refcount[i] == 0 {
            debug_assert_eq!(self.place[i], Place::Cached);
            self.unlink(c);
            self.place[i] = Place::Used;
        }
        self.refcount[i] += 1;
    }

    /// Register the content of a used, full, computed chunk under `hash`.
    /// `parent` is the chunk holding the previous block (None for block 0); `salt` the
    /// computing request's cache salt (0: none). Returns false
    /// (and leaves the chunk unhashed) when the hash is already taken by another chunk or
    /// the chunk is already hashed.
    pub fn cache(
        &mut self,
        c: ChunkId,
        hash: u64,
        parent: Option<ChunkId>,
        salt: u64,
        block_tokens: &[Token],
    ) -> bool {
        let i = c as usize;
        debug_assert_eq!(self.place[i], Place::Used);
        debug_assert_eq!(block_tokens.len(), self.page_size);
        if self.meta[i].is_some() || self.table.contains_key(&hash) {
            return false;
        }
        let (parent, parent_epoch) = match parent {
            Some(p) => (p, self.epoch[p as usize]),
            None => (NIL, 0),
        };
        self.meta[i] = Some(HashMeta {
            hash,
            parent,
            parent_epoch,
            salt,
        });
        self.tokens[i * self.page_size..(i + 1) * self.page_size].copy_from_slice(block_tokens);
        self.table.insert(hash, c);
        true
    }

    /// Token-verified lookup of one block: the chunk registered under `hash` whose content
    /// equals `block_tokens` and which was computed on top of `parent` (the chunk matched
    /// for the previous block, unchanged since) under the same cache `salt`. A mismatch is a
    /// miss.
    pub fn lookup(
        &self,
        hash: u64,
        parent: Option<ChunkId>,
        salt: u64,
        block_tokens: &[Token],
    ) -> Option<ChunkId> {
        let &c = self.table.get(&hash)?;
        let i = c as usize;
        let m = self.meta[i]?;
        if m.hash != hash || m.salt != salt {
            return None;
        }
        match parent {
            None => {
                if m.parent != NIL {
                    return None;
                }
            }
            Some(p) => {
                if m.parent != p || m.parent_epoch != self.epoch[p as usize] {
                    return None;
                }
            }
        }
        if &self.tokens[i * self.page_size..(i + 1) * self.page_size] != block_tokens {
            return None;
        }
        Some(c)
    }

    /// Check every pool invariant. `holders[c]` = number of references held by requests.
    pub fn check(&self, holders: &[u32]) -> Result<(), String> {
        let n = self.num_blocks + 2;
        if holders.len() != n || self.refcount.len() != n {
            return Err("pool: table sizes".into());
        }
        for r in [ZERO_CHUNK, SCRATCH_CHUNK] {
            let i = r as usize;
            if self.refcount[i] != 0
                || holders[i] != 0
                || self.place[i] != Place::Reserved
                || self.meta[i].is_some()
            {
                return Err(format!("reserved chunk {r} was handed out or hashed"));
            }
        }
        let mut seen = vec![0u8; n];
        for &c in &self.uninit {
            let i = c as usize;
            if c < FIRST_DATA_CHUNK || i >= n {
                return Err(format!("free list holds non-data chunk {c}"));
            }
            seen[i] += 1;
            if self.place[i] != Place::Uninit || self.meta[i].is_some() {
                return Err(format!(
                    "uninitialized chunk {c} is not marked uninit/unhashed"
                ));
            }
        }
        let mut count = 0usize;
        let mut c = self.head;
        let mut prev = NIL;
        while c != NIL {
            let i = c as usize;
            if self.prev[i] != prev {
                return Err(format!("cached list broken at chunk {c}"));
            }
            seen[i] += 1;
            if seen[i] > 1 {
                return Err(format!("free lists not disjoint: chunk {c}"));
            }
            if self.place[i] != Place::Cached || self.meta[i].is_none() {
                return Err(format!("cached chunk {c} not marked cached/hashed"));
            }
            count += 1;
            prev = c;
            c = self.next[i];
        }
        if prev != self.tail || count != self.num_cached {
            return Err("cached list length/tail mismatch".into());
        }
        for i in FIRST_DATA_CHUNK as usize..n {
            if self.refcount[i] != holders[i] {
                return Err(format!(
                    "refcount of chunk {i} is {} but {} holders",
                    self.refcount[i], holders[i]
                ));
            }
            let free = seen[i] == 1;
            let used = self.refcount[i] > 0;
            if free == used {
                return Err(format!(
                    "chunk {i} conservation: free={free} used={used} (seen {} times)",
                    seen[i]
                ));
            }
            if used && self.place[i] != Place::Used {
                return Err(format!("used chunk {i} not marked used"));
            }
            if let Some(m) = self.meta[i] {
                if self.table.get(&m.hash) != Some(&(i as u32)) {
                    return Err(format!("hash table does not map chunk {i}'s hash to it"));
                }
            }
        }
        if self.num_used() + self.num_free() != self.num_blocks {
            return Err("conservation: used + free != num_blocks".into());
        }
        for (&h, &c) in &self.table {
            match self.meta.get(c as usize).copied().flatten() {
                Some(m) if m.hash == h => {}
                _ => return Err(format!("hash table entry {h:#x} -> {c} is stale")),
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reserved_never_handed_out() {
        let mut p = ChunkPool::new(3, 4, true);
        let a: Vec<_> = (0..3).map(|_| p.allocate().unwrap()).collect();
        assert_eq!(a, vec![2, 3, 4]);
        assert!(p.allocate().is_none());
        for c in a {
            p.free(c);
        }
        assert_eq!(p.num_free(), 3);
        p.check(&[0; 5]).unwrap();
    }

    #[test]
    fn cached_lru_eviction_order() {
        let mut p = ChunkPool::new(3, 2, true);
        let a = p.allocate().unwrap();
        let b = p.allocate().unwrap();
        let c = p.allocate().unwrap();
        assert!(p.cache(a, 10, None, 0, &[1, 2]));
        assert!(p.cache(b, 11, Some(a), 0, &[3, 4]));
        // Free in reverse block order: b then a => b evicted first.
        p.free(c);
        p.free(b);
        p.free(a);
        assert_eq!(p.num_cached(), 2);
        assert_eq!(p.cached_chunks(), vec![b, a]);
        // Uninit first.
        assert_eq!(p.allocate(), Some(c));
        // Then LRU head b (its hash dropped).
        assert_eq!(p.allocate(), Some(b));
        assert_eq!(p.lookup(11, Some(a), 0, &[3, 4]), None);
        assert_eq!(p.lookup(10, None, 0, &[1, 2]), Some(a));
        let mut holders = vec![0; 5];
        holders[c as usize] = 1;
        holders[b as usize] = 1;
        p.check(&holders).unwrap();
    }

    #[test]
    fn lookup_verifies_tokens_and_parent() {
        let mut p = ChunkPool::new(4, 2, true);
        let a = p.allocate().unwrap();
        let b = p.allocate().unwrap();
        assert!(p.cache(a, 1, None, 0, &[5, 6]));
        assert!(p.cache(b, 2, Some(a), 0, &[7, 8]));
        assert_eq!(
            p.lookup(1, None, 0, &[5, 7]),
            None,
            "token mismatch is a miss"
        );
        assert_eq!(
            p.lookup(2, None, 0, &[7, 8]),
            None,
            "parent mismatch is a miss"
        );
        assert_eq!(p.lookup(2, Some(a), 0, &[7, 8]), Some(b));
        // Twin hash: another chunk cannot take a registered hash.
        let c = p.allocate().unwrap();
        assert!(!p.cache(c, 1, None, 0, &[9, 9]));
        assert!(!p.is_hashed(c));
    }

    #[test]
    fn pin_takes_free_chunks_out_of_either_list() {
        let mut p = ChunkPool::new(4, 2, true);
        let a = p.allocate().unwrap();
        let b = p.allocate().unwrap();
        assert!(p.cache(a, 1, None, 0, &[1, 1]));
        p.free(a);
        p.free(b);
        assert_eq!((p.num_free(), p.num_cached()), (4, 1));
        p.pin(a); // cached
        p.pin(b); // uninitialized
        assert_eq!((p.num_free(), p.num_cached()), (2, 0));
        assert_eq!(
            p.lookup(1, None, 0, &[1, 1]),
            Some(a),
            "pin keeps the content"
        );
        p.pin(a); // used: one more reference
        assert_eq!(p.refcount(a), 2);
        let mut h = vec![0; 6];
        h[a as usize] = 2;
        h[b as usize] = 1;
        p.check(&h).unwrap();
        p.free(a);
        p.free(a);
        p.free(b);
        assert_eq!(p.num_free(), 4);
        // The order of the uninitialized stack is unchanged by the pin of `b`.
        assert_eq!(p.allocate(), Some(b));
    }

    #[test]
    fn touch_removes_from_cached() {
        let mut p = ChunkPool::new(2, 2, true);
        let a = p.allocate().unwrap();
        assert!(p.cache(a, 1, None, 0, &[1, 1]));
        p.free(a);
        assert_eq!(p.num_free(), 2);
        p.touch(a);
        assert_eq!(p.num_free(), 1);
        assert_eq!(p.refcount(a), 1);
        p.touch(a);
        assert_eq!(p.refcount(a), 2);
        let mut h = vec![0; 4];
        h[a as usize] = 2;
        p.check(&h).unwrap();
    }
}
