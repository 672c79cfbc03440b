//! The budgets of one step: query tokens (`max_batch_tokens`), rows
//! (`max_requests_per_batch`), cache reads (`max_batch_cache_tokens`, the sum of
//! `seqlens_k`) and, when the step-time budget binds (`max_step_ms`), predicted
//! milliseconds. Every placement clamps to it and charges it the same way.
//!
//! The time budget never cuts a one-token row (a decode, or a prompt's last token): it caps
//! prefill chunks only. The first prefill row of a step after [`Budget::open_prefill`]
//! always gets at least one token (the step's prefills always progress).

use super::cost::{Coef, Geometry};
use super::SchedulerConfig;

/// The step-time part of a budget.
#[derive(Clone, Copy, Debug)]
pub(super) struct TimeBudget {
    /// Predicted milliseconds left.
    pub left_ms: f64,
    /// Held back by [`Budget::withhold`], given back by [`Budget::restore`].
    pub held_ms: f64,
    pub coef: Coef,
    pub geo: Geometry,
    /// The next prefill row gets at least one token.
    pub floor: bool,
    /// Milliseconds charged to rows of more than one token (prefill chunks).
    pub prefill_ms: f64,
    /// Milliseconds charged to the rest of the step: its fixed cost and its one-token rows
    /// (decodes).
    pub rest_ms: f64,
}

/// What is left of a step's budgets.
#[derive(Clone, Copy, Debug)]
pub(super) struct Budget {
    tokens: usize,
    rows: usize,
    /// Cache reads left (`usize::MAX` when unlimited).
    cache: usize,
    cache_limited: bool,
    /// The step-time budget, when it binds this step.
    pub time: Option<TimeBudget>,
}

impl Budget {
    /// The full budgets of a step.
    pub fn new(cfg: &SchedulerConfig) -> Self {
        Budget {
            tokens: cfg.max_batch_tokens,
            rows: cfg.max_requests_per_batch,
            cache: cfg.max_batch_cache_tokens.unwrap_or(usize::MAX),
            cache_limited: cfg.max_batch_cache_tokens.is_some(),
            time: None,
        }
    }

    /// Bind the step to `ms` predicted milliseconds (its fixed cost is charged now).
    pub fn with_time(mut self, ms: f64, coef: Coef, geo: Geometry) -> Self {
        self.time = Some(TimeBudget {
            left_ms: ms - coef.step_ms(),
            held_ms: 0.0,
            coef,
            geo,
            floor: false,
            prefill_ms: 0.0,
            rest_ms: coef.step_ms(),
        });
        self
    }

    /// The prefill rows start: they get at least `floor_ms` in all, and at least what the
    /// step's fixed cost and decodes were charged (even when the decodes used the step's
    /// time), and the first of them at least one token.
    pub fn open_prefill(&mut self, floor_ms: f64) {
        if let Some(t) = &mut self.time {
            t.left_ms = t.left_ms.max(floor_ms).max(t.rest_ms);
            t.floor = true;
        }
    }

    /// Milliseconds left for prefill rows (infinite without a time budget).
    pub fn time_left(&self) -> f64 {
        self.time.map_or(f64::INFINITY, |t| t.left_ms)
    }

    /// Predicted milliseconds of `q` query tokens from `start` (0 without a time budget).
    pub fn row_ms(&self, start: usize, q: usize) -> f64 {
        self.time
            .map_or(0.0, |t| t.coef.predict(&t.geo.row(start, q)))
    }

    /// Hold back up to `ms` of the time left (for a later row), until [`Budget::restore`].
    pub fn withhold(&mut self, ms: f64) {
        if let Some(t) = &mut self.time {
            let ms = ms.clamp(0.0, t.left_ms.max(0.0));
            t.left_ms -= ms;
            t.held_ms += ms;
        }
    }

    /// Give back what [`Budget::withhold`] held.
    pub fn restore(&mut self) {
        if let Some(t) = &mut self.time {
            t.left_ms += t.held_ms;
            t.held_ms = 0.0;
        }
    }

