//! The request API: adding (with the fit check), cancelling and recomputing requests, and
//! the running list they move in and out of.

use super::config::{check_lengths, MAX_LIFETIME};
use super::{PlanSlot, Scheduler};
use crate::request::{FinishReason, Request, RequestState, StopConditions};
use crate::{Error, Result, Token};

impl Scheduler {
    /// Whether a request of `prompt_len` prompt tokens and `max_new_tokens` could ever fit
    /// the cache: exactly the length and capacity checks of `add_request`, adding nothing.
    /// Errors (`Value`) name the field: `"prompt"` (empty, or too long even with one new
    /// token) or `"max_new_tokens"` (below 1, or too many for what the prompt leaves).
    pub fn check_fits(&self, prompt_len: usize, max_new_tokens: usize) -> Result<()> {
        check_lengths(prompt_len, max_new_tokens)?;
        self.check_capacity(None, prompt_len, max_new_tokens)
    }

    /// Chunks a request holding `cached_tokens` keys needs at most: its full-attention blocks
    /// plus its sliding ring. A request's whole lifetime holds `prompt + max_new_tokens - 1`.
    pub fn lifetime_chunks(&self, cached_tokens: usize) -> usize {
        self.kv.layout().max_chunks(cached_tokens)
    }

    /// The largest `prompt_len + max_new_tokens` that [`Scheduler::check_fits`] accepts
    /// (0 when not even a one-token prompt with one new token fits). O(1).
    pub fn max_request_tokens(&self) -> usize {
        if self.max_lifetime == 0 {
            0
        } else {
            self.max_lifetime + 1
        }
    }

    /// The capacity half of `check_fits` (the message names request `id` when given).
    fn check_capacity(
        &self,
        id: Option<&str>,
        prompt_len: usize,
        max_new_tokens: usize,
    ) -> Result<()> {
        let who = || match id {
            Some(id) => format!("request {id:?}"),
            None => "the request".to_owned(),
        };
        // Blame the prompt when it cannot fit even with a single new token.
        let field = if prompt_len > self.max_lifetime {
            "prompt"
        } else {
            "max_new_tokens"
        };
        let lifetime = prompt_len.saturating_add(max_new_tokens - 1);
        if lifetime > MAX_LIFETIME {
            return Err(Error::invalid(
                field,
                "prompt_token_ids + max_new_tokens is too long",
            ));
        }
        let need = self.kv.layout().max_chunks(lifetime);
        if need > self.cfg.num_blocks {
            return Err(Error::invalid(
                field,
                format!(
                    "{} can never fit: prompt_token_ids ({prompt_len}) + max_new_tokens \
                     ({max_new_tokens}) need {need} blocks of page_size {} but num_blocks is {}",
                    who(),
                    self.cfg.page_size,
                    self.cfg.num_blocks
                ),
            ));
        }
        if let Some(c) = self.cfg.max_batch_cache_tokens {
            if lifetime > c {
                return Err(Error::invalid(
                    field,
                    format!(
                        "{} can never fit: prompt_token_ids ({prompt_len}) + max_new_tokens \
                         ({max_new_tokens}) - 1 exceeds max_batch_cache_tokens ({c})",
                        who()
                    ),
                ));
            }
        }
        Ok(())
    }

    /// Add a request. Errors (`Value`) name the field: duplicate `request_id`, empty
    /// `prompt_token_ids`, `max_new_tokens < 1`, an empty stop sequence, or a request that
    /// could never fit (`num_blocks`, `max_batch_cache_tokens`). Returns its slab index.
    pub fn add_request(
        &mut self,
        id: &str,
        prompt: Vec<Token>,
        stop: StopConditions,
        priority: i64,
    ) -> Result<u32> {
        self.add_request_opts(id, prompt, stop, priority, false)
    }

    /// `add_request` with `skip_prefix_lookup`: the request never takes prefix-cache hits
    /// (it computes every prompt position, e.g. because its caller wants the logits of each
    /// one); its computed blocks are still offered to the cache for others.
    pub fn add_request_opts(
        &mut self,
        id: &str,
        prompt: Vec<Token>,
        stop: StopConditions,
        priority: i64,
        skip_prefix_lookup: bool,
    ) -> Result<u32> {
        if self.ids.contains_key(id) {
            return Err(Error::invalid(
                "request_id",
                format!("request_id {id:?} is already in use"),
            ));
        }
        check_lengths(prompt.len(), stop.max_new_tokens)?;
        if stop.stop_sequences.iter().any(|s| s.is_empty()) {
            return Err(Error::invalid(
                "stop_sequences",
                "stop_sequences must not contain an empty sequence",
            ));
        }
        self.check_capacity(Some(id), prompt.len(), stop.max_new_tokens)?;
        let key = (priority, self.arrivals);
        self.arrivals += 1;
        let req = Request::new(id.to_owned(), key, prompt, stop, skip_prefix_lookup);
        let idx = match self.free_idx.pop() {
            Some(i) => {
                self.reqs[i as usize] = Some(req);
                i
            }
            None => {
                self.reqs.push(Some(req));
                (self.reqs.len() - 1) as u32
            }
        };
        self.ids.insert(id.to_owned(), idx);
        self.waiting.insert(key, idx);
        Ok(idx)
    }

