"""Bookkeeping of the async pipeline (`ferrobatch.engine.pipeline.AsyncStepper`) against a fake
scheduler and runner that follow the one-step-in-flight contract (ARCHITECTURE.md §3):
step N+1 is launched before N's tokens are recorded, its input ids come from N's sampled
tokens on the device, N+1 is sampled only after N's tokens reached the requests, and
finishes, cancellations and drains of the pipeline are handled."""

from __future__ import annotations

import collections
import types
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch
from ferrobatch.core import Scheduler
from ferrobatch.engine.pipeline import AsyncStepper, DeviceToHost
from ferrobatch.engine.request import make_request
from ferrobatch.engine.routing import OutputRouter
from ferrobatch.engine.stepper import Stepper
from ferrobatch.sampling.params import SamplingParams
from ferrobatch.sampling.sampler import Sampler

V = 97


def next_token(tok: int, pos: int) -> int:
    """The fake model: the next token depends on the input token and its position."""
    return (tok * 31 + pos * 7 + 5) % V


def reference(prompt: list[int], n: int, eos: int | None = None) -> list[int]:
    out: list[int] = []
    tok, pos = prompt[-1], len(prompt) - 1
    while len(out) < n:
        tok = next_token(tok, pos)
        pos += 1
        out.append(tok)
        if tok == eos:
            break
    return out


@dataclass
class _Req:
    rid: str
    tokens: list[int]
    prompt_len: int
    max_new: int
    eos: set[int]
    computed: int = 0  # tokens whose K/V exist (all but the last)
    generated: int = 0
    finished: bool = False
    cancelled: bool = False
    reported: bool = False


@dataclass
class _Plan:
    request_ids: list[str]
    input_ids: np.ndarray
    positions: np.ndarray
    logits_indices: np.ndarray
    logits_rows: np.ndarray
    prev_token_index: np.ndarray
    ahead: bool
    pid: int
    sampled_rids: list[str] = field(default_factory=list)


@dataclass
class _Delta:
    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None


class _StepOutput:
    """The part of `ferrobatch.core.StepOutput` the router reads: one row per delta, its
    token (-1: none), whether it finished and why."""

    def __init__(self, deltas: list[_Delta]) -> None:
        self.deltas = deltas
        self.request_ids = [d.request_id for d in deltas]
        self.token_ids = np.asarray([d.new_token_ids[0] if d.new_token_ids else -1
                                     for d in deltas], dtype=np.int32)  # fmt: skip
        self.finished = np.asarray([d.finished for d in deltas], dtype=bool)
        self.finish_reasons = [d.finish_reason for d in deltas]
        self.num_finished = int(self.finished.sum())

    def __iter__(self):
        return iter(self.deltas)

    def __len__(self) -> int:
        return len(self.deltas)


