//! The one owner of KV memory: device chunks (the [`ChunkPool`]), CPU swap slots (the
//! [`SwapPool`]) and the prefix cache. Nothing else allocates, frees, touches or pins a chunk,
//! or takes or releases a swap slot; the scheduler asks [`KvManager`] in terms of requests.
//!
//! API, in the spirit of vLLM v1's `KVCacheManager`:
//! * [`KvManager::computed_prefix`] / [`KvManager::take_prefix`]: the token-verified
//!   prefix-cache hits of a waiting request, found without taking references, then taken
//!   once admission is sure.
//! * [`KvManager::need`] / [`KvManager::fit`] / [`KvManager::grow`]: chunks a request needs
//!   to hold a length, the largest growth the free chunks allow, and the growth itself (or
//!   the shortfall, with nothing changed).
//! * [`KvManager::free`]: all of a request's device chunks back to the pool.
//! * [`KvManager::defer_free`]: the same, deferred to an outstanding plan's [`Held`] (a
//!   forward may still read or write them), released by [`KvManager::release`] at that
//!   plan's update.
//! * [`KvManager::try_swap_out`] / [`KvManager::swap_in`]: move a request between device
//!   chunks and CPU swap slots, writing the plan's copy pairs.
//! * [`KvManager::register`]: offer a request's newly full computed blocks to the prefix
//!   cache.
//!
//! Invariants (checked by [`KvManager::check`], part of `Scheduler::check_invariants`):
//! * Every reference on a data chunk is held by exactly one request block (`full` or `ring`)
//!   or one [`Held`] entry; every reference on a swap slot by one swapped request's
//!   `swap_slots` entry or one [`Held`] entry (a plan's swap-in reads the slot, a
//!   cancelled request's swap-out writes it). Pool refcounts equal those counts.
//! * A running request's blocks cover its cached tokens; a swapped request holds no device
//!   chunks; a waiting request holds nothing.
//! * The pool's own invariants ([`ChunkPool::check`]) and the swap pool's
//!   ([`SwapPool::check`]).

use crate::alloc::Layout;
use crate::pool::{ChunkPool, FIRST_DATA_CHUNK};
use crate::prefix::BlockHasher;
use crate::request::Request;
use crate::swap::SwapPool;
use crate::ChunkId;

/// References held for one outstanding plan rather than by a request, released together by
/// [`KvManager::release`] when the plan's update runs. Only the [`KvManager`] fills it.
#[derive(Clone, Debug, Default)]
pub struct Held {
    /// Device chunks: those of requests that finished or were cancelled while the plan
    /// (the last one referencing them) was outstanding, and pinned swap-out sources.
    chunks: Vec<ChunkId>,
    /// Swap slots the plan reads by swap-in, or writes by swap-out for a request cancelled
    /// since.
    slots: Vec<u32>,
}

impl Held {
    pub fn chunks(&self) -> &[ChunkId] {
        &self.chunks
    }
    pub fn slots(&self) -> &[u32] {
        &self.slots
    }
    pub fn is_empty(&self) -> bool {
        self.chunks.is_empty() && self.slots.is_empty()
    }
}

/// Device chunks, swap slots and prefix cache of one scheduler. See the module docs.
#[derive(Clone, Debug)]
pub struct KvManager {
    layout: Layout,
    pool: ChunkPool,
    swap: SwapPool,
    hasher: BlockHasher,
    /// Prefix caching is on (full attention only, block sharing allowed).
    prefix: bool,
}

impl KvManager {
    /// `num_blocks` data chunks of `layout.page` tokens, `swap_slots` CPU slots; `hash_mask`
    /// masks block hashes (all ones except in tests forcing twin hashes).
    pub fn new(
        num_blocks: usize,
        layout: Layout,
        prefix: bool,
        hash_mask: u64,
        swap_slots: usize,
    ) -> Self {
        let mut hasher = BlockHasher::new();
        hasher.mask = hash_mask;
        KvManager {
            layout,
            pool: ChunkPool::new(num_blocks, layout.page, prefix),
            swap: SwapPool::new(swap_slots),
            hasher,
            prefix,
        }
    }

