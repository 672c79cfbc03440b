"""Embeddings: a prompt's final hidden states (the base model's output, after its final norm)
pooled into one vector, computed while the prompt is prefilled, chunk by chunk.

An embedding request is a request for one greedy token whose prompt rows the runner also
returns as hidden states (`ModelRunner.execute_with_rows`). A step finds, for each of its rows
that belongs to an embedding request, the token indices of the prompt positions the pooling
still needs (`PoolJob.of`): every position for "mean", the first for "cls", the last for
"last". `PoolJob.record` adds them to the request's `Pooled` state; a position is recorded
once, so a request recomputed after a soft reset skips those already done. "mean" and "cls"
requests take no prefix-cache hits (every position they pool must be computed); "last" ones
do (the last prompt position is always computed: it is the sampled row).
"""

from __future__ import annotations

import base64
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F

from ferrobatch.errors import FieldError

if TYPE_CHECKING:
    from ferrobatch.core import StepPlan

__all__ = ["POOLING_MODES", "PoolJob", "Pooled", "check_pooling", "encode_vector"]

#: the pooling modes `Engine.embed` takes
POOLING_MODES = ("last", "mean", "cls")


def check_pooling(pooling: Any, normalize: Any) -> tuple[str, bool]:
    """(`pooling`, `normalize`) validated: a `FieldError` naming the field otherwise."""
    if pooling not in POOLING_MODES:
        raise FieldError(f"pooling must be one of {list(POOLING_MODES)}, got {pooling!r}",
                         "pooling")
    if not isinstance(normalize, bool):
        raise FieldError(f"normalize must be a bool, got {normalize!r}", "normalize")
    return pooling, normalize


@dataclass
class Pooled:
    """One embedding request's pooling state: positions `0 .. next_pos` are recorded;
    `total` is the fp32 sum of the pooled rows ([hidden], on the runner's device)."""

    mode: str
    normalize: bool
    prompt_len: int
    next_pos: int = 0
    total: torch.Tensor | None = None
    count: int = 0
    # the positions this mode pools, [lo, hi)
    lo: int = field(init=False)
    hi: int = field(init=False)

    def __post_init__(self) -> None:
        self.lo, self.hi = {
            "mean": (0, self.prompt_len),
            "cls": (0, 1),
            "last": (self.prompt_len - 1, self.prompt_len),
        }[self.mode]
        self.next_pos = self.lo

    @property
    def needs_every_position(self) -> bool:
        """Whether it pools positions before the last (no prefix-cache hits then)."""
        return self.lo < self.prompt_len - 1

    @property
    def complete(self) -> bool:
        """Every pooled position recorded."""
        return self.next_pos >= self.hi

    def add(self, rows: torch.Tensor, upto: int) -> None:
        """Add hidden `rows` [k, hidden] (positions `next_pos .. upto`)."""
        s = rows.float().sum(dim=0)
        self.total = s if self.total is None else self.total + s
        self.count += rows.shape[0]
        self.next_pos = upto

    def vector(self) -> torch.Tensor:
        """The pooled embedding [hidden] (fp32, CPU), L2-normalized with `normalize`."""
        if not self.complete or self.total is None:
            raise RuntimeError("the embedding's prompt positions were not all computed")
        v = (self.total / self.count).cpu()
        return F.normalize(v, dim=0) if self.normalize else v


@dataclass
class PoolJob:
    """The prompt positions of one plan that embedding requests pool.

    `indices` [M] token indices into the plan (for the runner); `spans`: (request, start,
    count, upto) per request: its entries `start .. start+count` of `indices`, and the
    position after its last one."""

    indices: np.ndarray
    spans: list[tuple[Any, int, int, int]]

    @classmethod
    def of(cls, plan: StepPlan, pending: dict[str, Any]) -> PoolJob | None:
        """The job of `plan` for the requests in `pending` (by id; those complete or over
        are dropped from it). None when no row needs any."""
        for rid in [k for k, req in pending.items() if req.done.is_set() or req.pool.complete]:
            del pending[rid]
        if not pending:
            return None
        cu = np.asarray(plan.cu_seqlens_q)
        positions = np.asarray(plan.positions)
        parts, spans, total = [], [], 0
        for r, rid in enumerate(plan.request_ids):
            req = pending.get(rid)
            t0, t1 = int(cu[r]), int(cu[r + 1])
            if req is None or t1 <= t0:
                continue
            pool: Pooled = req.pool
            start = int(positions[t0])
            if start > pool.next_pos:
                raise RuntimeError(
                    f"embedding of {req.request_id!r}: positions {pool.next_pos}..{start} were "
                    "never computed (a prefix-cache hit?)"
                )
            lo, hi = pool.next_pos, min(start + (t1 - t0), pool.hi)
            if hi <= lo:
                continue
            parts.append(np.arange(t0 + (lo - start), t0 + (hi - start), dtype=np.int64))
            spans.append((req, total, hi - lo, hi))
            total += hi - lo
        if not spans:
            return None
        return cls(np.concatenate(parts), spans)

    def record(self, hidden: torch.Tensor) -> None:
        """Add each request's rows of `hidden` [M, hidden] (rows of `indices`)."""
        if hidden.shape[0] != len(self.indices):
            raise ValueError(f"got {hidden.shape[0]} hidden rows for {len(self.indices)}")
        for req, start, count, upto in self.spans:
            req.pool.add(hidden[start : start + count], upto)


def encode_vector(vector: list[float] | torch.Tensor, encoding_format: str) -> Any:
    """An embedding as the OpenAI API returns it: a list of floats ("float") or the
    base64 of its little-endian float32 bytes ("base64")."""
    arr = np.asarray(vector.tolist() if isinstance(vector, torch.Tensor) else vector,
                     dtype="<f4")
    if encoding_format == "float":
        return arr.astype(np.float64).tolist()
    if encoding_format == "base64":
        return base64.b64encode(arr.tobytes()).decode("ascii")
    raise FieldError(
        f"encoding_format must be 'float' or 'base64', got {encoding_format!r}",
        "encoding_format",
    )
