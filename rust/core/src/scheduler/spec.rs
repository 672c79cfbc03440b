//! Speculative decoding in the core: proposals, speculative rows, acceptance and rollback.
//!
//! A decoding request may be given `k` proposed tokens for its next step
//! ([`Scheduler::propose`], or [`Scheduler::propose_ngram`], prompt lookup over its own
//! tokens). The next `schedule()` (never `schedule_ahead()`) gives it a row of `1 + k'`
//! query tokens (its last token, then the first `k'` proposals; `k'` is capped by the
//! budgets, the free chunks, the tokens it may still generate and [`Scheduler::spec_cap`])
//! and `1 + k'` `logits_indices` entries, one per query token. `schedule()` consumes every
//! proposal, used or not.
//!
//! `update()` takes one sampled token per `logits_indices` entry, as always: for a
//! speculative row, `s_0 .. s_k'` sampled at its query tokens. The row accepts the longest
//! prefix with `s_j == proposal_j`, then the token sampled after it (the bonus): `a + 1`
//! tokens. With greedy sampling that is exactly the non-speculative output; with sampling
//! (each `s_j` drawn from the target distribution at its position, independently) it is
//! the rejection rule for a deterministic proposal (accept `x` with probability `p(x)`, else
//! a draw from `p` without `x`, renormalised), so the output distribution is the target's.
//! The accepted tokens go through the stop conditions one by one (a stop cuts the run), one
//! delta per token. Rollback: `num_computed` moves by the tokens applied, blocks grown for
//! rejected positions are freed (their KV is simply not used), and only accepted tokens'
//! full blocks are offered to the prefix cache.
//!
//! Async batching: `schedule_ahead()` returns None while the outstanding plan has a
//! speculative row (the pipeline drains): its accepted count is unknown, so the next
//! positions are too.

use super::budget::Budget;
use super::Scheduler;
use crate::plan::Row;
use crate::request::RequestState;
use crate::{Error, Result, Token};

/// Prompt lookup: the `k` tokens that followed the most recent earlier occurrence of the
/// last `n` tokens of `tokens`, for `n` from `n_max` down to `n_min` (the first `n` with a
/// match wins). Fewer than `k` when the match is near the end; empty when nothing matches.
pub fn ngram_lookup(tokens: &[Token], k: usize, n_min: usize, n_max: usize, out: &mut Vec<Token>) {
    out.clear();
    let len = tokens.len();
    if k == 0 || n_min == 0 {
        return;
    }
    for n in (n_min..=n_max).rev() {
        if len < n + 1 {
            continue;
        }
        let pat = &tokens[len - n..];
        // Earlier occurrences start at i < len - n, most recent first.
        for i in (0..len - n).rev() {
            if &tokens[i..i + n] == pat {
                let from = i + n;
                let to = (from + k).min(len);
                out.extend_from_slice(&tokens[from..to]);
                return;
            }
        }
    }
}

impl Scheduler {
    /// Most speculative tokens one row may carry: `page_size`, and `sliding_window - 1`
    /// with sliding layers (so a ring never drops, or overwrites, a position that the
    /// accepted tokens still read after a rollback).
    pub fn spec_cap(&self) -> usize {
        let l = self.kv.layout();
        let mut cap = l.page;
        if l.has_sliding {
            cap = cap.min(l.window.saturating_sub(1));
        }
        cap
    }

    /// Propose `tokens` as the next tokens of request `id`, for the next `schedule()` only
    /// (which consumes them; a later call replaces them). Returns false, storing nothing,
    /// for an unknown or finished request or an empty proposal. Errors (field `tokens`) on
    /// a negative token.
    pub fn propose(&mut self, id: &str, tokens: &[i32]) -> Result<bool> {
        if let Some(t) = tokens.iter().find(|&&t| t < 0) {
            return Err(Error::invalid(
                "tokens",
                format!("proposed tokens must be non-negative (got {t})"),
            ));
        }
        let Some(&idx) = self.ids.get(id) else {
            return Ok(false);
        };
        if tokens.is_empty() {
            return Ok(false);
        }
        let r = self.reqs[idx as usize].as_mut().expect("live");
        if r.state == RequestState::Finished {
            return Ok(false);
        }
        if r.proposal.is_empty() {
            self.proposed.push(idx);
        }
        r.proposal.clear();
        r.proposal.extend(tokens.iter().map(|&t| t as Token));
        Ok(true)
    }

