"""The Rust core of ferrobatch (PyO3 extension): scheduler, paged KV-cache allocator, CPU kernels.

Bad values raise `ferrobatch.errors.FieldError` (a ValueError whose `.field` names the
argument); calls at the wrong time and broken invariants raise RuntimeError. The step
contract (what a `StepPlan` holds) is ARCHITECTURE.md section 3.
"""

from collections.abc import Iterable, Iterator, Sequence
from typing import Literal, TypedDict, final

import numpy as np
import numpy.typing as npt

__version__: str
"""The crate version."""
ZERO_CHUNK: int
"""The chunk padding reads point to (never written)."""
SCRATCH_CHUNK: int
"""The chunk padding writes and discarded sliding-window writes go to (never read)."""

_AttentionType = Literal["full_attention", "sliding_attention"]
_FinishReason = Literal["stop", "length", "cancelled"]
_Int32Array = npt.NDArray[np.int32]
_TokenIds = Sequence[int] | npt.NDArray[np.int32] | npt.NDArray[np.int64]
_Indices = npt.NDArray[np.int32] | npt.NDArray[np.int64]

class _Stats(TypedDict):
    """`Scheduler.stats()`: counters and gauges."""

    num_blocks: int
    num_free_blocks: int
    num_cached_blocks: int
    num_used_blocks: int
    waiting: int
    running: int
    swapped: int
    finished: int
    prefix_hit_tokens: int
    deferred_admissions: int
    prompt_tokens: int
    num_preemptions: int
    num_offloads: int
    num_soft_resets: int
    num_recomputes: int
    num_evictions: int
    num_swap_free: int
    cpu_offload_blocks: int
    steps: int
    generated_tokens: int
    stalled_requests: int
    stalled_blocks: int
    spec_rows: int
    spec_proposed: int
    spec_accepted: int
    prefix_caching: bool
    time_budget_steps: int
    prefill_budget_ms: float
    prefill_budget_tokens: int
    step_predicted_ms: float
    cost_samples: int
    cost_ms_per_step: float
    cost_ms_per_token: float
    cost_ms_per_row: float
    cost_ms_per_kkey_full: float
    cost_ms_per_kkey_sliding: float

class _RequestSnapshot(TypedDict):
    """One unfinished request in `Scheduler.snapshot()["requests"]`."""

    state: Literal["waiting", "prefilling", "decoding", "swapped"]
    num_computed_tokens: int
    num_tokens: int
    num_prompt_tokens: int
    num_generated_tokens: int
    priority: int
    arrival: int
    blocks: dict[_AttentionType, list[int]]
    swap_slots: list[int]

class _Snapshot(TypedDict):
    """`Scheduler.snapshot()`: the whole state, for outside checks."""

    num_blocks: int
    page_size: int
    ring_size: int
    sliding_window: int | None
    prefix_caching: bool
    safety_margin: float
    outstanding: bool
    num_outstanding: int
    deferred_chunks: list[int]
    refcounts: list[int]
    free_chunks: list[int]
    cached_chunks: list[int]
    hashed_chunks: list[int]
    swap_free_slots: list[int]
    swap_deferred_slots: list[int]
    requests: dict[str, _RequestSnapshot]

@final
class StepPlan:
    """One step of work for the model runner; every attribute is built once, then cached."""

    @property
    def request_ids(self) -> list[str]:
        """[B]: the requests in batch order."""
    @property
    def input_ids(self) -> _Int32Array:
        """int32 [T]: token ids, rows concatenated in batch order."""
    @property
    def positions(self) -> _Int32Array:
        """int32 [T]: absolute position of each token in its request."""
    @property
    def cu_seqlens_q(self) -> _Int32Array:
        """int32 [B+1]: row r owns tokens `cu_seqlens_q[r] .. cu_seqlens_q[r+1]`."""
    @property
    def seqlens_k(self) -> _Int32Array:
        """int32 [B]: keys visible to the row's last token (cached before this step + new)."""
    @property
    def logits_indices(self) -> _Int32Array:
        """int32 [N]: token indices (into T) whose next token is sampled."""
    @property
    def logits_rows(self) -> _Int32Array:
        """int32 [N]: batch row of each sampled token (ascending)."""
    @property
    def slot_mapping(self) -> dict[_AttentionType, _Int32Array]:
        """{attention type: int32 [T]}: slot each new token's K/V is written to."""
    @property
    def block_tables(self) -> dict[_AttentionType, _Int32Array]:
        """{attention type: int32 [B, W]}: chunk ids per row, padded with 0."""
    @property
    def swap_out(self) -> _Int32Array:
        """int32 [n, 2]: (device chunk, swap slot) pairs, copied before swap_in and the forward."""
    @property
    def swap_in(self) -> _Int32Array:
        """int32 [n, 2]: (swap slot, device chunk) pairs, copied after swap_out."""
    @property
    def prev_token_index(self) -> _Int32Array:
        """int32 [T]: -1, or the previous plan's sampled token that is this token's input id."""
    @property
    def ahead(self) -> bool:
        """True for plans from `schedule_ahead()`."""
    @property
    def num_rows(self) -> int:
        """Rows B."""
    @property
    def num_tokens(self) -> int:
        """Query tokens T."""
    @property
    def num_sampled(self) -> int:
        """Sampled rows N (entries of `logits_indices`)."""
    @property
    def page_size(self) -> int:
        """Tokens per chunk."""

