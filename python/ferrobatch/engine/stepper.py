"""One engine step: queued requests and cancellations into the scheduler, then plan →
forward → sample → scheduler update → outputs routed to their requests."""

from __future__ import annotations

import collections
import threading
import time
from typing import TYPE_CHECKING

import numpy as np

from ferrobatch.engine.request import Request
from ferrobatch.engine.routing import OutputRouter
from ferrobatch.models import model_lock
from ferrobatch.sampling.prompt_logprobs import PromptJob
from ferrobatch.sampling.sampler import Sampler, SampleResult
from ferrobatch.spec.verify import entry_states

if TYPE_CHECKING:
    from ferrobatch.core import Scheduler, StepPlan
    from ferrobatch.runner.model_runner import ModelRunner
    from ferrobatch.spec.controller import SpecController

__all__ = ["STEP_RECORDS", "Stepper"]

# Step records kept between two `take_step_records` calls (metrics scrapes).
STEP_RECORDS = 4096


class Stepper:
    """Runs steps of `scheduler`, `runner` and `sampler` for the requests in `router`.

    `inbox` (new requests) and `cancel_inbox` (request ids) are filled by any thread and
    drained at the start of each step; only the caller holding the engine's step lock
    calls `step`. `stats` counts steps, step tokens and submitted prompt tokens;
    `busy_time` is the seconds spent in steps that ran the model. With a step-time budget
    (`scheduler.max_step_ms`), each step's measured time goes back to the scheduler's cost
    model (`report_step_time`), and `step_records` keeps (seconds, prefill budget tokens)
    per step for the metrics (`take_step_records`). `spec` (a
    `ferrobatch.spec.controller.SpecController`, or None) gives proposals before each
    `schedule()` and counts acceptances after each `update()`.
    """

    def __init__(
        self,
        scheduler: Scheduler,
        runner: ModelRunner,
        sampler: Sampler,
        router: OutputRouter,
        stats: collections.Counter[str],
        *,
        spec: SpecController | None = None,
    ) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.sampler = sampler
        self.router = router
        self.stats = stats
        self.inbox: collections.deque[Request] = collections.deque()
        self.cancel_inbox: collections.deque[str] = collections.deque()
        self.busy_time = 0.0
        # the step-time budget's feedback (None: off) and the last steps' records
        self.report_times = scheduler.max_step_ms is not None
        self.step_records: collections.deque[tuple[float, int]] = collections.deque(
            maxlen=STEP_RECORDS
        )
        # requests with prompt logprobs still to compute, by id (empty: no step looks)
        self.prompt_pending: dict[str, Request] = {}
        # per-request rope factors (`ferrobatch.attention.rope.LongRope`), when the model needs them
        self.rope = getattr(runner, "rope", None)
        model = getattr(runner, "model", None)
        self.forward_lock = model_lock(model) if model is not None else threading.Lock()
        self.spec = spec  # speculative decoding, or None

    def has_mail(self) -> bool:
        """Whether requests or cancellations wait for the next step."""
        return bool(self.inbox or self.cancel_inbox)

    def step(self) -> bool:
        """Run one scheduler step; False when there was nothing to do."""
        changed = self._drain_inboxes()
        if self.spec is not None:  # proposals for the next schedule() (speculative rows)
            self.spec.before_schedule(self.scheduler, self.router.requests)
        plan = self.scheduler.schedule()
        if plan is None:
            return changed
        t0 = time.perf_counter()
        rids = list(plan.request_ids)
        rows = np.asarray(plan.logits_rows).tolist()
        requests = self.router.requests
        states = [requests[rids[r]].sstate for r in rows]
        if self.spec is not None and len(rows) > plan.num_rows:
            states = entry_states(plan, rows, states, self.sampler.device)
        # every sampled row plain greedy: the runner's screened argmax, no full logits
        greedy = self.runner.fast_greedy and all(
            s.plain_greedy for s in states
        )
        job = PromptJob.of(plan, self.prompt_pending) if self.prompt_pending else None
        with self.forward_lock:
            if job is not None:  # prompt positions' logits too (sampling.prompt_logprobs)
                greedy = False
                logits, prompt_logits = self.runner.execute_with_prompt(plan, job.indices)
                job.record(prompt_logits)
                del prompt_logits
            elif greedy:
                result = SampleResult(self.runner.execute_greedy(plan))
            else:
                logits = self.runner.execute(plan)
        if not greedy:
            result = self.sampler(logits, states)
        self._record(plan, rids, rows, result)
        took = time.perf_counter() - t0
        self.busy_time += took
        self.step_records.append((took, self.scheduler.prefill_budget_tokens))
        if self.report_times:
            self.scheduler.report_step_time(max(took, 1e-6))
        return True

    def take_step_records(self) -> list[tuple[float, int]]:
        """The (seconds, prefill budget tokens) of the steps since the last call (the most
        recent `STEP_RECORDS`), oldest first."""
        out = []
        while self.step_records:
            out.append(self.step_records.popleft())
        return out

    def _record(
        self, plan: StepPlan, rids: list[str], rows: list[int], result: SampleResult
    ) -> None:
        """`plan`'s sampled tokens into the scheduler (the oldest outstanding plan's update),
        the resulting deltas and logprobs routed to their requests, step counters."""
        tokens = result.token_ids.numpy().astype(np.int32)
        step_out = self.scheduler.update(tokens)
        if self.rope is not None:  # crossing the longrope threshold: recompute, as generate
            n = self.rope.after_update(self.scheduler, plan, step_out.finished_request_ids)
            self.stats["rope_recomputes"] += n
        now = time.perf_counter()
        lp_by_rid: dict[str, dict[int, float]] = {}
        if result.logprobs is not None:
            for r, lp in zip(rows, result.logprobs, strict=True):
                if lp is not None:
                    lp_by_rid[rids[r]] = lp
        self.router.route(step_out, lp_by_rid, now)
        if self.spec is not None:
            self.spec.after_update(plan, rows, step_out)
        self.stats["steps"] += 1
        self.stats["step_tokens"] += len(plan.input_ids)

    def close(self) -> None:
        """Nothing is left in flight between synchronous steps."""

    def _drain_inboxes(self) -> bool:
        changed = False
        while self.inbox:
            req = self.inbox.popleft()
            if req.done.is_set():
                continue
            # prompt logprobs need every prompt position computed: no prefix-cache hits
            extra = {"skip_prefix_lookup": True} if req.params.prompt_logprobs is not None else {}
            try:
                self.scheduler.add_request(
                    req.request_id,
                    req.prompt_ids,
                    req.params.max_new_tokens,
                    eos_token_ids=req.eos_token_ids,
                    stop_token_ids=list(req.params.stop_token_ids),
                    **extra,
                )
            except (ValueError, KeyError, TypeError) as exc:  # this request only
                self.router.fail(req, exc)
                continue
            req.in_scheduler = True
            if req.params.prompt_logprobs is not None and len(req.prompt_ids) > 1:
                self.prompt_pending[req.request_id] = req
            if self.rope is not None:
                self.rope.add(req.request_id, len(req.prompt_ids))
            self.stats["prompt_tokens"] += len(req.prompt_ids)
            changed = True
        while self.cancel_inbox:
            rid = self.cancel_inbox.popleft()
            req = self.router.requests.get(rid)
            if req is None or req.done.is_set():
                continue
            if req.in_scheduler:
                self.scheduler.cancel(rid)
            self.router.cancel(req)
            changed = True
        return changed
