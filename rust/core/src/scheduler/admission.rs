//! Phase 2: swapped and waiting requests into rows, merged in `(priority, arrival)` order,
//! head of line, while the pool's free fraction is at least the safety margin (ignored when
//! nothing runs). Admission is atomic: prefix hits are taken and chunks allocated only once
//! everything fits.
//!
//! In-batch prefix sharing: a waiting request whose first block past its prefix hits is a
//! block that a prefill placed in this very step fills, in this step or a later one of its
//! chunks (another request's prompt with the same prefix, admitted just before it, or a
//! running chunked prefill), would compute that block again. It is put off instead
//! (`Request::admission_deferrals`), and admission goes on behind it; in a later step that
//! block is registered and it is a hit. So many requests with a shared system prompt
//! arriving together compute it once, not once per request, whether the prompt is prefilled
//! in one step or in chunks (the step-time budget). No starvation: a request is put off only
//! while a prefill that is placed in the same step (so progresses by at least one token)
//! has still to fill its next block, so at most as many steps as that prefill has tokens
//! left, and never more than [`MAX_ADMISSION_DEFERRALS`] steps in all. `schedule_ahead()`
//! never puts off (its blocks in flight belong to the outstanding plan too).

use super::budget::Budget;
use super::placement::OnShortfall;
use super::Scheduler;

/// Most steps a request's admission is put off to share blocks (a bound beyond the one the
/// sharing prefills' progress gives).
pub const MAX_ADMISSION_DEFERRALS: u32 = 1024;

impl Scheduler {
    /// Admit swapped and waiting requests in key order (head of line; requests put off to
    /// share a block filled in this step are stepped over and wait for the next one).
    pub(super) fn admit(&mut self, b: &mut Budget) {
        self.admit_in_order(b);
        let mut deferred = std::mem::take(&mut self.deferred_buf);
        for idx in deferred.drain(..) {
            let key = self.req(idx).key;
            self.waiting.insert(key, idx);
        }
        self.deferred_buf = deferred;
    }

    fn admit_in_order(&mut self, b: &mut Budget) {
        loop {
            if b.exhausted() {
                return;
            }
            let w = self.waiting.first_key_value().map(|(k, &i)| (*k, i));
            let s = self.swapped.first_key_value().map(|(k, &i)| (*k, i));
            let (idx, is_swapped) = match (w, s) {
                (None, None) => return,
                (Some((_, i)), None) => (i, false),
                (None, Some((_, i))) => (i, true),
                (Some((kw, iw)), Some((ks, is))) => {
                    if ks < kw {
                        (is, true)
                    } else {
                        (iw, false)
                    }
                }
            };
            if self.req(idx).touched_step == self.step {
                return; // preempted in this step
            }
            if self.below_margin() {
                return;
            }
            let ok = if is_swapped {
                self.resume(idx, b)
            } else {
                match self.admit_new(idx, b, true) {
                    Admitted::Yes => true,
                    Admitted::No => false,
                    Admitted::PutOff => {
                        let key = self.req(idx).key;
                        self.waiting.remove(&key);
                        self.deferred_buf.push(idx);
                        true
                    }
                }
            };
            if !ok {
                return;
            }
        }
    }

    /// `schedule_ahead()` phase 2: waiting requests only (resuming needs a swap-in, so a
    /// swapped request at the head stops admission).
    pub(super) fn admit_ahead(&mut self, b: &mut Budget) {
        loop {
            if b.exhausted() {
                break;
            }
            let Some((&kw, &iw)) = self.waiting.first_key_value() else {
                break;
            };
            if matches!(self.swapped.first_key_value(), Some((ks, _)) if *ks < kw) {
                break;
            }
            if self.below_margin() {
                break;
            }
            if self.admit_new(iw, b, false) != Admitted::Yes {
                break;
            }
        }
    }

    /// Requests are running and the free fraction of the pool is below the safety margin.
    fn below_margin(&self) -> bool {
        !self.running.is_empty()
            && (self.kv.num_free() as f64) < self.margin * self.cfg.num_blocks as f64
    }

    /// Swap a swapped request back in and place it, if its chunks and one token fit.
    fn resume(&mut self, idx: u32, b: &mut Budget) -> bool {
        let r = self.req(idx);
        let start = r.num_computed;
        let q = b.clamp(start, r.tokens.len() - start);
        if q == 0 || !self.kv.swap_in_fits(r, start, q) {
            return false;
        }
        let key = r.key;
        self.swapped.remove(&key);
        let r = self.reqs[idx as usize].as_mut().expect("live");
        self.kv
            .swap_in(r, &mut self.plan.swap_in, &mut self.cur.held);
        r.state = Self::running_state(r);
        self.insert_running(idx);
        let placed = self.place_running(idx, b, OnShortfall::GiveUp);
        debug_assert!(placed);
        placed
    }

    /// Admit a waiting request with its prefix-cache hits and place it, if one token past
    /// them fits; with `may_put_off`, put it off instead when its next block is one a
    /// prefill of this step fills, now or in a later chunk (module docs).
    pub(super) fn admit_new(&mut self, idx: u32, b: &mut Budget, may_put_off: bool) -> Admitted {
        let page = self.cfg.page_size;
        let mut hits = std::mem::take(&mut self.hits_buf);
        let r = self.reqs[idx as usize].as_mut().expect("live");
        self.kv.computed_prefix(r, &mut hits);
        let r = self.req(idx);
        let start = hits.len() * page;
        let len = r.tokens.len();
        let next = hits.len();
        if may_put_off
            && r.admission_deferrals < MAX_ADMISSION_DEFERRALS
            && next < (len - 1) / page
            && next < r.block_hashes.len()
            && self.filling.contains(&r.block_hashes[next])
        {
            self.hits_buf = hits;
            self.reqs[idx as usize]
                .as_mut()
                .expect("live")
                .admission_deferrals += 1;
            self.stats.deferred_admissions += 1;
            return Admitted::PutOff;
        }
        let q = b.clamp(start, len - start);
        let free = self.kv.free_after_taking(&hits);
        let ok = q > 0 && self.kv.layout().fit(hits.len(), 0, start, q, free) > 0;
        if ok {
            let key = r.key;
            self.waiting.remove(&key);
            let r = self.reqs[idx as usize].as_mut().expect("live");
            self.kv.take_prefix(r, &hits);
            r.num_computed = start;
            r.state = Self::running_state(r);
            self.stats.prefix_hit_tokens += start as u64;
            self.stats.prompt_tokens += len as u64;
            self.insert_running(idx);
            let placed = self.place_running(idx, b, OnShortfall::GiveUp);
            debug_assert!(placed);
        }
        self.hits_buf = hits;
        if ok {
            Admitted::Yes
        } else {
            Admitted::No
        }
    }
}

/// What [`Scheduler::admit_new`] did with a waiting request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Admitted {
    /// admitted and placed
    Yes,
    /// not now: admission stops (head of line)
    No,
    /// put off to the next step to share a block this step fills; admission goes on
    PutOff,
}