@final
class Delta:
    """One request's news in an update: its new tokens and whether it finished."""

    @property
    def request_id(self) -> str:
        """The request this delta is about."""
    @property
    def new_token_ids(self) -> list[int]:
        """Tokens generated since the last update (the stop or EOS token included)."""
    @property
    def finished(self) -> bool:
        """Whether the request finished in this update."""
    @property
    def finish_reason(self) -> _FinishReason | None:
        """The reason once finished ("stop", "length" or "cancelled"), else None."""

@final
class StepOutput:
    """The result of `update()`: a sequence of deltas (built on access) plus array views."""

    def __len__(self) -> int:
        """Deltas n."""
    def __getitem__(self, i: int) -> Delta:
        """The i-th delta (negative i counts from the end)."""
    def __iter__(self) -> Iterator[Delta]:
        """The deltas in order."""
    @property
    def request_ids(self) -> list[str]:
        """[n]: the request of each delta."""
    @property
    def token_ids(self) -> _Int32Array:
        """int32 [n]: each delta's token, -1 for a delta without one (a cancellation)."""
    @property
    def finished(self) -> npt.NDArray[np.bool_]:
        """bool [n]: whether each delta finishes its request."""
    @property
    def rows(self) -> _Int32Array:
        """int32 [n]: the plan row each token came from, -1 for cancellations."""
    @property
    def finish_reasons(self) -> list[_FinishReason | None]:
        """[n]: each delta's finish reason."""
    @property
    def finished_request_ids(self) -> list[str]:
        """The requests that finished, in delta order."""
    @property
    def all_have_token(self) -> bool:
        """Every delta has exactly one token (`token_ids` has no -1)."""
    @property
    def num_finished(self) -> int:
        """Deltas that finish their request."""

