//! Phase 1 of `schedule_ahead()` off the steady path: the running requests, from where the
//! outstanding plan leaves them, into a fresh plan. A sampled row continues at
//! `start + q` with its pending token as placeholder; an unsampled (prefill chunk) row
//! continues its prompt; a request not in the plan continues from `num_computed`. Chunks
//! come only from the free lists: no victim search, no preemption.

use super::budget::Budget;
use super::{Scheduler, SchedulerType};
use crate::plan::Row;
use crate::RequestState;

impl Scheduler {
    /// Place the running requests into a fresh plan (the outstanding one moves to
    /// `prev_plan`).
    pub(super) fn place_ahead_rows(&mut self, b: &mut Budget) {
        self.row_of.clear();
        self.row_of.resize(self.reqs.len(), u32::MAX);
        for (ri, row) in self.plan.rows.iter().enumerate() {
            self.row_of[row.req as usize] = ri as u32;
        }
        // Build into the spare buffer; the outstanding plan moves to `prev_plan`.
        std::mem::swap(&mut self.plan, &mut self.prev_plan);
        self.plan.clear();
        self.plan.ahead = true;
        let mut order = std::mem::take(&mut self.order_buf);
        order.clear();
        order.extend_from_slice(&self.running);
        let phases = match self.cfg.scheduler_type {
            SchedulerType::Fifo => [true, false],
            SchedulerType::PrefillFirst => [false, true],
        };
        for decodes in phases {
            for &idx in &order {
                if b.exhausted() {
                    break;
                }
                let r = self.req(idx);
                // Where the request stands once the outstanding plan is applied.
                let ri = self.row_of[idx as usize];
                let (start, pending) = if ri != u32::MAX {
                    let row = self.prev_plan.rows[ri as usize];
                    let pending = if row.sampled {
                        let j = self
                            .prev_plan
                            .logits_rows
                            .binary_search(&(ri as i32))
                            .expect("sampled row in logits_rows");
                        Some(j as i32)
                    } else {
                        None
                    };
                    ((row.start + row.q) as usize, pending)
                } else {
                    (r.num_computed, None)
                };
                let is_decode = match pending {
                    Some(_) => true,
                    None => ri == u32::MAX && r.state == RequestState::Decoding,
                };
                if is_decode != decodes {
                    continue;
                }
                if pending.is_some() && r.num_generated() + 1 >= r.max_new_tokens {
                    continue; // the pending token finishes it (length)
                }
                self.place_ahead(idx, start, pending, b);
            }
        }
        self.order_buf = order;
    }

    /// Place a running request in an ahead plan from `start` (its progress once the
    /// outstanding plan is applied); `pending` = index of its not yet known token among the
    /// outstanding plan's sampled tokens. Prefills shrink to the chunks available; a row that
    /// cannot get even one token's chunks is left out (stalled), never preempting.
    fn place_ahead(&mut self, idx: u32, start: usize, pending: Option<i32>, b: &mut Budget) {
        let r = self.req(idx);
        let known = r.tokens.len();
        let len = known + pending.is_some() as usize;
        debug_assert!(start < len);
        let mut q = b.clamp(start, len - start);
        if q == 0 {
            return;
        }
        let free = self.kv.num_free();
        let need = self.kv.need(r, start, q);
        if need > free {
            let fit = self.kv.fit(r, start, q);
            if fit == 0 {
                self.stats.stalled_requests += 1;
                self.stats.stalled_blocks += need - free;
                return;
            }
            q = fit;
        }
        let end = start + q;
        self.place_row(
            Row {
                req: idx,
                start: start as u32,
                q: q as u32,
                sampled: end == len,
                spec: 0,
            },
            true,
        );
        let r = self.reqs[idx as usize].as_ref().expect("live");
        let p = &mut self.plan;
        for pos in start..end {
            if pos < known {
                p.input_ids.push(r.tokens[pos] as i32);
            } else {
                let j = pending.expect("only the pending token is unknown");
                self.ahead_tokens.push((p.input_ids.len() as u32, j));
                p.input_ids.push(0);
            }
        }
        b.debit(start, q);
    }
}
