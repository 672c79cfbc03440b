"""Shared helpers for the scheduler tests: a checking harness around ``ferrobatch.core.Scheduler``.

The harness plays the part of the Python runner. Every plan is checked from the outside against
the step contract (ARCHITECTURE.md §3) and against ``snapshot()``; then a tiny simulated KV cache
is run: every new token's "KV content" is written to the slot named by ``slot_mapping`` and every
cached key a row needs is READ BACK through ``block_tables`` (full and sliding ring formulas).
The content of position ``p`` of a request is a chained hash of its tokens ``0..=p``, so a wrong
block table, a stale block, a block shared with the wrong request or a lost swap shows up as a
wrong content (``strict`` mode asserts it; the simulated model turns it into a wrong token).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np
from ferrobatch.core import SCRATCH_CHUNK, ZERO_CHUNK, Scheduler, StepPlan

FULL = "full_attention"
SLIDING = "sliding_attention"

MASK64 = (1 << 64) - 1
SEED = 0x243F6A8885A308D3


def mix64(x: int) -> int:
    """splitmix64 finalizer: a deterministic 64-bit mixer (Python's hash() is salted for str)."""
    x &= MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def chain(prev: int, tok: int) -> int:
    """KV content of a token given the content of the previous position (causal chain)."""
    return mix64(prev ^ mix64(int(tok) + 0x9E3779B97F4A7C15))


def fold(values: Sequence[int], salt: int) -> int:
    h = mix64(salt)
    for v in values:
        h = mix64(h ^ v)
    return h


def contents_of(tokens: Sequence[int]) -> list[int]:
    out = []
    prev = SEED
    for t in tokens:
        prev = chain(prev, t)
        out.append(prev)
    return out


# ----------------------------------------------------------------------------------------------
# The simulated model (pure function of history) and the stop rules
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """Which attention types the model has and its window; the "model" reads keys per type."""

    layer_types: tuple[str, ...] = (FULL,)
    sliding_window: int | None = None
    vocab: int = 64

    @property
    def types(self) -> tuple[str, ...]:
        return tuple(t for t in (FULL, SLIDING) if t in self.layer_types)


def next_token_from_visible(spec: ModelSpec, visible: dict[str, list[int]]) -> int:
    """Token sampled from the keys the last query sees, per attention type (canonical order)."""
    h = SEED
    for ty in spec.types:
        h = mix64(h ^ fold(visible[ty], 0x1000 + len(ty)))
    return h % spec.vocab


def visible_window(spec: ModelSpec, ty: str, n: int) -> range:
    """Positions the query at position n-1 sees for attention type ty."""
    if ty == FULL:
        return range(0, n)
    w = spec.sliding_window
    return range(max(0, n - w), n)


def reference_next_token(spec: ModelSpec, tokens: Sequence[int]) -> int:
    cont = contents_of(tokens)
    n = len(tokens)
    return next_token_from_visible(
        spec, {ty: [cont[p] for p in visible_window(spec, ty, n)] for ty in spec.types}
    )


@dataclasses.dataclass
class ReqSpec:
    request_id: str
    prompt: list[int]
    max_new_tokens: int
    eos_token_ids: tuple[int, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    stop_sequences: tuple[tuple[int, ...], ...] = ()
    priority: int = 0


def finish_reason_after(spec: ReqSpec, generated: Sequence[int]) -> str | None:
    """Finish reason after the last generated token (stop wins over length, as in vLLM/HF)."""
    t = generated[-1]
    if t in spec.eos_token_ids or t in spec.stop_token_ids:
        return "stop"
    for s in spec.stop_sequences:
        if len(s) <= len(generated) and tuple(generated[-len(s):]) == tuple(s):
            return "stop"
    if len(generated) >= spec.max_new_tokens:
        return "length"
    return None


def reference_generate(model: ModelSpec, spec: ReqSpec) -> tuple[list[int], str]:
    """What an unconstrained engine must produce for spec with the simulated model."""
    tokens = list(spec.prompt)
    gen: list[int] = []
    cont = contents_of(tokens)
    while True:
        n = len(tokens)
        t = next_token_from_visible(
            model, {ty: [cont[p] for p in visible_window(model, ty, n)] for ty in model.types}
        )
        tokens.append(t)
        cont.append(chain(cont[-1], t))
        gen.append(t)
        r = finish_reason_after(spec, gen)
        if r is not None:
            return gen, r


# ----------------------------------------------------------------------------------------------
# snapshot() adapter
# ----------------------------------------------------------------------------------------------


def _get(obj, name, default=None):
    if isinstance(obj, dict):
        return obj.get(name, default)
    return getattr(obj, name, default)


@dataclasses.dataclass
class SnapReq:
    state: str
    num_computed_tokens: int
    num_tokens: int
    held: dict[str, list[int]]
    swap_slots: list[int]
    key: tuple[int, int] = (0, 0)  # (priority, arrival): queue order
    deferrals: int = 0  # steps put off to share a block another prefill fills


@dataclasses.dataclass
class Snap:
    requests: dict[str, SnapReq]
    refcounts: dict[int, int]
    free: list[int]  # uninitialized free chunks
    cached: list[int]  # free chunks keeping a hashed block, eviction order
    swap_free: list[int]
    swap_deferred: list[int]
    hashed: set[int]
    raw: object
    # chunk references held for outstanding plans (finished / cancelled requests' chunks,
    # pinned swap-out sources), one entry per reference
    deferred: list[int] = dataclasses.field(default_factory=list)
    num_outstanding: int = 0

    def held_chunks(self) -> set[int]:
        return {c for r in self.requests.values() for cs in r.held.values() for c in cs}


def read_snapshot(s: Scheduler) -> Snap:
    raw = s.snapshot()
    reqs = {}
    raw_reqs = _get(raw, "requests")
    items = raw_reqs.items() if isinstance(raw_reqs, dict) else [
        (_get(r, "request_id"), r) for r in raw_reqs
    ]
    for rid, r in items:
        held_raw = _get(r, "blocks")
        if held_raw is None:
            held_raw = _get(r, "held")
        held = {str(k): [int(c) for c in v] for k, v in dict(held_raw).items()}
        swap = _get(r, "swap_slots") or []
        if isinstance(swap, dict):
            swap = [c for v in swap.values() for c in v]
        reqs[str(rid)] = SnapReq(
            state=str(_get(r, "state")),
            num_computed_tokens=int(_get(r, "num_computed_tokens")),
            num_tokens=int(_get(r, "num_tokens")),
            held=held,
            swap_slots=[int(x) for x in swap],
            key=(int(_get(r, "priority", 0)), int(_get(r, "arrival", 0))),
            deferrals=int(_get(r, "admission_deferrals", 0)),
        )
    rc = _get(raw, "refcounts")
    if isinstance(rc, dict):
        refcounts = {int(k): int(v) for k, v in rc.items()}
    else:
        refcounts = {i: int(v) for i, v in enumerate(rc)}
    return Snap(
        requests=reqs,
        refcounts=refcounts,
        free=[int(c) for c in _get(raw, "free_chunks")],
        cached=[int(c) for c in _get(raw, "cached_chunks")],
        swap_free=[int(c) for c in _get(raw, "swap_free_slots") or []],
        swap_deferred=[int(c) for c in _get(raw, "swap_deferred_slots") or []],
        hashed={int(c) for c in _get(raw, "hashed_chunks") or []},
        raw=raw,
        deferred=[int(c) for c in _get(raw, "deferred_chunks") or []],
        num_outstanding=int(_get(raw, "num_outstanding", 0) or 0),
    )


# ----------------------------------------------------------------------------------------------
# The harness
# ----------------------------------------------------------------------------------------------


class ContractError(AssertionError):
    pass


def check(cond: bool, msg: str, *args) -> None:
    if not cond:
        raise ContractError(msg % args if args else msg)


@dataclasses.dataclass
class Track:
    spec: ReqSpec
    arrival: int
    generated: list[int] = dataclasses.field(default_factory=list)
    contents: list[int] = dataclasses.field(default_factory=list)
    computed: int = 0  # tokens whose KV the request has in cache (per the plans we saw)
    ever_scheduled: bool = False
    resets_seen: int = 0  # scheduler num_soft_resets when this request last ran
    finished: bool = False
    finish_reason: str | None = None
    cancel_pending: bool = False  # cancel() returned True, delta not seen yet
    sampled_in_plan: bool = False

    @property
    def tokens(self) -> list[int]:
        return self.spec.prompt + self.generated

    def __post_init__(self):
        self.contents = contents_of(self.spec.prompt)


def synthetic_step_seconds(plan: StepPlan, salt: int) -> float:
    """A synthetic machine's time for `plan` (for the step-time budget's cost model): 2 ms a
    step, 1 ms a query token, 0.5 ms per thousand keys attended, +-20% deterministic noise."""
    cu = np.asarray(plan.cu_seqlens_q)
    seqlens = np.asarray(plan.seqlens_k)
    q = cu[1:] - cu[:-1]
    start = seqlens - q
    keys = float(np.sum(q * start + q * (q + 1) / 2))
    ms = 2.0 + float(q.sum()) + 0.5 * keys / 1000.0
    return ms * (0.8 + 0.4 * ((salt * 7919) % 101) / 100.0) / 1000.0


@dataclasses.dataclass
class SchedConfig:
    num_blocks: int
    page_size: int
    max_batch_tokens: int
    max_requests_per_batch: int = 256
    scheduler_type: str = "fifo"
    safety_margin: float | None = None
    allow_block_sharing: bool = True
    layer_types: tuple[str, ...] = (FULL,)
    sliding_window: int | None = None
    cpu_offload_blocks: int = 0
    max_batch_cache_tokens: int | None = None
    # step-time budget (ms); the Harness then reports `synthetic_step_seconds` after updates
    max_step_ms: float | None = None

    def make(self) -> Scheduler:
        kw = dict(
            max_requests_per_batch=self.max_requests_per_batch,
            scheduler_type=self.scheduler_type,
            safety_margin=self.safety_margin,
            allow_block_sharing=self.allow_block_sharing,
            layer_types=list(self.layer_types),
            sliding_window=self.sliding_window,
            cpu_offload_blocks=self.cpu_offload_blocks,
        )
        if self.max_batch_cache_tokens is not None:
            kw["max_batch_cache_tokens"] = self.max_batch_cache_tokens
        if self.max_step_ms is not None:
            kw["max_step_ms"] = self.max_step_ms
        return Scheduler(self.num_blocks, self.page_size, self.max_batch_tokens, **kw)

    @property
    def model(self) -> ModelSpec:
        return ModelSpec(layer_types=self.layer_types, sliding_window=self.sliding_window)

    @property
    def ring(self) -> int:
        w = self.sliding_window
        return -(-w // self.page_size) + 1


class Harness:
    """Drives a Scheduler and checks every plan and every output against the contract.

    strict: assert every read-back KV content equals the true one (the state-machine test);
    with strict=False wrong contents only change the simulated model's tokens (the sim test).
    """

    def __init__(self, cfg: SchedConfig, *, strict: bool = True, use_snapshot: bool = True,
                 vocab: int = 64):
        self.cfg = cfg
        self.s = cfg.make()
        self.model = dataclasses.replace(cfg.model, vocab=vocab)
        self.types = self.model.types
        self.strict = strict
        self.use_snapshot = use_snapshot
        self.ps = cfg.page_size
        self.kv: dict[str, dict[int, int]] = {ty: {} for ty in self.types}
        self.swap: dict[int, dict[str, list[int | None]]] = {}
        self.tracks: dict[str, Track] = {}
        self.order = 0
        self.plan = None
        self.plan_rows: list[dict] = []
        self.steps = 0
        self.finished_order: list[str] = []
        self.plans_seen = 0
        self.last_snapshot: Snap | None = None
        self.read_mismatches = 0

    # ------------------------------------------------------------------ requests
    def add(self, spec: ReqSpec) -> None:
        self.s.add_request(
            spec.request_id,
            list(spec.prompt),
            spec.max_new_tokens,
            eos_token_ids=list(spec.eos_token_ids),
            stop_token_ids=list(spec.stop_token_ids),
            priority=spec.priority,
            **({"stop_sequences": [list(s) for s in spec.stop_sequences]}
               if spec.stop_sequences else {}),
        )
        self.tracks[spec.request_id] = Track(spec=spec, arrival=self.order)
        self.order += 1

    def cancel(self, rid: str) -> bool:
        tr = self.tracks.get(rid)
        ok = self.s.cancel(rid)
        expected = tr is not None and not tr.finished and not tr.cancel_pending
        check(ok == expected, "cancel(%r) returned %r, expected %r", rid, ok, expected)
        if ok:
            tr.cancel_pending = True
        return ok

    def live(self) -> list[str]:
        return [r for r, t in self.tracks.items() if not t.finished and not t.cancel_pending]

    def unfinished(self) -> list[str]:
        return [r for r, t in self.tracks.items() if not t.finished]

    # ------------------------------------------------------------------ schedule + checks
    def schedule(self):
        check(self.plan is None, "harness: schedule() with a plan outstanding")
        resets_before = self.stats()["num_soft_resets"]
        before = read_snapshot(self.s) if self.use_snapshot else None
        plan = self.s.schedule()
        self.steps += 1
        if plan is None:
            self.plan_rows = []
            self.after_schedule_none()
            return None
        self.plan = plan
        self.plans_seen += 1
        snap = read_snapshot(self.s) if self.use_snapshot else None
        self.last_snapshot = snap
        resets_after = self.stats()["num_soft_resets"]
        self.check_plan(plan, snap, resets_before, resets_after)
        if snap is not None:
            self.check_snapshot(snap)
            self.check_order(plan, before, snap)
        self.s.check_invariants()
        return plan

    def check_order(self, plan, before: Snap, after: Snap) -> None:
        """Queue discipline seen from outside: requests that were running keep their rows
        first, grouped by phase (fifo: decodes then in-flight prefills; prefill_first: the
        reverse), each group in (priority, arrival) order; then admissions (waiting and
        swapped merged) in key order, head of line: no waiting/swapped request is passed over
        by one with a larger key, except a waiting one put off in this very step to share a
        block the step fills (in-batch prefix sharing: once per request)."""
        rids = list(plan.request_ids)
        running_before = {r for r, sr in before.requests.items()
                          if sr.state in ("prefilling", "decoding")}
        phase = {r: before.requests[r].state for r in running_before}
        old = [r for r in rids if r in running_before]
        new = [r for r in rids if r not in running_before]
        if self.s.prefill_budget_ms > 0:  # the step-time budget bound: the fair order
            self.check_fair_order(rids, before, after, phase)
            old = []  # admissions are checked below; running rows were checked here
        else:
            check(rids == old + new, "admitted rows %s come before running rows %s", new, old)
        first, second = (("decoding", "prefilling") if self.cfg.scheduler_type == "fifo"
                         else ("prefilling", "decoding"))
        want_old = (sorted([r for r in old if phase[r] == first], key=lambda r: after.requests[
            r].key) + sorted([r for r in old if phase[r] == second],
                             key=lambda r: after.requests[r].key))
        check(old == want_old, "%s: running rows in order %s, expected %s",
              self.cfg.scheduler_type, old, want_old)
        # preemption victims: newest first, never one already placed in this step, never the
        # last active request
        victims = {r for r in running_before if r in after.requests
                   and after.requests[r].state in ("waiting", "swapped")}
        if victims:
            check(running_before - victims, "every running request was preempted: %s", victims)
            for v in victims:
                check(v not in rids, "preempted %s still has a row", v)
                for r in running_before - victims:
                    if before.requests[r].key > before.requests[v].key:
                        check(r in rids, "%s (key %s) preempted while newer %s (key %s) kept its "
                              "cache without running in this step", v, before.requests[v].key,
                              r, before.requests[r].key)
        # eviction: cached chunks are reclaimed only once no uninitialized chunk is left, and
        # in LRU order (head of the cached list first; prefix hits leave the list)
        held_after = after.held_chunks()
        evicted = [c for c in before.cached if c in held_after and c not in after.hashed]
        hits = {c for c in before.cached if c in held_after and c in after.hashed}
        if evicted:
            left = set(before.free) & set(after.free)
            check(not left, "cached chunks %s evicted while uninitialized %s were free",
                  evicted, sorted(left))
            lru = [c for c in before.cached if c not in hits]
            k = len([c for c in lru if c in evicted])
            check(set(lru[:k]) == set(evicted) & set(lru),
                  "eviction not in LRU order: evicted %s, cached list was %s (hits %s)",
                  evicted, before.cached, sorted(hits))
        keys = [after.requests[r].key for r in new]
        check(keys == sorted(keys), "admissions out of (priority, arrival) order: %s",
              list(zip(new, keys, strict=True)))
        if new:
            top = max(keys)
            for r, sr in after.requests.items():
                if sr.state in ("waiting", "swapped") and r not in rids:
                    put_off = (sr.state == "waiting" and r in before.requests
                               and sr.deferrals > before.requests[r].deferrals)
                    check(sr.key > top or put_off, "%s (key %s) passed over by admitted %s "
                          "(key %s)", r, sr.key, new[keys.index(top)], top)

    def check_fair_order(self, rids: list[str], before: Snap, after: Snap,
                         phase: dict[str, str]) -> None:
        """Row order of a step planned with the step-time budget binding (ARCHITECTURE.md,
        "Step-time budget"): decodes in key order; the oldest in-flight prefill (the anchor),
        which always has a row unless preempted or the row / token budgets ran out; the
        admissions; the other in-flight prefills, shortest remaining prompt first."""
        key = before.requests
        decodes = [r for r in rids if phase.get(r) == "decoding"]
        check(decodes == sorted(decodes, key=lambda r: key[r].key), "decodes out of order %s",
              decodes)
        check(rids[:len(decodes)] == decodes, "decodes not first: %s", rids)
        rest = rids[len(decodes):]
        prefilling = sorted((r for r, st in phase.items() if st == "prefilling"),
                            key=lambda r: key[r].key)
        if prefilling and rest and rest[0] == prefilling[0]:
            rest = rest[1:]
        elif prefilling:
            anchor = prefilling[0]
            preempted = anchor not in after.requests or after.requests[anchor].state in (
                "waiting", "swapped")
            full = (len(rids) >= self.cfg.max_requests_per_batch
                    or len(self.plan.input_ids) >= self.cfg.max_batch_tokens)
            check(preempted or full, "the oldest in-flight prefill %s has no row first among "
                  "the prefills: %s", anchor, rids)
        others = [r for r in rest if phase.get(r) == "prefilling"]
        admitted = [r for r in rest if r not in phase]
        check(rest == admitted + others, "admissions %s not before the other prefills %s",
              admitted, others)

        def remaining(r: str) -> int:
            return key[r].num_tokens - key[r].num_computed_tokens

        check(others == sorted(others, key=lambda r: (remaining(r), key[r].key)),
              "in-flight prefills not shortest remaining first: %s", others)

    def stats(self) -> dict:
        return dict(self.s.stats())

    def after_schedule_none(self) -> None:
        self.s.check_invariants()
        if self.use_snapshot:
            snap = read_snapshot(self.s)
            self.check_snapshot(snap)

    def check_plan(self, plan, snap: Snap | None, resets_before: int, resets_after: int) -> None:
        cfg, ps = self.cfg, self.ps
        rids = list(plan.request_ids)
        B = len(rids)
        check(B >= 1, "plan with no rows")
        check(len(set(rids)) == B, "duplicate request in plan: %r", rids)
        check(B <= cfg.max_requests_per_batch, "B=%d > max_requests_per_batch=%d", B,
              cfg.max_requests_per_batch)
        arrays = {}
        for name in ("input_ids", "positions", "cu_seqlens_q", "seqlens_k", "logits_indices"):
            a = getattr(plan, name)
            check(isinstance(a, np.ndarray), "%s is not a numpy array", name)
            check(a.dtype == np.int32, "%s dtype %s", name, a.dtype)
            check(a.flags["C_CONTIGUOUS"], "%s not C-contiguous", name)
            arrays[name] = a
        ids, pos, cu, sk, li = (arrays[n] for n in ("input_ids", "positions", "cu_seqlens_q",
                                                     "seqlens_k", "logits_indices"))
        T = len(ids)
        check(pos.shape == (T,), "positions shape %s, T=%d", pos.shape, T)
        check(cu.shape == (B + 1,), "cu_seqlens_q shape %s, B=%d", cu.shape, B)
        check(sk.shape == (B,), "seqlens_k shape %s", sk.shape)
        check(cu[0] == 0 and cu[-1] == T, "cu_seqlens_q ends %d..%d, T=%d", cu[0], cu[-1], T)
        check(T <= cfg.max_batch_tokens, "T=%d > max_batch_tokens=%d", T, cfg.max_batch_tokens)
        logits_rows = getattr(plan, "logits_rows", None)
        sm = {k: v for k, v in dict(plan.slot_mapping).items()}
        bt = {k: v for k, v in dict(plan.block_tables).items()}
        check(set(sm) == set(self.types), "slot_mapping types %s, model %s", set(sm),
              set(self.types))
        check(set(bt) == set(self.types), "block_tables types %s, model %s", set(bt),
              set(self.types))
        for ty in self.types:
            check(sm[ty].dtype == np.int32 and sm[ty].shape == (T,),
                  "slot_mapping[%s] dtype/shape %s %s", ty, sm[ty].dtype, sm[ty].shape)
            check(bt[ty].dtype == np.int32 and bt[ty].ndim == 2 and bt[ty].shape[0] == B,
                  "block_tables[%s] dtype/shape %s %s", ty, bt[ty].dtype, bt[ty].shape)
            check(bt[ty].flags["C_CONTIGUOUS"], "block_tables[%s] not C-contiguous", ty)
        if SLIDING in self.types:
            check(bt[SLIDING].shape[1] == cfg.ring, "sliding block table width %d, ring R=%d",
                  bt[SLIDING].shape[1], cfg.ring)
        swap_out = np.asarray(plan.swap_out)
        swap_in = np.asarray(plan.swap_in)
        for name, a in (("swap_out", swap_out), ("swap_in", swap_in)):
            check(a.dtype == np.int32, "%s dtype %s", name, a.dtype)
            check(a.ndim == 2 and a.shape[1] == 2, "%s shape %s", name, a.shape)
        if cfg.cpu_offload_blocks == 0:
            check(len(swap_out) == 0 and len(swap_in) == 0, "swaps without a CPU pool")

        # cache-read budget: keys read by all rows
        if cfg.max_batch_cache_tokens is not None:
            check(int(sk.sum()) <= cfg.max_batch_cache_tokens,
                  "sum(seqlens_k)=%d > max_batch_cache_tokens=%d", int(sk.sum()),
                  cfg.max_batch_cache_tokens)

        nb2 = cfg.num_blocks + 2
        # --- swaps: apply to the simulated cache (swap_out, then swap_in)
        out_slots = [int(x) for x in swap_out[:, 1]]
        in_slots = [int(x) for x in swap_in[:, 0]]
        out_chunks = [int(x) for x in swap_out[:, 0]]
        in_chunks = [int(x) for x in swap_in[:, 1]]
        check(len(set(out_slots)) == len(out_slots), "swap_out slot twice: %s", out_slots)
        check(len(set(in_slots)) == len(in_slots), "swap_in slot twice: %s", in_slots)
        check(len(set(out_chunks)) == len(out_chunks), "swap_out chunk twice: %s", out_chunks)
        check(len(set(in_chunks)) == len(in_chunks), "swap_in chunk twice: %s", in_chunks)
        check(not set(out_slots) & set(in_slots), "slot both swapped out and in: %s %s",
              out_slots, in_slots)
        for c in out_chunks + in_chunks:
            check(2 <= c < nb2, "swap references chunk %d outside data chunks 2..%d", c, nb2)
        for sl in out_slots + in_slots:
            check(0 <= sl < cfg.cpu_offload_blocks, "swap slot %d outside 0..%d", sl,
                  cfg.cpu_offload_blocks)
        for sl in in_slots:
            check(sl in self.swap, "swap_in from slot %d that holds nothing", sl)
        for c, sl in zip(out_chunks, out_slots, strict=True):
            self.swap[sl] = {ty: [self.kv[ty].get(c * ps + i) for i in range(ps)]
                             for ty in self.types}
        for sl, c in zip(in_slots, in_chunks, strict=True):
            data = self.swap.pop(sl)
            for ty in self.types:
                for i in range(ps):
                    v = data[ty][i]
                    if v is None:
                        self.kv[ty].pop(c * ps + i, None)
                    else:
                        self.kv[ty][c * ps + i] = v

        # --- rows
        written: dict[str, dict[int, tuple[str, int]]] = {ty: {} for ty in self.types}
        sampled_rows = []
        self.plan_rows = []
        for r, rid in enumerate(rids):
            tr = self.tracks.get(rid)
            check(tr is not None, "plan row for unknown request %r", rid)
            check(not tr.finished, "plan row for finished request %r", rid)
            check(not tr.cancel_pending, "plan row for cancelled request %r", rid)
            a, b = int(cu[r]), int(cu[r + 1])
            q = b - a
            check(q >= 1, "row %d (%s) has %d query tokens", r, rid, q)
            start = int(pos[a])
            end = start + q
            toks = tr.tokens
            check(list(pos[a:b]) == list(range(start, end)),
                  "row %s positions not contiguous: %s", rid, list(pos[a:b]))
            check(int(sk[r]) == end, "row %s seqlens_k %d != start %d + q %d", rid, int(sk[r]),
                  start, q)
            check(end <= len(toks), "row %s runs to %d past its %d known tokens", rid, end,
                  len(toks))
            check([int(x) for x in ids[a:b]] == toks[start:end],
                  "row %s input_ids %s != tokens[%d:%d] %s", rid, list(ids[a:b]), start, end,
                  toks[start:end])
            # positions continue where the request left off (or restart block-aligned after a
            # soft reset / on first admission with a prefix hit)
            if start != tr.computed:
                first = not tr.ever_scheduled
                reset = resets_after > tr.resets_seen
                check(first or reset,
                      "row %s starts at %d but the request had computed %d (no reset seen)",
                      rid, start, tr.computed)
                check(start % ps == 0, "row %s restarts at %d, not block aligned", rid, start)
            check(start < len(toks), "row %s computes nothing new", rid)
            if snap is not None:
                sr = snap.requests.get(rid)
                check(sr is not None, "request %s in plan but not in snapshot", rid)
            # block tables
            held_rows = {}
            for ty in self.types:
                row = [int(x) for x in bt[ty][r]]
                for c in row:
                    check(0 <= c < nb2 and c != SCRATCH_CHUNK,
                          "block_tables[%s] row %s has chunk %d", ty, rid, c)
                if ty == FULL:
                    need = -(-end // ps)
                    check(all(c >= 2 for c in row[:need]),
                          "full block table row %s missing blocks for %d tokens: %s", rid, end,
                          row)
                    nz = [c for c in row if c != 0]
                    check(row[: len(nz)] == nz, "full block table row %s has holes: %s", rid,
                          row)
                    check(len(set(nz)) == len(nz), "full block table row %s repeats: %s", rid,
                          row)
                    if snap is not None:
                        check(nz == sr.held.get(FULL, []),
                              "full block table row %s %s != held %s", rid, nz,
                              sr.held.get(FULL))
                else:
                    nz = [c for c in row if c != 0]
                    check(len(set(nz)) == len(nz), "sliding ring row %s repeats: %s", rid, row)
                    if snap is not None:
                        check(sorted(nz) == sorted(sr.held.get(SLIDING, [])),
                              "sliding ring row %s %s != held %s", rid, nz,
                              sr.held.get(SLIDING))
                held_rows[ty] = row
            # read back the cached keys this row needs (before any write of this step)
            visible = {}
            first_prev = None
            for ty in self.types:
                row = held_rows[ty]
                if ty == FULL:
                    rng = range(0, start)
                else:
                    rng = range(max(0, start - self.cfg.sliding_window + 1), start)
                vals = []
                for p in rng:
                    c = self._chunk_for(ty, row, p)
                    check(c >= 2, "row %s reads position %d of %s from chunk %d", rid, p, ty, c)
                    v = self.kv[ty].get(c * ps + p % ps)
                    if v != tr.contents[p]:
                        self.read_mismatches += 1
                        if self.strict:
                            raise ContractError(
                                f"row {rid}: {ty} key at position {p} (chunk {c}) holds "
                                f"{'nothing' if v is None else 'another content'}"
                            )
                    vals.append(v if v is not None else 0)
                visible[ty] = vals
                if start > 0 and first_prev is None and vals:
                    first_prev = vals[-1]
            # the forward: new contents chain from what the cache gave back
            prev = SEED if start == 0 else (first_prev if first_prev is not None else SEED)
            new_contents = []
            for t in toks[start:end]:
                prev = chain(prev, t)
                new_contents.append(prev)
            # writes
            for ty in self.types:
                row = held_rows[ty]
                for i in range(q):
                    p = start + i
                    slot = int(sm[ty][a + i])
                    c, off = divmod(slot, ps)
                    check(0 <= slot < nb2 * ps, "slot %d out of range", slot)
                    check(c != ZERO_CHUNK, "row %s writes position %d into the zero chunk", rid,
                          p)
                    if c == SCRATCH_CHUNK:
                        check(ty == SLIDING, "row %s writes full-attention position %d to "
                              "scratch", rid, p)
                        check(p < end - self.cfg.sliding_window + 1,
                              "row %s sends position %d to scratch but the window needs it "
                              "(end %d, w %d)", rid, p, end, self.cfg.sliding_window)
                        continue
                    want = self._chunk_for(ty, row, p) * ps + p % ps
                    check(slot == want, "row %s %s position %d written to slot %d, formula "
                          "says %d", rid, ty, p, slot, want)
                    check(off == p % ps, "offset")
                    check(slot not in written[ty], "%s slot %d written twice in one step "
                          "(%s and %s pos %d)", ty, slot, written[ty].get(slot), rid, p)
                    written[ty][slot] = (rid, p)
                    if snap is not None:
                        check(c in snap.requests[rid].held.get(ty, []),
                              "row %s writes chunk %d it does not hold", rid, c)
                        check(snap.refcounts.get(c, 0) == 1,
                              "row %s writes chunk %d shared by %d holders", rid, c,
                              snap.refcounts.get(c, 0))
            # visible keys of the last query: cached reads + new keys
            n_vis = end
            vis_full = {}
            for ty in self.types:
                rng = visible_window(self.model, ty, n_vis)
                cached_part = visible[ty]
                cached_lo = 0 if ty == FULL else max(0, start - self.cfg.sliding_window + 1)
                seq = []
                for p in rng:
                    if p >= start:
                        seq.append(new_contents[p - start])
                    else:
                        seq.append(cached_part[p - cached_lo])
                vis_full[ty] = seq
            sampled = end == len(toks)
            if sampled:
                sampled_rows.append(r)
            self.plan_rows.append(dict(rid=rid, start=start, end=end, sampled=sampled,
                                       visible=vis_full, new_contents=new_contents))
            tr.computed = end
            tr.ever_scheduled = True
            tr.resets_seen = resets_after
        # commit the writes (after all reads: read first, then write)
        for ty in self.types:
            for slot, (rid, p) in written[ty].items():
                row = next(x for x in self.plan_rows if x["rid"] == rid)
                self.kv[ty][slot] = row["new_contents"][p - row["start"]]
        # sampling rows
        check(li.dtype == np.int32, "logits_indices dtype")
        want_li = [int(cu[r + 1]) - 1 for r in sampled_rows]
        check([int(x) for x in li] == want_li,
              "logits_indices %s, expected last token of rows that reach their end %s",
              list(li), want_li)
        if logits_rows is not None:
            check([int(x) for x in logits_rows] == sampled_rows, "logits_rows %s != %s",
                  list(logits_rows), sampled_rows)
        for r in range(B):
            self.tracks[rids[r]].sampled_in_plan = r in sampled_rows

    def _chunk_for(self, ty: str, row: list[int], p: int) -> int:
        if ty == FULL:
            i = p // self.ps
            return row[i] if i < len(row) else 0
        return row[(p // self.ps) % self.cfg.ring]

    # ------------------------------------------------------------------ snapshot checks
    def check_snapshot(self, snap: Snap) -> None:
        cfg = self.cfg
        nb2 = cfg.num_blocks + 2
        unfinished = set(self.unfinished())
        pending_cancel = {r for r in unfinished if self.tracks[r].cancel_pending}
        in_snap = set(snap.requests)
        check(unfinished - pending_cancel <= in_snap,
              "requests lost from the scheduler: %s", sorted(unfinished - pending_cancel - in_snap))
        check(in_snap <= unfinished, "scheduler holds requests already reported finished: %s",
              sorted(in_snap - unfinished))
        holders: dict[int, int] = {}
        used_slots: list[int] = []
        for rid, sr in snap.requests.items():
            tr = self.tracks[rid]
            check(sr.num_tokens == len(tr.tokens), "snapshot %s num_tokens %d != %d", rid,
                  sr.num_tokens, len(tr.tokens))
            chunks_of_req = []
            for ty, chunks in sr.held.items():
                check(ty in self.types, "snapshot holds type %s not in the model", ty)
                for c in chunks:
                    check(2 <= c < nb2, "request %s holds chunk %d (reserved or out of range)",
                          rid, c)
                    holders[c] = holders.get(c, 0) + 1
                chunks_of_req += chunks
            check(len(set(chunks_of_req)) == len(chunks_of_req),
                  "request %s holds a chunk twice: %s", rid, sr.held)
            if SLIDING in sr.held:
                check(len(sr.held[SLIDING]) <= cfg.ring, "request %s holds %d ring chunks > R=%d",
                      rid, len(sr.held[SLIDING]), cfg.ring)
            used_slots += sr.swap_slots
        # references held for outstanding plans count as holders (chunk lifetime)
        for c in snap.deferred:
            check(2 <= c < nb2, "deferred chunk %d out of range", c)
            holders[c] = holders.get(c, 0) + 1
        for c in range(nb2):
            rc = snap.refcounts.get(c, 0)
            if c < 2:
                continue
            check(rc == holders.get(c, 0), "chunk %d refcount %d but %d holders", c, rc,
                  holders.get(c, 0))
        free, cached = snap.free, snap.cached
        for name, lst in (("free", free), ("cached", cached)):
            for c in lst:
                check(2 <= c < nb2, "%s list has chunk %d", name, c)
                check(c not in holders, "chunk %d is %s but held", c, name)
            check(len(set(lst)) == len(lst), "%s list has duplicates", name)
        check(not set(free) & set(cached), "chunk both free and cached")
        total = len(free) + len(cached) + len(holders)
        check(total == cfg.num_blocks, "chunks not conserved: free %d + cached %d + held %d != %d",
              len(free), len(cached), len(holders), cfg.num_blocks)
        check(len(set(used_slots)) == len(used_slots), "swap slot held twice: %s", used_slots)
        for sl in used_slots:
            check(0 <= sl < cfg.cpu_offload_blocks, "swap slot %d out of range", sl)
        all_slots = used_slots + snap.swap_free + snap.swap_deferred
        check(sorted(all_slots) == list(range(cfg.cpu_offload_blocks)),
              "swap slots not conserved: held %s free %s deferred %s", used_slots,
              snap.swap_free, snap.swap_deferred)
        # a held swap slot holds the request's data: it must be one the simulated pool filled
        for sl in used_slots:
            check(sl in self.swap, "request holds swap slot %d that no swap_out filled", sl)
        if not cfg.allow_block_sharing or SLIDING in self.types:
            check(all(v <= 1 for v in holders.values()), "chunk shared without prefix sharing")
        st = self.stats()
        check(st["num_blocks"] == cfg.num_blocks, "stats num_blocks")
        check(st["num_free_blocks"] + st["num_used_blocks"] == cfg.num_blocks,
              "stats free+used != num_blocks: %s", st)
        check(st["num_used_blocks"] == len(holders), "stats num_used_blocks %d != held %d",
              st["num_used_blocks"], len(holders))
        check(st["num_cached_blocks"] == len(cached), "stats num_cached_blocks %d != %d",
              st["num_cached_blocks"], len(cached))
        check(st["num_free_blocks"] == len(free) + len(cached),
              "stats num_free_blocks %d != uninit %d + cached %d", st["num_free_blocks"],
              len(free), len(cached))
        check(st["waiting"] + st["running"] + st.get("swapped", 0) == len(snap.requests)
              or pending_cancel, "stats waiting+running+swapped != live requests: %s", st)

    # ------------------------------------------------------------------ update + checks
    def update(self, tokens: Sequence[int]):
        plan = self.plan
        check(plan is not None, "harness: update() without a plan")
        arr = np.asarray(tokens, dtype=np.int32)
        n = len(plan.logits_indices)
        check(len(arr) == n, "harness gave %d tokens for %d sampled rows", len(arr), n)
        out = self.s.update(arr)
        self.plan = None
        if self.cfg.max_step_ms is not None:
            self.s.report_step_time(synthetic_step_seconds(plan, self.plans_seen))
        sampled = [row for row in self.plan_rows if row["sampled"]]
        got_token = {row["rid"]: int(t) for row, t in zip(sampled, arr, strict=True)}
        self.check_deltas(out, got_token)
        self.s.check_invariants()
        if self.use_snapshot:
            snap = read_snapshot(self.s)
            self.check_snapshot(snap)
            for rid, sr in snap.requests.items():
                tr = self.tracks[rid]
                if any(row["rid"] == rid for row in self.plan_rows) and sr.state.lower() not in (
                        "waiting", "pending", "swapped"):
                    check(sr.num_computed_tokens == tr.computed,
                          "snapshot %s num_computed_tokens %d != %d from the plans", rid,
                          sr.num_computed_tokens, tr.computed)
        return out

    def check_output_views(self, out) -> None:
        """The StepOutput array views the engine uses must agree with the delta sequence."""
        deltas = list(out)
        n = len(deltas)
        check(len(out) == n, "len(StepOutput) %d != %d deltas", len(out), n)
        ids = list(out.request_ids)
        check(ids == [str(d.request_id) for d in deltas], "StepOutput.request_ids %s", ids)
        tok = np.asarray(out.token_ids)
        check(tok.dtype == np.int32 and tok.shape == (n,), "token_ids %s %s", tok.dtype,
              tok.shape)
        fin = np.asarray(out.finished)
        check(fin.shape == (n,), "finished shape %s", fin.shape)
        rows = np.asarray(out.rows)
        check(rows.shape == (n,), "rows shape %s", rows.shape)
        sampled_rows = {row["rid"]: r for r, row in enumerate(self.plan_rows)}
        for i, d in enumerate(deltas):
            new = [int(x) for x in d.new_token_ids]
            check(new == ([int(tok[i])] if tok[i] >= 0 else []),
                  "token_ids[%d]=%d vs delta tokens %s", i, int(tok[i]), new)
            check(bool(fin[i]) == bool(d.finished), "finished[%d] view mismatch", i)
            check(list(out.finish_reasons)[i] == d.finish_reason, "finish_reasons[%d]", i)
            if tok[i] >= 0:
                check(int(rows[i]) == sampled_rows.get(str(d.request_id), -2),
                      "rows[%d]=%d, plan row of %s is %s", i, int(rows[i]), d.request_id,
                      sampled_rows.get(str(d.request_id)))
            else:
                check(int(rows[i]) == -1, "rows[%d] of a tokenless delta is %d", i,
                      int(rows[i]))
        check(bool(out.all_have_token) == all(int(t) >= 0 for t in tok), "all_have_token")
        check(int(out.num_finished) == int(fin.sum()), "num_finished")
        check(list(out.finished_request_ids) == [str(d.request_id) for d in deltas
                                                  if d.finished], "finished_request_ids")

    def check_deltas(self, out, got_token: dict[str, int]) -> None:
        self.check_output_views(out)
        seen = set()
        for d in out:
            rid = str(d.request_id)
            check(rid not in seen, "two deltas for %s in one update", rid)
            seen.add(rid)
            tr = self.tracks.get(rid)
            check(tr is not None, "delta for unknown request %r", rid)
            check(not tr.finished, "delta for already finished request %r", rid)
            new = [int(x) for x in d.new_token_ids]
            if tr.cancel_pending:
                check(d.finished and d.finish_reason == "cancelled",
                      "cancelled request %s reported finished=%r reason=%r", rid, d.finished,
                      d.finish_reason)
                check(new in ([], [got_token.get(rid)]),
                      "cancelled %s delta tokens %s", rid, new)
                if new:
                    tr.generated.append(new[0])
                tr.finished = True
                tr.finish_reason = "cancelled"
                self.finished_order.append(rid)
                continue
            check(rid in got_token, "delta for %s which was not sampled this step", rid)
            t = got_token[rid]
            check(new == [t], "delta %s new_token_ids %s, sampled %d", rid, new, t)
            tr.generated.append(t)
            tr.contents.append(chain(tr.contents[-1], t))
            want = finish_reason_after(tr.spec, tr.generated)
            check(bool(d.finished) == (want is not None),
                  "%s finished=%r, expected reason %r after %s", rid, d.finished, want,
                  tr.generated)
            check(d.finish_reason == want, "%s finish_reason %r, expected %r", rid,
                  d.finish_reason, want)
            if want is not None:
                tr.finished = True
                tr.finish_reason = want
                self.finished_order.append(rid)
        for rid in got_token:
            tr = self.tracks[rid]
            check(rid in seen, "sampled request %s got no delta", rid)
        for rid, tr in self.tracks.items():
            if tr.cancel_pending and not tr.finished:
                raise ContractError(f"cancelled request {rid} not reported in this update")

    # ------------------------------------------------------------------ driving
    def model_tokens(self) -> list[int]:
        """The simulated model's tokens for the sampled rows, from the read-back keys."""
        return [next_token_from_visible(self.model, row["visible"])
                for row in self.plan_rows if row["sampled"]]

    def step(self, sampler: Callable[[], list[int]] | None = None) -> bool:
        plan = self.schedule()
        if plan is None:
            return False
        toks = sampler() if sampler is not None else self.model_tokens()
        self.update(toks)
        return True

    def flush_cancels(self) -> None:
        """Cancelled requests are reported in the next update; when nothing is scheduled, an
        update with no tokens must deliver them."""
        if any(t.cancel_pending and not t.finished for t in self.tracks.values()):
            check(self.plan is None, "harness: flush with a plan")
            out = self.s.update(np.zeros(0, dtype=np.int32))
            self.check_deltas(out, {})

    def run_to_completion(self, max_steps: int = 20000, sampler=None) -> None:
        if self.plan is not None:
            self.update(sampler() if sampler else self.model_tokens())
        idle = 0
        for _ in range(max_steps):
            if self.step(sampler):
                idle = 0
                continue
            self.flush_cancels()
            if not self.s.has_unfinished() and not self.unfinished():
                break
            idle += 1
            check(idle < 3, "schedule() returns None but requests are unfinished: %s (stats %s)",
                  self.unfinished(), self.stats())
        else:
            raise ContractError(f"did not finish in {max_steps} steps")
        self.check_drained()

    def check_drained(self) -> None:
        check(not self.s.has_unfinished(), "has_unfinished() after everything finished")
        for rid, tr in self.tracks.items():
            check(tr.finished, "request %s never finished", rid)
        st = self.stats()
        check(st["num_used_blocks"] == 0, "blocks leaked at the end: %s", st)
        check(st["num_free_blocks"] == self.cfg.num_blocks,
              "free != num_blocks at the end: %s", st)
        check(st["waiting"] == 0 and st["running"] == 0, "queues not empty at the end: %s", st)
        if self.use_snapshot:
            snap = read_snapshot(self.s)
            check(not snap.requests, "snapshot still holds requests: %s", list(snap.requests))
            check(len(snap.free) + len(snap.cached) == self.cfg.num_blocks,
                  "chunks not all free/cached at the end")
            check(all(v == 0 for c, v in snap.refcounts.items() if c >= 2), "refcounts left")
        self.s.check_invariants()

    def outputs(self) -> dict[str, tuple[list[int], str | None]]:
        return {r: (t.generated, t.finish_reason) for r, t in self.tracks.items()}


# ----------------------------------------------------------------------------------------------
# One plan ahead: schedule_ahead() with up to two plans outstanding
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Launched:
    """A plan whose simulated forward ran, waiting for its update()."""

    plan: object
    rows: list[str]  # request id per row
    sampled_rids: list[str]  # request id per sampled token (logits_indices order)
    tokens: list[int]  # the tokens the simulated model sampled, same order
    # (chunk, request id of the row that references it) from the block tables / slots
    refs: list[tuple[int, str]]
    swap_out_src: list[int]
    swap_in_dst: list[int]
    swap_slots: list[int]


class AheadHarness:
    """Drives a Scheduler with up to two plans outstanding, as an async engine does:
    ``schedule()`` with none outstanding, ``schedule_ahead()`` with one (planning step N+1
    before step N's tokens are known), ``update()`` of the oldest, ``cancel()``, ``add``.

    It plays the device: each plan's forward runs when the plan is made (in plan order),
    resolving ``prev_token_index`` from the previous plan's sampled tokens, reading every
    cached key back through ``block_tables`` from a simulated KV cache (asserting the content)
    and writing through ``slot_mapping``; sampled tokens come from the read-back keys. After
    every call it checks from outside (``snapshot()``): chunk and swap-slot conservation with
    the references held for outstanding plans (``deferred_chunks``), and the chunk lifetime:
    every chunk an outstanding plan references is held, not free or cached, and held by no
    other request than its row's (unless it is a shared hashed block).
    """

    def __init__(self, cfg: SchedConfig, vocab: int = 64) -> None:
        self.cfg = cfg
        self.s = cfg.make()
        self.model = dataclasses.replace(cfg.model, vocab=vocab)
        self.types = self.model.types
        self.ps = cfg.page_size
        self.kv: dict[str, dict[int, int]] = {ty: {} for ty in self.types}
        self.swap: dict[int, dict[str, list[int | None]]] = {}
        self.specs: dict[str, ReqSpec] = {}
        self.generated: dict[str, list[int]] = {}  # caller-visible (from deltas)
        self.device: dict[str, list[int]] = {}  # prompt + tokens sampled by forwards so far
        self.queue: list[Launched] = []
        self.results: dict[str, tuple[list[int], str]] = {}
        self.cancel_pending: set[str] = set()
        self.ahead_plans = 0
        self.ahead_none = 0

    # ------------------------------------------------------------------ requests
    def add(self, spec: ReqSpec) -> None:
        self.s.add_request(
            spec.request_id, list(spec.prompt), spec.max_new_tokens,
            eos_token_ids=list(spec.eos_token_ids), stop_token_ids=list(spec.stop_token_ids),
            priority=spec.priority, stop_sequences=[list(q) for q in spec.stop_sequences],
        )
        self.specs[spec.request_id] = spec
        self.generated[spec.request_id] = []
        self.device[spec.request_id] = list(spec.prompt)
        self.check_state()

    def live(self) -> list[str]:
        return [r for r in self.specs if r not in self.results and r not in self.cancel_pending]

    def cancel(self, rid: str) -> bool:
        ok = self.s.cancel(rid)
        check(ok == (rid in self.specs and rid not in self.results
                     and rid not in self.cancel_pending), "cancel(%r) returned %r", rid, ok)
        if ok:
            self.cancel_pending.add(rid)
        self.check_state()
        return ok

    # ------------------------------------------------------------------ plans
    def schedule(self) -> object | None:
        """schedule(): refused (RuntimeError) unless nothing is outstanding."""
        return self._launch(ahead=False)

    def schedule_ahead(self) -> object | None:
        """schedule_ahead(): refused (RuntimeError) unless exactly one plan is outstanding."""
        return self._launch(ahead=True)

    def _launch(self, ahead: bool) -> object | None:
        n = len(self.queue)
        allowed = n == 1 if ahead else n == 0
        try:
            plan = self.s.schedule_ahead() if ahead else self.s.schedule()
        except RuntimeError as e:
            check(not allowed, "refused with %d outstanding: %s", n, e)
            check("outstanding" in str(e), "error does not name the problem: %s", e)
            check(self.s.num_outstanding == n, "num_outstanding changed by a refused call")
            return None
        check(allowed, "%s accepted with %d outstanding", "schedule_ahead" if ahead else
              "schedule", n)
        if plan is None:
            if ahead:
                self.ahead_none += 1
            check(self.s.num_outstanding == n, "num_outstanding %d after None (was %d)",
                  self.s.num_outstanding, n)
            self.check_state()
            return None
        check(bool(plan.ahead) == ahead, "plan.ahead %r", plan.ahead)
        check(self.s.num_outstanding == n + 1, "num_outstanding %d", self.s.num_outstanding)
        check(self.s.has_outstanding_plan, "has_outstanding_plan")
        if ahead:
            self.ahead_plans += 1
        prev = self.queue[-1] if self.queue else None
        self.queue.append(self._forward(plan, prev))
        self.check_state()
        return plan

    def _forward(self, plan, prev: Launched | None) -> Launched:
        cfg, ps = self.cfg, self.ps
        rids = [str(r) for r in plan.request_ids]
        B = len(rids)
        check(B >= 1 and len(set(rids)) == B, "plan rows %s", rids)
        ids, pos, cu, sk = (np.asarray(getattr(plan, n)) for n in
                            ("input_ids", "positions", "cu_seqlens_q", "seqlens_k"))
        pti = np.asarray(plan.prev_token_index)
        li = np.asarray(plan.logits_indices)
        T = len(ids)
        check(pti.dtype == np.int32 and pti.shape == (T,), "prev_token_index %s %s",
              pti.dtype, pti.shape)
        check(T <= cfg.max_batch_tokens and B <= cfg.max_requests_per_batch, "budgets")
        if cfg.max_batch_cache_tokens is not None:
            check(int(sk.sum()) <= cfg.max_batch_cache_tokens, "cache-read budget")
        if not plan.ahead:
            check(bool((pti == -1).all()), "schedule() plan with prev_token_index >= 0")
        swap_out, swap_in = np.asarray(plan.swap_out), np.asarray(plan.swap_in)
        if plan.ahead:
            check(len(swap_out) == 0 and len(swap_in) == 0, "ahead plan swaps")
        for c, sl in swap_out.tolist():
            self.swap[sl] = {ty: [self.kv[ty].get(c * ps + i) for i in range(ps)]
                             for ty in self.types}
        for sl, c in swap_in.tolist():
            data = self.swap.pop(sl)
            for ty in self.types:
                for i in range(ps):
                    if data[ty][i] is None:
                        self.kv[ty].pop(c * ps + i, None)
                    else:
                        self.kv[ty][c * ps + i] = data[ty][i]
        bt = {ty: np.asarray(a) for ty, a in dict(plan.block_tables).items()}
        sm = {ty: np.asarray(a) for ty, a in dict(plan.slot_mapping).items()}
        refs: list[tuple[int, str]] = []
        writes: dict[str, dict[int, int]] = {ty: {} for ty in self.types}
        sampled_rids, sampled_toks, want_li = [], [], []
        for r, rid in enumerate(rids):
            check(rid in self.specs and rid not in self.results, "row for finished %s", rid)
            check(rid not in self.cancel_pending, "row for cancelled %s", rid)
            toks = self.device[rid]
            cont = contents_of(toks)
            a, b = int(cu[r]), int(cu[r + 1])
            start, end = int(pos[a]), int(pos[a]) + (b - a)
            check(b > a and list(pos[a:b]) == list(range(start, end)), "row %s positions", rid)
            check(int(sk[r]) == end and end <= len(toks), "row %s seqlens_k/end", rid)
            for i in range(a, b):
                j = int(pti[i])
                if j >= 0:
                    check(prev is not None and j < len(prev.tokens), "prev_token_index %d", j)
                    check(int(ids[i]) == 0, "placeholder input id %d", int(ids[i]))
                    check(prev.sampled_rids[j] == rid, "prev_token_index %d names %s's token "
                          "for row %s", j, prev.sampled_rids[j], rid)
                    tok = prev.tokens[j]
                else:
                    tok = int(ids[i])
                check(tok == toks[start + i - a], "row %s input at position %d: %d != %d", rid,
                      start + i - a, tok, toks[start + i - a])
            visible = {}
            for ty in self.types:
                row = [int(c) for c in bt[ty][r]]
                refs += [(c, rid) for c in row if c >= 2]
                lo = 0 if ty == FULL else max(0, start - cfg.sliding_window + 1)
                vals = []
                for p in range(lo, start):
                    c = (row[p // ps] if ty == FULL else row[(p // ps) % cfg.ring])
                    v = self.kv[ty].get(c * ps + p % ps)
                    check(c >= 2 and v == cont[p], "row %s reads %s position %d from chunk %d: "
                          "wrong content", rid, ty, p, c)
                    vals.append(v)
                new = cont[start:end]
                seen = vals + new
                lo_vis = visible_window(self.model, ty, end).start
                visible[ty] = seen[lo_vis - lo:]
                for i in range(a, b):
                    slot = int(sm[ty][i])
                    c, p = slot // ps, start + i - a
                    if c == SCRATCH_CHUNK:
                        check(ty == SLIDING and p < end - cfg.sliding_window + 1, "scratch")
                        continue
                    want = (row[p // ps] if ty == FULL else row[(p // ps) % cfg.ring])
                    check(c == want and slot % ps == p % ps, "row %s slot of position %d", rid, p)
                    check(slot not in writes[ty], "%s slot %d written twice", ty, slot)
                    writes[ty][slot] = cont[p]
                    refs.append((c, rid))
            if end == len(toks):
                want_li.append(b - 1)
                sampled_rids.append(rid)
                sampled_toks.append(next_token_from_visible(self.model, visible))
        check([int(x) for x in li] == want_li, "logits_indices %s != %s", list(li), want_li)
        for ty in self.types:
            self.kv[ty].update(writes[ty])
        for rid, t in zip(sampled_rids, sampled_toks, strict=True):
            self.device[rid].append(t)
        return Launched(plan=plan, rows=rids, sampled_rids=sampled_rids, tokens=sampled_toks,
                        refs=refs, swap_out_src=[int(c) for c in swap_out[:, 0]],
                        swap_in_dst=[int(c) for c in swap_in[:, 1]],
                        swap_slots=[int(x) for x in swap_out[:, 1]] +
                        [int(x) for x in swap_in[:, 0]])

    # ------------------------------------------------------------------ update
    def update(self) -> object | None:
        """update() of the oldest outstanding plan (or update(()) with none: only reports)."""
        if self.queue:
            fl = self.queue.pop(0)
            out = self.s.update(np.asarray(fl.tokens, dtype=np.int32))
        else:
            fl = None
            out = self.s.update(())
        seen = set()
        for d in out:
            rid = str(d.request_id)
            check(rid not in seen and rid not in self.results, "second delta for %s", rid)
            seen.add(rid)
            new = [int(x) for x in d.new_token_ids]
            if rid in self.cancel_pending:
                check(d.finished and d.finish_reason == "cancelled" and not new,
                      "cancel of %s reported as %r %s", rid, d.finish_reason, new)
                self.cancel_pending.discard(rid)
                self.results[rid] = (self.generated[rid], "cancelled")
                continue
            check(fl is not None and rid in fl.sampled_rids and len(new) == 1,
                  "delta %s %s not from a sampled row", rid, new)
            gen = self.generated[rid]
            check(new[0] == self.device[rid][len(self.specs[rid].prompt) + len(gen)],
                  "delta of %s is not the token its forward sampled", rid)
            gen.append(new[0])
            want = finish_reason_after(self.specs[rid], gen)
            check(d.finish_reason == want and bool(d.finished) == (want is not None),
                  "%s finish %r, expected %r", rid, d.finish_reason, want)
            if want is not None:
                self.results[rid] = (gen, want)
        check(not self.cancel_pending, "cancellations %s not reported", self.cancel_pending)
        if fl is not None:
            for rid in fl.sampled_rids:
                # a row is dropped only when its request finished before this update
                check(rid in seen or rid in self.results, "sampled row of %s lost", rid)
        self.check_state()
        return out

    # ------------------------------------------------------------------ checks
    def check_state(self) -> None:
        self.s.check_invariants()
        snap = read_snapshot(self.s)
        cfg, nb2 = self.cfg, self.cfg.num_blocks + 2
        check(snap.num_outstanding == len(self.queue) == self.s.num_outstanding,
              "num_outstanding %d / %d, harness %d", snap.num_outstanding,
              self.s.num_outstanding, len(self.queue))
        live = set(self.specs) - set(self.results) - self.cancel_pending
        check(live <= set(snap.requests) <= live | self.cancel_pending,
              "requests lost or kept: %s vs %s", sorted(live), sorted(snap.requests))
        holders: dict[int, set[str]] = {}
        count: dict[int, int] = {}
        slots: list[int] = []
        for rid, sr in snap.requests.items():
            for cs in sr.held.values():
                for c in cs:
                    holders.setdefault(c, set()).add(rid)
                    count[c] = count.get(c, 0) + 1
            slots += sr.swap_slots
        for c in snap.deferred:
            count[c] = count.get(c, 0) + 1
        for c in range(2, nb2):
            check(snap.refcounts.get(c, 0) == count.get(c, 0), "chunk %d refcount %d, %d "
                  "references (requests + deferred)", c, snap.refcounts.get(c, 0),
                  count.get(c, 0))
        free = set(snap.free) | set(snap.cached)
        check(len(free) + len(count) == cfg.num_blocks, "chunks not conserved")
        check(not free & set(count), "a held chunk is free")
        check(sorted(slots + snap.swap_free + snap.swap_deferred)
              == list(range(cfg.cpu_offload_blocks)), "swap slots not conserved")
        sole = len(self.queue) == 1
        for k, fl in enumerate(self.queue):
            for c, rid in fl.refs:
                check(snap.refcounts.get(c, 0) > 0 and c not in free,
                      "chunk lifetime: chunk %d of outstanding plan %d (row %s) is free", c, k,
                      rid)
                others = holders.get(c, set()) - {rid}
                check(not others or c in snap.hashed, "chunk lifetime: chunk %d of outstanding "
                      "plan %d (row %s) now held by %s", c, k, rid, sorted(others))
            for c in fl.swap_in_dst + ([] if sole else fl.swap_out_src):
                check(snap.refcounts.get(c, 0) > 0, "chunk lifetime: swap chunk %d free", c)
            for sl in fl.swap_slots:
                check(sl not in snap.swap_free, "swap slot %d of outstanding plan free", sl)

    # ------------------------------------------------------------------ driving
    def drain(self, *, ahead: bool = True, max_steps: int = 20000) -> None:
        """Run to completion: pipelined (a plan ahead whenever one is outstanding) or not."""
        for _ in range(max_steps):
            if not self.queue:
                if not self.s.has_unfinished():
                    break
                if self.schedule() is None:
                    self.update()  # only cancellation reports remain
                    continue
            if ahead and len(self.queue) == 1:
                self.schedule_ahead()
            self.update()
        else:
            raise ContractError(f"did not finish in {max_steps} steps")
        check(not self.queue and not self.s.has_unfinished(), "not drained")
        check(set(self.results) == set(self.specs), "requests never finished: %s",
              sorted(set(self.specs) - set(self.results)))
        st = dict(self.s.stats())
        check(st["num_used_blocks"] == 0, "blocks leaked: %s", st)

    def check_outputs(self) -> None:
        """Every request that was not cancelled produced what an unconstrained run does."""
        for rid, (gen, reason) in self.results.items():
            if reason != "cancelled":
                want = reference_generate(self.model, self.specs[rid])
                check((gen, reason) == want, "%s: %s, expected %s", rid, (gen, reason), want)