@final
class Scheduler:
    """Continuous-batching scheduler and paged KV-cache allocator (ARCHITECTURE.md section 3)."""

    def __new__(
        cls,
        num_blocks: int,
        page_size: int,
        max_batch_tokens: int,
        max_requests_per_batch: int = 256,
        scheduler_type: str = "fifo",
        safety_margin: float | None = None,
        allow_block_sharing: bool = True,
        layer_types: Sequence[str] | None = None,
        sliding_window: int | None = None,
        cpu_offload_blocks: int = 0,
        max_batch_cache_tokens: int | None = None,
        defer_shared_prefixes: bool = True,
        priority_preemption: bool = False,
        max_step_ms: float | None = None,
    ) -> Scheduler:
        """A scheduler over `num_blocks` chunks of `page_size` tokens; FieldError on bad values."""
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: _TokenIds,
        max_new_tokens: int,
        eos_token_ids: _TokenIds | None = None,
        stop_token_ids: _TokenIds | None = None,
        priority: int = 0,
        stop_sequences: Iterable[_TokenIds] | None = None,
        skip_prefix_lookup: bool = False,
        cache_salt: int = 0,
        offline: bool = False,
    ) -> None:
        """Queue a request; FieldError naming the field on bad input or if it could never fit.
        `cache_salt` (non-zero): its prefix-cache namespace (blocks shared only within it).
        `offline`: part of an offline batch (the step-time budget binds only while an
        unfinished request is not offline)."""
    def schedule(self) -> StepPlan | None:
        """Plan the next step (None when nothing can run); RuntimeError while a plan is out."""
    def schedule_ahead(self) -> StepPlan | None:
        """Plan the step after the one outstanding plan before its tokens are known, or None."""
    def update(self, sampled_token_ids: _TokenIds) -> StepOutput:
        """Apply one sampled token per `logits_indices` entry of the oldest outstanding plan."""
    def propose(self, request_id: str, tokens: _TokenIds) -> bool:
        """Proposed next tokens of a request for the next `schedule()` (a speculative row)."""
    def propose_ngram(
        self, num_tokens: int, min_n: int, max_n: int, request_ids: list[str] | None = None
    ) -> int:
        """Prompt-lookup proposals for decoding requests; how many got one."""
    def rewind(self, request_id: str, length: int) -> bool:
        """Cut a decoding request back to its first `length` tokens (keys and blocks too)."""
    @property
    def spec_cap(self) -> int:
        """Most proposed tokens one speculative row carries."""
    def cancel(self, request_id: str) -> bool:
        """Cancel a request in any state (frees everything); False if unknown or finished."""
    def recompute(self, request_id: str) -> bool:
        """Soft-reset a running or swapped request; False if unknown, finished or waiting."""
    def has_unfinished(self) -> bool:
        """Whether a request is waiting, running or swapped, or a cancellation is unreported."""
    def stats(self) -> _Stats:
        """Counters and gauges (a fresh dict)."""
    def check_invariants(self) -> None:
        """Raise RuntimeError naming the broken invariant, if any."""
    def report_step_time(self, seconds: float) -> bool:
        """The measured time of the step the last `update()` applied (cost model); taken?"""
    @property
    def max_step_ms(self) -> float | None:
        """The step-time budget (ms), or None."""
    @property
    def prefill_budget_ms(self) -> float:
        """The last plan's prefill allowance (predicted ms; 0.0 when the budget did not bind)."""
    @property
    def prefill_budget_tokens(self) -> int:
        """Prefill tokens the last plan's allowance buys (`max_batch_tokens` when unbound)."""
    def snapshot(self) -> _Snapshot:
        """The whole state as a dict, for outside checks."""
    def check_fits(self, prompt_len: int, max_new_tokens: int) -> None:
        """FieldError ("prompt" or "max_new_tokens") unless such a request could ever fit."""
    def lifetime_chunks(self, cached_tokens: int) -> int:
        """Chunks a request holding `cached_tokens` keys needs at most (blocks + ring)."""
    def max_request_tokens(self) -> int:
        """The largest `prompt_len + max_new_tokens` that `check_fits` accepts."""
    @property
    def num_free_blocks(self) -> int:
        """Chunks allocatable now: uninitialized and cached (free, keeping a hashed block)."""
    @property
    def num_cached_blocks(self) -> int:
        """Free chunks that keep a hashed block (counted in `num_free_blocks` too)."""
    @property
    def num_waiting(self) -> int:
        """Requests waiting for admission (never run, or soft-reset)."""
    @property
    def num_running(self) -> int:
        """Requests holding device chunks (prefilling or decoding)."""
    @property
    def num_swapped(self) -> int:
        """Requests offloaded to the CPU swap pool."""
    @property
    def num_stalled(self) -> int:
        """Rows the last plan found short of chunks (`stats()["stalled_requests"]`)."""
    @property
    def wants_priority_preemption(self) -> bool:
        """A waiting request of higher priority would preempt running ones (only
        `schedule()` does)."""
    @property
    def num_outstanding(self) -> int:
        """Outstanding plans (0, 1 or 2): scheduled, not yet updated."""
    @property
    def has_outstanding_plan(self) -> bool:
        """Whether a plan awaits `update()`."""
    @property
    def num_blocks(self) -> int:
        """Data chunks in the device pool (chunk ids `2 .. num_blocks + 2`)."""
    @property
    def page_size(self) -> int:
        """Tokens per chunk."""
    @property
    def layer_types(self) -> list[_AttentionType]:
        """The attention type of each layer, as configured."""
    @property
    def attention_types(self) -> list[_AttentionType]:
        """The attention types present ("full_attention" first): the keys of a plan's dicts."""
    @property
    def ring_size(self) -> int:
        """Chunks in a sliding request's ring (the sliding table's width); 0 without sliding."""
    @property
    def prefix_caching(self) -> bool:
        """Whether full blocks are shared through the prefix cache."""
    @property
    def safety_margin(self) -> float:
        """The effective admission margin (free fraction kept while something runs)."""
    @property
    def cpu_offload_blocks(self) -> int:
        """Chunk slots in the CPU swap pool."""

def table_columns(positions: _Indices, page_size: int, ring: int | None) -> npt.NDArray[np.int64]:
    """int64: the block-table column of each key position (`ring` None: full attention)."""

def slots(
    table: _Indices,
    rows: _Indices,
    positions: _Indices,
    page_size: int,
    ring: int | None,
) -> npt.NDArray[np.int64]:
    """int64: `table[rows, table_columns(positions, ...)] * page_size + positions % page_size`."""

