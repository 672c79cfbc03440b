//! Step plan and step output buffers. Both are owned by the scheduler and reused between
//! steps (cleared, never shrunk), so steady-state steps do not allocate.
//!
//! Layout of every field: ARCHITECTURE.md §3. Request ids are not stored here: `rows[r].req`
//! is the request's slab index ([`crate::Scheduler::request`]); the bindings map it to a
//! cached Python string.

use crate::request::FinishReason;

/// One batch row.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Row {
    /// Slab index of the request.
    pub req: u32,
    /// Tokens cached before the step (= first new position).
    pub start: u32,
    /// Query tokens in this step.
    pub q: u32,
    /// Whether the row's last token is sampled.
    pub sampled: bool,
    /// Speculative tokens after the row's first token (a decode row of `1 + spec` query
    /// tokens, each of them sampled: `1 + spec` `logits_indices` entries).
    pub spec: u32,
}

/// The step plan (ARCHITECTURE.md §3). Arrays are flat; `block_table_*` are row-major
/// `[rows, width]`, `swap_*` are flat `(a, b)` pairs.
#[derive(Clone, Debug, Default)]
pub struct StepPlan {
    pub rows: Vec<Row>,
    pub input_ids: Vec<i32>,
    pub positions: Vec<i32>,
    pub cu_seqlens_q: Vec<i32>,
    pub seqlens_k: Vec<i32>,
    pub logits_indices: Vec<i32>,
    pub logits_rows: Vec<i32>,
    pub has_full: bool,
    pub has_sliding: bool,
    pub slot_mapping_full: Vec<i32>,
    pub slot_mapping_sliding: Vec<i32>,
    pub block_table_full: Vec<i32>,
    pub full_width: usize,
    pub block_table_sliding: Vec<i32>,
    pub sliding_width: usize,
    /// `(device chunk, swap slot)` pairs.
    pub swap_out: Vec<i32>,
    /// `(swap slot, device chunk)` pairs.
    pub swap_in: Vec<i32>,
    /// Per query token: `-1` when `input_ids` holds its id, else the index (in the previous
    /// plan's `logits_indices` order) of the previous plan's sampled token that is its input
    /// id (`input_ids` holds 0 there). Empty means all `-1` (every plan from `schedule()`).
    pub prev_token_index: Vec<i32>,
    /// Built by `schedule_ahead()` (one step ahead of an outstanding plan).
    pub ahead: bool,
}

impl StepPlan {
    pub fn clear(&mut self) {
        self.rows.clear();
        self.input_ids.clear();
        self.positions.clear();
        self.cu_seqlens_q.clear();
        self.cu_seqlens_q.push(0);
        self.seqlens_k.clear();
        self.logits_indices.clear();
        self.logits_rows.clear();
        self.slot_mapping_full.clear();
        self.slot_mapping_sliding.clear();
        self.block_table_full.clear();
        self.block_table_sliding.clear();
        self.full_width = 0;
        self.sliding_width = 0;
        self.swap_out.clear();
        self.swap_in.clear();
        self.prev_token_index.clear();
        self.ahead = false;
    }
    /// Copy every array but `rows` into `spare`, reusing its buffers' capacity.
    pub fn copy_arrays_to(&self, spare: &mut StepPlan) {
        spare.rows.clear();
        spare.input_ids.clone_from(&self.input_ids);
        spare.positions.clone_from(&self.positions);
        spare.cu_seqlens_q.clone_from(&self.cu_seqlens_q);
        spare.seqlens_k.clone_from(&self.seqlens_k);
        spare.logits_indices.clone_from(&self.logits_indices);
        spare.logits_rows.clone_from(&self.logits_rows);
        spare.slot_mapping_full.clone_from(&self.slot_mapping_full);
        spare
            .slot_mapping_sliding
            .clone_from(&self.slot_mapping_sliding);
        spare.block_table_full.clone_from(&self.block_table_full);
        spare
            .block_table_sliding
            .clone_from(&self.block_table_sliding);
        spare.swap_out.clone_from(&self.swap_out);
        spare.swap_in.clone_from(&self.swap_in);
        spare.prev_token_index.clone_from(&self.prev_token_index);
        spare.ahead = self.ahead;
        spare.has_full = self.has_full;
        spare.has_sliding = self.has_sliding;
        spare.full_width = self.full_width;
        spare.sliding_width = self.sliding_width;
    }
    /// B.
    pub fn num_rows(&self) -> usize {
        self.rows.len()
    }
    /// T.
    pub fn num_tokens(&self) -> usize {
        self.input_ids.len()
    }
    /// N.
    pub fn num_sampled(&self) -> usize {
        self.logits_indices.len()
    }
    /// `prev_token_index[t]` (`-1` when the array is empty: a plan from `schedule()`).
    pub fn prev_token(&self, t: usize) -> i32 {
        self.prev_token_index.get(t).copied().unwrap_or(-1)
    }
}

