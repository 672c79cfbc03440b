//! The steady decode path: when every running request decodes one token per step, the
//! previous plan is advanced in place (only the columns that move are written), and the
//! bindings reuse the previous step's request-name tuples. [`SteadyState`] is everything
//! this path carries from one call to the next.

use super::budget::Budget;
use super::Scheduler;
use crate::RequestState;

/// Shape of the newest plan, for the steady path.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) enum PlanShape {
    /// Anything else.
    #[default]
    General,
    /// A steady decode plan: full attention only, no swaps, one row per running request in
    /// running order, each one sampled token.
    Steady,
    /// A steady plan whose update finished and cancelled nothing, with no other plan
    /// outstanding: the next `schedule()` may advance it in place. Any other update, a
    /// `cancel()`, a `recompute()`, a `schedule()` or a `schedule_ahead()` ends it.
    Ready,
}

/// Shape of the last `update()`'s deltas.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) enum DeltaShape {
    /// Anything else.
    #[default]
    General,
    /// One delta per plan row, in row order.
    PerRow,
    /// One delta per plan row, in row order, for the same rows as the update before it
    /// (which was `PerRow` too): the same requests in the same order.
    Repeat,
}

/// What the steady path carries between calls: one value, set by `schedule()`,
/// `schedule_ahead()` and `update()`.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct SteadyState {
    pub plan: PlanShape,
    pub deltas: DeltaShape,
}

impl SteadyState {
    /// Whether the newest plan may be advanced in place by `schedule()`; ends that
    /// (`Ready` becomes `Steady`).
    #[inline]
    pub fn take_ready(&mut self) -> bool {
        let ready = self.plan == PlanShape::Ready;
        if ready {
            self.plan = PlanShape::Steady;
        }
        ready
    }

    /// Whether the newest plan is a steady decode plan.
    #[inline]
    pub fn is_steady(&self) -> bool {
        self.plan != PlanShape::General
    }

    /// Whether the last deltas repeat the requests of the deltas before them.
    pub fn deltas_repeat(&self) -> bool {
        self.deltas == DeltaShape::Repeat
    }
}

impl Scheduler {
    /// Whether the plan just built by `schedule()` is a steady decode plan (see
    /// [`PlanShape::Steady`]).
    pub(super) fn is_steady_plan(&self) -> bool {
        let l = self.kv.layout();
        let p = &self.plan;
        let n = p.rows.len();
        l.has_full
            && !l.has_sliding
            && p.swap_out.is_empty()
            && p.swap_in.is_empty()
            && n == self.running.len()
            && p.input_ids.len() == n
            && p.logits_indices.len() == n
            && p.rows.iter().zip(&self.running).all(|(r, &i)| r.req == i)
    }

    /// Whether `schedule_ahead()` may advance the outstanding plan in place: it is steady,
    /// still one row per running request in running order, and none of them is certain to
    /// finish with its pending token.
    pub(super) fn ahead_is_steady(&self) -> bool {
        self.steady.is_steady()
            && self.running.len() == self.plan.rows.len()
            && self.plan.rows.iter().zip(&self.running).all(|(row, &i)| {
                let r = self.req(i);
                row.req == i && r.num_generated() + 1 < r.max_new_tokens
            })
    }

    /// Phase 1 of a steady decode step, done in place on the previous plan: every running
    /// request was a sampled one-token row of it, none finished, was cancelled or preempted
    /// since ([`PlanShape::Ready`]), so the running rows are the same in the same order, one
    /// token further. Only the per-row columns that move are written (token, position,
    /// seqlen, slot); a row whose token starts a block gets a chunk (the pool is checked to
    /// have one for every row, so no preemption can be needed) and its block-table entry (a
    /// row that outgrows the table widens it: `build_block_tables` then rebuilds it).
    /// cu_seqlens_q / logits_* are unchanged. Returns false, having changed nothing, when
    /// the step is not that simple (the pool may run short, the cache-read budget binds).
    /// Admission then runs as usual and appends its rows.
    ///
    /// With `AHEAD` (from `schedule_ahead()`, the plan being the outstanding one): each row
    /// continues after its pending token, which is its input (a placeholder 0; the caller
    /// writes `prev_token_index`).
    pub(super) fn advance_steady<const AHEAD: bool>(&mut self, b: &mut Budget) -> bool {
        let n = self.plan.rows.len();
        if !self.steady.is_steady() || self.kv.num_free() < n {
            return false;
        }
        let seqlens_k = &self.plan.seqlens_k;
        if !b.take_decodes(n, || seqlens_k.iter().map(|&k| k as usize + 1).sum()) {
            return false;
        }
        let step = self.step;
        let page = self.cfg.page_size;
        let p = &mut self.plan;
        let width = p.full_width;
        let mut widen = false;
        debug_assert!(
            p.input_ids.len() == n
                && p.positions.len() == n
                && p.seqlens_k.len() == n
                && p.slot_mapping_full.len() == n
                && p.block_table_full.len() == n * width
        );
        for (i, row) in p.rows.iter_mut().enumerate() {
            let r = self.reqs[row.req as usize].as_mut().expect("live");
            let start = if AHEAD {
                row.start as usize + 1
            } else {
                r.num_computed
            };
            debug_assert!(if AHEAD {
                row.q == 1 && row.sampled && start == r.tokens.len()
            } else {
                r.state == RequestState::Decoding
                    && start == row.start as usize + 1
                    && start + 1 == r.tokens.len()
            });
            row.start = start as u32;
            r.touched_step = step;
            p.input_ids[i] = if AHEAD { 0 } else { r.last_token as i32 };
            p.positions[i] = start as i32;
            p.seqlens_k[i] = start as i32 + 1;
            // Blocks cover exactly the cached tokens, so the token starts a new block iff
            // the blocks are full; otherwise it follows the previous token in its block.
            if r.full.len() * page <= start {
                let c = self.kv.push_block(r);
                let len = r.full.len();
                if len > width {
                    widen = true;
                } else {
                    p.block_table_full[i * width + len - 1] = c as i32;
                }
                p.slot_mapping_full[i] = (c as usize * page) as i32;
            } else {
                p.slot_mapping_full[i] += 1;
            }
            debug_assert_eq!(
                p.slot_mapping_full[i],
                self.kv.layout().full_slot(&r.full, start)
            );
        }
        if widen {
            // Each row grows by at most one block.
            p.full_width = width + 1;
        }
        true
    }
}
