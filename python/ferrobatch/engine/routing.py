"""The engine's table of live requests and the delivery of each step's outputs to them:
tokens, detokenized text, stop strings, finishes, errors."""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ferrobatch.engine.request import Request

if TYPE_CHECKING:
    from ferrobatch.core import Scheduler, StepOutput

__all__ = ["OutputRouter"]

_FINISH_REASONS = ("stop", "length", "cancelled")


class OutputRouter:
    """Live requests by id, and what happens to them as tokens arrive or they end.

    `requests` is guarded by `lock`; `stats` counts generated tokens and finished requests.
    A stop string cancels its request in `scheduler`.
    """

    def __init__(self, scheduler: Scheduler, stats: collections.Counter[str]) -> None:
        self.requests: dict[str, Request] = {}
        self.lock = threading.Lock()
        self.scheduler = scheduler
        self.stats = stats
        # called with each request as it ends (finished, cancelled or failed), or None
        self.on_done: Callable[[Request], None] | None = None

    def route(
        self, step_out: StepOutput, lp_by_rid: dict[str, dict[int, float]], now: float
    ) -> None:
        """Hand each request its delta; the common case (one token, no streaming, no stop
        string, no logprobs) touches only plain lists."""
        rids = step_out.request_ids
        toks = step_out.token_ids.tolist()
        finished = step_out.finished.tolist() if step_out.num_finished else None
        reasons = step_out.finish_reasons if finished is not None else None
        requests = self.requests
        generated = 0
        for i, rid in enumerate(rids):
            t = toks[i]
            reason = None
            if finished is not None and finished[i]:
                reason = _reason(reasons[i])
            req = requests.get(rid)
            if req is None or req.done.is_set():
                continue  # already finished here (stop string, cancel)
            if reason is None and t >= 0 and req.plain:
                req.add_token(t, now)
                generated += 1
                continue
            self.deliver(req, [t] if t >= 0 else [], reason, lp_by_rid.get(rid), now)
        self.stats["generated_tokens"] += generated

    def deliver(
        self, req: Request, new: list[int], reason: str | None, lp: dict[int, float] | None,
        now: float,
    ) -> None:  # fmt: skip
        """Record `new` tokens, check stop strings, and tell the caller (or finish)."""
        if new:
            req.add_tokens(new, lp, now)
            self.stats["generated_tokens"] += len(new)
        text = req.detok.add(new) if new else ""
        if req.detok.stopped and reason != "stop":
            # a stop string: end it here; the scheduler must not run it again
            if reason is None:
                self.scheduler.cancel(req.request_id)
            reason = "stop"
        if reason is not None:
            self.finish(req, reason, new, text_so_far=text)
            return
        if req.listener is not None and (new or text):
            req.listener(req.delta(new, text, None))

    def cancel(self, req: Request) -> None:
        """End a request the caller cancelled."""
        self.finish(req, "cancelled", [])

    def finish(self, req: Request, reason: str, new: list[int], *, text_so_far: str = "") -> None:
        """End a request with `reason`; its last delta carries `new` and the rest of the text.
        A guided request whose grammar failed fails instead (`Guide.failure`): its "stop"
        would claim an output the grammar does not accept."""
        guide = req.sstate.guide
        failure = guide.failure() if guide is not None and reason == "stop" else None
        if failure is not None:
            self.fail(req, failure)
            return
        text = text_so_far + req.detok.finish()
        req.output.text = req.detok.text
        req.output.finish_reason = reason
        req.output.finished = True
        self.stats["finished_requests"] += 1
        if req.listener is not None:
            req.listener(req.delta(new, text, reason))
        self._done(req)

    def fail(self, req: Request, exc: BaseException) -> None:
        """End a request with an error delivered to its caller."""
        req.error = exc
        if req.listener is not None:
            req.listener(exc)
        self._done(req)

    def fail_all(self, exc: BaseException) -> None:
        """End every unfinished request with `exc`."""
        with self.lock:
            reqs = [r for r in self.requests.values() if not r.done.is_set()]
        for r in reqs:
            self.fail(r, exc)

    def forget(self, req: Request) -> None:
        """Drop a finished request from the table (unfinished ones drop when they finish)."""
        with self.lock:
            if req.done.is_set() and self.requests.get(req.request_id) is req:
                del self.requests[req.request_id]
            else:
                req.keep = False

    def unfinished(self) -> list[Request]:
        """Requests not finished yet."""
        with self.lock:
            return [r for r in self.requests.values() if not r.done.is_set()]

    def _done(self, req: Request) -> None:
        if self.on_done is not None:
            self.on_done(req)
        with self.lock:
            req.done.set()
            if not req.keep and self.requests.get(req.request_id) is req:
                del self.requests[req.request_id]


def _reason(reason: Any) -> str:
    """A scheduler finish reason, "stop" for anything unknown."""
    return reason if reason in _FINISH_REASONS else "stop"
