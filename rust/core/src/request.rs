//! Request state, token ids, stop conditions and progress.
//!
//! A request's `tokens` are its prompt followed by its generated tokens. `num_computed`
//! tokens have their K/V in the cache (or in the swap pool while `Swapped`). The tokens still
//! to feed are `tokens[num_computed..]`; a step whose row reaches `tokens.len()` is sampled.
//! After a soft reset `num_computed = 0`: the generated tokens are simply recomputed as part
//! of the prompt ("compute prompt" = all tokens), and the output is unchanged.

use crate::{ChunkId, Token};

/// Lifecycle: `Waiting → Prefilling → Decoding → Finished`, with `Swapped` and the way back
/// to `Waiting` (soft reset) on preemption.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RequestState {
    /// Pending: never ran, or soft-reset (holds no chunks).
    Waiting,
    /// Admitted, prompt (or compute prompt) not fully computed yet.
    Prefilling,
    /// Every token but the last sampled one is cached; one token per step.
    Decoding,
    /// Offloaded to the CPU swap pool (holds swap slots, no device chunks).
    Swapped,
    /// Done (finished, or cancelled).
    Finished,
}

impl RequestState {
    pub fn as_str(self) -> &'static str {
        match self {
            RequestState::Waiting => "waiting",
            RequestState::Prefilling => "prefilling",
            RequestState::Decoding => "decoding",
            RequestState::Swapped => "swapped",
            RequestState::Finished => "finished",
        }
    }
}

/// Why a request finished.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FinishReason {
    /// EOS, a stop token id or a stop token sequence was generated.
    Stop,
    /// `max_new_tokens` reached.
    Length,
    /// `cancel()`ed.
    Cancelled,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Cancelled => "cancelled",
        }
    }
}

/// Stop conditions of a request.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StopConditions {
    pub max_new_tokens: usize,
    pub eos_token_ids: Vec<Token>,
    pub stop_token_ids: Vec<Token>,
    /// Token sequences that stop generation when the generated tokens end with one of them.
    pub stop_sequences: Vec<Vec<Token>>,
}

/// One request (owned by the scheduler's slab).
///
/// `repr(C)` keeps the fields a decode step touches together in the first three 64-byte
/// cache lines (the hot fields end at byte 135 on 64-bit targets: three `Vec`s of 24 bytes,
/// five `usize`/`u64`, then the inline stop ids; checked by a test); the rest (id, stop
/// lists, hashes, swap state) follows.
#[derive(Clone, Debug)]
#[repr(C)]
pub struct Request {
    // --- hot: read or written by every decode step ---
    pub tokens: Vec<Token>,
    /// Full-attention blocks (block `i` holds positions `i*page .. (i+1)*page`).
    pub full: Vec<ChunkId>,
    /// Sliding ring chunks.
    pub ring: Vec<ChunkId>,
    pub num_computed: usize,
    pub prompt_len: usize,
    /// Copy of `stop.max_new_tokens`.
    pub max_new_tokens: usize,
    /// Leading full blocks already offered to the prefix cache.
    pub num_registered: usize,
    /// Step in which the request was last placed in a batch or preempted.
    pub touched_step: u64,
    /// `*tokens.last()`, kept inline so a decode step does not touch the token array.
    pub last_token: Token,
    /// EOS and stop token ids inline when there are at most 4 of them (`n_stop_inline`
    /// entries; `u8::MAX` = use the vectors), so the per-token check stays in this struct.
    pub stop_inline: [Token; 4],
    pub n_stop_inline: u8,
    pub has_stop_sequences: bool,
    pub state: RequestState,
    // --- cold ---
    pub id: String,
    /// Queue key: (priority, arrival). Lower runs first.
    pub key: (i64, u64),
    pub stop: StopConditions,
    pub finish: Option<FinishReason>,
    /// While `Swapped`: slots of `full` then `ring` (lengths `n_full_swapped`, rest ring).
    pub swap_slots: Vec<u32>,
    pub n_full_swapped: usize,
    /// Chained hashes of the first full blocks of `tokens` (computed lazily, kept).
    pub block_hashes: Vec<u64>,
    /// Never take prefix-cache hits (every prompt position is computed).
    pub skip_prefix_lookup: bool,
    /// Times a request of higher priority preempted it (`priority_preemption`); at
    /// `MAX_PRIORITY_PREEMPTIONS` it is no longer a priority victim.
    pub priority_preemptions: u32,
    /// Prefix-cache namespace (0: none): blocks are shared only between requests of the same
    /// salt (a LoRA adapter's requests compute other keys and values for the same tokens).
    pub cache_salt: u64,
    /// Part of an offline batch (`Engine.generate`): its caller waits for the whole batch,
    /// not on any step, so the step-time budget does not bind for offline requests alone.
    pub offline: bool,
    /// Speculative tokens proposed for the next `schedule()` (`Scheduler::propose`; it
    /// consumes them whether or not it uses them).
    pub proposal: Vec<Token>,
    /// Lowest position from which every key up to the last one a plan wrote is in the
    /// sliding ring (rejected speculative tokens' writes count; 0 once the ring is freed).
    /// A step ending at `end` keeps only `end - w ..` of its new keys and overwrites slots
    /// `R * page` back, so `rewind` may only cut back to where this floor still serves.
    pub ring_floor: usize,
    /// Steps its admission was put off to share a block another request's prefill was
    /// computing (at most [`crate::scheduler::MAX_ADMISSION_DEFERRALS`]).
    pub admission_deferrals: u32,
}