def paged_decode_attention(
    q: npt.NDArray[np.float32] | npt.NDArray[np.uint16],
    k_cache: npt.NDArray[np.float32] | npt.NDArray[np.uint16] | npt.NDArray[np.int8],
    v_cache: npt.NDArray[np.float32] | npt.NDArray[np.uint16] | npt.NDArray[np.int8],
    block_tables: _Int32Array,
    seqlens: _Int32Array,
    out: npt.NDArray[np.float32] | npt.NDArray[np.uint16],
    *,
    q_dtype: Literal["float32", "bfloat16", "float16"],
    cache_dtype: Literal["float32", "bfloat16", "float16", "int8"],
    out_dtype: Literal["float32", "bfloat16", "float16"],
    page: int,
    window: int,
    scale: float,
    softcap: float,
    threads: int,
    k_scales: npt.NDArray[np.float32] | None = None,
    v_scales: npt.NDArray[np.float32] | None = None,
) -> None:
    """Decode rows' attention over the paged cache, read in place, written to `out`; an
    int8 cache (`cache_dtype="int8"`) with `k_scales` / `v_scales` float32 [slots, kv_heads]."""

def paged_prefill_attention(
    q: npt.NDArray[np.float32] | npt.NDArray[np.uint16],
    k_cache: npt.NDArray[np.float32] | npt.NDArray[np.uint16] | npt.NDArray[np.int8],
    v_cache: npt.NDArray[np.float32] | npt.NDArray[np.uint16] | npt.NDArray[np.int8],
    block_tables: _Int32Array,
    cu_seqlens_q: _Int32Array,
    seqlens: _Int32Array,
    out: npt.NDArray[np.float32] | npt.NDArray[np.uint16],
    *,
    q_dtype: Literal["float32", "bfloat16", "float16"],
    cache_dtype: Literal["float32", "bfloat16", "float16", "int8"],
    out_dtype: Literal["float32", "bfloat16", "float16"],
    page: int,
    window: int,
    scale: float,
    softcap: float,
    threads: int,
    k_scales: npt.NDArray[np.float32] | None = None,
    v_scales: npt.NDArray[np.float32] | None = None,
) -> None:
    """Causal attention of multi-token rows (`q` [tokens, heads, dim], row `r`'s tokens
    `cu_seqlens_q[r] .. cu_seqlens_q[r + 1]` at the last positions of its `seqlens[r]`
    keys, all in the cache) over the paged cache, read in place and tiled, written to
    `out`."""

def share_openmp(path: str | None) -> None:
    """Run the CPU kernels' threads on the OpenMP runtime of the library at `path`, already
    loaded in this process (torch's libtorch_cpu; OSError otherwise); None: threads started
    per call again."""

_Storage = npt.NDArray[np.float32] | npt.NDArray[np.uint16]
_DType = Literal["float32", "bfloat16", "float16"]

def rms_norm(
    x: _Storage,
    weight: _Storage,
    out: _Storage,
    *,
    x_dtype: _DType,
    weight_dtype: _DType,
    out_dtype: _DType,
    eps: float,
    weight_offset: float = 0.0,
    residual: _Storage | None = None,
    residual_dtype: _DType = "float32",
    threads: int = 1,
) -> None:
    """RMSNorm of `x` [T, H] rows into `out` [T, H] (`weight` [H], plus `weight_offset`),
    after `x += residual` in place when `residual` [T, H] is given (`x` then float32).

    All f32: `out = round((x * rsqrt(mean(x^2) + eps)) * (w + weight_offset))`, the mean a
    64-lane sum; equals transformers' `LlamaRMSNorm` on f32 input up to that order.
    `threads` > 1 splits rows only from 2^20 elements on (at decode sizes it never paid).
    """

def silu_mul(
    gate_up: _Storage,
    out: _Storage,
    *,
    dtype: _DType,
    out_dtype: _DType,
    threads: int = 1,
    activation: Literal["silu", "gelu_pytorch_tanh"] = "silu",
) -> None:
    """`out[t, i] = round(act(g) * u)`, `g = gate_up[t, i]`, `u = gate_up[t, I + i]`
    (`gate_up` [T, 2I], `out` [T, I]); `silu(g) = g / (1 + exp(-g))` in f32, exp within
    2 ulp (Cephes); "gelu_pytorch_tanh" as `g / (1 + exp(-2u))`, `u = sqrt(2 / pi) (g +
    0.044715 g^3)`. `threads` > 1 splits rows only from 2^20 output elements on."""

def rope(
    src: _Storage,
    cos: npt.NDArray[np.float32],
    sin: npt.NDArray[np.float32],
    out: _Storage,
    *,
    src_dtype: _DType,
    out_dtype: _DType,
    col_offset: int,
    heads: int,
    dim: int,
    threads: int = 1,
    rot: int | None = None,
) -> None:
    """Rotary embedding of `heads` heads of `src` [T, W] from column `col_offset` on into
    `out` [T, heads, dim] (`cos` / `sin` float32 [T, rot], `rot` default `dim`): `x * cos +
    rotate_half(x) * sin` in f32 over each head's first `rot` columns, the rest copied,
    bit-equal to transformers' fp32 formula, rounded once to `out_dtype`."""

