//! The budgets of one step: query tokens (`max_batch_tokens`), rows
//! (`max_requests_per_batch`) and cache reads (`max_batch_cache_tokens`, the sum of
//! `seqlens_k`). Every placement clamps to it and charges it the same way.

use super::SchedulerConfig;

/// What is left of a step's budgets.
#[derive(Clone, Copy, Debug)]
pub(super) struct Budget {
    tokens: usize,
    rows: usize,
    /// Cache reads left (`usize::MAX` when unlimited).
    cache: usize,
    cache_limited: bool,
}

impl Budget {
    /// The full budgets of a step.
    pub fn new(cfg: &SchedulerConfig) -> Self {
        Budget {
            tokens: cfg.max_batch_tokens,
            rows: cfg.max_requests_per_batch,
            cache: cfg.max_batch_cache_tokens.unwrap_or(usize::MAX),
            cache_limited: cfg.max_batch_cache_tokens.is_some(),
        }
    }

    /// No further row fits (no row or no token left).
    #[inline]
    pub fn exhausted(&self) -> bool {
        self.rows == 0 || self.tokens == 0
    }

    /// Query tokens a row may take from `start` (its cached tokens) with `remaining` tokens
    /// to feed: capped by the tokens left and by the cache reads left (a row of `q` tokens
    /// from `start` reads `start + q` keys). 0 when it cannot run.
    #[inline]
    pub fn clamp(&self, start: usize, remaining: usize) -> usize {
        remaining
            .min(self.tokens)
            .min(self.cache.saturating_sub(start))
    }

    /// Charge a placed row of `q` tokens from `start` (within [`Budget::clamp`]).
    #[inline]
    pub fn debit(&mut self, start: usize, q: usize) {
        debug_assert!(q >= 1 && q <= self.tokens && self.rows >= 1);
        self.tokens -= q;
        self.rows -= 1;
        self.cache = self.cache.saturating_sub(start + q);
    }

    /// Charge `n` one-token rows reading `reads()` keys in total (only evaluated when the
    /// cache-read budget is limited), if they all fit; else change nothing and return false.
    #[inline]
    pub fn take_decodes(&mut self, n: usize, reads: impl FnOnce() -> usize) -> bool {
        if n > self.rows.min(self.tokens) {
            return false;
        }
        if self.cache_limited {
            let reads = reads();
            if reads > self.cache {
                return false;
            }
            self.cache -= reads;
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