impl Request {
    /// A waiting request with nothing computed. `key` = (priority, arrival); `tokens` is
    /// the prompt (not empty).
    pub fn new(
        id: String,
        key: (i64, u64),
        tokens: Vec<Token>,
        stop: StopConditions,
        skip_prefix_lookup: bool,
    ) -> Self {
        let mut r = Request {
            id,
            key,
            prompt_len: tokens.len(),
            last_token: *tokens.last().expect("a non-empty prompt"),
            tokens,
            num_computed: 0,
            stop,
            state: RequestState::Waiting,
            finish: None,
            full: Vec::new(),
            ring: Vec::new(),
            swap_slots: Vec::new(),
            n_full_swapped: 0,
            block_hashes: Vec::new(),
            num_registered: 0,
            touched_step: 0,
            stop_inline: [0; 4],
            n_stop_inline: 0,
            max_new_tokens: 0,
            has_stop_sequences: false,
            skip_prefix_lookup,
            cache_salt: 0,
            offline: false,
            priority_preemptions: 0,
            proposal: Vec::new(),
            ring_floor: 0,
            admission_deferrals: 0,
        };
        r.init_stop_inline();
        r
    }

    /// Fill the hot copies of the stop conditions.
    fn init_stop_inline(&mut self) {
        self.max_new_tokens = self.stop.max_new_tokens;
        self.has_stop_sequences = !self.stop.stop_sequences.is_empty();
        let n = self.stop.eos_token_ids.len() + self.stop.stop_token_ids.len();
        if n <= 4 {
            for (i, &t) in self
                .stop
                .eos_token_ids
                .iter()
                .chain(&self.stop.stop_token_ids)
                .enumerate()
            {
                self.stop_inline[i] = t;
            }
            self.n_stop_inline = n as u8;
        } else {
            self.n_stop_inline = u8::MAX;
        }
    }

    /// Number of generated tokens.
    #[inline]
    pub fn num_generated(&self) -> usize {
        self.tokens.len() - self.prompt_len
    }

