//! The pieces of `update()`: argument checks, settling the plan's flight, applying its
//! rows (in bulk when every row is live and sampled, else row by row), finishing requests
//! and reporting cancellations.

use super::steady::{DeltaShape, PlanShape};
use super::{PlanSlot, Scheduler};
use crate::request::{FinishReason, RequestState};
use crate::{Error, Result, Token};

impl Scheduler {
    /// `sampled` has one non-negative token per sampled row of the oldest outstanding plan
    /// (none without a plan).
    pub(super) fn check_sampled(&self, sampled: &[i32]) -> Result<()> {
        if self.outstanding > 0 {
            let want = if self.outstanding == 2 {
                self.old.sampled
            } else {
                self.cur.sampled
            };
            if sampled.len() != want {
                return Err(Error::invalid(
                    "sampled_token_ids",
                    format!(
                        "sampled_token_ids has {} entries but the plan samples {want} rows",
                        sampled.len(),
                    ),
                ));
            }
        } else if !sampled.is_empty() {
            return Err(Error::runtime(
                "update() called with tokens but no plan is outstanding (call schedule() first)",
            ));
        }
        if let Some(t) = sampled.iter().find(|&&t| t < 0) {
            return Err(Error::invalid(
                "sampled_token_ids",
                format!("sampled_token_ids must be non-negative (got {t})"),
            ));
        }
        Ok(())
    }

    /// Release what the flight of the plan in `slot` held; returns (and clears) its
    /// `dead_rows`.
    pub(super) fn settle(&mut self, slot: PlanSlot) -> bool {
        let f = match slot {
            PlanSlot::Oldest => &mut self.old,
            PlanSlot::Newest => &mut self.cur,
        };
        let dead = std::mem::take(&mut f.dead_rows);
        self.kv.release(&mut f.held);
        dead
    }

    /// Free the slab slots of finished requests reported earlier whose last plan has been
    /// updated (all of them when no plan is outstanding).
    pub(super) fn drop_reported(&mut self) {
        if self.to_remove.is_empty() {
            return;
        }
        let limit = if self.outstanding > 0 {
            self.upd_step
        } else {
            u64::MAX
        };
        let (reqs, free_idx) = (&mut self.reqs, &mut self.free_idx);
        self.to_remove.retain(|&(idx, last)| {
            if last < limit {
                reqs[idx as usize] = None;
                free_idx.push(idx);
                false
            } else {
                true
            }
        });
    }

    /// The bulk path: every row of the plan is live and sampled, so there is one delta per
    /// row, in row order, and the request / token / row columns are written at once.
    /// Returns whether a request finished.
    pub(super) fn update_every_row(
        &mut self,
        sampled: &[i32],
        oldest: PlanSlot,
        prev_deltas: DeltaShape,
    ) -> bool {
        let n = sampled.len();
        let out = &mut self.out;
        out.reqs.extend(self.plan.rows.iter().map(|r| r.req));
        out.token_ids.extend_from_slice(sampled);
        out.finished.resize(n, false);
        out.finish_reasons.resize(n, None);
        out.rows.extend(0..n as i32);
        self.stats.generated_tokens += n as u64;
        let mut any_finished = false;
        for (ri, &t) in sampled.iter().enumerate() {
            let row = self.plan.rows[ri];
            let r = self.reqs[row.req as usize].as_mut().expect("live");
            debug_assert!(r.state != RequestState::Finished);
            r.num_computed = (row.start + row.q) as usize;
            if self.kv.has_new_full_block(r) {
                self.kv.register(r);
            }
            r.state = RequestState::Decoding;
            if let Some(f) = r.append(t as Token) {
                self.out.finished[ri] = true;
                self.out.finish_reasons[ri] = Some(f);
                any_finished = true;
                self.finish(row.req, f);
            }
        }
        let two = oldest == PlanSlot::Oldest;
        if self.steady.plan == PlanShape::Steady && !any_finished && !two {
            self.steady.plan = PlanShape::Ready;
        }
        // Plans are updated in the order they were built: the previous update was the
        // plan built just before this one.
        self.steady.deltas = if prev_deltas != DeltaShape::General && self.flight(oldest).repeats {
            DeltaShape::Repeat
        } else {
            DeltaShape::PerRow
        };
        any_finished
    }

    /// The general path: rows in order, skipping those of finished requests (cancelled since
    /// the plan was built, or stopped in an earlier update), tokens only for sampled rows.
    /// Returns whether a request finished.
    #[inline(never)]
    pub(super) fn update_rows(&mut self, sampled: &[i32]) -> bool {
        let mut k = 0usize;
        let mut any_finished = false;
        self.out
            .reserve(self.plan.rows.len() + self.pending_cancel.len());
        for ri in 0..self.plan.rows.len() {
            let row = self.plan.rows[ri];
            if row.spec > 0 {
                let n = 1 + row.spec as usize;
                k += n;
                let live = self.req(row.req).state != RequestState::Finished;
                if live && self.apply_spec_row(ri, row, &sampled[k - n..k]) {
                    any_finished = true;
                }
                continue;
            }
            let tok = if row.sampled {
                k += 1;
                Some(sampled[k - 1])
            } else {
                None
            };
            let r = self.reqs[row.req as usize].as_mut().expect("live");
            if r.state == RequestState::Finished {
                // Cancelled since the plan was built, or stopped in an earlier update.
                continue;
            }
            r.num_computed = (row.start + row.q) as usize;
            if self.kv.has_new_full_block(r) {
                self.kv.register(r);
            }
            if let Some(t) = tok {
                r.state = RequestState::Decoding;
                let fin = r.append(t as Token);
                self.stats.generated_tokens += 1;
                self.out.push(row.req, t, fin, ri as i32);
                if let Some(f) = fin {
                    any_finished = true;
                    self.finish(row.req, f);
                }
            }
        }
        any_finished
    }

    /// A request finished in the update of the plan built in step `self.upd_step`: free its
    /// chunks, unless a newer outstanding plan has a row of it (then they are held for that
    /// plan and freed by its update); its slab slot goes at a later update (the deltas still
    /// name it, and the newer plan's update must still see it finished).
    #[cold]
    #[inline(never)]
    pub(super) fn finish(&mut self, idx: u32, f: FinishReason) {
        let r = self.reqs[idx as usize].as_mut().expect("live");
        r.state = RequestState::Finished;
        r.finish = Some(f);
        let last = r.touched_step;
        if last > self.upd_step {
            debug_assert!(self.outstanding == 2 && last == self.cur.step);
            self.kv.defer_free(r, &mut self.cur.held);
        } else {
            self.kv.free(r);
        }
        let r = self.reqs[idx as usize].as_ref().expect("live");
        self.ids.remove(&r.id);
        self.to_remove.push((idx, last));
        self.stats.finished += 1;
    }

    /// Report every cancellation since the last update (one delta each, no token).
    pub(super) fn report_cancellations(&mut self) {
        for idx in std::mem::take(&mut self.pending_cancel) {
            self.out.push(idx, -1, Some(FinishReason::Cancelled), -1);
            let r = self.req(idx);
            let (id, last) = (r.id.clone(), r.touched_step);
            self.ids.remove(&id);
            self.to_remove.push((idx, last));
            self.stats.finished += 1;
        }
    }
}
