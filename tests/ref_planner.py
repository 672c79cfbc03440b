"""A small Python reference planner producing ARCHITECTURE.md §3 step plans, for tests.

It is deliberately naive (no budgets, no prefix cache): the test says which rows run and how
many tokens each; the planner allocates chunks, builds slot mappings and block tables by the
contract's formulas, and records swap pairs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import numpy as np

FULL = "full_attention"
SLIDING = "sliding_attention"
SCRATCH = 1


@dataclass
class RefRequest:
    rid: str
    tokens: list[int]
    computed: int = 0
    full: list[int] = field(default_factory=list)
    ring: list[int] = field(default_factory=list)  # 0 = not allocated
    swapped: dict | None = None


class RefPlanner:
    """Builds `StepPlan`-shaped objects (attribute names as in the contract)."""

    def __init__(self, *, page_size: int, num_blocks: int, layer_types: list[str],
                 sliding_window: int | None, swap_slots: int = 0) -> None:
        self.page = page_size
        self.types = [t for t in (FULL, SLIDING) if t in layer_types]
        self.w = sliding_window
        self.ring_len = math.ceil(sliding_window / page_size) + 1 if SLIDING in self.types else 0
        self.free = list(range(2, num_blocks + 2))
        self.free_slots = list(range(swap_slots))
        self.reqs: dict[str, RefRequest] = {}
        self.pending_out: list[tuple[int, int]] = []
        self.pending_in: list[tuple[int, int]] = []

    def _alloc(self) -> int:
        if not self.free:
            raise RuntimeError("reference planner out of chunks")
        return self.free.pop(0)

    def add(self, rid: str, tokens: list[int]) -> None:
        self.reqs[rid] = RefRequest(rid, list(tokens), ring=[0] * self.ring_len)

    def append(self, rid: str, token: int) -> None:
        self.reqs[rid].tokens.append(int(token))

    def remaining(self, rid: str) -> int:
        r = self.reqs[rid]
        return len(r.tokens) - r.computed

    def finish(self, rid: str) -> None:
        r = self.reqs.pop(rid)
        self.free.extend(r.full + [c for c in r.ring if c])

    def swap_out(self, rid: str) -> None:
        r = self.reqs[rid]
        chunks = r.full + [c for c in r.ring if c]
        slots = [self.free_slots.pop(0) for _ in chunks]
        self.pending_out += list(zip(chunks, slots, strict=True))
        r.swapped = {"full": len(r.full), "ring": [bool(c) for c in r.ring], "slots": slots}
        self.free.extend(chunks)
        r.full, r.ring = [], [0] * self.ring_len

    def swap_in(self, rid: str) -> None:
        r = self.reqs[rid]
        info, r.swapped = r.swapped, None
        slots = iter(info["slots"])
        for _ in range(info["full"]):
            c, s = self._alloc(), next(slots)
            r.full.append(c)
            self.pending_in.append((s, c))
            self.free_slots.append(s)
        for i, had in enumerate(info["ring"]):
            if had:
                c, s = self._alloc(), next(slots)
                r.ring[i] = c
                self.pending_in.append((s, c))
                self.free_slots.append(s)

    def plan(self, rows: list[tuple[str, int]]) -> SimpleNamespace:
        """One step: `rows` are (request id, number of its next tokens to run)."""
        page, w, R = self.page, self.w, self.ring_len
        ids, pos, cu, seqlens, lidx, lrows = [], [], [0], [], [], []
        slots = {t: [] for t in self.types}
        for b, (rid, n) in enumerate(rows):
            r = self.reqs[rid]
            assert r.swapped is None and 1 <= n <= len(r.tokens) - r.computed
            s, end = r.computed, r.computed + n
            ids += r.tokens[s:end]
            pos += list(range(s, end))
            if FULL in self.types:
                while len(r.full) * page < end:
                    r.full.append(self._alloc())
                slots[FULL] += [r.full[p // page] * page + p % page for p in range(s, end)]
            if SLIDING in self.types:
                for p in range(s, end):
                    if p >= end - w:  # the ring keeps it
                        col = (p // page) % R
                        if not r.ring[col]:
                            r.ring[col] = self._alloc()
                        slots[SLIDING].append(r.ring[col] * page + p % page)
                    else:
                        slots[SLIDING].append(SCRATCH * page + p % page)
            cu.append(cu[-1] + n)
            seqlens.append(end)
            if end == len(r.tokens):
                lidx.append(cu[-1] - 1)
                lrows.append(b)
            r.computed = end
        tables = {}
        if FULL in self.types:
            width = max(1, max(len(self.reqs[rid].full) for rid, _ in rows))
            t = np.zeros((len(rows), width), dtype=np.int32)
            for b, (rid, _) in enumerate(rows):
                f = self.reqs[rid].full
                t[b, : len(f)] = f
            tables[FULL] = t
        if SLIDING in self.types:
            tables[SLIDING] = np.array([self.reqs[rid].ring for rid, _ in rows], dtype=np.int32)
        i32 = lambda x: np.asarray(x, dtype=np.int32)  # noqa: E731
        plan = SimpleNamespace(
            request_ids=[rid for rid, _ in rows],
            input_ids=i32(ids), positions=i32(pos), cu_seqlens_q=i32(cu),
            seqlens_k=i32(seqlens), logits_indices=i32(lidx), logits_rows=i32(lrows),
            slot_mapping={t: i32(v) for t, v in slots.items()}, block_tables=tables,
            swap_out=i32(self.pending_out).reshape(-1, 2),
            swap_in=i32(self.pending_in).reshape(-1, 2),
            prev_token_index=np.full(len(ids), -1, dtype=np.int32), ahead=False,
        )
        self.pending_out, self.pending_in = [], []
        return plan


def drive_runner(runner: Any, prompts: list[list[int]], new: int,
                 forced: bool = False) -> list[Any]:
    """Prefill every prompt in one packed step, then `new` packed decode steps; the logits
    of every sampled row, step after step. Each row's next input is its argmax, or with
    `forced` a fixed token (so that runs that round differently see the same inputs)."""
    planner = RefPlanner(page_size=runner.page_size, num_blocks=runner.num_blocks,
                         layer_types=runner.layer_types, sliding_window=runner.sliding_window)
    rids = [f"r{i}" for i in range(len(prompts))]
    for rid, p in zip(rids, prompts, strict=True):
        planner.add(rid, p)
    out = []
    rows = [(rid, len(p)) for rid, p in zip(rids, prompts, strict=True)]
    for _ in range(new):
        plan = planner.plan(rows)
        logits = runner.execute(plan)
        out.append(logits)
        for i, b in enumerate(plan.logits_rows):
            tok = (7 * len(out) + i) % runner.vocab_size if forced else int(logits[i].argmax())
            planner.append(plan.request_ids[b], tok)
        rows = [(rid, 1) for rid in rids]
    return out