def write_rows(
    src: _Storage,
    dst: _Storage,
    slots: npt.NDArray[np.int64],
    *,
    src_dtype: _DType,
    dst_dtype: _DType,
    col_offset: int,
    width: int,
) -> None:
    """`dst[slots[t]] = src[t, col_offset : col_offset + width]` in `dst`'s type (`dst`
    [S, width] or [S, kv_heads, dim]); slots checked in `0 .. S` before any write; a
    repeated slot keeps its last row. Equals `index_copy_(0, slots, ...)`."""

def write_rows_int8(
    src: _Storage,
    dst: npt.NDArray[np.int8],
    scales: npt.NDArray[np.float32],
    slots: npt.NDArray[np.int64],
    *,
    src_dtype: _DType,
    group: int,
) -> None:
    """`src` [T, width] quantized per `group` columns (symmetric absmax int8, one float32
    scale each) into `dst` int8 [S, width] and `scales` [S, width / group] at `slots`
    (checked in `0 .. S` first); the arithmetic of `kv_cache.quantize_int8`."""
def greedy_select(
    scores: npt.NDArray[np.uint16] | npt.NDArray[np.float32] | npt.NDArray[np.int32],
    base: npt.NDArray[np.float64],
    gain: npt.NDArray[np.float64],
    per_token: npt.NDArray[np.float64],
    *,
    max_stage1: int,
    max_candidates: int,
    threads: int,
) -> tuple[
    npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.int64]
] | None:
    """The greedy head screen's candidates for `scores` [rows, vocab] (uint16 = bf16 bits,
    float32, or exact int32) within `base + gain * per_token` of the fp32 logits:
    `(rows, cols, unique, inverse)` int64 (pairs in row-major order, the distinct tokens
    ascending, each pair's index among them); None when more than `max_stage1` /
    `max_candidates` per row on average survive, or a threshold is not finite."""

def greedy_pick(
    logits: npt.NDArray[np.float32],
    rows: npt.NDArray[np.int64],
    cols: npt.NDArray[np.int64],
    inverse: npt.NDArray[np.int64],
) -> npt.NDArray[np.int64] | None:
    """int64 [rows]: each row's argmax among its candidates (logit of pair `i` at
    `logits[rows[i], inverse[i]]`; ties: the lowest token); None when a candidate's logit is
    not finite or a row has none."""

def row_norms(
    x: npt.NDArray[np.float32],
) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64], npt.NDArray[np.float64]]:
    """float64 (l2, l1, amax) per row of `x` [rows, k], summed in f64 (`l1` is finite iff
    the row is; `amax` is NaN when the row holds a NaN)."""

def amx_available() -> bool:
    """Whether `amx_linear` runs on this CPU (AMX tiles, or AVX-512 BF16 without them)."""

def amx_backend() -> str:
    """Which instructions run `amx_linear` here: "amx", "avx512_bf16" or "none"."""

def amx_packed_len(n: int, k: int) -> int:
    """Elements (uint16) of the packed form of an `[n, k]` weight."""

def amx_pack(weight: npt.NDArray[np.uint16], out: npt.NDArray[np.uint16]) -> None:
    """Packs `weight` [n, k] (bf16 bits, uint16) into `out` (`amx_packed_len(n, k)` uint16)."""

def amx_linear(
    x: _Storage,
    packed: npt.NDArray[np.uint16],
    out: npt.NDArray[np.float32],
    *,
    x_dtype: Literal["float32", "bfloat16"],
    n: int,
    k: int,
    bias: npt.NDArray[np.float32] | None = None,
    threads: int = 1,
) -> None:
    """`out = bf16(x) @ W.T (+ bias)` in f32: `x` [m, k], `packed` the `amx_pack`ed W
    [n, k], `bias` [n] or None, `out` [m, n]. Column blocks of 16 are split over at most
    `threads` threads of the kernel pool."""

def f32_linear_available() -> bool:
    """Whether `f32_linear` runs on this CPU (AVX-512F)."""

def f32_packed_len(n: int, k: int) -> int:
    """Elements (float32) of the packed form of an `[n, k]` weight."""

def f32_pack(weight: npt.NDArray[np.float32], out: npt.NDArray[np.float32]) -> None:
    """Packs `weight` [n, k] (float32) into `out` (`f32_packed_len(n, k)` float32)."""

