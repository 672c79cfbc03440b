//! Phase 3: the plan's arrays from the placed rows (`positions`, `cu_seqlens_q`,
//! `seqlens_k`, `logits_*`, block tables and full-attention slots; tokens and sliding slots
//! were written as the rows were placed).

use super::Scheduler;
use crate::plan::StepPlan;

/// Write `positions`, `cu_seqlens_q`, `seqlens_k`, `logits_indices` and `logits_rows`
/// from the placed rows, column by column (a steady decode step: every row one sampled
/// token, so most columns are plain ranges).
pub(super) fn fill_row_arrays(p: &mut StepPlan, from: usize) {
    let rows = &p.rows;
    let b = rows.len();
    if from > 0 {
        // Rows `..from` are written (one token each); append the others'.
        let mut cum = from as i32;
        for (i, r) in rows.iter().enumerate().skip(from) {
            p.positions.extend(r.start as i32..(r.start + r.q) as i32);
            cum += r.q as i32;
            p.cu_seqlens_q.push(cum);
            p.seqlens_k.push((r.start + r.q) as i32);
            if r.sampled {
                for j in cum - 1 - r.spec as i32..cum {
                    p.logits_indices.push(j);
                    p.logits_rows.push(i as i32);
                }
            }
        }
        return;
    }
    p.seqlens_k
        .extend(rows.iter().map(|r| (r.start + r.q) as i32));
    if p.input_ids.len() == b {
        // One token per row (every row has q >= 1).
        p.positions.extend(rows.iter().map(|r| r.start as i32));
        p.cu_seqlens_q.extend(1..=b as i32);
        if rows.iter().all(|r| r.sampled) {
            p.logits_indices.extend(0..b as i32);
            p.logits_rows.extend(0..b as i32);
        } else {
            for (i, r) in rows.iter().enumerate() {
                if r.sampled {
                    p.logits_indices.push(i as i32);
                    p.logits_rows.push(i as i32);
                }
            }
        }
        return;
    }
    p.positions.reserve(p.input_ids.len());
    let mut cum = 0i32;
    for (i, r) in rows.iter().enumerate() {
        p.positions.extend(r.start as i32..(r.start + r.q) as i32);
        cum += r.q as i32;
        p.cu_seqlens_q.push(cum);
        if r.sampled {
            for j in cum - 1 - r.spec as i32..cum {
                p.logits_indices.push(j);
                p.logits_rows.push(i as i32);
            }
        }
    }
}

impl Scheduler {
    /// Block tables of every row, and full-attention slots of rows `from..` (rows `..from`
    /// were advanced in place: their table rows are valid unless the width changed).
    pub(super) fn build_block_tables(&mut self, from: usize) {
        let layout = *self.kv.layout();
        let reqs = &self.reqs;
        let p = &mut self.plan;
        if p.has_full {
            // `full_width` was tracked by `emit_row` / `advance_steady`.
            let width = p.full_width;
            // Rows whose table row is already laid out at this width.
            let valid = if p.block_table_full.len() == from * width {
                from
            } else {
                0
            };
            if valid == p.rows.len() {
                // A steady step with nothing appended and no widening (full attention only).
                debug_assert!(!p.has_sliding);
                return;
            }
            // Zero-filled (the padding), then each row's blocks copied into its slice.
            p.block_table_full.truncate(valid * width);
            p.block_table_full.resize(width * p.rows.len(), 0);
            p.slot_mapping_full.reserve(p.input_ids.len());
            let page = layout.page;
            // Every row holds at least one block, so `width >= 1` here.
            for (i, (row, dst)) in p
                .rows
                .iter()
                .zip(p.block_table_full.chunks_exact_mut(width.max(1)))
                .enumerate()
                .skip(valid)
            {
                if let Some(next) = p.rows.get(i + 4) {
                    let f = &reqs[next.req as usize].as_ref().expect("live").full;
                    if !f.is_empty() {
                        crate::hint::prefetch(f.as_ptr());
                    }
                }
                let full = &reqs[row.req as usize].as_ref().expect("live").full;
                dst[..full.len()].copy_from_slice(crate::chunk_ids_as_i32(full));
                if i < from {
                    continue;
                }
                let start = row.start as usize;
                if row.q == 1 {
                    // The token lives in the last block (blocks are allocated as needed).
                    let bi = full.len() - 1;
                    p.slot_mapping_full
                        .push((full[bi] as usize * page + (start - bi * page)) as i32);
                } else {
                    for pos in start..start + row.q as usize {
                        p.slot_mapping_full.push(layout.full_slot(full, pos));
                    }
                }
            }
        }
        if p.has_sliding {
            p.sliding_width = layout.ring;
            for row in p.rows.iter().skip(from) {
                let ring = &reqs[row.req as usize].as_ref().expect("live").ring;
                p.block_table_sliding.extend(ring.iter().map(|&c| c as i32));
                p.block_table_sliding
                    .extend(std::iter::repeat_n(0, layout.ring - ring.len()));
            }
        }
    }
}
