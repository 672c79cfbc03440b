"""`SpecController`: which requests get proposals each step, from which proposer, and when
speculation switches itself off (large batch, low acceptance)."""

from __future__ import annotations

import collections
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from ferrobatch.spec.config import SpeculativeConfig

if TYPE_CHECKING:
    from ferrobatch.core import Scheduler, StepOutput, StepPlan
    from ferrobatch.engine.request import Request

__all__ = ["SpecController", "Proposer"]

_EMA = 0.5  # weight of the newest step in a request's running acceptance rate
_GLOBAL_EMA = 0.2  # the same, engine-wide, per speculative row
_START_RATE = 0.5  # a new request's running rate: two steps of nothing accepted pause it


class Proposer(Protocol):
    """Gives `scheduler` proposals (`Scheduler.propose*`) for `ids`; returns how many got one."""

    def propose(self, scheduler: Scheduler, ids: list[str], reqs: Mapping[str, Request]) -> int: ...
    def forget(self, request_id: str) -> None: ...
    def close(self) -> None: ...


class NgramProposer:
    """Prompt lookup, in the core (`Scheduler.propose_ngram`: pure token logic)."""

    def __init__(self, cfg: SpeculativeConfig) -> None:
        self.k = cfg.num_speculative_tokens
        self.n_min = cfg.prompt_lookup_min
        self.n_max = cfg.prompt_lookup_max

    def propose(self, scheduler: Scheduler, ids: list[str], reqs: Mapping[str, Request]) -> int:
        return scheduler.propose_ngram(self.k, self.n_min, self.n_max, ids)

    def forget(self, request_id: str) -> None:
        pass

    def close(self) -> None:
        pass


class _Accept:
    """A request's running acceptance rate and backoff."""

    __slots__ = ("rate", "pause_until", "backoff")

    def __init__(self) -> None:
        self.rate = _START_RATE
        self.pause_until = 0
        self.backoff = 2


class SpecController:
    """Proposals before `schedule()`, acceptance bookkeeping after `update()`.

    A step speculates only while the running requests times `1 + k` stay within
    `max_spec_tokens_per_step`; a request whose running acceptance rate drops below
    `min_acceptance_rate` pauses (for 2, 4, 8, ... up to `max_backoff_steps` steps) and then
    tries again (a step at or above the rate halves the next pause); while the engine-wide
    rate is below it, new requests start paused. Requests with logprobs or a guide never
    speculate (their per-token extras are computed for one sampled position per row).
    """

    def __init__(self, cfg: SpeculativeConfig, proposer: Proposer) -> None:
        self.cfg = cfg
        self.proposer = proposer
        self.k = cfg.num_speculative_tokens
        self.step = 0
        self.accept: dict[str, _Accept] = {}
        # engine-wide running acceptance rate and the last pause given: a new request starts
        # paused when speculation has not been paying (a useless draft is not retried by
        # every new request)
        self.global_rate = _START_RATE
        self.global_backoff = 2
        self.stats: collections.Counter[str] = collections.Counter()

    def before_schedule(self, scheduler: Scheduler, reqs: Mapping[str, Request]) -> None:
        """Give proposals to the eligible decoding requests (nothing at large batch)."""
        self.step += 1
        if len(self.accept) > 2 * len(reqs) + 64:
            self.accept = {k: v for k, v in self.accept.items() if k in reqs}
        limit = self.cfg.max_spec_tokens_per_step
        running = scheduler.num_running
        if running == 0:
            return
        if limit is not None and running * (1 + self.k) > limit:
            self.stats["spec_skipped_batch"] += 1
            return
        ids = []
        for rid, req in reqs.items():
            if req.done.is_set() or not req.in_scheduler or not req.sstate.output_ids:
                continue
            p = req.params
            if p.logprobs is not None or req.sstate.guide is not None:
                continue
            a = self.accept.get(rid)
            if a is None:
                a = self.accept[rid] = self._new_accept()
            if a.pause_until > self.step:
                continue
            ids.append(rid)
        if ids:
            self.proposer.propose(scheduler, ids, reqs)

    def after_update(self, plan: StepPlan, rows: list[int], out: StepOutput) -> None:
        """Per speculative row: proposals carried vs accepted, into the running rates."""
        if len(set(rows)) == len(rows):
            return
        counts = np.bincount(np.asarray(rows, dtype=np.int64), minlength=plan.num_rows)
        delivered = np.bincount(
            np.asarray(out.rows, dtype=np.int64).clip(min=0), minlength=plan.num_rows
        )
        rids = plan.request_ids
        for r in np.nonzero(counts > 1)[0].tolist():
            proposed = int(counts[r]) - 1
            accepted = max(0, int(delivered[r]) - 1)
            self.stats["spec_steps_rows"] += 1
            a = self.accept.get(rids[r]) or self.accept.setdefault(rids[r], _Accept())
            a.rate = (1 - _EMA) * a.rate + _EMA * (accepted / proposed)
            self.global_rate = (1 - _GLOBAL_EMA) * self.global_rate + _GLOBAL_EMA * (
                accepted / proposed
            )
            if a.rate < self.cfg.min_acceptance_rate:
                a.pause_until = self.step + a.backoff
                self.global_backoff = a.backoff
                a.backoff = min(2 * a.backoff, self.cfg.max_backoff_steps)
                a.rate = self.cfg.min_acceptance_rate  # one good step resumes it
                self.stats["spec_backoffs"] += 1
            else:
                a.backoff = max(2, a.backoff // 2)

    def _new_accept(self) -> _Accept:
        a = _Accept()
        if self.global_rate < self.cfg.min_acceptance_rate:
            a.pause_until = self.step + self.global_backoff
            a.backoff = min(2 * self.global_backoff, self.cfg.max_backoff_steps)
            a.rate = self.cfg.min_acceptance_rate
        return a

    def forget(self, request_id: str) -> None:
        """A request left the engine."""
        self.accept.pop(request_id, None)
        self.proposer.forget(request_id)

    def engine_stats(self, sched: Mapping[str, Any]) -> dict[str, Any]:
        """The `Engine.stats()` entries: acceptance rate, tokens per speculative row."""
        rows = int(sched.get("spec_rows", 0))
        prop = int(sched.get("spec_proposed", 0))
        acc = int(sched.get("spec_accepted", 0))
        return {
            "spec_method": self.cfg.method,
            "spec_num_tokens": self.k,
            "spec_acceptance_rate": acc / prop if prop else 0.0,
            "spec_tokens_per_step": (rows + acc) / rows if rows else 1.0,
            "spec_skipped_batch_steps": self.stats["spec_skipped_batch"],
            "spec_backoffs": self.stats["spec_backoffs"],
        }

    def close(self) -> None:
        self.proposer.close()