def f32_linear(
    x: npt.NDArray[np.float32],
    packed: npt.NDArray[np.float32],
    out: npt.NDArray[np.float32],
    *,
    n: int,
    k: int,
    bias: npt.NDArray[np.float32] | None = None,
    threads: int = 1,
) -> None:
    """`out = x @ W.T (+ bias)` in f32: `x` [m, k], `packed` the `f32_pack`ed W [n, k],
    `bias` [n] or None, `out` [m, n]. Panels of 64 columns are split over at most `threads`
    threads of the kernel pool; a row's result depends on neither `m` nor `threads`."""

def f32_pack_half(weight: npt.NDArray[np.uint16], out: npt.NDArray[np.uint16], *,
                  dtype: Literal["bfloat16", "float16"]) -> None:
    """Packs a half-precision `weight` [n, k] (`dtype`'s bits as uint16) into `out`
    (`f32_packed_len(n, k)` uint16): `f32_pack`'s layout at half the bytes."""

def f32_unpack_half(packed: npt.NDArray[np.uint16], weight: npt.NDArray[np.uint16], *,
                    dtype: Literal["bfloat16", "float16"]) -> None:
    """Unpacks `packed` (`f32_pack_half`ed bits of a `dtype` weight [n, k]) into `weight`
    (uint16 [n, k]): the packed weight, bit for bit."""

def f32_pack_bf16_exact(weight: npt.NDArray[np.float32],
                        out: npt.NDArray[np.uint16]) -> bool:
    """Packs a float32 `weight` [n, k] whose every value is a bf16 one into `out`
    (`f32_packed_len(n, k)` uint16) as `f32_pack_half` packs that bf16 weight; False, with
    `out` untouched, where a value is not."""

def f32_linear_half(
    x: npt.NDArray[np.float32],
    packed: npt.NDArray[np.uint16],
    out: npt.NDArray[np.float32],
    *,
    n: int,
    k: int,
    dtype: Literal["bfloat16", "float16"],
    bias: npt.NDArray[np.float32] | None = None,
    threads: int = 1,
) -> None:
    """`f32_linear` over an `f32_pack_half`ed W [n, k] of `dtype` (as packed): its weights
    widened exactly to f32 in registers, every output bit for bit `f32_linear`'s over the
    widened weights."""

def i16_linear_available() -> bool:
    """Whether `i16_linear` runs on this CPU (AVX-512 VNNI)."""

def i16_packed_len(n: int, k: int) -> int:
    """Elements (int16) of the packed form of an `[n, k]` weight (`k` even)."""

def i16_pack(weight: npt.NDArray[np.int16], out: npt.NDArray[np.int16]) -> None:
    """Packs `weight` [n, k] (int16, `k` even) into `out` (`i16_packed_len(n, k)` int16)."""

def i16_linear(
    x: npt.NDArray[np.int16],
    packed: npt.NDArray[np.int16],
    out: npt.NDArray[np.int32],
    *,
    n: int,
    k: int,
    threads: int = 1,
) -> None:
    """`out = x @ W.T` exactly in int32 (the caller keeps `k max|x| max|W| < 2^31`): `x`
    [m, k] int16, `packed` the `i16_pack`ed W [n, k], `out` int32 [m, n]; column blocks split
    over at most `threads` threads of the kernel pool."""

def quant_types() -> list[str]:
    """The quantization types the products take ("q8_0", "q4_0", "q4_1", "q4_k", "q5_k",
    "q6_k", "q5_0", "q5_1", "iq4_nl", "q3_k", "q2_k", "iq4_xs", "mxfp4")."""

def quant_backend() -> str:
    """The backend `quant_linear` runs when given none: "amx_int8" where the CPU has AMX-INT8
    and AVX-512 VNNI, else "avx512vnni" where it has that, else "avx2" where it has that,
    else "portable" (`FERROBATCH_QUANT_BACKEND` picks one of those that run here)."""

def quant_backend_available(backend: str) -> bool:
    """Whether this CPU runs `backend` ("portable" always does)."""

def quant_packed_len(qtype: str, n: int, k: int) -> int:
    """Bytes (uint8) of the packed form of an `[n, k]` weight of `qtype` (`k` whole blocks)."""

def quant_dequantize(
    qtype: str,
    blocks: npt.NDArray[np.uint8],
    out: npt.NDArray[np.float32],
    *,
    n: int,
    k: int,
) -> None:
    """`out` (float32 [n, k]) = the GGUF rows `blocks` (uint8, `n * k / block` blocks of
    `qtype`) dequantized, as `gguf.quants.dequantize`."""

