//! `check_invariants()`: the whole state, after any call. The KV memory's own invariants
//! (every chunk and swap-slot reference accounted for) are checked by the KV manager; here
//! the queues, request states, progress, prefix hashes, the steady-path state and the
//! chunk lifetime of outstanding plans.

use super::steady::PlanShape;
use super::Scheduler;
use crate::request::RequestState;
use crate::{ChunkId, Error, Result};

impl Scheduler {
    /// Check every invariant; the error names the broken one.
    pub fn check_invariants(&self) -> Result<()> {
        self.check()
            .map_err(|m| Error::runtime(format!("invariant violated: {m}")))
    }

    fn check(&self) -> std::result::Result<(), String> {
        self.kv.check(
            self.live_requests().map(|(_, r)| r),
            self.flights().map(|f| &f.held),
        )?;
        let layout = self.kv.layout();
        let pool = self.kv.pool();
        let (mut nw, mut nr, mut ns) = (0, 0, 0);
        let page = self.cfg.page_size;
        for (idx, r) in self.live_requests() {
            if self.ids.get(&r.id) != Some(&idx) {
                return Err(format!("id map does not point to request {:?}", r.id));
            }
            if r.num_computed >= r.tokens.len() {
                return Err(format!("request {:?}: nothing left to compute", r.id));
            }
            match r.state {
                RequestState::Waiting => {
                    nw += 1;
                    if self.waiting.get(&r.key) != Some(&idx) {
                        return Err(format!(
                            "waiting request {:?} not in the waiting queue",
                            r.id
                        ));
                    }
                    if !r.full.is_empty()
                        || !r.ring.is_empty()
                        || r.num_computed != 0
                        || !r.swap_slots.is_empty()
                    {
                        return Err(format!(
                            "waiting request {:?} holds chunks or progress",
                            r.id
                        ));
                    }
                }
                RequestState::Swapped => {
                    ns += 1;
                    if self.swapped.get(&r.key) != Some(&idx) {
                        return Err(format!(
                            "swapped request {:?} not in the swapped queue",
                            r.id
                        ));
                    }
                    let want = layout.full_blocks_for(r.num_computed);
                    if !r.full.is_empty() || !r.ring.is_empty() || r.n_full_swapped < want {
                        return Err(format!(
                            "swapped request {:?} holds device chunks or lost blocks",
                            r.id
                        ));
                    }
                }
                RequestState::Prefilling | RequestState::Decoding => {
                    nr += 1;
                    if !self.running.contains(&idx) {
                        return Err(format!(
                            "running request {:?} not in the running list",
                            r.id
                        ));
                    }
                    if !r.swap_slots.is_empty() {
                        return Err(format!("running request {:?} holds swap slots", r.id));
                    }
                    // Each outstanding plan may have grown it by its pending token, a
                    // speculative row by its proposals.
                    let spec: usize = self
                        .outstanding_plans()
                        .flat_map(|p| p.rows.iter())
                        .filter(|row| row.req == idx)
                        .map(|row| row.spec as usize)
                        .sum();
                    let most = r.tokens.len() + self.outstanding as usize + spec;
                    if r.full.len() < layout.full_blocks_for(r.num_computed)
                        || r.full.len() > layout.full_blocks_for(most)
                        || r.ring.len() < layout.ring_chunks_for(r.num_computed)
                    {
                        return Err(format!(
                            "running request {:?}: blocks do not cover its cached tokens",
                            r.id
                        ));
                    }
                    for (i, &c) in r.full.iter().enumerate() {
                        if let Some(h) = pool.hash_of(c) {
                            if r.block_hashes.get(i) != Some(&h) || (i + 1) * page > r.num_computed
                            {
                                return Err(format!(
                                    "request {:?} block {i}: hashed chunk {c} does not match its content",
                                    r.id
                                ));
                            }
                        }
                    }
                }
                RequestState::Finished => unreachable!(),
            }
        }
        if nw != self.waiting.len() || nr != self.running.len() || ns != self.swapped.len() {
            return Err(format!(
                "queues hold requests in other states (waiting {nw}/{}, running {nr}/{}, swapped {ns}/{})",
                self.waiting.len(),
                self.running.len(),
                self.swapped.len()
            ));
        }
        let reqs = &self.reqs;
        let key = |i: &u32| reqs[*i as usize].as_ref().map(|r| r.key);
        if !self.running.windows(2).all(|w| key(&w[0]) < key(&w[1])) {
            return Err("running list not sorted by (priority, arrival)".into());
        }
        self.check_outstanding()?;
        for p in self.outstanding_plans() {
            if p.rows.iter().any(|row| row.spec > 0) && (p.ahead || self.outstanding != 1) {
                return Err("a speculative row in an ahead plan, or planned ahead of".into());
            }
        }

        if self.steady.plan == PlanShape::Ready && self.outstanding != 0 {
            return Err("steady path: a plan marked ready to advance is still outstanding".into());
        }
        for &(idx, _) in &self.to_remove {
            match self.request(idx) {
                Some(r) if r.state == RequestState::Finished => {}
                _ => {
                    return Err(format!(
                        "slab slot {idx} queued for removal is not finished"
                    ))
                }
            }
        }
        self.check_time_budget()
    }

    /// Chunk lifetime: every chunk an outstanding plan references (block tables, slot
    /// mappings, swap pairs) is held (refcount > 0), and so is every swap slot it
    /// references. One exception: while a plan is the only one outstanding, its swap-out
    /// sources may be free (the plan released them itself; nothing can allocate before its
    /// update but `schedule_ahead()`, which pins them first).
    fn check_outstanding(&self) -> std::result::Result<(), String> {
        if self.outstanding > 2 {
            return Err("more than two plans outstanding".into());
        }
        let page = self.cfg.page_size;
        let n = (self.cfg.num_blocks + 2) as i32;
        for (k, p) in self.outstanding_plans().enumerate() {
            let held = |c: i32, what: &str| -> std::result::Result<(), String> {
                if c < 0 || c >= n {
                    return Err(format!(
                        "outstanding plan {k}: {what} chunk {c} out of range"
                    ));
                }
                if c as ChunkId >= crate::pool::FIRST_DATA_CHUNK
                    && self.kv.pool().refcount(c as ChunkId) == 0
                {
                    return Err(format!(
                        "chunk lifetime: chunk {c} ({what}) of outstanding plan {k} is free"
                    ));
                }
                Ok(())
            };
            for &c in p.block_table_full.iter().chain(&p.block_table_sliding) {
                held(c, "block table")?;
            }
            for &s in p.slot_mapping_full.iter().chain(&p.slot_mapping_sliding) {
                held(s / page as i32, "slot mapping")?;
            }
            for pr in p.swap_out.chunks_exact(2) {
                if self.outstanding == 2 {
                    held(pr[0], "swap_out source")?;
                }
                if self.kv.swap().refcount(pr[1] as u32) == 0 {
                    return Err(format!(
                        "chunk lifetime: swap slot {} of outstanding plan {k} is free",
                        pr[1]
                    ));
                }
            }
            for pr in p.swap_in.chunks_exact(2) {
                held(pr[1], "swap_in destination")?;
                if self.kv.swap().refcount(pr[0] as u32) == 0 {
                    return Err(format!(
                        "chunk lifetime: swap slot {} of outstanding plan {k} is free",
                        pr[0]
                    ));
                }
            }
            if !p.prev_token_index.is_empty() && p.prev_token_index.len() != p.input_ids.len() {
                return Err(format!("outstanding plan {k}: prev_token_index length"));
            }
        }
        Ok(())
    }
}