    /// Prompt-lookup proposals ([`ngram_lookup`], up to `k` tokens) for the decoding
    /// requests named in `ids` (every running request when None). Returns how many got a
    /// proposal.
    pub fn propose_ngram(
        &mut self,
        k: usize,
        n_min: usize,
        n_max: usize,
        ids: Option<&[&str]>,
    ) -> usize {
        let mut picked = std::mem::take(&mut self.order_buf);
        picked.clear();
        match ids {
            Some(ids) => picked.extend(ids.iter().filter_map(|id| self.ids.get(*id).copied())),
            None => picked.extend_from_slice(&self.running),
        }
        let mut n = 0;
        let mut buf = std::mem::take(&mut self.spec_buf);
        for &idx in &picked {
            let r = self.reqs[idx as usize].as_mut().expect("live");
            if r.state != RequestState::Decoding || r.num_computed + 1 != r.tokens.len() {
                continue;
            }
            ngram_lookup(&r.tokens, k, n_min, n_max, &mut buf);
            if buf.is_empty() {
                continue;
            }
            if r.proposal.is_empty() {
                self.proposed.push(idx);
            }
            r.proposal.clone_from(&buf);
            n += 1;
        }
        self.spec_buf = buf;
        self.order_buf = picked;
        n
    }

    /// Cut a decoding request back to its first `len` tokens (prompt + generated): the
    /// tokens after them are forgotten, as if never generated (a draft model's rejected
    /// proposals). Its cached keys are cut to `len - 1` (the last kept token is computed
    /// again with the next one); when that cuts into blocks offered to the prefix cache,
    /// the cut moves down to the block boundary and those blocks are let go (their content
    /// stays valid for later hits). Needs no plan outstanding (`Runtime` error). Returns
    /// false, changing nothing, for an unknown or not decoding request, `len < prompt
    /// length`, or a sliding ring that no longer holds the keys `len - w ..` the next query
    /// reads (overwritten by later decode steps, never kept by a prefill chunk, or
    /// overwritten by rejected speculative tokens: `Request::ring_floor`); true otherwise (a
    /// no-op when `len` covers every token).
    pub fn rewind(&mut self, id: &str, len: usize) -> Result<bool> {
        if self.outstanding > 0 {
            return Err(Error::runtime(
                "rewind() called while a plan is outstanding: call update() first",
            ));
        }
        let Some(&idx) = self.ids.get(id) else {
            return Ok(false);
        };
        let page = self.cfg.page_size;
        let r = self.reqs[idx as usize].as_mut().expect("live");
        if r.state != RequestState::Decoding || len < r.prompt_len.max(1) {
            return Ok(false);
        }
        if len >= r.tokens.len() {
            return Ok(true);
        }
        let l = *self.kv.layout();
        // The next query (at `len - 1`) reads keys `len - w ..`: they must still be in the
        // ring. Decode steps (the steady path does not move `ring_floor`) overwrite the key
        // `R * page` back of each one they write; a longer step or a speculative row's
        // rejected tokens leave the floor higher (`ring_floor`).
        let overwritten_back = r.num_computed - r.num_computed.min(len - 1);
        if l.has_sliding
            && (overwritten_back > l.ring * page - l.window
                || len.saturating_sub(l.window) < r.ring_floor)
        {
            // The ring may already have dropped keys the cut-back request reads again.
            return Ok(false);
        }
        self.steady.take_ready();
        r.tokens.truncate(len);
        r.last_token = *r.tokens.last().expect("len >= 1");
        let mut nc = r.num_computed.min(len - 1);
        if nc < r.num_registered * page {
            nc = (nc / page) * page;
            r.num_registered = nc / page;
        }
        r.block_hashes.truncate(r.num_registered);
        r.num_computed = nc;
        self.kv.shrink(r, nc);
        Ok(true)
    }

    /// Drop every pending proposal (the end of `schedule()`'s placement).
    pub(super) fn clear_proposals(&mut self) {
        for idx in self.proposed.drain(..) {
            if let Some(r) = self.reqs[idx as usize].as_mut() {
                r.proposal.clear();
            }
        }
    }

    /// Place a decoding request with a proposal as a speculative row (`1 + k'` tokens,
    /// `k' >= 1`). Returns false, having changed nothing, when not even one proposal fits
    /// (the caller places it as a plain decode).
    pub(super) fn place_spec(&mut self, idx: u32, b: &mut Budget) -> bool {
        let cap = self.spec_cap();
        let r = self.req(idx);
        let start = r.num_computed;
        if start + 1 != r.tokens.len() {
            return false;
        }
        let left = r.max_new_tokens.saturating_sub(r.num_generated());
        let kmax = r.proposal.len().min(left.saturating_sub(1)).min(cap);
        if kmax == 0 {
            return false;
        }
        let mut q = b.clamp(start, 1 + kmax);
        if q <= 1 {
            return false;
        }
        if self.kv.need(r, start, q) > self.kv.num_free() {
            q = self.kv.fit(r, start, q);
            if q <= 1 {
                return false;
            }
        }
        self.place_row(
            Row {
                req: idx,
                start: start as u32,
                q: q as u32,
                sampled: true,
                spec: (q - 1) as u32,
            },
            true,
        );
        let r = self.reqs[idx as usize].as_ref().expect("live");
        let p = &mut self.plan;
        p.input_ids.push(r.last_token as i32);
        p.input_ids
            .extend(r.proposal[..q - 1].iter().map(|&t| t as i32));
        b.debit(start, q);
        self.cur.spec = true;
        self.stats.spec_rows += 1;
        self.stats.spec_proposed += (q - 1) as u64;
        true
    }

