//! Phase 1 of `schedule()`: running requests into rows, in queue order, growing their
//! chunks and preempting when the pool runs short.

use super::budget::Budget;
use super::{Scheduler, SchedulerType};
use crate::alloc::Layout;
use crate::plan::{Row, StepPlan};
use crate::request::Request;
use crate::RequestState;

/// What a row that cannot get even one token's chunks does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum OnShortfall {
    /// Preempt a victim (possibly itself) and retry (running requests in `schedule()`).
    Preempt,
    /// Give up (just-admitted requests, whose fit was checked).
    GiveUp,
}

impl Scheduler {
    /// Place the running requests in queue order (`fifo`: decodes first; `prefill_first`:
    /// prefills first).
    pub(super) fn place_running_rows(&mut self, b: &mut Budget) {
        let mut order = std::mem::take(&mut self.order_buf);
        order.clear();
        order.extend_from_slice(&self.running);
        let phases = match self.cfg.scheduler_type {
            SchedulerType::Fifo => [RequestState::Decoding, RequestState::Prefilling],
            SchedulerType::PrefillFirst => [RequestState::Prefilling, RequestState::Decoding],
        };
        // With the time budget binding (fifo only), the in-flight prefills are placed by
        // `fair`, after the decodes.
        let fair = b.time.is_some();
        let mut other_seen = true;
        for (k, want) in phases.into_iter().enumerate() {
            if k == 1 && (!other_seen || fair) {
                break;
            }
            other_seen = false;
            for &idx in &order {
                if b.exhausted() {
                    break;
                }
                let r = self.req(idx);
                if r.state != want {
                    other_seen = true;
                    continue;
                }
                if r.touched_step == self.step {
                    continue;
                }
                if want == RequestState::Decoding
                    && !r.proposal.is_empty()
                    && self.place_spec(idx, b)
                {
                    continue;
                }
                if want == RequestState::Decoding && self.decode_fast(idx, b) {
                    continue;
                }
                self.place_running(idx, b, OnShortfall::Preempt);
            }
        }
        self.order_buf = order;
    }

    /// Try to place a running request as a row from its cached tokens: prefills shrink to
    /// the chunks available; a row that cannot get even one token's chunks acts as
    /// `on_shortfall` says. Returns whether it was placed.
    pub(super) fn place_running(
        &mut self,
        idx: u32,
        b: &mut Budget,
        on_shortfall: OnShortfall,
    ) -> bool {
        loop {
            let r = self.req(idx);
            let start = r.num_computed;
            let mut q = b.clamp(start, r.tokens.len() - start);
            if q == 0 {
                return false;
            }
            let free = self.kv.num_free();
            let need = if q == 1 {
                self.kv.need_one(r, start)
            } else {
                self.kv.need(r, start, q)
            };
            if need > free {
                let fit = self.kv.fit(r, start, q);
                if fit > 0 {
                    q = fit;
                } else if on_shortfall == OnShortfall::Preempt {
                    self.stats.stalled_requests += 1;
                    self.stats.stalled_blocks += need - free;
                    match self.pick_victim(idx) {
                        Some(v) => {
                            self.preempt(v);
                            if v == idx {
                                return false;
                            }
                            continue;
                        }
                        None => return false,
                    }
                } else {
                    return false;
                }
            }
            self.emit_row(idx, start, q, need > 0 || q > 1);
            b.debit(start, q);
            if self.collect_filling && (q > 1 || start + q < self.req(idx).tokens.len()) {
                // the blocks this prefill fills in this step and its later chunks
                let r = self.reqs[idx as usize].as_mut().expect("live");
                let len = r.tokens.len();
                self.kv.blocks_filled(r, start, len, &mut self.filling);
            }
            return true;
        }
    }

    /// Place a decode row (one token) when it needs no new chunk and fits the budgets: the
    /// common case of a steady decode step, done with one request lookup. Returns false
    /// (nothing changed) otherwise; the general path handles it.
    #[inline]
    fn decode_fast(&mut self, idx: u32, b: &mut Budget) -> bool {
        let page = self.cfg.page_size;
        let l = *self.kv.layout();
        let r = self.req(idx);
        let start = r.num_computed;
        let end = start + 1;
        if end != r.tokens.len()
            || b.clamp(start, 1) == 0
            || (l.has_full && r.full.len() * page < end)
            || (l.has_sliding && r.ring.len() < l.ring && r.ring.len() * page < end)
        {
            return false;
        }
        let last = r.last_token as i32;
        self.place_row(
            Row {
                req: idx,
                start: start as u32,
                q: 1,
                sampled: true,
                spec: 0,
            },
            false,
        );
        self.plan.input_ids.push(last);
        b.debit(start, 1);
        true
    }

    /// Grow the request (when `grow`) and write its row's entries of every per-token /
    /// per-row array (block tables are written by `build_block_tables` once the width is
    /// known).
    pub(super) fn emit_row(&mut self, idx: u32, start: usize, q: usize, grow: bool) {
        let end = start + q;
        let sampled = end == self.req(idx).tokens.len();
        self.place_row(
            Row {
                req: idx,
                start: start as u32,
                q: q as u32,
                sampled,
                spec: 0,
            },
            grow,
        );
        // Full-attention slots are written with the block tables (one pass over `full`);
        // positions, cu_seqlens_q, seqlens_k and logits_* by `fill_row_arrays` (from `rows`).
        let r = self.reqs[idx as usize].as_ref().expect("live");
        let p = &mut self.plan;
        if sampled && q == 1 {
            p.input_ids.push(r.last_token as i32);
        } else {
            p.input_ids
                .extend(r.tokens[start..end].iter().map(|&t| t as i32));
        }
    }

    /// Grow request `row.req` to `row.start + row.q` keys when `grow`, mark it touched this
    /// step, and append `row` and its tokens' sliding-ring slots to the plan; the caller
    /// writes the row's input ids. Every placement of a row goes through here.
    pub(super) fn place_row(&mut self, row: Row, grow: bool) {
        let layout = *self.kv.layout();
        let (start, end) = (row.start as usize, (row.start + row.q) as usize);
        let r = self.reqs[row.req as usize].as_mut().expect("live");
        if grow {
            self.kv
                .grow(r, end)
                .expect("place_row: the fit was checked by the caller");
        }
        r.touched_step = self.step;
        push_row(&mut self.plan, r, &layout, row);
        if layout.has_sliding {
            for pos in start..end {
                self.plan
                    .slot_mapping_sliding
                    .push(layout.sliding_slot(&r.ring, pos, end));
            }
        }
    }
}

/// Append request `r`'s `row` to `plan`: the block table widens to `r`'s full blocks, and
/// `r`'s ring floor moves past the keys the row's step leaves out of the sliding ring
/// ([`Layout::ring_floor_after`]).
#[inline]
fn push_row(plan: &mut StepPlan, r: &mut Request, layout: &Layout, row: Row) {
    if layout.has_sliding {
        let start = row.start as usize;
        r.ring_floor = layout.ring_floor_after(r.ring_floor, start, start + row.q as usize);
    }
    plan.full_width = plan.full_width.max(r.full.len());
    plan.rows.push(row);
}