    /// Append a sampled token and return the finish reason it causes, if any.
    /// Stop (EOS, stop ids, stop sequences) wins over length.
    #[inline(always)]
    pub fn append(&mut self, t: Token) -> Option<FinishReason> {
        self.tokens.push(t);
        self.last_token = t;
        let s = &self.stop;
        let hit = if self.n_stop_inline != u8::MAX {
            self.stop_inline[..self.n_stop_inline as usize].contains(&t)
        } else {
            s.eos_token_ids.contains(&t) || s.stop_token_ids.contains(&t)
        };
        if hit {
            return Some(FinishReason::Stop);
        }
        if self.has_stop_sequences {
            let gen = &self.tokens[self.prompt_len..];
            if s.stop_sequences.iter().any(|q| gen.ends_with(q)) {
                return Some(FinishReason::Stop);
            }
        }
        if self.num_generated() >= self.max_new_tokens {
            return Some(FinishReason::Length);
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(prompt: Vec<Token>, stop: StopConditions) -> Request {
        Request::new("r".into(), (0, 0), prompt, stop, false)
    }

    fn stop(max_new_tokens: usize) -> StopConditions {
        StopConditions {
            max_new_tokens,
            ..Default::default()
        }
    }

    #[test]
    fn new_is_waiting_with_the_prompt() {
        let r = req(vec![5, 6, 7], stop(3));
        assert_eq!(r.state, RequestState::Waiting);
        assert_eq!((r.prompt_len, r.last_token, r.num_generated()), (3, 7, 0));
        assert_eq!(r.max_new_tokens, 3);
        assert!(r.full.is_empty() && r.ring.is_empty() && r.swap_slots.is_empty());
    }

    #[test]
    fn length_stop_at_max_new_tokens() {
        let mut r = req(vec![1], stop(3));
        assert_eq!(r.append(4), None);
        assert_eq!(r.append(4), None);
        assert_eq!(r.append(4), Some(FinishReason::Length));
        assert_eq!(r.tokens, vec![1, 4, 4, 4]);
        assert_eq!(r.last_token, 4);
    }

    #[test]
    fn eos_and_stop_ids_inline_and_in_vectors() {
        for n in [1usize, 4, 5, 9] {
            // n stop ids in total: inline up to 4, in the vectors beyond.
            let mut s = stop(100);
            s.eos_token_ids = vec![100];
            s.stop_token_ids = (101..100 + n as u32).collect();
            let mut r = req(vec![1], s.clone());
            assert_eq!(r.n_stop_inline == u8::MAX, n > 4);
            assert_eq!(r.append(7), None);
            assert_eq!(r.append(100), Some(FinishReason::Stop), "eos, n={n}");
            let mut r = req(vec![1], s);
            let last = 99 + n as u32;
            if n > 1 {
                assert_eq!(r.append(last), Some(FinishReason::Stop), "stop id, n={n}");
            }
        }
    }

    #[test]
    fn stop_sequences_match_generated_tokens_only() {
        let mut s = stop(100);
        s.stop_sequences = vec![vec![3, 4], vec![9]];
        // The prompt ends with 3: a generated 4 alone does not complete [3, 4].
        let mut r = req(vec![1, 3], s.clone());
        assert_eq!(r.append(4), None);
        assert_eq!(r.append(3), None);
        assert_eq!(r.append(4), Some(FinishReason::Stop));
        let mut r = req(vec![1], s);
        assert_eq!(r.append(9), Some(FinishReason::Stop));
    }

    #[test]
    fn stop_wins_over_length() {
        let mut s = stop(1);
        s.eos_token_ids = vec![2];
        let mut r = req(vec![1], s.clone());
        assert_eq!(r.append(2), Some(FinishReason::Stop));
        s.eos_token_ids.clear();
        s.stop_sequences = vec![vec![2]];
        let mut r = req(vec![1], s);
        assert_eq!(r.append(2), Some(FinishReason::Stop));
    }

    #[test]
    fn hot_fields_fill_three_cache_lines() {
        use std::mem::offset_of;
        let hot_end = offset_of!(Request, state) + std::mem::size_of::<RequestState>();
        assert!(
            hot_end > 128 && hot_end <= 192,
            "hot fields end at {hot_end}"
        );
        assert_eq!(offset_of!(Request, tokens), 0);
        assert!(offset_of!(Request, id) >= hot_end);
    }

    #[test]
    fn names() {
        assert_eq!(RequestState::Swapped.as_str(), "swapped");
        assert_eq!(FinishReason::Cancelled.as_str(), "cancelled");
    }
}
