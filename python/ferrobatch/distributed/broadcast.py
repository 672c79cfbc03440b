"""A step as a handful of tensors: rank 0 packs the plan, every other rank unpacks it.

One step = two broadcasts from rank 0: a fixed int32 header (`HEADER` entries: the command
and every length) and, when the command carries a plan, one int32 payload holding the
plan's arrays back to back. `PlanView` is the unpacked plan: the same fields the runner
reads from a `StepPlan` (ARCHITECTURE.md §3), so every rank runs the identical forward —
swaps included, since they are part of the plan.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

# commands
EXECUTE, GREEDY, WITH_PROMPT, NOOP, STOP = 1, 2, 3, 4, 5
HEADER = 16
_TYPES = ("full_attention", "sliding_attention")


@dataclass
class PlanView:
    """A step plan received from rank 0 (duck-types `StepPlan` for the runner)."""

    request_ids: list[str]
    input_ids: np.ndarray
    positions: np.ndarray
    cu_seqlens_q: np.ndarray
    seqlens_k: np.ndarray
    logits_indices: np.ndarray
    logits_rows: np.ndarray
    slot_mapping: dict[str, np.ndarray]
    block_tables: dict[str, np.ndarray]
    swap_out: np.ndarray
    swap_in: np.ndarray
    prev_token_index: np.ndarray
    page_size: int
    ahead: bool = False
    extra: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    prev_tokens: torch.Tensor | None = None  # rank 0's samples `prev_token_index` names

    @property
    def num_rows(self) -> int:
        return len(self.seqlens_k)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def num_sampled(self) -> int:
        return len(self.logits_indices)


def _i32(a: object) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(a, dtype=np.int32)).reshape(-1)


def pack(
    cmd: int, plan: object | None = None, extra: object = ()
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(header, payload) of a command; `extra`: prompt-logprob token indices (WITH_PROMPT)."""
    header = np.zeros(HEADER, np.int32)
    header[0] = cmd
    if plan is None:
        return torch.from_numpy(header), None
    B, T, N = len(plan.seqlens_k), len(plan.input_ids), len(plan.logits_indices)
    parts = [plan.input_ids, plan.positions, plan.cu_seqlens_q, plan.seqlens_k,
             plan.logits_indices, plan.logits_rows]
    header[1:4] = (B, T, N)
    slots, tables = plan.slot_mapping, plan.block_tables
    for i, t in enumerate(_TYPES):
        if t in tables:
            table = np.asarray(tables[t])
            header[4 + i] = 1 + (table.shape[1] if table.ndim == 2 else 0)
            parts += [slots[t], table]
    swap_out, swap_in = np.asarray(plan.swap_out), np.asarray(plan.swap_in)
    header[6], header[7] = len(swap_out), len(swap_in)
    parts += [swap_out, swap_in]
    prev = np.asarray(plan.prev_token_index)
    has_prev = bool(len(prev)) and bool((prev >= 0).any())
    header[8] = int(has_prev)
    if has_prev:
        parts.append(prev)
    extra = _i32(extra)
    header[9] = len(extra)
    parts.append(extra)
    header[10] = int(plan.page_size)
    header[11] = int(bool(getattr(plan, "ahead", False)))
    payload = np.concatenate([_i32(p) for p in parts]) if parts else np.zeros(0, np.int32)
    header[12] = len(payload)
    return torch.from_numpy(header), torch.from_numpy(payload)


def unpack(header: np.ndarray, payload: np.ndarray) -> PlanView:
    """The `PlanView` of a received header and payload."""
    B, T, N = (int(x) for x in header[1:4])
    pos = 0

    def take(n: int) -> np.ndarray:
        nonlocal pos
        out = payload[pos : pos + n]
        pos += n
        return out

    input_ids, positions = take(T), take(T)
    cu, seqlens_k = take(B + 1), take(B)
    logits_indices, logits_rows = take(N), take(N)
    slots, tables = {}, {}
    for i, t in enumerate(_TYPES):
        code = int(header[4 + i])
        if code:
            width = code - 1
            slots[t] = take(T)
            tables[t] = take(B * width).reshape(B, width)
    swap_out = take(2 * int(header[6])).reshape(-1, 2)
    swap_in = take(2 * int(header[7])).reshape(-1, 2)
    prev = take(T) if header[8] else np.full(T, -1, np.int32)
    extra = take(int(header[9]))
    return PlanView(
        request_ids=[f"r{i}" for i in range(B)], input_ids=input_ids, positions=positions,
        cu_seqlens_q=cu, seqlens_k=seqlens_k, logits_indices=logits_indices,
        logits_rows=logits_rows, slot_mapping=slots, block_tables=tables, swap_out=swap_out,
        swap_in=swap_in, prev_token_index=prev, page_size=int(header[10]),
        ahead=bool(header[11]), extra=extra,
    )


def send(cmd: int, plan: object | None = None, extra: object = (),
         device: torch.device | None = None, prev_tokens: torch.Tensor | None = None) -> None:
    """Rank 0: broadcast a command (and its plan) to every rank (NCCL: through `device`).

    `prev_tokens` (async batching: the previous plan's samples, which this plan's
    `prev_token_index` refers to) follow as a third broadcast, int64, straight from where
    they are (on CUDA a device tensor: no host sync)."""
    header, payload = pack(cmd, plan, extra)
    prev = None
    if payload is not None and header[8] and prev_tokens is not None:
        prev = prev_tokens.reshape(-1).to(torch.int64)
        header[13] = prev.numel()
    dist.broadcast(_to(header, device), src=0)
    if payload is not None:
        dist.broadcast(_to(payload, device), src=0)
    if prev is not None:
        dist.broadcast(prev, src=0)


def _to(t: torch.Tensor, device: torch.device | None) -> torch.Tensor:
    return t.to(device) if device is not None and device.type == "cuda" else t


def receive(device: torch.device | None = None) -> tuple[int, PlanView | None]:
    """Ranks > 0: the next command from rank 0 and its plan (None without one); the
    plan's `prev_tokens` is rank 0's samples it refers to (None when it refers to none)."""
    header = _to(torch.zeros(HEADER, dtype=torch.int32), device)
    dist.broadcast(header, src=0)
    h = header.cpu().numpy()
    cmd = int(h[0])
    if cmd in (NOOP, STOP):
        return cmd, None
    payload = _to(torch.zeros(int(h[12]), dtype=torch.int32), device)
    dist.broadcast(payload, src=0)
    plan = unpack(h, payload.cpu().numpy())
    if h[13]:
        prev = torch.zeros(int(h[13]), dtype=torch.int64, device=device or "cpu")
        dist.broadcast(prev, src=0)
        plan.prev_tokens = prev
    return cmd, plan


def agree(value: int, device: torch.device | None = None) -> int:
    """Rank 0's `value` on every rank (e.g. the cache's `num_blocks`)."""
    t = _to(torch.tensor([int(value)], dtype=torch.int64), device)
    dist.broadcast(t, src=0)
    return int(t.cpu()[0])