    #[inline]
    pub fn layout(&self) -> &Layout {
        &self.layout
    }
    /// The device chunk pool (read-only: every change goes through this manager).
    pub fn pool(&self) -> &ChunkPool {
        &self.pool
    }
    /// The CPU swap-slot pool (read-only).
    pub fn swap(&self) -> &SwapPool {
        &self.swap
    }
    /// Whether prefix caching is active.
    pub fn prefix_caching(&self) -> bool {
        self.prefix
    }
    /// Chunks allocatable now (uninitialized + cached).
    #[inline]
    pub fn num_free(&self) -> usize {
        self.pool.num_free()
    }

    // ----- prefix cache ----------------------------------------------------------------

    /// The computed prefix of a request: its leading full blocks whose content the prefix
    /// cache holds, token-verified (stored tokens equal, recorded parent unchanged), written
    /// to `hits` in block order. Takes no reference: a later allocation may still evict them
    /// until [`KvManager::take_prefix`]. The last prompt token is never a hit (a request
    /// always computes at least one token). Nothing when prefix caching is off or the request
    /// skips lookups.
    pub fn computed_prefix(&mut self, r: &mut Request, hits: &mut Vec<ChunkId>) {
        hits.clear();
        if !self.prefix || r.skip_prefix_lookup {
            return;
        }
        let page = self.layout.page;
        let max_hit = (r.tokens.len() - 1) / page;
        self.hasher
            .extend(&mut r.block_hashes, &r.tokens, page, max_hit, r.cache_salt);
        let mut parent = None;
        for i in 0..max_hit {
            match self.pool.lookup(
                r.block_hashes[i],
                parent,
                r.cache_salt,
                &r.tokens[i * page..(i + 1) * page],
            ) {
                Some(c) => {
                    hits.push(c);
                    parent = Some(c);
                }
                None => break,
            }
        }
    }

    /// Chunks still allocatable once `hits` are taken (taking a free cached hit removes it
    /// from the free side).
    pub fn free_after_taking(&self, hits: &[ChunkId]) -> usize {
        let hit_free = hits.iter().filter(|&&c| self.pool.refcount(c) == 0).count();
        self.pool.num_free() - hit_free
    }

    /// Take a reference on each hit of [`KvManager::computed_prefix`] (found since with
    /// nothing allocated in between) and make them the request's first blocks, already
    /// registered. The request holds no chunks before.
    pub fn take_prefix(&mut self, r: &mut Request, hits: &[ChunkId]) {
        debug_assert!(r.full.is_empty() && r.ring.is_empty());
        for &c in hits {
            self.pool.touch(c);
        }
        r.full.extend_from_slice(hits);
        r.num_registered = hits.len();
    }

    /// Offer the request's newly full computed blocks (`num_registered ..
    /// num_computed / page`) to the prefix cache. A block whose hash another chunk holds
    /// stays unhashed.
    #[cold]
    #[inline(never)]
    pub fn register(&mut self, r: &mut Request) {
        let page = self.layout.page;
        let n = r.num_computed / page;
        self.hasher
            .extend(&mut r.block_hashes, &r.tokens, page, n, r.cache_salt);
        for i in r.num_registered..n {
            let parent = if i == 0 { None } else { Some(r.full[i - 1]) };
            self.pool.cache(
                r.full[i],
                r.block_hashes[i],
                parent,
                r.cache_salt,
                &r.tokens[i * page..(i + 1) * page],
            );
        }
        r.num_registered = n;
    }

    /// Push to `out` the hashes of the request's blocks that tokens `start..end` make full
    /// (a row computing them in the step being planned: they are registered only after it
    /// runs). Nothing when prefix caching is off or the request skips lookups.
    pub fn blocks_filled(&mut self, r: &mut Request, start: usize, end: usize, out: &mut Vec<u64>) {
        if !self.prefix || r.skip_prefix_lookup {
            return;
        }
        let page = self.layout.page;
        let last = end.min(r.tokens.len()) / page;
        self.hasher
            .extend(&mut r.block_hashes, &r.tokens, page, last, r.cache_salt);
        out.extend_from_slice(&r.block_hashes[(start / page).min(last)..last]);
    }

    /// Whether `update` should call [`KvManager::register`]: prefix caching is on and a
    /// block became full since the last registration.
    #[inline(always)]
    pub fn has_new_full_block(&self, r: &Request) -> bool {
        self.prefix && r.num_computed >= (r.num_registered + 1) * self.layout.page
    }

    // ----- growth ----------------------------------------------------------------------

    /// New chunks the request needs so `q` more tokens from `start` fit.
    #[inline]
    pub fn need(&self, r: &Request, start: usize, q: usize) -> usize {
        self.layout
            .chunks_needed(r.full.len(), r.ring.len(), start + q)
    }

