"""One engine step: queued requests and cancellations into the scheduler, then plan →
forward → sample → scheduler update → outputs routed to their requests."""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import TYPE_CHECKING, Any

import numpy as np

from ferrobatch.engine.request import Request
from ferrobatch.engine.routing import OutputRouter
from ferrobatch.errors import FieldError
from ferrobatch.models import model_lock
from ferrobatch.sampling.pooling import PoolJob
from ferrobatch.sampling.prompt_logprobs import PromptJob
from ferrobatch.sampling.sampler import Sampler, SampleResult
from ferrobatch.spec.verify import entry_states

if TYPE_CHECKING:
    import torch

    from ferrobatch.core import Scheduler, StepPlan
    from ferrobatch.lora.manager import LoraManager
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
        lora: LoraManager | None = None,
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
        # embedding requests whose pooled positions are not all computed yet, by id
        self.pool_pending: dict[str, Request] = {}
        # per-request rope factors (`ferrobatch.attention.rope.LongRope`), when the model needs them
        self.rope = getattr(runner, "rope", None)
        model = getattr(runner, "model", None)
        self.forward_lock = model_lock(model) if model is not None else threading.Lock()
        self.spec = spec  # speculative decoding, or None
        # LoRA adapters (`ferrobatch.lora`), or None; requests of an adapter beyond the
        # `max_loras` active ones wait here, in arrival order, outside the scheduler
        self.lora = lora
        self.lora_waiting: collections.deque[Request] = collections.deque()
        # ids of ended requests whose speculative state (a draft model's mirror and its
        # cache blocks) is dropped at the next step, on the stepping thread
        self.spec_ended: collections.deque[str] = collections.deque()
        router.on_done = self._on_done

    def has_mail(self) -> bool:
        """Whether requests or cancellations wait for the next step (or requests held back
        for their LoRA adapter)."""
        return bool(self.inbox or self.cancel_inbox or self.lora_waiting or self.spec_ended)

    def step(self) -> bool:
        """Run one scheduler step; False when there was nothing to do."""
        changed = self._drain_inboxes()
        while self.spec_ended:
            self.spec.forget(self.spec_ended.popleft())
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
        with self.forward_lock, self.lora_bound(plan):
            rows_logits = self.execute_rows(plan, None)
            if rows_logits is not None:  # prompt logprobs or embeddings of prompt rows
                greedy = False
                logits = rows_logits
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

    def lora_bound(self, plan: StepPlan) -> AbstractContextManager[None]:
        """The forward of `plan` with each row's LoRA adapter applied (nothing to do
        without adapters)."""
        if self.lora is None:
            return nullcontext()
        requests = self.router.requests
        salts = [getattr(requests.get(rid), "lora_salt", 0) for rid in plan.request_ids]
        if not any(salts):  # no adapter rows: the fused layers may run
            return nullcontext()
        return self._adapter_step(salts, plan.cu_seqlens_q)

    @contextmanager
    def _adapter_step(self, salts: list[int], cu_seqlens_q: Any) -> Iterator[None]:
        """A forward with adapter rows: the hooks bound, the lean (fused) decoder layers off
        (they call no linear module, so no hook would run)."""
        activations = getattr(self.runner, "activations", None)
        if activations is not None:
            activations.lean_off = True
        try:
            with self.lora.bind(salts, cu_seqlens_q):  # type: ignore[union-attr]
                yield
        finally:
            if activations is not None:
                activations.lean_off = False

    def _on_done(self, req: Request) -> None:
        """A request ended (finished, cancelled or failed; any thread)."""
        self._lora_release(req)
        if self.spec is not None:
            self.spec_ended.append(req.request_id)

    def _lora_release(self, req: Request) -> None:
        """A request left: its adapter's count in the scheduler drops."""
        if req.lora_admitted and self.lora is not None:
            req.lora_admitted = False
            self.lora.release(req.lora_salt)

    def execute_rows(
        self, plan: StepPlan, prev_tokens: torch.Tensor | None
    ) -> torch.Tensor | None:
        """When requests of `plan` want prompt rows (prompt logprobs,
        `sampling.prompt_logprobs`; embeddings, `sampling.pooling`): the forward that also
        returns those rows, recorded into the requests; the sampled rows' logits. None
        (nothing run) when no request wants any."""
        job = PromptJob.of(plan, self.prompt_pending) if self.prompt_pending else None
        pool = PoolJob.of(plan, self.pool_pending) if self.pool_pending else None
        if pool is None:
            if job is None:
                return None
            logits, prompt_logits = self.runner.execute_with_prompt(plan, job.indices,
                                                                    prev_tokens)
            job.record(prompt_logits)
            return logits
        logits, prompt_logits, hidden = self.runner.execute_with_rows(
            plan, None if job is None else job.indices, pool.indices, prev_tokens)
        if job is not None:
            assert prompt_logits is not None
            job.record(prompt_logits)
        assert hidden is not None
        pool.record(hidden)
        return logits

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

    def _next_request(self) -> Request | None:
        """The next request to add to the scheduler: those held back for their LoRA adapter
        first, once it may run (arrival order within the held ones), then the inbox's; None
        when none can go in now."""
        if self.lora_waiting:
            while self.lora_waiting and self.lora_waiting[0].done.is_set():
                self.lora_waiting.popleft()
            if self.lora_waiting and self._lora_admit(self.lora_waiting[0]):
                return self.lora_waiting.popleft()
        while self.inbox:
            req = self.inbox.popleft()
            if req.done.is_set():
                continue
            if self.lora_waiting and req.lora_salt:  # behind the held ones of its kind
                self._hold(req)
                continue
            if not self._lora_admit(req):
                self._hold(req)
                continue
            return req
        return None

    def _hold(self, req: Request) -> None:
        """Hold `req` back for its LoRA adapter: in arrival order, or by priority (lower
        first, then arrival) when requests carry priorities."""
        self.lora_waiting.append(req)
        if req.params.priority:
            self.lora_waiting = collections.deque(
                sorted(self.lora_waiting, key=lambda r: r.params.priority or 0))

    def _lora_admit(self, req: Request) -> bool:
        """Whether `req` may enter the scheduler now (`LoraManager.admit`); a request whose
        adapter was unloaded while it waited fails alone (and is dropped as done)."""
        if self.lora is None or not req.lora_salt:
            return True
        try:
            admitted = self.lora.admit(req.lora_salt)
        except FieldError as exc:
            self.router.fail(req, exc)
            return False
        if admitted:
            req.lora_admitted = True
            return True
        return False

    def _drain_inboxes(self) -> bool:
        changed = False
        while True:
            req = self._next_request()
            if req is None:
                break
            # prompt logprobs (and mean / cls embeddings) need every prompt position
            # computed: no prefix-cache hits
            every = req.params.prompt_logprobs is not None or (
                req.pool is not None and req.pool.needs_every_position)
            extra: dict[str, Any] = {"skip_prefix_lookup": True} if every else {}
            if req.lora_salt:  # blocks shared only among requests of the same adapter
                extra["cache_salt"] = req.lora_salt
            if req.params.priority:
                extra["priority"] = req.params.priority
            if req.offline:
                extra["offline"] = True
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
                self.router.fail(req, exc)  # (its LoRA count released as it ends)
                continue
            req.in_scheduler = True
            if req.params.prompt_logprobs is not None and len(req.prompt_ids) > 1:
                self.prompt_pending[req.request_id] = req
            if req.pool is not None:
                self.pool_pending[req.request_id] = req
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