class FakeScheduler:
    """Whole-prompt prefills, one decode token per step, at most two outstanding plans."""

    def __init__(self, log: list[tuple[str, int]]) -> None:
        self.reqs: dict[str, _Req] = {}
        self.order: list[str] = []
        self.outstanding: collections.deque[_Plan] = collections.deque()
        self.log = log
        self.pids = 0
        self.pending_cancels: list[str] = []
        self.plans: list[_Plan] = []
        self.stall_at: set[int] = set()  # plan ids after which num_stalled reports a stall
        self.free_at: dict[int, int] = {}  # free chunks after a plan (with a swapped request)

    # no step-time budget (the engine gives none to the async pipeline)
    max_step_ms = None
    prefill_budget_tokens = 0

    # the scheduler's O(1) getters the pipeline reads after each ahead plan
    @property
    def num_stalled(self) -> int:
        return int(self.pids in self.stall_at)

    @property
    def num_swapped(self) -> int:
        return int(bool(self.free_at))

    wants_priority_preemption = False  # no priorities here

    @property
    def num_free_blocks(self) -> int:
        return self.free_at.get(self.pids, 10)

    @property
    def num_outstanding(self) -> int:
        return len(self.outstanding)

    def add_request(self, rid, prompt, max_new, *, eos_token_ids=(), stop_token_ids=()) -> None:
        self.reqs[rid] = _Req(rid, list(prompt), len(prompt), max_new,
                              set(eos_token_ids) | set(stop_token_ids))  # fmt: skip
        self.order.append(rid)

    def cancel(self, rid: str) -> None:
        r = self.reqs[rid]
        if not r.finished and not r.cancelled:
            r.cancelled = True
            self.pending_cancels.append(rid)

    def _live(self) -> list[_Req]:
        return [self.reqs[i] for i in self.order
                if not self.reqs[i].finished and not self.reqs[i].cancelled]  # fmt: skip

    def _build(self, rows: list[tuple[_Req, list[int], int, list[int]]], ahead: bool) -> _Plan:
        ids, pos, pti, li, lr = [], [], [], [], []
        for b, (_r, toks, start, prev) in enumerate(rows):
            ids += toks
            pos += list(range(start, start + len(toks)))
            pti += prev
            li.append(len(ids) - 1)
            lr.append(b)
        self.pids += 1
        i32 = lambda x: np.asarray(x, dtype=np.int32)  # noqa: E731
        plan = _Plan([r.rid for r, *_ in rows], i32(ids), i32(pos), i32(li), i32(lr), i32(pti),
                     ahead, self.pids, [r.rid for r, *_ in rows])  # fmt: skip
        self.outstanding.append(plan)
        self.plans.append(plan)
        self.log.append(("plan", plan.pid))
        return plan

    def schedule(self) -> _Plan | None:
        if self.outstanding:
            raise RuntimeError("a plan is outstanding")
        rows = []
        for r in self._live():
            toks = r.tokens[r.computed:]
            rows.append((r, toks, r.computed, [-1] * len(toks)))
        return self._build(rows, False) if rows else None

    def schedule_ahead(self) -> _Plan | None:
        if len(self.outstanding) != 1:
            raise RuntimeError("schedule_ahead needs exactly one outstanding plan")
        prev = self.outstanding[0]
        rows = []
        in_prev = {rid: j for j, rid in enumerate(prev.sampled_rids)}
        for r in self._live():
            if r.rid in in_prev:
                if r.generated + 1 >= r.max_new:
                    continue  # certain to finish with the outstanding plan's token
                pos = len(r.tokens)  # the unknown token's position
                rows.append((r, [0], pos, [in_prev[r.rid]]))
            else:
                toks = r.tokens[r.computed:]
                rows.append((r, toks, r.computed, [-1] * len(toks)))
        return self._build(rows, True) if rows else None

    def update(self, tokens) -> _StepOutput:
        out = [_Delta(rid, [], True, "cancelled") for rid in self.pending_cancels]
        self.pending_cancels = []
        if not self.outstanding:
            return _StepOutput(out)
        plan = self.outstanding.popleft()
        self.log.append(("update", plan.pid))
        tokens = np.asarray(tokens).tolist()
        assert len(tokens) == len(plan.sampled_rids)
        for rid, tok in zip(plan.sampled_rids, tokens, strict=True):
            r = self.reqs[rid]
            if r.finished or r.cancelled:
                continue  # dropped: finished in an earlier update or cancelled since
            r.computed = len(r.tokens)
            r.tokens.append(int(tok))
            r.generated += 1
            reason = None
            if tok in r.eos:
                reason = "stop"
            elif r.generated >= r.max_new:
                reason = "length"
            r.finished = reason is not None
            out.append(_Delta(rid, [int(tok)], r.finished, reason))
        return _StepOutput(out)


class FakeRunner:
    """Fills input ids from the previous step's samples as the real runner does, checks
    the contract, and returns logits that pick `next_token`."""

    fast_greedy = False  # no greedy head: every step through `execute`

    def __init__(self, log: list[tuple[str, int]]) -> None:
        self.log = log
        self.inputs: list[np.ndarray] = []

    def execute(self, plan: _Plan, prev_tokens: torch.Tensor | None = None) -> torch.Tensor:
        pti = torch.from_numpy(plan.prev_token_index).long()
        ids = torch.from_numpy(plan.input_ids).long()
        if (pti >= 0).any():
            assert prev_tokens is not None, "an ahead plan needs the previous step's tokens"
            ids = torch.where(pti >= 0, prev_tokens[pti.clamp(min=0)], ids)
        self.inputs.append(ids.numpy().copy())
        self.log.append(("execute", plan.pid))
        logits = torch.full((len(plan.logits_indices), V), -10.0)
        for j, t in enumerate(plan.logits_indices.tolist()):
            logits[j, next_token(int(ids[t]), int(plan.positions[t]))] = 10.0
        return logits