    /// No further row fits (no row or no token left).
    #[inline]
    pub fn exhausted(&self) -> bool {
        self.rows == 0 || self.tokens == 0
    }

    /// Query tokens a row may take from `start` (its cached tokens) with `remaining` tokens
    /// to feed: capped by the tokens left and by the cache reads left (a row of `q` tokens
    /// from `start` reads `start + q` keys). 0 when it cannot run (no row left included).
    /// With a time budget, a row of more than one token is also capped to the time left
    /// (at least one token for the floor row, see [`Budget::open_prefill`]).
    #[inline]
    pub fn clamp(&self, start: usize, remaining: usize) -> usize {
        if self.rows == 0 {
            return 0;
        }
        let q = remaining
            .min(self.tokens)
            .min(self.cache.saturating_sub(start));
        match &self.time {
            Some(t) if q > 1 => {
                let fit = t.coef.tokens_within(&t.geo, t.left_ms, start, q);
                if t.floor {
                    fit.max(1)
                } else {
                    fit
                }
            }
            _ => q,
        }
    }

    /// Charge a placed row of `q` tokens from `start` (within [`Budget::clamp`]).
    #[inline]
    pub fn debit(&mut self, start: usize, q: usize) {
        debug_assert!(q >= 1 && q <= self.tokens && self.rows >= 1);
        self.tokens -= q;
        self.rows -= 1;
        self.cache = self.cache.saturating_sub(start + q);
        if let Some(t) = &mut self.time {
            let ms = t.coef.predict(&t.geo.row(start, q));
            if q > 1 {
                t.prefill_ms += ms;
            } else {
                t.rest_ms += ms;
            }
            t.floor = false;
            t.left_ms -= ms;
        }
    }

    /// Charge `n` one-token rows reading `reads()` keys in total (only evaluated when the
    /// cache-read or the time budget is on), if they all fit; else change nothing and
    /// return false. The time budget never refuses decodes: it is charged their cost.
    #[inline]
    pub fn take_decodes(&mut self, n: usize, reads: impl FnOnce() -> usize) -> bool {
        if n > self.rows.min(self.tokens) {
            return false;
        }
        if self.cache_limited || self.time.is_some() {
            let reads = reads();
            if self.cache_limited {
                if reads > self.cache {
                    return false;
                }
                self.cache -= reads;
            }
            if let Some(t) = &mut self.time {
                let ms = t.coef.predict(&t.geo.decodes(n, reads));
                t.rest_ms += ms;
                t.left_ms -= ms;
            }
        }
        self.rows -= n;
        self.tokens -= n;
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(tokens: usize, rows: usize, cache: Option<usize>) -> SchedulerConfig {
        let mut c = SchedulerConfig::new(8, 4, tokens);
        c.max_requests_per_batch = rows;
        c.max_batch_cache_tokens = cache;
        c
    }

    #[test]
    fn clamp_and_debit() {
        let mut b = Budget::new(&cfg(10, 2, Some(20)));
        assert_eq!(b.clamp(0, 100), 10);
        assert_eq!(b.clamp(15, 100), 5, "reads of start + q keys");
        assert_eq!(b.clamp(25, 3), 0);
        b.debit(4, 6);
        assert_eq!(b.clamp(0, 100), 4);
        assert_eq!(b.clamp(8, 100), 2);
        assert!(!b.exhausted());
        b.debit(0, 1);
        assert!(b.exhausted(), "no rows left");
    }

    #[test]
    fn take_decodes_is_all_or_nothing() {
        let mut b = Budget::new(&cfg(4, 8, Some(10)));
        assert!(!b.take_decodes(5, || 0), "more rows than tokens");
        assert!(!b.take_decodes(2, || 11), "more reads than the budget");
        assert_eq!(b.clamp(0, 100), 4, "nothing charged");
        assert!(b.take_decodes(2, || 6));
        assert_eq!(b.clamp(0, 100), 2);
        assert_eq!(b.clamp(3, 100), 1);
        let mut b = Budget::new(&cfg(4, 8, None));
        assert!(b.take_decodes(4, || unreachable!("reads are not counted without a limit")));
        assert!(b.exhausted());
    }
}