def quant_pack(
    qtype: str,
    blocks: npt.NDArray[np.uint8],
    out: npt.NDArray[np.uint8],
    *,
    n: int,
    k: int,
    threads: int = 1,
) -> None:
    """Packs the GGUF rows `blocks` (uint8, `n * k / block` blocks of `qtype`) into `out`
    (uint8, `quant_packed_len(qtype, n, k)` bytes), panels split over at most `threads`
    threads."""

def quant_linear(
    qtype: str,
    x: npt.NDArray[np.float32],
    weight: npt.NDArray[np.uint8],
    out: npt.NDArray[np.float32],
    *,
    n: int,
    k: int,
    threads: int = 1,
    backend: str | None = None,
) -> None:
    """`out = x @ W.T` in f32 through int8 activations: `x` float32 [m, k], `weight` the
    `quant_pack`ed W [n, k] of `qtype` (uint8), `out` float32 [m, n]. Output panels of 16
    are split over at most `threads` threads of the kernel pool; a row's result depends on
    neither `m`, `threads` nor `backend` ("portable", "avx2", "avx512vnni", "amx_int8", or
    None for `quant_backend()`)."""

def quant_quantize_types() -> list[str]:
    """The types `quant_quantize` takes ("q4_k", "q5_k", "q6_k"; the others are
    `gguf.quants`')."""

def quant_quantize(
    qtype: str,
    w: npt.NDArray[np.float32],
    out: npt.NDArray[np.uint8],
    *,
    threads: int = 1,
) -> None:
    """`out` (uint8 [n, k / 256 * block bytes]) = the float32 weight `w` [n, k] quantized to
    the GGUF rows of `qtype` (a K-type), rows split over at most `threads` threads; a NaN,
    infinite or too large weight raises a `FieldError` on "w" naming its row."""

#: a quantized product's parts for `LeanLayer`: (qtype, packed rows, rows) each
_QuantParts = Sequence[tuple[str, npt.NDArray[np.uint8], int]]


class QuantExperts:
    """One mixture-of-experts layer's experts on the quantized products (`rust/kernels/src/
    moe.rs`): `gate_up[e]` expert `e`'s GGUF parts `(qtype, quant_pack`ed uint8, rows)` of
    its gate rows then its up rows [2 * inter, hidden], `down[e]` those of its down
    projection [hidden, inter]; run on `backend` (None: `quant_backend()`). The arrays are
    kept, not copied. gpt-oss's experts: `gate_up_bias[e]` (float32 [2 * inter]) and
    `down_bias[e]` ([hidden]) added to the products (copied), `swiglu` = (limit, alpha): the
    clamped SwiGLU `(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)`, `g = min(gate,
    limit)`, in place of `silu(gate) * up`. FieldError on a bad shape."""

    def __new__(
        cls,
        *,
        gate_up: Sequence[_QuantParts],
        down: Sequence[_QuantParts],
        hidden: int,
        inter: int,
        backend: str | None = None,
        gate_up_bias: Sequence[npt.NDArray[np.float32]] | None = None,
        down_bias: Sequence[npt.NDArray[np.float32]] | None = None,
        swiglu: tuple[float, float] | None = None,
    ) -> QuantExperts:
        """The experts over these weights (checked once here)."""

    @property
    def num_experts(self) -> int:
        """The number of experts."""

    def forward(
        self,
        x: npt.NDArray[np.float32],
        ids: npt.NDArray[np.int64],
        weights: npt.NDArray[np.float32],
        out: npt.NDArray[np.float32],
        *,
        threads: int = 1,
    ) -> None:
        """`out` [tokens, hidden] = each token's experts `ids` [tokens, top_k] (`num_experts`:
        none) applied to its row of `x` [tokens, hidden], `silu(gate) * up` through down,
        times its `weights` [tokens, top_k], added in ascending expert order (transformers'
        eager experts forward); the GIL released. FieldError naming the argument."""