class SpySampler(Sampler):
    """Records, per sampled row, how many tokens its request had when it was sampled."""

    def __init__(self) -> None:
        super().__init__(seed=0)
        self.seen: list[list[int]] = []

    def sample(self, logits, states):  # type: ignore[override]
        self.seen.append([len(s.output_ids) for s in states])
        return super().sample(logits, states)


def _engine_like() -> types.SimpleNamespace:
    """What `make_request` reads of an engine; the fit check is a real scheduler's."""
    return types.SimpleNamespace(
        tokenizer=None, vocab_size=V, max_model_len=10_000, eos_token_ids=[],
        scheduler=Scheduler(num_blocks=10_000, page_size=8, max_batch_tokens=64),
    )  # fmt: skip


def _setup(async_: bool = True):
    log: list[tuple[str, int]] = []
    sched, runner, sampler = FakeScheduler(log), FakeRunner(log), SpySampler()
    stats: collections.Counter[str] = collections.Counter()
    router = OutputRouter(sched, stats)
    cls = AsyncStepper if async_ else Stepper
    return cls(sched, runner, sampler, router, stats), sched, runner, sampler, log


def _submit(stepper, prompt, sp, rid):
    req = make_request(_engine_like(), prompt, sp, rid, lambda: rid)
    stepper.router.requests[rid] = req
    stepper.inbox.append(req)
    return req


def _run(stepper, limit: int = 500) -> int:
    n = 0
    while stepper.step():
        n += 1
        assert n < limit
    return n


PROMPTS = [[5, 9, 11], [3], [40, 41, 42, 43, 44, 45, 46], [7, 7]]


@pytest.mark.parametrize("async_", [True, False], ids=["async", "sync"])
def test_outputs_follow_the_model_with_inputs_from_previous_samples(async_: bool) -> None:
    stepper, sched, runner, _, log = _setup(async_)
    reqs = [_submit(stepper, p, SamplingParams(max_new_tokens=3 + 2 * i), f"r{i}")
            for i, p in enumerate(PROMPTS)]  # fmt: skip
    _run(stepper)
    for i, r in enumerate(reqs):
        assert r.done.is_set() and r.output.finish_reason == "length"
        assert r.output.token_ids == reference(PROMPTS[i], 3 + 2 * i)
    assert sched.num_outstanding == 0 and not getattr(stepper, "in_flight", False)
    ahead = stepper.stats["ahead_steps"]
    if async_:
        assert ahead > 0
        # every plan but the first was planned ahead; the longest request runs 9 tokens
        assert stepper.stats["steps"] == ahead + 1 == 9
    else:
        assert ahead == 0


def test_next_step_is_launched_before_the_previous_is_recorded() -> None:
    stepper, sched, runner, sampler, log = _setup()
    for i, p in enumerate(PROMPTS):
        _submit(stepper, p, SamplingParams(max_new_tokens=4), f"r{i}")
    _run(stepper)
    pos = {ev: i for i, ev in enumerate(log)}
    pids = sorted({pid for _, pid in log})
    for pid in pids[1:]:
        # plan and forward of pid happen before the update of pid - 1
        assert pos[("plan", pid)] < pos[("execute", pid)] < pos[("update", pid - 1)]
    assert pos[("update", pids[-1])] == len(log) - 1
    # sampling of a step saw its requests' tokens of the step before (penalties, seeds):
    # a decode row at position p of a prompt of length L has p - L + 1 tokens recorded
    assert sampler.seen == [[0, 0, 0, 0], [1, 1, 1, 1], [2, 2, 2, 2], [3, 3, 3, 3]]


def test_finish_by_eos_mid_flight_drops_the_row_planned_ahead() -> None:
    prompt = [5, 9, 11]
    ref = reference(prompt, 20)
    eos = ref[2]  # the third token ends it; the fake scheduler cannot know ahead of time
    stepper, sched, runner, sampler, log = _setup()
    req = make_request(_engine_like(), prompt, SamplingParams(max_new_tokens=20), "e", lambda: "e")
    req.eos_token_ids = [eos]
    stepper.router.requests["e"] = req
    stepper.inbox.append(req)
    other = _submit(stepper, [1, 2], SamplingParams(max_new_tokens=8), "o")
    _run(stepper)
    assert req.output.token_ids == reference(prompt, 20, eos=eos) == ref[:3]
    assert req.output.finish_reason == "stop"
    assert other.output.token_ids == reference([1, 2], 8)
    # the eos request had a row in the plan launched before its eos was known: wasted, dropped
    assert sum("e" in p.request_ids for p in sched.plans) == 4
    assert stepper.stats["generated_tokens"] == 3 + 8