    /// [`KvManager::need`] of one token (no divisions: a new chunk iff the token starts
    /// one), for a request whose blocks cover exactly its `start` cached tokens.
    #[inline]
    pub fn need_one(&self, r: &Request, start: usize) -> usize {
        let (nf, nr) = (r.full.len(), r.ring.len());
        let l = &self.layout;
        (l.has_full && nf * l.page <= start) as usize
            + (l.has_sliding && nr < l.ring && nr * l.page <= start) as usize
    }

    /// The largest `q' <= q` whose growth from `start` the free chunks cover (0 if not even
    /// one token's).
    pub fn fit(&self, r: &Request, start: usize, q: usize) -> usize {
        self.layout
            .fit(r.full.len(), r.ring.len(), start, q, self.pool.num_free())
    }

    /// Grow the request so it holds `end` tokens (full blocks and ring chunks). When the free
    /// chunks do not cover it, nothing changes and the error is the shortfall (chunks
    /// missing).
    pub fn grow(&mut self, r: &mut Request, end: usize) -> Result<(), usize> {
        let need = self.layout.chunks_needed(r.full.len(), r.ring.len(), end);
        let free = self.pool.num_free();
        if need > free {
            return Err(need - free);
        }
        let l = &self.layout;
        for (blocks, n) in [
            (&mut r.full, l.full_blocks_for(end)),
            (&mut r.ring, l.ring_chunks_for(end)),
        ] {
            while blocks.len() < n {
                blocks.push(self.pool.allocate().expect("grow: need <= free"));
            }
        }
        Ok(())
    }

    /// Append one full-attention block (the steady decode path, whose caller checked that
    /// the pool has a free chunk for it).
    #[inline]
    pub fn push_block(&mut self, r: &mut Request) -> ChunkId {
        let c = self
            .pool
            .allocate()
            .expect("push_block: a free chunk checked by the caller");
        r.full.push(c);
        c
    }

    // ----- freeing ---------------------------------------------------------------------

    /// Free the request's blocks beyond those `end` tokens need (a speculative row's growth
    /// for rejected tokens; never hashed: only computed full blocks are).
    pub fn shrink(&mut self, r: &mut Request, end: usize) {
        let l = &self.layout;
        for (blocks, n) in [
            (&mut r.full, l.full_blocks_for(end)),
            (&mut r.ring, l.ring_chunks_for(end)),
        ] {
            while blocks.len() > n {
                let c = blocks.pop().expect("len > n");
                self.pool.free(c);
            }
        }
    }

    /// Free all device chunks of a request: full blocks deepest first (so the deepest
    /// blocks of a cached prefix are evicted first), then the ring.
    pub fn free(&mut self, r: &mut Request) {
        for &c in r.full.iter().rev() {
            self.pool.free(c);
        }
        for &c in &r.ring {
            self.pool.free(c);
        }
        r.full.clear();
        r.ring.clear();
        r.ring_floor = 0;
    }

    /// Hand a request's device chunks to an outstanding plan's `held` (freed, in the order
    /// [`KvManager::free`] would, by [`KvManager::release`] at that plan's update).
    #[cold]
    #[inline(never)]
    pub fn defer_free(&mut self, r: &mut Request, held: &mut Held) {
        held.chunks.extend(r.full.iter().rev());
        held.chunks.extend(r.ring.iter());
        r.full.clear();
        r.ring.clear();
        r.ring_floor = 0;
    }

    /// Release the swap slots of a swapped request (cancelled or recomputed).
    pub fn free_swapped(&mut self, r: &mut Request) {
        for s in r.swap_slots.drain(..) {
            self.swap.release(s);
        }
        r.n_full_swapped = 0;
    }

    /// Hand a swapped request's slots to the outstanding plan whose swap-out writes them.
    pub fn defer_free_swapped(&mut self, r: &mut Request, held: &mut Held) {
        held.slots.append(&mut r.swap_slots);
        r.n_full_swapped = 0;
    }

    /// Release everything held for a plan whose update runs (its forward and copies are
    /// done): swap slots, then chunks.
    pub fn release(&mut self, held: &mut Held) {
        for s in held.slots.drain(..) {
            self.swap.release(s);
        }
        for c in held.chunks.drain(..) {
            self.pool.free(c);
        }
    }