class LeanLayer:
    """A Llama-style decoder layer run by `forward` in one call (ARCHITECTURE.md section 5a,
    one-call lean layers): `input_norm` / `post_norm` [hidden] in `norm_dtype`, the packed
    products `qkv` [heads * dim + 2 * kv_heads * dim, hidden], `o` [hidden, heads * dim],
    `gate_up` [2 * inter, hidden], `down` [hidden, inter] (`amx_pack`ed uint16 with
    `weight_dtype` "bfloat16", `f32_pack`ed float32 with "float32", `f32_pack_half`ed
    uint16 with "bfloat16_panels" / "float16_panels", or with "quantized" a sequence of
    GGUF parts `(qtype, quant_pack`ed uint8, rows)` stacked in order, run on
    `quant_backend()`'s products), each with an optional
    float32 bias; `q_norm` / `k_norm` [dim] (in `norm_dtype`, both or neither): per-head
    RMSNorms of q and k before rope (Qwen3). Gemma 2 / 3: `post_attn_norm` / `post_mlp_norm`
    [hidden] normalize the attention's and the MLP's outputs before the residual
    (`sandwich_eps`), `norm_offset` 1.0 makes every norm weight `1 + w`, `activation`
    "gelu_pytorch_tanh" gates the MLP, `softcap` caps the attention scores. `rot` (default
    `dim`): the columns of each head the rope rotates (cos / sin [rows, rot]; the rest
    copied). The arrays are kept, not copied. FieldError on a bad shape or value."""

    def __new__(
        cls,
        *,
        input_norm: _Storage,
        post_norm: _Storage,
        norm_dtype: Literal["float32", "bfloat16", "float16"],
        input_eps: float,
        post_eps: float,
        qkv: npt.NDArray[np.uint16] | npt.NDArray[np.float32] | _QuantParts,
        o: npt.NDArray[np.uint16] | npt.NDArray[np.float32] | _QuantParts,
        gate_up: npt.NDArray[np.uint16] | npt.NDArray[np.float32] | _QuantParts,
        down: npt.NDArray[np.uint16] | npt.NDArray[np.float32] | _QuantParts,
        hidden: int,
        heads: int,
        kv_heads: int,
        dim: int,
        inter: int,
        qkv_bias: npt.NDArray[np.float32] | None = None,
        o_bias: npt.NDArray[np.float32] | None = None,
        gate_up_bias: npt.NDArray[np.float32] | None = None,
        down_bias: npt.NDArray[np.float32] | None = None,
        weight_dtype: Literal["bfloat16", "float32", "bfloat16_panels",
                              "float16_panels", "quantized"] = "bfloat16",
        q_norm: _Storage | None = None,
        k_norm: _Storage | None = None,
        qk_norm_eps: float = 1e-6,
        post_attn_norm: _Storage | None = None,
        post_mlp_norm: _Storage | None = None,
        sandwich_eps: float = 1e-6,
        norm_offset: float = 0.0,
        activation: Literal["silu", "gelu_pytorch_tanh"] = "silu",
        softcap: float | None = None,
        rot: int | None = None,
    ) -> LeanLayer:
        """The layer over these weights (checked once here)."""

    def forward(
        self,
        x: npt.NDArray[np.float32],
        k_cache: _Storage,
        v_cache: _Storage,
        cos: npt.NDArray[np.float32],
        sin: npt.NDArray[np.float32],
        slots: npt.NDArray[np.int64],
        block_tables: npt.NDArray[np.int32],
        seqlens: npt.NDArray[np.int32],
        *,
        cache_dtype: Literal["float32", "bfloat16", "float16"],
        page: int,
        window: int,
        scale: float,
        threads: int,
    ) -> None:
        """The layer on `x` [rows, hidden] (updated in place): new keys and values written at
        `slots` of the caches ([slots, kv_heads, dim] in `cache_dtype`), every row attended
        by the decode kernel over `block_tables` [rows, width] and `seqlens` [rows]; `cos` /
        `sin` [rows, dim]; `window` 0 = full attention."""


def lean_layers_forward(
    layers: Sequence[LeanLayer],
    x: npt.NDArray[np.float32],
    k_caches: Sequence[_Storage],
    v_caches: Sequence[_Storage],
    cos: npt.NDArray[np.float32],
    sin: npt.NDArray[np.float32],
    slots: npt.NDArray[np.int64],
    block_tables: npt.NDArray[np.int32],
    seqlens: npt.NDArray[np.int32],
    *,
    cache_dtype: Literal["float32", "bfloat16", "float16"],
    page: int,
    window: int,
    scale: float,
    threads: int,
    groups: Sequence[tuple[npt.NDArray[np.int64], npt.NDArray[np.int32],
                           npt.NDArray[np.int32], int,
                           tuple[npt.NDArray[np.float32], npt.NDArray[np.float32]] | None]]
    | None = None,
    group_of: Sequence[int] | None = None,
) -> None:
    """`layers` in order on `x` [rows, hidden] in one call, layer `i` with `k_caches[i]` /
    `v_caches[i]`, the other arguments shared (`LeanLayer.forward`'s): bit for bit the
    layers' own calls in order. Layers of other attention groups (sliding next to full):
    `groups` holds the others' `(slots, block_tables, seqlens, window, rope)` (`rope` None
    or the group's own `(cos, sin)`: Gemma 3's local and global layers), `group_of` each
    layer's group (0: the positional arguments', `i`: `groups[i - 1]`). FieldError for
    lists of other lengths, a group index out of range, layers of other widths, or caches
    overlapping one another or `x`."""
