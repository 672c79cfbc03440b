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
/// `repr(C)` keeps the fields a decode step touches together in the first two cache lines;
/// the rest (id, stop lists, hashes, swap state) follows.
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
}

impl Request {
    /// Fill the hot copies of the stop conditions.
    pub fn init_stop_inline(&mut self) {
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
