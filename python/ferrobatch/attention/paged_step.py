"""`PagedStep`: what the SDPA path of the attention layers needs for one step, built once
per step from the plan by `build_step` (gather indices, slot mappings, additive masks)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ferrobatch import _core
from ferrobatch.attention.kv_cache import PagedKVCache
from ferrobatch.model_config import SLIDING

if TYPE_CHECKING:
    from ferrobatch.core import StepPlan


@dataclass
class _PrefillRow:
    """One multi-token row of one attention type."""

    tok_start: int
    tok_end: int
    cached_start: int  # offsets into the group's cached-key gather
    cached_end: int
    mask: torch.Tensor | None  # [q, cached + q] additive (0 / -inf); None with causal
    causal: bool


@dataclass
class _DecodeBucket:
    """Single-token rows of similar key length, attended together."""

    tokens: torch.Tensor | None  # [Bb] token indices; None when the bucket is all T tokens
    chunks: torch.Tensor  # [Bb * Wb] chunk ids to gather, row after row
    rows: int  # Bb
    keys: int  # Wb * page_size gathered keys per row
    mask: torch.Tensor | None  # [Bb, 1, 1, keys] additive; None when every key counts


@dataclass
class _KernelDecode:
    """The rows of one attention type for the in-place CPU kernel
    (`ferrobatch._core.paged_decode_attention`): every single-token row, and in the
    batch-invariant mode each token of the full-attention multi-token rows as a row of its
    own."""

    tokens: torch.Tensor | None  # [Bd] token indices; None when the rows are all T tokens
    block_tables: np.ndarray  # [Bd, W] int32
    seqlens: np.ndarray  # [Bd] int32
    window: int  # 0 = full attention


@dataclass
class _WindowRows:
    """Batch-invariant mode's multi-token rows of a sliding-window type: each token attended
    alone by the CPU kernel, as it would be in a decode step, over a scratch copy of its
    row's keys (the ring may not hold them all after the step's write). The scratch is
    `chunks` chunks of `page` slots; a row's window keys, cached ones from the group's
    gather and new ones from the forward, are copied to `cached_dest` / `new_dest`, and the
    kernel reads token `i` through `kernel.block_tables[i]` (no column wraps)."""

    kernel: _KernelDecode  # tokens, scratch tables, seqlens (position + 1), window
    chunks: int
    cached_dest: torch.Tensor | None  # [C] scratch slots of the gathered cached keys
    new_tokens: torch.Tensor  # [N] step tokens of these rows
    new_dest: torch.Tensor  # [N] their scratch slots


@dataclass
class _KernelPrefill:
    """The multi-token rows of one attention type for the tiled in-place CPU prefill kernel
    (`ferrobatch._core.paged_prefill_attention`): every row of a full-attention type, and
    the rows of a sliding type whose keys the ring still holds after this step's write."""

    tokens: torch.Tensor | None  # [Tp] token indices, row after row; None: all T tokens
    block_tables: np.ndarray  # [Bp, W] int32
    cu_seqlens_q: np.ndarray  # [Bp + 1] int32 token offsets of the rows in the kernel's q
    seqlens: np.ndarray  # [Bp] int32 keys of each row after this step
    window: int  # 0 = full attention


@dataclass
class _Group:
    """Per-step metadata of one attention type, shared by all its layers."""

    slot_mapping: torch.Tensor  # [T] long
    decode: list[_DecodeBucket]
    prefill_cached_slots: torch.Tensor | None  # all prefill rows' cached keys, row after row
    prefill: list[_PrefillRow]
    kernel_decode: _KernelDecode | None = None
    window_rows: _WindowRows | None = None
    kernel_prefill: _KernelPrefill | None = None


@dataclass
class PagedStep:
    """What the attention layers need for one step (built once by `build_step`)."""

    cache: PagedKVCache
    groups: list[_Group]  # per layer: the group of its attention type
    num_tokens: int
    calls: int = 0  # attention calls seen; the runner checks every layer came through here
    # dtype of the attention output (None: the query's); the runner asks for the cache's
    # when the next product rounds its input to it anyway (packed half-precision linears)
    out_dtype: torch.dtype | None = None