    /// Apply speculative row `ri` (`row`) of the plan being updated, with `toks` its
    /// `1 + spec` sampled tokens: accept, apply through the stop conditions (one delta per
    /// token), roll back. Returns whether the request finished.
    pub(super) fn apply_spec_row(&mut self, ri: usize, row: Row, toks: &[i32]) -> bool {
        debug_assert!(self.outstanding == 1 && !self.plan.ahead);
        let spec = row.spec as usize;
        let t0 = self.plan.cu_seqlens_q[ri] as usize;
        let proposal = &self.plan.input_ids[t0 + 1..t0 + 1 + spec];
        let a = proposal
            .iter()
            .zip(toks)
            .take_while(|(p, s)| p == s)
            .count();
        let start = row.start as usize;
        let r = self.reqs[row.req as usize].as_mut().expect("live");
        r.state = RequestState::Decoding;
        let mut applied = 0;
        let mut fin = None;
        for &t in &toks[..=a] {
            applied += 1;
            fin = r.append(t as Token);
            self.out.push(row.req, t, fin, ri as i32);
            if fin.is_some() {
                break;
            }
        }
        r.num_computed = start + applied;
        if self.kv.has_new_full_block(r) {
            self.kv.register(r);
        }
        self.stats.generated_tokens += applied as u64;
        self.stats.spec_accepted += a.min(applied) as u64;
        match fin {
            Some(f) => {
                self.finish(row.req, f);
                true
            }
            None => {
                // Blocks grown for rejected positions go back.
                self.kv.shrink(r, start + applied);
                false
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::request::StopConditions;
    use crate::scheduler::SchedulerConfig;

    #[test]
    fn rewind_cuts_tokens_keys_and_blocks() {
        let mut cfg = SchedulerConfig::new(16, 2, 64);
        cfg.allow_block_sharing = true;
        let mut s = Scheduler::new(cfg).unwrap();
        let stop = StopConditions {
            max_new_tokens: 10,
            ..Default::default()
        };
        s.add_request_opts("a", vec![1, 2, 3], stop, 0, false)
            .unwrap();
        s.schedule().unwrap();
        s.update(&[4]).unwrap();
        for t in [5, 6, 7] {
            s.schedule().unwrap();
            s.update(&[t]).unwrap();
        }
        // tokens 1 2 3 4 5 6 7, 6 keys cached, blocks [1 2][3 4][5 6] registered.
        let idx = s.request_index("a").unwrap();
        assert_eq!(s.request(idx).unwrap().num_registered, 3);
        assert!(s.rewind("a", 5).unwrap());
        let r = s.request(idx).unwrap();
        assert_eq!(r.tokens, vec![1, 2, 3, 4, 5]);
        // the cut (4 keys) lands on a block boundary: blocks 0, 1 kept, block 2 let go
        assert_eq!((r.num_computed, r.full.len(), r.num_registered), (4, 2, 2));
        s.check_invariants().unwrap();
        assert!(!s.rewind("a", 2).unwrap(), "into the prompt");
        assert!(!s.rewind("nope", 4).unwrap());
        let p = s.schedule().unwrap().unwrap();
        assert_eq!(
            (p.input_ids.clone(), p.positions.clone()),
            (vec![5], vec![4])
        );
        assert!(s.rewind("a", 4).is_err(), "a plan is outstanding");
        s.update(&[9]).unwrap();
        assert_eq!(s.request(idx).unwrap().tokens, vec![1, 2, 3, 4, 5, 9]);
        s.check_invariants().unwrap();
    }

    #[test]
    fn ngram_lookup_prefers_the_longest_most_recent_match() {
        let mut out = Vec::new();
        // ... 1 2 3 [4 5] ... 9 2 3 [7] ... 2 3 -> n=2 matches "2 3" most recently at 5..7.
        let toks = [1, 2, 3, 4, 5, 9, 2, 3, 7, 8, 2, 3];
        ngram_lookup(&toks, 3, 1, 3, &mut out);
        assert_eq!(out, vec![7, 8, 2]);
        // n=3 "9 2 3"? the tail is "8 2 3": no 3-gram match, the 2-gram wins.
        ngram_lookup(&toks, 5, 3, 3, &mut out);
        assert!(out.is_empty());
        // Near the end: fewer than k.
        ngram_lookup(&[5, 6, 5], 4, 1, 1, &mut out);
        assert_eq!(out, vec![6, 5]);
        ngram_lookup(&[5], 4, 1, 2, &mut out);
        assert!(out.is_empty());
        ngram_lookup(&toks, 0, 1, 2, &mut out);
        assert!(out.is_empty());
    }
}