    /// Put a waiting request that has computed nothing yet into the prefix-cache namespace
    /// `salt` (0: the shared one): it takes hits only from, and offers its blocks only to,
    /// requests of the same salt. Call it right after `add_request`.
    pub fn set_cache_salt(&mut self, id: &str, salt: u64) -> Result<()> {
        let idx = self.known(id)?;
        let r = self.req_mut(idx);
        if r.state != RequestState::Waiting || r.num_computed != 0 || !r.block_hashes.is_empty() {
            return Err(Error::invalid(
                "cache_salt",
                format!("request {id:?} has started: its cache salt can't change"),
            ));
        }
        r.cache_salt = salt;
        Ok(())
    }

    /// Mark a request (any state) as part of an offline batch, or not: the step-time budget
    /// binds only while an unfinished request is not offline (`scheduler::fair`).
    pub fn set_offline(&mut self, id: &str, offline: bool) -> Result<()> {
        let idx = self.known(id)?;
        self.req_mut(idx).offline = offline;
        Ok(())
    }

    /// Slab index of the request `id` (unfinished, or finished and not yet reported), or a
    /// `request_id` error.
    fn known(&self, id: &str) -> Result<u32> {
        self.request_index(id)
            .ok_or_else(|| Error::invalid("request_id", format!("unknown request_id {id:?}")))
    }

    /// Cancel a request in any state, freeing everything it holds. It is reported once by
    /// the next `update()` with reason `cancelled`. Returns false if unknown or finished.
    ///
    /// Chunk lifetime: when an outstanding plan references the request (a row of it, or its
    /// swap-out), its chunks (or swap slots) are not freed now but held for the last such
    /// plan and freed by that plan's update, so nothing reallocates them while a forward
    /// (or copy) may still use them.
    pub fn cancel(&mut self, id: &str) -> bool {
        let Some(&idx) = self.ids.get(id) else {
            return false;
        };
        let r = self.req(idx);
        let key = r.key;
        let flight = self.flight_of(r.touched_step);
        match r.state {
            RequestState::Finished => return false,
            RequestState::Waiting => {
                self.waiting.remove(&key);
            }
            RequestState::Swapped | RequestState::Prefilling | RequestState::Decoding => {
                let swapped = r.state == RequestState::Swapped;
                if swapped {
                    self.swapped.remove(&key);
                } else {
                    self.remove_running(idx);
                }
                let r = self.reqs[idx as usize].as_mut().expect("live");
                // Touched by an outstanding plan: its copies and writes still use these
                // chunks / swap slots, so they are freed at that plan's update.
                let held = flight.map(|slot| match slot {
                    PlanSlot::Oldest => &mut self.old.held,
                    PlanSlot::Newest => &mut self.cur.held,
                });
                match (held, swapped) {
                    (Some(held), true) => self.kv.defer_free_swapped(r, held),
                    (Some(held), false) => self.kv.defer_free(r, held),
                    (None, true) => self.kv.free_swapped(r),
                    (None, false) => self.kv.free(r),
                }
            }
        }
        self.steady.take_ready();
        let r = self.req_mut(idx);
        r.state = RequestState::Finished;
        r.finish = Some(FinishReason::Cancelled);
        self.pending_cancel.push(idx);
        true
    }

    /// Recompute a request from scratch: the soft reset of preemption (generated tokens
    /// appended to the prompt, chunks freed, hashed full blocks kept in the cached list,
    /// back to `Waiting` at its original queue position), asked for by the caller, e.g.
    /// when the model's forward would compute its cached keys differently from now on.
    /// A swapped request's swap slots are released. Returns false (nothing done) when the
    /// request is unknown, finished, or waiting with nothing computed. Errors while a plan
    /// is outstanding (its forward may still read the chunks).
    pub fn recompute(&mut self, id: &str) -> Result<bool> {
        if self.outstanding > 0 {
            return Err(Error::runtime(
                "recompute() called while a plan is outstanding: call update() first",
            ));
        }
        let Some(&idx) = self.ids.get(id) else {
            return Ok(false);
        };
        let r = self.req(idx);
        let key = r.key;
        match r.state {
            // a waiting request holds nothing and computes from scratch anyway
            RequestState::Finished | RequestState::Waiting => return Ok(false),
            RequestState::Swapped => {
                self.swapped.remove(&key);
                let r = self.reqs[idx as usize].as_mut().expect("live");
                self.kv.free_swapped(r);
            }
            RequestState::Prefilling | RequestState::Decoding => {
                self.remove_running(idx);
                let r = self.reqs[idx as usize].as_mut().expect("live");
                self.kv.free(r);
            }
        }
        self.steady.take_ready();
        let r = self.req_mut(idx);
        r.num_computed = 0;
        r.num_registered = 0;
        r.state = RequestState::Waiting;
        self.waiting.insert(key, idx);
        self.stats.num_recomputes += 1;
        Ok(true)
    }

    pub(super) fn remove_running(&mut self, idx: u32) {
        if let Some(p) = self.running.iter().rposition(|&i| i == idx) {
            self.running.remove(p);
        }
    }

    pub(super) fn insert_running(&mut self, idx: u32) {
        let key = self.req(idx).key;
        let reqs = &self.reqs;
        let pos = self
            .running
            .partition_point(|&i| reqs[i as usize].as_ref().expect("live").key <= key);
        self.running.insert(pos, idx);
    }

    pub(super) fn running_state(r: &Request) -> RequestState {
        if r.num_generated() > 0 && r.num_computed + 1 == r.tokens.len() {
            RequestState::Decoding
        } else {
            RequestState::Prefilling
        }
    }
}