    /// Pin the swap-out sources of an outstanding plan that are free again (the plan freed
    /// them when it was built; its copy runs before its forward), for `held`: nothing may
    /// reallocate them before that plan's update. `pairs` = the plan's `swap_out`.
    pub fn pin_swap_sources(&mut self, pairs: &[i32], held: &mut Held) {
        for pr in pairs.chunks_exact(2) {
            let c = pr[0] as ChunkId;
            if self.pool.refcount(c) == 0 {
                self.pool.pin(c);
                held.chunks.push(c);
            }
        }
    }

    // ----- swap ------------------------------------------------------------------------

    /// Swap a running request out: when the swap pool has a slot for each of its chunks and
    /// none of its chunks is already a source in `pairs` (a plan copies each chunk at most
    /// once), take the slots, append `(chunk, slot)` pairs to `pairs` (the plan's
    /// `swap_out`) and free its chunks (the copy runs before the next forward). Returns
    /// false, with nothing changed, otherwise.
    pub fn try_swap_out(&mut self, r: &mut Request, pairs: &mut Vec<i32>) -> bool {
        let n = r.full.len() + r.ring.len();
        if self.swap.capacity() == 0
            || self.swap.num_free() < n
            || r.full
                .iter()
                .any(|&c| pairs.chunks_exact(2).any(|pr| pr[0] == c as i32))
        {
            return false;
        }
        r.n_full_swapped = r.full.len();
        for &c in r.full.iter().chain(r.ring.iter()) {
            let s = self.swap.allocate().expect("checked: a slot per chunk");
            pairs.push(c as i32);
            pairs.push(s as i32);
            r.swap_slots.push(s);
        }
        self.free(r);
        true
    }

    /// Whether a swapped request can come back with `q` tokens from `start`: a chunk for each
    /// swapped one, and its growth after that.
    pub fn swap_in_fits(&self, r: &Request, start: usize, q: usize) -> bool {
        let nf = r.n_full_swapped;
        let nr = r.swap_slots.len() - nf;
        let free = self.pool.num_free();
        nf + nr <= free && self.layout.fit(nf, nr, start, q, free - nf - nr) > 0
    }

    /// Swap a request in (the caller checked [`KvManager::swap_in_fits`]): a fresh chunk per
    /// slot, `(slot, chunk)` pairs appended to `pairs` (the plan's `swap_in`), the slots
    /// handed to `held` (the plan's copy reads them; released by its update). Swapped-in
    /// chunks are unhashed copies: the request's blocks are offered to the prefix cache again.
    pub fn swap_in(&mut self, r: &mut Request, pairs: &mut Vec<i32>, held: &mut Held) {
        let nf = r.n_full_swapped;
        for (i, &s) in r.swap_slots.iter().enumerate() {
            let c = self.pool.allocate().expect("checked: swap_in_fits");
            pairs.push(s as i32);
            pairs.push(c as i32);
            if i < nf {
                r.full.push(c);
            } else {
                r.ring.push(c);
            }
        }
        held.slots.append(&mut r.swap_slots);
        r.n_full_swapped = 0;
        r.num_registered = 0;
    }

    // ----- invariants ------------------------------------------------------------------