def test_cancel_mid_flight() -> None:
    stepper, sched, runner, sampler, log = _setup()
    a = _submit(stepper, [4, 5], SamplingParams(max_new_tokens=30), "a")
    b = _submit(stepper, [6], SamplingParams(max_new_tokens=6), "b")
    for _ in range(3):
        assert stepper.step()
    assert stepper.in_flight and sched.num_outstanding == 1
    stepper.cancel_inbox.append("a")
    _run(stepper)
    assert a.output.finish_reason == "cancelled"
    assert a.output.token_ids == reference([4, 5], 30)[: len(a.output.token_ids)]
    assert 1 <= len(a.output.token_ids) < 30
    assert b.output.token_ids == reference([6], 6) and b.output.finish_reason == "length"


def test_requests_arriving_while_a_step_is_in_flight_join_ahead_plans() -> None:
    stepper, sched, runner, sampler, log = _setup()
    a = _submit(stepper, [4, 5], SamplingParams(max_new_tokens=10), "a")
    assert stepper.step() and stepper.step()
    b = _submit(stepper, [8, 9, 10], SamplingParams(max_new_tokens=5), "b")
    assert stepper.step()
    _run(stepper)
    assert a.output.token_ids == reference([4, 5], 10)
    assert b.output.token_ids == reference([8, 9, 10], 5)
    assert stepper.stats["pipeline_drains"] == 1  # only at the very end


def test_close_with_a_step_in_flight() -> None:
    stepper, sched, *_ = _setup()
    _submit(stepper, [4, 5], SamplingParams(max_new_tokens=10), "a")
    assert stepper.step() and stepper.step()
    assert stepper.in_flight
    stepper.close()
    assert not stepper.in_flight


def test_errors_propagate_out_of_step() -> None:
    stepper, sched, runner, *_ = _setup()
    _submit(stepper, [4, 5], SamplingParams(max_new_tokens=10), "a")
    assert stepper.step()

    def boom(plan, prev_tokens=None):
        raise RuntimeError("device lost")

    runner.execute = boom
    with pytest.raises(RuntimeError, match="device lost"):
        stepper.step()


def test_cpu_transfers_are_identity_views() -> None:
    t = torch.arange(5)
    pending = DeviceToHost(torch.device("cpu")).start([t])
    assert pending.wait()[0] is t


def test_a_stalled_row_drains_the_pipeline_after_the_step() -> None:
    stepper, sched, runner, sampler, log = _setup()
    a = _submit(stepper, [4, 5], SamplingParams(max_new_tokens=8), "a")
    sched.stall_at = {3}  # the third plan (an ahead plan) leaves a row out
    _run(stepper)
    assert a.output.token_ids == reference([4, 5], 8)
    # plan 3 was followed by a drain: plan 4 came from schedule(), not schedule_ahead
    assert [p.ahead for p in sched.plans] == [False, True, True, False, True, True, True, True]
    assert stepper.stats["pipeline_drains"] == 2  # the stall, and the end
    assert stepper.stats["stall_drains"] == 1


def test_chunks_freed_while_a_request_is_swapped_drain_the_pipeline() -> None:
    stepper, sched, runner, sampler, log = _setup()
    a = _submit(stepper, [4, 5], SamplingParams(max_new_tokens=10), "a")
    # a swapped request exists throughout; free chunks: 10 after plans 2-3, 12 after plan 4
    sched.free_at = {4: 12}
    _run(stepper)
    assert a.output.token_ids == reference([4, 5], 10)
    ahead = [p.ahead for p in sched.plans]
    # plan 2 sets the baseline, plan 4 saw more free chunks: plan 5 came from schedule()
    assert ahead[:6] == [False, True, True, True, False, True]
    assert stepper.stats["swap_drains"] == 1 and stepper.stats["stall_drains"] == 0
