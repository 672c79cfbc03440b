"""CUDA-graph shape bucketing, the graph-cache key, and a bounded (LRU) graph cache.

A captured graph replays fixed kernels with fixed launch grids over fixed buffers, so a step
plan (ARCHITECTURE.md §3) is first padded to a bucketed shape (`pad_plan`), and graphs are
cached by a `GraphKey` holding **every integer that shapes a kernel** of the forward: padded
query tokens, padded rows, padded sampled rows, padded max query length, padded max key
length, and per attention type the block-table width and the decode split count. (The
reference implementation once keyed graphs without the max key length: a graph captured for
short contexts was replayed for long ones and silently attended to a truncated context.
`tests/cuda/test_cuda_graph_keys.py` catches that.)

Padding (ARCHITECTURE.md §2 chunks 0 and 1):

* Padding token `i` (`T <= i < T_pad`) writes its K/V to the scratch chunk, slot
  `1 * page_size + i % page_size`, has token id 0 and position 0, and is a row of its own
  with one query token and `seqlens_k = 1` whose block-table row is all zeros: it reads its
  one key from the zero chunk (slot 0), so it attends to zeros and touches no real data.
* Rows beyond those are empty (no query token, `seqlens_k = 0`); kernels skip them.
* Sampled rows beyond `N` point at the last padded token; callers use the first `N` only.

Capture needs CUDA (`CapturedGraph`, torch.cuda.CUDAGraph); the padding, keying and eviction
logic is plain numpy/Python and is tested on CPU with a fake capture function.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Self

import numpy as np
import torch

from ferrobatch._core import SCRATCH_CHUNK
from ferrobatch.defaults import DEFAULT_KV_INTERVAL, DEFAULT_Q_INTERVAL
from ferrobatch.model_config import SLIDING

from .triton_attention import choose_num_splits

if TYPE_CHECKING:
    from ferrobatch.core import StepPlan

__all__ = [
    "SLIDING",
    "CapturedGraph",
    "EagerReplay",
    "GraphBuckets",
    "GraphCache",
    "GraphKey",
    "PaddedPlan",
    "StaticInputs",
    "dummy_plan",
    "pad_plan",
]

def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


@dataclass(frozen=True)
class GraphBuckets:
    """How plan shapes are padded for CUDA graphs.

    Attributes:
        q_interval: `q_padding_interval_size`: query tokens (and rows) are padded to the next
            power of two up to this value, then to a multiple of it.
        kv_interval: `kv_padding_interval_size`: the max key length is padded to a multiple
            of it (the Triton kernels read true lengths on the device, so this only sets the
            table width and the decode split count: a coarse interval costs no compute and
            keeps the graph count low).
        max_tokens: steps with more query tokens run eager.
        max_rows: steps with more rows (after padding) run eager.
        decode_only: only steps where every row has one query token get a graph (prefill
            shapes vary too much to be worth capturing); mixed steps run eager.
        num_kv_heads / num_sms / block_n: inputs of the decode split count.
    """

    q_interval: int = DEFAULT_Q_INTERVAL
    kv_interval: int = DEFAULT_KV_INTERVAL
    max_tokens: int = 512
    max_rows: int = 512
    decode_only: bool = True
    num_kv_heads: int = 1
    num_sms: int = 132
    block_n: int = 64

    def __post_init__(self) -> None:
        for name in ("q_interval", "kv_interval", "max_tokens", "max_rows", "num_kv_heads"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1")

    @classmethod
    def from_config(cls, config: Any, **overrides: Any) -> GraphBuckets:
        """From a `ContinuousBatchingConfig` (0 padding intervals = the presets here)."""
        q = int(getattr(config, "q_padding_interval_size", 0) or DEFAULT_Q_INTERVAL)
        kv = int(getattr(config, "kv_padding_interval_size", 0) or DEFAULT_KV_INTERVAL)
        rows = int(getattr(config, "max_requests_per_batch", 512) or 512)
        kwargs: dict[str, Any] = dict(
            q_interval=q, kv_interval=kv, max_rows=_round_up(rows, q), max_tokens=_round_up(rows, q)
        )
        kwargs.update(overrides)
        return cls(**kwargs)

    def pad_tokens(self, n: int) -> int:
        """Query tokens (or rows) `n` → padded count: 1, 2, 4, ... up to `q_interval`, then
        multiples of `q_interval`."""
        if n <= 0:
            return 0
        if n <= self.q_interval:
            return min(self.q_interval, 1 << (n - 1).bit_length())
        return _round_up(n, self.q_interval)

    def pad_kv(self, n: int) -> int:
        """Max key length → padded length (a multiple of `kv_interval`, at least one)."""
        return _round_up(max(1, n), self.kv_interval)


@dataclass(frozen=True)
class GraphKey:
    """Every integer that shapes a kernel of a padded step (the graph-cache key)."""

    tokens: int  # padded T
    rows: int  # padded B
    logits_rows: int  # padded N (sampled rows)
    max_seqlen_q: int  # padded max query tokens of a row (1 = decode only)
    max_seqlen_k: int  # padded max key length
    table_widths: tuple[tuple[str, int], ...]  # per attention type: padded block-table width
    num_splits: tuple[tuple[str, int], ...]  # per attention type: decode split count
    page_size: int


@dataclass
class PaddedPlan:
    """A step plan padded to a graph shape; arrays are C-contiguous int32."""

    input_ids: np.ndarray  # [T_pad]
    positions: np.ndarray  # [T_pad]
    cu_seqlens_q: np.ndarray  # [B_pad + 1]
    seqlens_k: np.ndarray  # [B_pad]
    logits_indices: np.ndarray  # [N_pad]
    logits_rows: np.ndarray  # [N_pad]
    slot_mapping: dict[str, np.ndarray]  # type -> [T_pad]
    block_tables: dict[str, np.ndarray]  # type -> [B_pad, W_pad]
    num_tokens: int  # real T
    num_rows: int  # real B
    num_logits: int  # real N
    key: GraphKey
    request_ids: list[str] = field(default_factory=list)
    swap_out: np.ndarray = field(default_factory=lambda: np.zeros((0, 2), np.int32))
    swap_in: np.ndarray = field(default_factory=lambda: np.zeros((0, 2), np.int32))

    @property
    def max_seqlen_q(self) -> int:
        """Padded max query tokens per row (an upper bound of the true one)."""
        return self.key.max_seqlen_q

    @property
    def max_seqlen_k(self) -> int:
        """Padded max key length (an upper bound of the true one)."""
        return self.key.max_seqlen_k

    def arrays(self) -> dict[str, np.ndarray]:
        """Every array by a flat name (`slot_mapping/<type>`, `block_tables/<type>`): the
        static input buffers of a captured graph."""
        out = {
            "input_ids": self.input_ids,
            "positions": self.positions,
            "cu_seqlens_q": self.cu_seqlens_q,
            "seqlens_k": self.seqlens_k,
            "logits_indices": self.logits_indices,
            "logits_rows": self.logits_rows,
        }
        for typ, a in self.slot_mapping.items():
            out[f"slot_mapping/{typ}"] = a
        for typ, a in self.block_tables.items():
            out[f"block_tables/{typ}"] = a
        return out


def _i32(a: Any) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(a), dtype=np.int32)


def pad_plan(
    plan: StepPlan,
    buckets: GraphBuckets,
    *,
    page_size: int,
    sliding_window: int | None = None,
) -> PaddedPlan | None:
    """Pad `plan` to its graph bucket, or None when the step should run eager (a mixed step
    with `decode_only`, or more tokens or rows than the buckets allow).

    Real rows, tokens and sampled rows keep their indices; see the module docstring for
    what padding tokens and rows do."""
    cu = np.asarray(plan.cu_seqlens_q, dtype=np.int64)
    seqlens = np.asarray(plan.seqlens_k, dtype=np.int64)
    num_rows = len(seqlens)
    num_tokens = int(cu[-1]) if len(cu) else 0
    if num_rows == 0 or num_tokens == 0:
        return None
    qlen = np.diff(cu)
    max_q = int(qlen.max())
    if buckets.decode_only and max_q != 1:
        return None
    t_pad = buckets.pad_tokens(num_tokens)
    pad_tok = t_pad - num_tokens
    b_pad = buckets.pad_tokens(num_rows + pad_tok)
    if t_pad > buckets.max_tokens or b_pad > buckets.max_rows:
        return None
    lidx = np.asarray(plan.logits_indices, dtype=np.int64)
    num_logits = len(lidx)
    n_pad = buckets.pad_tokens(max(1, num_logits))
    max_q_pad = 1 if max_q == 1 else min(t_pad, buckets.pad_tokens(max_q))
    max_k_pad = buckets.pad_kv(int(seqlens.max()))

    input_ids = np.zeros(t_pad, np.int32)
    input_ids[:num_tokens] = np.asarray(plan.input_ids)[:num_tokens]
    positions = np.zeros(t_pad, np.int32)
    positions[:num_tokens] = np.asarray(plan.positions)[:num_tokens]
    # Row r < B: as planned; rows B .. B+pad_tok-1: one padding token each; then empty rows.
    new_cu = np.empty(b_pad + 1, np.int64)
    new_cu[: num_rows + 1] = cu
    new_cu[num_rows + 1 : num_rows + 1 + pad_tok] = num_tokens + np.arange(1, pad_tok + 1)
    new_cu[num_rows + 1 + pad_tok :] = t_pad
    new_seqlens = np.zeros(b_pad, np.int32)
    new_seqlens[:num_rows] = seqlens
    new_seqlens[num_rows : num_rows + pad_tok] = 1
    logits_indices = np.full(n_pad, t_pad - 1, np.int32)
    logits_indices[:num_logits] = lidx
    logits_rows = np.full(n_pad, num_rows + pad_tok - 1 if pad_tok else num_rows - 1, np.int32)
    logits_rows[:num_logits] = np.asarray(plan.logits_rows)[:num_logits]

    pad_slots = SCRATCH_CHUNK * page_size + np.arange(num_tokens, t_pad) % page_size
    slot_mapping: dict[str, np.ndarray] = {}
    block_tables: dict[str, np.ndarray] = {}
    widths: list[tuple[str, int]] = []
    splits: list[tuple[str, int]] = []
    kv_pages = max(1, math.ceil(buckets.kv_interval / page_size))
    for typ in sorted(plan.block_tables):
        sm = np.empty(t_pad, np.int32)
        sm[:num_tokens] = np.asarray(plan.slot_mapping[typ])[:num_tokens]
        sm[num_tokens:] = pad_slots
        slot_mapping[typ] = sm
        table = np.asarray(plan.block_tables[typ])
        if typ == SLIDING:
            width = table.shape[1]  # the ring: its size is part of the layout, never padded
            keys = min(max_k_pad, int(sliding_window)) if sliding_window else max_k_pad
        else:
            need = max(table.shape[1], math.ceil(max_k_pad / page_size))
            width = _round_up(need, kv_pages)
            keys = max_k_pad
        padded = np.zeros((b_pad, width), np.int32)  # zero chunk everywhere else
        padded[:num_rows, : table.shape[1]] = table
        block_tables[typ] = padded
        widths.append((typ, width))
        splits.append((typ, choose_num_splits(
            b_pad, buckets.num_kv_heads, keys, block_n=buckets.block_n, num_sms=buckets.num_sms,
        )))
    key = GraphKey(
        tokens=t_pad,
        rows=b_pad,
        logits_rows=n_pad,
        max_seqlen_q=max_q_pad,
        max_seqlen_k=max_k_pad,
        table_widths=tuple(widths),
        num_splits=tuple(splits),
        page_size=page_size,
    )
    return PaddedPlan(
        input_ids=input_ids,
        positions=positions,
        cu_seqlens_q=_i32(new_cu),
        seqlens_k=new_seqlens,
        logits_indices=logits_indices,
        logits_rows=logits_rows,
        slot_mapping=slot_mapping,
        block_tables=block_tables,
        num_tokens=num_tokens,
        num_rows=num_rows,
        num_logits=num_logits,
        key=key,
        request_ids=list(getattr(plan, "request_ids", [])),
        swap_out=_i32(getattr(plan, "swap_out", np.zeros((0, 2)))).reshape(-1, 2),
        swap_in=_i32(getattr(plan, "swap_in", np.zeros((0, 2)))).reshape(-1, 2),
    )


def dummy_plan(key: GraphKey) -> PaddedPlan:
    """A plan of `key`'s shape made only of padding: what warm-up and capture run, so they
    never touch real data. Tokens are dealt to rows greedily, at most `max_seqlen_q` per
    row; every row has no cached key (single-token rows read the zero chunk, longer rows
    their own new keys) and every write goes to the scratch chunk."""
    t, b, page = key.tokens, key.rows, key.page_size
    qlen = np.zeros(b, np.int64)
    left = t
    for r in range(b):
        qlen[r] = min(key.max_seqlen_q, left)
        left -= int(qlen[r])
    if left:
        raise ValueError(f"{key}: {t} tokens do not fit {b} rows of {key.max_seqlen_q}")
    cu = np.zeros(b + 1, np.int32)
    cu[1:] = np.cumsum(qlen)
    slots = (SCRATCH_CHUNK * page + np.arange(t) % page).astype(np.int32)
    last = max(0, int(np.count_nonzero(qlen)) - 1)
    return PaddedPlan(
        input_ids=np.zeros(t, np.int32),
        positions=np.zeros(t, np.int32),
        cu_seqlens_q=cu,
        seqlens_k=qlen.astype(np.int32),
        logits_indices=np.full(key.logits_rows, t - 1, np.int32),
        logits_rows=np.full(key.logits_rows, last, np.int32),
        slot_mapping={typ: slots.copy() for typ, _ in key.table_widths},
        block_tables={typ: np.zeros((b, w), np.int32) for typ, w in key.table_widths},
        num_tokens=0,
        num_rows=0,
        num_logits=0,
        key=key,
    )


# ------------------------------------------------------------------------ the cache


class GraphCache:
    """Captured graphs by `GraphKey`, at most `max_graphs` of them (least recently used
    evicted first).

    `capture(key)` builds the graph for a key (on CUDA: a `CapturedGraph`; in tests any
    object). `release(graph)` is called on eviction (default: the graph's own `release()`
    when it has one). Memory: graphs captured into one shared pool
    (`torch.cuda.graph_pool_handle()`) reuse each other's activation memory, so the pool is
    about the largest captured step's activations; each graph adds its static inputs (a
    few int32 arrays of the padded shape) and its output (the runner's graphs return hidden
    states `[N_pad, hidden]`: the LM head runs outside, so no graph pins `[N_pad, vocab]`).
    """

    def __init__(
        self,
        capture: Callable[[GraphKey], Any],
        *,
        max_graphs: int = 32,
        release: Callable[[Any], None] | None = None,
    ) -> None:
        if max_graphs < 1:
            raise ValueError("max_graphs must be >= 1")
        self._capture = capture
        self._release = release
        self.max_graphs = max_graphs
        self._graphs: OrderedDict[GraphKey, Any] = OrderedDict()
        self.hits = 0
        self.misses = 0
        self.evictions = 0

    def get(self, key: GraphKey) -> Any:
        """The graph for `key`, captured on first use."""
        graph = self._graphs.get(key)
        if graph is not None:
            self.hits += 1
            self._graphs.move_to_end(key)
            return graph
        self.misses += 1
        # Evict before capturing, so the pool has the evicted graph's memory back.
        while len(self._graphs) >= self.max_graphs:
            self._evict()
        graph = self._capture(key)
        self._graphs[key] = graph
        return graph

    def _evict(self) -> None:
        _, graph = self._graphs.popitem(last=False)
        self.evictions += 1
        if self._release is not None:
            self._release(graph)
        elif hasattr(graph, "release"):
            graph.release()

    def __len__(self) -> int:
        return len(self._graphs)

    def __contains__(self, key: object) -> bool:
        return key in self._graphs

    def keys(self) -> list[GraphKey]:
        """Cached keys, least recently used first."""
        return list(self._graphs)

    def clear(self) -> None:
        """Release every graph."""
        while self._graphs:
            self._evict()
        self.evictions = 0

    def stats(self) -> dict[str, int]:
        """Counters for engine stats."""
        return {
            "graphs": len(self._graphs),
            "graph_hits": self.hits,
            "graph_misses": self.misses,
            "graph_evictions": self.evictions,
        }


ALIGN = 4  # int32s per 16 bytes: where each static input starts in the flat buffer


class StaticInputs:
    """The static input tensors of one graph key: int32 views (by `PaddedPlan.arrays()`
    names) of one flat device buffer, filled from a padded plan with one host→device copy.

    On CUDA the host staging buffer is pinned and the copy is asynchronous on the current
    stream; before the staging buffer is rewritten, the previous copy out of it is waited
    for (an event: by then long done in a steady loop). Replays of a graph are ordered
    after the copy on the same stream, and a copy for the next step is ordered after the
    replay that reads the current inputs."""

    def __init__(self, key: GraphKey, device: torch.device | str) -> None:
        self.device = torch.device(device)
        layout = dummy_plan(key).arrays()
        self.shapes = {name: a.shape for name, a in layout.items()}
        # Every slice starts at a multiple of 16 bytes (ALIGN int32s): Triton specialises
        # pointer arguments on 16-byte alignment, so an unaligned view would compile (and
        # launch) other kernel variants than the eager steps' own tensors do.
        offsets, off = {}, 0
        for name, a in layout.items():
            offsets[name] = off
            off += -(-a.size // ALIGN) * ALIGN
        total = max(off, ALIGN)
        cuda = self.device.type == "cuda"
        self._host_t = torch.zeros(total, dtype=torch.int32, pin_memory=cuda)
        self._host = self._host_t.numpy()
        self.flat = torch.zeros(total, dtype=torch.int32, device=self.device)
        self.tensors: dict[str, torch.Tensor] = {}
        self._slices: dict[str, slice] = {}
        for name, a in layout.items():
            off = offsets[name]
            self._slices[name] = slice(off, off + a.size)
            self.tensors[name] = self.flat[off : off + a.size].view(a.shape)
        self._copied = torch.cuda.Event() if cuda else None
        self.load(dummy_plan(key))

    @property
    def nbytes(self) -> int:
        """Device bytes of the static inputs."""
        return self.flat.numel() * self.flat.element_size()

    def load(self, plan: PaddedPlan) -> None:
        """Copy `plan`'s arrays into the static inputs (shapes must match the key's)."""
        arrays = plan.arrays()
        if arrays.keys() != self.shapes.keys():
            raise ValueError(f"plan arrays {sorted(arrays)} != graph inputs {sorted(self.shapes)}")
        if self._copied is not None:
            self._copied.synchronize()  # the last copy out of the staging buffer is done
        for name, arr in arrays.items():
            if arr.shape != self.shapes[name]:
                raise ValueError(f"{name}: plan shape {arr.shape} != graph {self.shapes[name]}")
            self._host[self._slices[name]] = arr.reshape(-1)
        self.flat.copy_(self._host_t, non_blocking=True)
        if self._copied is not None:
            self._copied.record(torch.cuda.current_stream(self.device))


class EagerReplay:
    """What a `CapturedGraph` does, without capturing: `run()` calls `fn` over the same
    static inputs every time. The runner uses it to run the exact padded, graph-shaped
    forward on CPU (tests) or where capture is not wanted."""

    def __init__(
        self, fn: Callable[[Mapping[str, torch.Tensor]], torch.Tensor], inputs: StaticInputs
    ) -> None:
        self.fn = fn
        self.inputs = inputs
        self.output: torch.Tensor | None = None

    @classmethod
    def for_plan(
        cls,
        fn: Callable[[Mapping[str, torch.Tensor]], torch.Tensor],
        key: GraphKey,
        device: torch.device | str,
        **kwargs: Any,
    ) -> Self:
        """An instance over new static inputs of `key`'s shape (filled with
        `dummy_plan(key)`); `kwargs` go to the constructor (`CapturedGraph`: `pool`,
        `warmup`)."""
        return cls(fn, StaticInputs(key, device), **kwargs)

    @property
    def static_inputs(self) -> dict[str, torch.Tensor]:
        return self.inputs.tensors

    def load(self, plan: PaddedPlan) -> None:
        """Copy `plan` into the static inputs."""
        self.inputs.load(plan)

    def run(self) -> torch.Tensor:
        """Run `fn` over the static inputs; returns its output."""
        self.output = self.fn(self.inputs.tensors)
        return self.output

    def replay(self, plan: PaddedPlan) -> torch.Tensor:
        """`load(plan)` then `run()`."""
        self.load(plan)
        return self.run()

    def release(self) -> None:
        """Drop the inputs and the output."""
        self.output = None


class CapturedGraph(EagerReplay):
    """One CUDA graph of `fn(static_inputs) -> tensor` over static device buffers.

    `load(plan)` copies a padded plan's arrays into the static inputs (one host→device copy),
    `run()` replays; `replay(plan)` does both. The returned output tensor (allocated in the
    graph's pool) is overwritten by the next replay. Warm-up runs `fn` on a side stream before
    capture (lazy initialization, Triton compilation, cuBLAS workspaces) over the static
    inputs filled with `dummy_plan(key)`, so warm-up and capture write only to the scratch
    chunk. Pass one `pool` (`torch.cuda.graph_pool_handle()`) to every graph so their
    intermediate memory is shared: graphs replay one at a time.
    """

    def __init__(
        self,
        fn: Callable[[Mapping[str, torch.Tensor]], torch.Tensor],
        inputs: StaticInputs,
        *,
        pool: Any = None,
        warmup: int = 2,
    ) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("CUDA graphs need a CUDA device")
        super().__init__(fn, inputs)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(max(1, warmup)):
                fn(self.inputs.tensors)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        # thread_local: CUDA calls other threads make meanwhile (the server's, the caller's)
        # do not invalidate this capture.
        with torch.cuda.graph(self.graph, pool=pool, capture_error_mode="thread_local"):
            self.output = fn(self.inputs.tensors)

    def run(self) -> torch.Tensor:
        """Replay the graph over the static inputs as they are now."""
        self.graph.replay()
        assert self.output is not None
        return self.output

    def release(self) -> None:
        """Drop the graph (its memory returns to the shared pool)."""
        self.graph.reset()
        self.output = None