    /// Check the module's invariants given every live request and every outstanding plan's
    /// `Held`; the error names the broken one.
    pub fn check<'a>(
        &self,
        requests: impl Iterator<Item = &'a Request>,
        held: impl Iterator<Item = &'a Held>,
    ) -> Result<(), String> {
        let n = self.pool.num_blocks() + 2;
        let mut holders = vec![0u32; n];
        let mut held_slots = Vec::new();
        for h in held {
            for &c in &h.chunks {
                if (c as usize) < n {
                    holders[c as usize] += 1;
                }
            }
            held_slots.extend_from_slice(&h.slots);
        }
        for r in requests {
            for &c in r.full.iter().chain(r.ring.iter()) {
                if c as usize >= n || c < FIRST_DATA_CHUNK {
                    return Err(format!("request {:?} holds non-data chunk {c}", r.id));
                }
                holders[c as usize] += 1;
            }
            held_slots.extend_from_slice(&r.swap_slots);
            if r.ring.len() > self.layout.ring {
                return Err(format!("request {:?}: ring larger than R", r.id));
            }
        }
        self.pool.check(&holders)?;
        self.swap.check(&held_slots)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::request::{RequestState, StopConditions};

    fn request(tokens: Vec<u32>) -> Request {
        let mut r = Request::new(
            "r".into(),
            (0, 0),
            tokens,
            StopConditions {
                max_new_tokens: 4,
                ..Default::default()
            },
            false,
        );
        r.state = RequestState::Prefilling;
        r
    }

    fn kv(num_blocks: usize, page: usize, swap: usize) -> KvManager {
        KvManager::new(
            num_blocks,
            Layout::new(page, true, None),
            true,
            u64::MAX,
            swap,
        )
    }

    fn check(kv: &KvManager, reqs: &[&Request], held: &[&Held]) {
        kv.check(reqs.iter().copied(), held.iter().copied())
            .unwrap();
    }

    #[test]
    fn grow_reports_the_shortfall_and_changes_nothing() {
        let mut kv = kv(3, 4, 0);
        let mut a = request((0..10).collect());
        assert_eq!(kv.need(&a, 0, 10), 3);
        kv.grow(&mut a, 10).unwrap();
        assert_eq!(a.full.len(), 3);
        assert_eq!(kv.num_free(), 0);
        let mut b = request((0..5).collect());
        assert_eq!(kv.grow(&mut b, 5), Err(2));
        assert!(b.full.is_empty());
        assert_eq!(kv.fit(&b, 0, 5), 0);
        check(&kv, &[&a, &b], &[]);
        kv.free(&mut a);
        assert_eq!(kv.fit(&b, 0, 5), 5);
        assert_eq!(kv.num_free(), 3);
        check(&kv, &[&a, &b], &[]);
    }

    #[test]
    fn need_of_one_token_matches_the_general_count() {
        for layout in [
            Layout::new(4, true, None),
            Layout::new(4, false, Some(6)),
            Layout::new(4, true, Some(5)),
        ] {
            let mut kv = KvManager::new(16, layout, false, u64::MAX, 0);
            let mut r = request((0..30).collect());
            for start in 0..30 {
                assert_eq!(kv.need_one(&r, start), kv.need(&r, start, 1), "{start}");
                kv.grow(&mut r, start + 1).unwrap();
                assert_eq!(kv.need(&r, start, 1), 0);
            }
            check(&kv, &[&r], &[]);
        }
    }

    #[test]
    fn computed_prefix_is_token_verified_and_taken_only_on_demand() {
        let mut kv = kv(8, 2, 0);
        let mut a = request(vec![1, 2, 3, 4, 5]);
        kv.grow(&mut a, 5).unwrap();
        a.num_computed = 5;
        assert!(kv.has_new_full_block(&a));
        kv.register(&mut a);
        assert_eq!(a.num_registered, 2);
        assert!(!kv.has_new_full_block(&a));
        let mut hits = Vec::new();
        // Same first block, different second: one hit.
        let mut b = request(vec![1, 2, 9, 9, 7]);
        kv.computed_prefix(&mut b, &mut hits);
        assert_eq!(hits, vec![a.full[0]]);
        // The whole prompt cached: the last token is still computed.
        let mut c = request(vec![1, 2, 3, 4]);
        kv.computed_prefix(&mut c, &mut hits);
        assert_eq!(hits, vec![a.full[0]]);
        let mut d = request(vec![1, 2, 3, 4, 8]);
        kv.computed_prefix(&mut d, &mut hits);
        assert_eq!(hits, a.full[..2].to_vec());
        // Nothing taken yet; a used hit costs no free chunk.
        assert_eq!(kv.pool.refcount(a.full[0]), 1);
        assert_eq!(kv.free_after_taking(&hits), kv.num_free());
        kv.take_prefix(&mut d, &hits);
        assert_eq!(d.num_registered, 2);
        assert_eq!(kv.pool.refcount(a.full[0]), 2);
        check(&kv, &[&a, &d], &[]);
        // Freed hits stay cached: taking them back costs free chunks.
        kv.free(&mut a);
        kv.free(&mut d);
        let mut e = request(vec![1, 2, 3, 4, 8]);
        kv.computed_prefix(&mut e, &mut hits);
        assert_eq!(hits.len(), 2);
        assert_eq!(kv.free_after_taking(&hits), kv.num_free() - 2);
        // A request that skips lookups gets no hit.
        let mut f = request(vec![1, 2, 3, 4, 8]);
        f.skip_prefix_lookup = true;
        kv.computed_prefix(&mut f, &mut hits);
        assert!(hits.is_empty());
        check(&kv, &[], &[]);
    }

    #[test]
    fn deferred_frees_wait_for_release() {
        let mut kv = kv(4, 2, 0);
        let mut a = request((0..6).collect());
        kv.grow(&mut a, 6).unwrap();
        let chunks = a.full.clone();
        let mut held = Held::default();
        kv.defer_free(&mut a, &mut held);
        assert!(a.full.is_empty());
        assert_eq!(held.chunks(), &[chunks[2], chunks[1], chunks[0]]);
        assert_eq!(kv.num_free(), 1, "held chunks are not free");
        check(&kv, &[&a], &[&held]);
        kv.release(&mut held);
        assert!(held.is_empty());
        assert_eq!(kv.num_free(), 4);
        check(&kv, &[&a], &[]);
    }

    #[test]
    fn swap_out_then_in_moves_every_chunk_once() {
        let mut kv = kv(4, 2, 4);
        let mut a = request((0..5).collect());
        kv.grow(&mut a, 5).unwrap();
        a.num_computed = 5;
        kv.register(&mut a);
        let chunks = a.full.clone();
        let mut out = Vec::new();
        assert!(kv.try_swap_out(&mut a, &mut out));
        assert_eq!(out.len(), 6);
        assert_eq!(a.swap_slots.len(), 3);
        assert_eq!(a.n_full_swapped, 3);
        assert!(a.full.is_empty());
        assert_eq!(
            out.chunks_exact(2).map(|p| p[0] as u32).collect::<Vec<_>>(),
            chunks
        );
        check(&kv, &[&a], &[]);
        // A second request sharing a source chunk would copy it twice: refused.
        let mut b = request((0..2).collect());
        b.full.push(chunks[0]);
        assert!(!kv.try_swap_out(&mut b, &mut out));
        b.full.clear();
        // Not enough slots: refused, nothing changed.
        let mut c = request((0..4).collect());
        kv.grow(&mut c, 4).unwrap();
        assert!(!kv.try_swap_out(&mut c, &mut Vec::new()));
        assert_eq!(c.full.len(), 2);
        kv.free(&mut c);
        assert!(kv.swap_in_fits(&a, 5, 1));
        let mut pairs = Vec::new();
        let mut held = Held::default();
        kv.swap_in(&mut a, &mut pairs, &mut held);
        assert_eq!(a.full.len(), 3);
        assert!(a.swap_slots.is_empty());
        assert_eq!(a.num_registered, 0, "copies are offered to the cache again");
        assert_eq!(held.slots().len(), 3, "slots held until the copy ran");
        check(&kv, &[&a], &[&held]);
        kv.release(&mut held);
        assert_eq!(kv.swap.num_free(), 4);
        check(&kv, &[&a], &[]);
    }

    #[test]
    fn cancelled_swap_out_slots_wait_for_the_copy() {
        let mut kv = kv(4, 2, 4);
        let mut a = request((0..3).collect());
        kv.grow(&mut a, 3).unwrap();
        let mut out = Vec::new();
        assert!(kv.try_swap_out(&mut a, &mut out));
        // The plan's copy still reads the (now free) source chunks: pinned for it.
        let mut held = Held::default();
        kv.pin_swap_sources(&out, &mut held);
        assert_eq!(held.chunks().len(), 2);
        assert_eq!(kv.num_free(), 2);
        kv.defer_free_swapped(&mut a, &mut held);
        assert!(a.swap_slots.is_empty());
        check(&kv, &[&a], &[&held]);
        kv.release(&mut held);
        assert_eq!((kv.num_free(), kv.swap.num_free()), (4, 4));
        let mut b = request((0..3).collect());
        kv.grow(&mut b, 3).unwrap();
        assert!(kv.try_swap_out(&mut b, &mut Vec::new()));
        kv.free_swapped(&mut b);
        assert_eq!(kv.swap.num_free(), 4);
        check(&kv, &[&a, &b], &[]);
    }

    #[test]
    fn check_counts_every_holder() {
        let mut kv = kv(4, 2, 0);
        let mut a = request((0..3).collect());
        kv.grow(&mut a, 3).unwrap();
        let mut twin = a.clone();
        twin.id = "twin".into();
        // The chunks are referenced twice but held once.
        assert!(kv.check([&a, &twin].into_iter(), [].into_iter()).is_err());
        a.full.push(0);
        assert!(kv.check([&a].into_iter(), [].into_iter()).is_err());
    }
}