def build_step(
    plan: StepPlan,
    cache: PagedKVCache,
    layer_types: list[str],
    sliding_window: int | None,
    decode_kernel: bool = False,
    invariant: bool = False,
    prefill_kernel: bool = True,
) -> PagedStep:
    """Precompute gather indices and masks for every attention type of `plan`.

    Follows ARCHITECTURE.md §3: full attention reads positions `0 .. seqlens_k` through
    `block_tables["full_attention"]`; sliding attention reads a row's last `w` positions
    through its ring of `R` chunks. With `decode_kernel` (see `decode_kernel_available`),
    single-token rows are attended in place by the CPU decode kernel instead of gathered,
    and (with `prefill_kernel`) multi-token rows by the tiled CPU prefill kernel: every
    full-attention row, and each sliding row of at most `w` tokens whose span of keys
    (`min(seqlens_k, q + w - 1)`) fits the ring (`R * page`; else this step's write drops
    or overwrites keys its first tokens need, and the row keeps SDPA). With `invariant`
    (batch-invariant mode, with `decode_kernel`), every row goes to the decode kernel
    whatever its length: each token is then attended alone, in key order, as it would be in
    any other step (a sliding type's multi-token rows over a scratch copy of their window,
    `_WindowRows`).
    """
    page = cache.page_size
    device = cache.device
    cu = np.asarray(plan.cu_seqlens_q, dtype=np.int64)
    seqlens = np.asarray(plan.seqlens_k, dtype=np.int64)
    qlen = np.diff(cu)
    num_tokens = int(cu[-1])
    if (qlen < 1).any():
        raise ValueError("every row of a plan must have at least one query token")
    start = seqlens - qlen
    if (start < 0).any():
        raise ValueError("seqlens_k smaller than the row's query length")
    decode_rows = np.flatnonzero(qlen == 1)
    prefill_rows = np.flatnonzero(qlen > 1)
    all_decode = len(decode_rows) == len(qlen)

    # On CUDA from pinned memory: a non-blocking copy from pageable memory may sync.
    pin = device.type == "cuda"

    def to_long(a: np.ndarray) -> torch.Tensor:
        host = torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64))
        return (host.pin_memory() if pin else host).to(device, non_blocking=True)

    def additive(valid: np.ndarray) -> torch.Tensor:
        # Additive masks built once per step: SDPA would convert a bool mask in every layer.
        host = torch.from_numpy(np.where(valid, np.float32(0.0), np.float32(-np.inf)))
        host = host.to(cache.dtype)  # cast on the host: the copy up stays a plain copy
        return (host.pin_memory() if pin else host).to(device, non_blocking=True)

    groups: dict[str, _Group] = {}
    for typ in set(layer_types):
        sliding = typ == SLIDING
        if sliding and not sliding_window:
            raise ValueError("sliding layers need a sliding window")
        w = int(sliding_window) if sliding else 0
        table = np.asarray(plan.block_tables[typ], dtype=np.int32)
        if table.ndim != 2 or table.shape[0] != len(qlen):
            raise ValueError(f"block_tables[{typ!r}] must be [B, W]")
        ring = table.shape[1]
        slot_mapping = np.asarray(plan.slot_mapping[typ], dtype=np.int64)
        if slot_mapping.shape != (num_tokens,):
            raise ValueError(f"slot_mapping[{typ!r}] must have T={num_tokens} entries")

        ring_arg = ring if sliding else None  # the core's column rule (`_core.table_columns`)

        # Single-token rows: whole chunks gathered after this step's write (their one new
        # key is then in the cache), keys outside the row's range masked; rows bucketed by
        # length so short rows do not pay for the longest.
        decode: list[_DecodeBucket] = []
        kernel_decode = None
        # the batch-invariant mode: every multi-token row of full attention on the decode
        # kernel, one kernel row per token
        short = prefill_rows if decode_kernel and invariant and not sliding \
            else prefill_rows[:0]
        tiled = prefill_rows[:0]
        if decode_kernel and prefill_kernel and not invariant:
            # a sliding row: the core keeps only the step's last `w` new keys (earlier ones
            # go to scratch) and each new key overwrites the one `ring * page` back, so its
            # tokens find all their keys in the ring when `q <= w` and `q + w - 1 <= ring *
            # page` (ARCHITECTURE.md §3); longer rows keep the gather (before the write)
            q = qlen[prefill_rows]
            tiled = prefill_rows if not sliding else prefill_rows[
                (q <= w) & (np.minimum(seqlens[prefill_rows], q + w - 1) <= ring * page)]
        kernel_prefill = _prefill_rows(tiled, cu, seqlens, table, w, page, num_tokens,
                                       to_long, typ) if len(tiled) else None
        if (len(decode_rows) or len(short)) and decode_kernel:
            kernel_decode = _kernel_rows(decode_rows, short, cu, seqlens, table, w, page,
                                         num_tokens, to_long, typ)
        elif len(decode_rows):
            total = seqlens[decode_rows]
            if sliding:
                width = np.full(len(decode_rows), ring)
            else:
                width = -(-total // page)
                if width.max() > table.shape[1]:
                    raise ValueError(f"block_tables[{typ!r}] too narrow for seqlens_k")
            for idx in _buckets(width, page):
                rows = decode_rows[idx]
                wb = int(width[idx].max())
                chunk_ids = table[rows, :wb]
                last = total[idx][:, None] - 1
                if sliding:
                    # The keys the ring holds now: the row's last w positions, each at the
                    # column the core puts it in; every other gathered key is masked.
                    pos = last - np.arange(w)[None, :]
                    r_of, k_of = np.nonzero(pos >= 0)
                    p = pos[r_of, k_of]
                    valid = np.zeros((len(rows), wb * page), dtype=bool)
                    valid[r_of, _core.table_columns(p, page, ring) * page + p % page] = True
                else:
                    valid = np.arange(wb * page)[None, :] <= last
                decode.append(_DecodeBucket(
                    tokens=None if all_decode and len(idx) == len(qlen) else to_long(cu[rows]),
                    chunks=to_long(chunk_ids.reshape(-1)),
                    rows=len(rows),
                    keys=wb * page,
                    mask=None if valid.all() else additive(valid[:, None, None, :]),
                ))

        # Multi-token rows: cached keys gathered before the write, new keys from the forward.
        prefill: list[_PrefillRow] = []
        cached_parts: list[np.ndarray] = []
        offset = 0
        long_rows = np.setdiff1d(prefill_rows, np.concatenate([short, tiled]),
                                 assume_unique=True)
        window_rows = None
        if sliding and invariant and decode_kernel and len(long_rows):
            window_rows = _window_rows(long_rows, cu, start, qlen, w, page, to_long)
        for r in long_rows:
            s, q = int(start[r]), int(qlen[r])
            c0 = max(0, s - w + 1) if sliding else 0
            c = s - c0
            if c:
                cached_parts.append(
                    _core.slots(table, np.full(c, r), np.arange(c0, s), page, ring_arg)
                )
            if window_rows is not None:
                continue
            causal = c == 0 and (not sliding or q <= w)
            mask = None
            if not causal:
                q_pos = np.arange(s, s + q)[:, None]
                k_pos = np.arange(c0, s + q)[None, :]
                m = k_pos <= q_pos
                if sliding:
                    m &= k_pos > q_pos - w
                mask = additive(m)
            prefill.append(
                _PrefillRow(int(cu[r]), int(cu[r + 1]), offset, offset + c, mask, causal)
            )
            offset += c
        cached = to_long(np.concatenate(cached_parts)) if cached_parts else None
        groups[typ] = _Group(
            slot_mapping=to_long(slot_mapping),
            decode=decode,
            prefill_cached_slots=cached,
            prefill=prefill,
            kernel_decode=kernel_decode,
            window_rows=window_rows,
            kernel_prefill=kernel_prefill,
        )
    return PagedStep(cache=cache, groups=[groups[t] for t in layer_types], num_tokens=num_tokens)


def _prefill_rows(rows: np.ndarray, cu: np.ndarray, seqlens: np.ndarray, table: np.ndarray,
                  w: int, page: int, num_tokens: int, to_long: Any,
                  typ: str) -> _KernelPrefill:
    """The prefill kernel's rows `rows` (in plan order) and their tokens."""
    q = np.diff(cu)[rows]
    tokens = np.concatenate([np.arange(cu[r], cu[r + 1]) for r in rows])
    if not w and int(-(-seqlens[rows].max() // page)) > table.shape[1]:
        raise ValueError(f"block_tables[{typ!r}] too narrow for seqlens_k")
    return _KernelPrefill(
        tokens=None if len(tokens) == num_tokens else to_long(tokens),
        block_tables=np.ascontiguousarray(table[rows], dtype=np.int32),
        cu_seqlens_q=np.concatenate([[0], np.cumsum(q)]).astype(np.int32),
        seqlens=np.ascontiguousarray(seqlens[rows], dtype=np.int32),
        window=w,
    )


def _kernel_rows(decode_rows: np.ndarray, short: np.ndarray, cu: np.ndarray,
                 seqlens: np.ndarray, table: np.ndarray, w: int, page: int,
                 num_tokens: int, to_long: Any, typ: str) -> _KernelDecode:
    """The decode kernel's rows: each single-token row, and each token of the `short`
    multi-token rows (token `i` of row `r` sees the row's first `seqlens[r] - qlen[r] + i +
    1` keys), in token order."""
    rows = np.sort(np.concatenate([decode_rows, short]))
    q = np.diff(cu)[rows]
    tokens = np.concatenate([np.arange(cu[r], cu[r + 1]) for r in rows]) if len(short) \
        else cu[rows]
    last = np.repeat(seqlens[rows], q)
    offset = np.arange(len(tokens)) - np.repeat(np.cumsum(q) - q, q)  # 0 .. q-1 per row
    lens = last - np.repeat(q, q) + 1 + offset
    if not w and int(-(-lens.max() // page)) > table.shape[1]:
        raise ValueError(f"block_tables[{typ!r}] too narrow for seqlens_k")
    return _KernelDecode(
        tokens=None if len(tokens) == num_tokens else to_long(tokens),
        block_tables=np.ascontiguousarray(np.repeat(table[rows], q, axis=0), dtype=np.int32),
        seqlens=np.ascontiguousarray(lens, dtype=np.int32),
        window=w,
    )


def _window_rows(rows: np.ndarray, cu: np.ndarray, start: np.ndarray, qlen: np.ndarray,
                 w: int, page: int, to_long: Any) -> _WindowRows:
    """`_WindowRows` of the multi-token `rows` of a sliding type with window `w`: row `r`'s
    scratch holds positions `b0 * page .. end` (`b0` the chunk of its first window key `c0`,
    `end` = start + qlen) in chunks of its own, after the rows before it; the gathered cached
    keys (`c0 .. start`, in the order `build_step` gathers them) and the new keys go to their
    positions' slots there."""
    tokens, tables, seqlens, cached_dest, new_dest = [], [], [], [], []
    spans = []
    base = 0
    for r in rows:
        s, q = int(start[r]), int(qlen[r])
        end, c0 = s + q, max(0, s - w + 1)
        b0 = c0 // page
        spans.append((base, b0, end))
        first = base * page - b0 * page  # scratch slot of position p: first + p
        cached_dest.append(first + np.arange(c0, s))
        new_dest.append(first + np.arange(s, end))
        tokens.append(np.arange(cu[r], cu[r + 1]))
        seqlens.append(np.arange(s + 1, end + 1))
        base += -(-end // page) - b0
    width = max(-(-end // page) for _, _, end in spans)
    for (b, b0, end), q in zip(spans, qlen[rows], strict=True):
        # column j holds the row's scratch chunk j - b0 (the columns below b0 and beyond
        # its last chunk hold no key its tokens read: any of its chunks)
        table = b + np.clip(np.arange(width) - b0, 0, -(-end // page) - b0 - 1)
        tables.append(np.broadcast_to(table, (int(q), width)))
    cached = np.concatenate(cached_dest)
    token_ids = np.concatenate(tokens)
    return _WindowRows(
        kernel=_KernelDecode(
            tokens=to_long(token_ids),
            block_tables=np.ascontiguousarray(np.concatenate(tables), dtype=np.int32),
            seqlens=np.ascontiguousarray(np.concatenate(seqlens), dtype=np.int32),
            window=w,
        ),
        chunks=base,
        cached_dest=to_long(cached) if len(cached) else None,
        new_tokens=to_long(token_ids),
        new_dest=to_long(np.concatenate(new_dest)),
    )


_BUCKET_PENALTY_KEYS = 256  # one more gather + SDPA call costs about this many padded keys


def _buckets(width: np.ndarray, page: int) -> list[np.ndarray]:
    """Split rows (by gathered chunks `width`) into up to 4 equal-count length buckets when
    that saves more padded keys than the extra calls cost."""
    order = np.argsort(width, kind="stable")
    n = len(order)
    best_cost, best = n * int(width.max()) * page, [order]
    for k in (2, 3, 4):
        if n < 4 * k:
            break
        parts = np.array_split(order, k)
        cost = sum(len(p) * int(width[p].max()) for p in parts) * page
        cost += (k - 1) * _BUCKET_PENALTY_KEYS
        if cost < best_cost:
            best_cost, best = cost, parts
    if len(best) == 1:
        return [np.arange(n)]  # keep plan order: a single bucket needs no scatter
    return best