/// Deltas of one `update()`: parallel arrays, one entry per request that got a token or
/// finished. `token_ids[i] == -1` when the delta carries no token (a cancellation).
#[derive(Clone, Debug, Default)]
pub struct StepOutput {
    /// Slab index of the request (valid for [`crate::Scheduler::request`] until the next
    /// `update()`).
    pub reqs: Vec<u32>,
    pub token_ids: Vec<i32>,
    pub finished: Vec<bool>,
    pub finish_reasons: Vec<Option<FinishReason>>,
    /// Plan row the token came from (`-1` for cancellations).
    pub rows: Vec<i32>,
    /// True when every delta has exactly one token.
    pub all_have_token: bool,
}

impl StepOutput {
    pub fn clear(&mut self) {
        self.reqs.clear();
        self.token_ids.clear();
        self.finished.clear();
        self.finish_reasons.clear();
        self.rows.clear();
        self.all_have_token = true;
    }
    pub fn reserve(&mut self, n: usize) {
        self.reqs.reserve(n);
        self.token_ids.reserve(n);
        self.finished.reserve(n);
        self.finish_reasons.reserve(n);
        self.rows.reserve(n);
    }
    #[inline(always)]
    pub fn push(&mut self, req: u32, token: i32, finish: Option<FinishReason>, row: i32) {
        self.reqs.push(req);
        self.token_ids.push(token);
        self.finished.push(finish.is_some());
        self.finish_reasons.push(finish);
        self.rows.push(row);
        if token < 0 {
            self.all_have_token = false;
        }
    }
    pub fn len(&self) -> usize {
        self.reqs.len()
    }
    pub fn is_empty(&self) -> bool {
        self.reqs.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan() -> StepPlan {
        let mut p = StepPlan {
            has_full: true,
            ..Default::default()
        };
        p.clear();
        p.rows.push(Row {
            req: 3,
            start: 4,
            q: 2,
            sampled: true,
            spec: 0,
        });
        p.input_ids.extend([7, 8]);
        p.positions.extend([4, 5]);
        p.cu_seqlens_q.push(2);
        p.seqlens_k.push(6);
        p.logits_indices.push(1);
        p.logits_rows.push(0);
        p.slot_mapping_full.extend([20, 21]);
        p.block_table_full.extend([5, 0]);
        p.full_width = 2;
        p.swap_out.extend([9, 0]);
        p.prev_token_index.extend([-1, 0]);
        p.ahead = true;
        p
    }

    #[test]
    fn counts_and_prev_token() {
        let p = plan();
        assert_eq!((p.num_rows(), p.num_tokens(), p.num_sampled()), (1, 2, 1));
        assert_eq!((p.prev_token(0), p.prev_token(1)), (-1, 0));
        let mut q = p.clone();
        q.prev_token_index.clear();
        assert_eq!(q.prev_token(1), -1, "empty means all -1");
    }

    #[test]
    fn clear_keeps_flags_and_leaves_one_cu_seqlen() {
        let mut p = plan();
        p.clear();
        assert_eq!(p.cu_seqlens_q, vec![0]);
        assert!(p.rows.is_empty() && p.input_ids.is_empty() && p.swap_out.is_empty());
        assert_eq!((p.full_width, p.ahead), (0, false));
        assert!(p.has_full, "attention kinds are fixed per scheduler");
    }

    #[test]
    fn copy_arrays_to_copies_everything_but_rows() {
        let p = plan();
        let mut spare = StepPlan::default();
        spare.rows.push(p.rows[0]);
        p.copy_arrays_to(&mut spare);
        assert!(spare.rows.is_empty());
        let mut want = p.clone();
        want.rows.clear();
        assert_eq!(format!("{spare:?}"), format!("{want:?}"));
    }

    #[test]
    fn output_push_and_clear() {
        let mut o = StepOutput::default();
        o.clear();
        assert!(o.is_empty() && o.all_have_token);
        o.reserve(2);
        o.push(1, 5, None, 0);
        o.push(2, -1, Some(FinishReason::Cancelled), -1);
        assert_eq!(o.len(), 2);
        assert_eq!(o.finished, vec![false, true]);
        assert!(!o.all_have_token, "a cancellation carries no token");
        o.clear();
        assert!(o.is_empty() && o.all_have_token);
    }
}
