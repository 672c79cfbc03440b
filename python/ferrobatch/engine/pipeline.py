"""Async batching: the engine step with one step in flight (ARCHITECTURE.md §6).

While step N's forward and sampling run on the device, the host plans step N+1
(`Scheduler.schedule_ahead`, which assumes every row sampled in N gets one token) and
queues its forward behind N's, its input ids taken on the device from N's sampled tokens
(`plan.prev_token_index`). Only then does the host wait for N's tokens, record them
(`update`), route the outputs, and queue N+1's sampling, which therefore sees token N in
its penalties and seeded generators exactly as the synchronous `Stepper` does.

    iteration:  drain inboxes → schedule_ahead(N+1) → forward(N+1, prev=tokens_N on device)
                → tokens_N to host → update(N) → route(N) → sample(N+1) on device

When `schedule_ahead` has nothing to run, N is finished alone and the next iteration starts
over with `schedule()` (which may preempt and swap; `schedule_ahead` never does).

On CUDA the sampled tokens come back through two pinned host buffers on a copy stream
(`DeviceToHost`); a plan's integer arrays go up inside `runner.execute` (for graph steps one
copy into the graph's static inputs, ordered after the replay that reads the previous ones).
On CPU every torch op is synchronous and the same pipeline runs step after step; that is
what the tests exercise.
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ferrobatch.engine.routing import OutputRouter
from ferrobatch.engine.stepper import Stepper
from ferrobatch.sampling.sampler import DeviceSample, Sampler, SamplingState

if TYPE_CHECKING:
    from ferrobatch.core import Scheduler, StepPlan
    from ferrobatch.lora.manager import LoraManager
    from ferrobatch.runner.model_runner import ModelRunner

__all__ = ["AsyncStepper", "DeviceToHost", "PendingCopy"]


@dataclass
class PendingCopy:
    """Host copies of device tensors, valid once `wait()` returns (`event` None: ready)."""

    host: list[torch.Tensor]
    event: Any = None

    def wait(self) -> list[torch.Tensor]:
        """Block until the copies landed; returns them."""
        if self.event is not None:
            self.event.synchronize()
            self.event = None
        return self.host


class DeviceToHost:
    """Brings a step's sampled tokens (and logprob tensors) back to the host.

    On CUDA: copies on `stream` (a copy stream beside the compute stream), ordered after
    everything queued on the compute stream so far (the sampling), into two alternating
    pinned token buffers (a step's buffer is only reused two steps later, after its tokens
    were read) plus fresh pinned tensors for logprobs; an event marks the end. The host
    waits on that event only, never on the compute stream, so the next forward, already
    queued, keeps the device busy. On CPU the tensors are already on the host.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.stream: Any = torch.cuda.Stream(self.device) if self.cuda else None
        self._token_bufs: list[torch.Tensor | None] = [None, None]
        self._next = 0

    def start(self, tensors: list[torch.Tensor]) -> PendingCopy:
        """Queue the copies of `tensors` (the first is the token ids); returns at once."""
        if not self.cuda:
            return PendingCopy([t if t.device.type == "cpu" else t.cpu() for t in tensors])
        compute = torch.cuda.current_stream(self.device)
        ready = torch.cuda.Event()
        ready.record(compute)
        host: list[torch.Tensor] = []
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(ready)
            for i, t in enumerate(tensors):
                if t.device.type == "cpu":  # nothing to copy
                    host.append(t)
                    continue
                if i == 0:
                    buf = self._token_buffer(t.numel(), t.dtype).view(t.shape)
                else:
                    buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                buf.copy_(t, non_blocking=True)
                # the tensor was made on the compute stream: keep its memory until the copy ran
                t.record_stream(self.stream)
                host.append(buf)
            done = torch.cuda.Event()
            done.record(self.stream)
        return PendingCopy(host, done)

    def _token_buffer(self, n: int, dtype: torch.dtype) -> torch.Tensor:
        k = self._next
        self._next ^= 1
        buf = self._token_bufs[k]
        if buf is None or buf.numel() < n or buf.dtype != dtype:
            buf = torch.empty(max(n, 256), dtype=dtype, pin_memory=True)
            self._token_bufs[k] = buf
        return buf[:n]


@dataclass
class _InFlight:
    """A launched step: its plan, the sampling state of each sampled row (captured when it
    was planned: a request may leave the table before its row is sampled), and its logits,
    then its samples on the device and their pending host copy."""

    plan: StepPlan
    rids: list[str]
    rows: list[int]
    states: list[SamplingState]
    logits: torch.Tensor | None = None
    sample: DeviceSample | None = None
    copy: PendingCopy | None = None


class AsyncStepper(Stepper):
    """`Stepper` with one step in flight (see the module docstring).

    Same interface: `inbox` / `cancel_inbox` drained before each plan, `step()` (False when
    there was nothing to do), `has_mail()`, `busy_time`, `stats` (also counts `ahead_steps`,
    the steps planned by `schedule_ahead`, and `pipeline_drains`, the times a step in flight
    was finished alone: nothing to run ahead, or the last ahead plan calls for `schedule()`,
    counted in `stall_drains` / `swap_drains`, see `_drain_reason`, or `rope_drains`: a
    request crosses the longrope threshold, `ferrobatch.attention.rope`).
    `close()` waits for the step in flight and drops it.
    """

    def __init__(
        self,
        scheduler: Scheduler,
        runner: ModelRunner,
        sampler: Sampler,
        router: OutputRouter,
        stats: collections.Counter[str],
        *,
        device: torch.device | str = "cpu",
        lora: LoraManager | None = None,
    ) -> None:
        super().__init__(scheduler, runner, sampler, router, stats, lora=lora)
        self.device = torch.device(device)
        self.to_host = DeviceToHost(self.device)
        self._inflight: _InFlight | None = None
        self._drain_next = ""  # the stats key of the drain the next iteration makes, if any
        self._last_free: int | None = None  # free chunks after the previous ahead plan

    @property
    def in_flight(self) -> bool:
        """Whether a step was launched and its tokens not yet recorded."""
        return self._inflight is not None

    def step(self) -> bool:
        """One pipeline iteration; False when there was nothing to do."""
        changed = self._drain_inboxes()
        prev = self._inflight
        t0 = time.perf_counter()
        if prev is None:
            plan = self.scheduler.schedule()
            if plan is None:
                return changed
            self._last_free = None  # `schedule()` may have swapped: a fresh baseline
            cur = self._launch(plan, None)
            self._sample(cur)
            self._inflight = cur
            self.busy_time += time.perf_counter() - t0
            return True
        if self.rope is not None and self.rope.crossing(prev.plan):
            # a request crosses the longrope threshold with this step's token: it is
            # recomputed by the update, before anything plans its next token
            self._drain_next = "rope_drains"
        if self._drain_next:
            plan = None
            self.stats[self._drain_next] += 1
        else:
            plan = self.scheduler.schedule_ahead()
        self._drain_next = ""
        nxt = None
        if plan is not None:
            assert prev.sample is not None
            nxt = self._launch(plan, prev.sample.token_ids)
            self._drain_next = self._drain_reason()
        else:
            self.stats["pipeline_drains"] += 1
        self._inflight = nxt
        self._finish(prev)
        if nxt is not None:
            self._sample(nxt)
        self.busy_time += time.perf_counter() - t0
        return True

    def _drain_reason(self) -> str:
        """After an ahead plan: the stats key to count when the next iteration should drain
        (finish the step in flight alone and plan with `schedule()`), else "".

        * `stall_drains`: the plan left a running request out for want of chunks; only
          `schedule()` preempts (newest first), as in synchronous mode, instead of letting
          newer requests run ahead while an older one waits.
        * `priority_drains`: a waiting request of higher priority would preempt running
          ones (`scheduling_policy="priority"`); only `schedule()` preempts.
        * `swap_drains`: requests are swapped out and chunks were freed since the previous
          ahead plan; only `schedule()` swaps in (an ahead plan stops admission at a swapped
          request), so without this a swapped request would wait for the running ones to
          finish even when it fits again.
        """
        sched = self.scheduler  # O(1) getters, no stats() dict per ahead step
        free = sched.num_free_blocks
        last, self._last_free = self._last_free, free
        if sched.num_stalled:
            return "stall_drains"
        if sched.wants_priority_preemption:
            return "priority_drains"
        if sched.num_swapped and last is not None and free > last:
            return "swap_drains"
        return ""

    def close(self) -> None:
        """Wait for the step in flight (its copies must not land in freed memory) and drop
        it; its plan stays outstanding in the scheduler, which is not used afterwards."""
        cur, self._inflight = self._inflight, None
        if cur is not None and cur.copy is not None:
            cur.copy.wait()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # -- pieces ---------------------------------------------------------------------------

    def _launch(self, plan: StepPlan, prev_tokens: torch.Tensor | None) -> _InFlight:
        """Queue `plan`'s forward (input ids from `prev_tokens` where the plan says so)."""
        rids = list(plan.request_ids)
        rows = np.asarray(plan.logits_rows).tolist()
        requests = self.router.requests
        states = []
        for r in rows:
            # every planned request is in the table: one leaves it only with its update,
            # and updates run after the launch of the plan that follows
            states.append(requests[rids[r]].sstate)
        cur = _InFlight(plan, rids, rows, states)
        if plan.ahead:
            self.stats["ahead_steps"] += 1
        # every sampled row plain greedy (no history, no seed, no logprobs: its token does
        # not depend on the step before): the runner's screened argmax, no full logits
        greedy = (
            self.device.type == "cpu"
            and self.runner.fast_greedy
            and all(s.plain_greedy for s in states)
        )
        with self.forward_lock, self.lora_bound(plan):
            rows_logits = self.execute_rows(plan, prev_tokens)
            if rows_logits is not None:  # prompt logprobs or embeddings of prompt rows
                cur.logits = rows_logits
            elif greedy:
                cur.sample = DeviceSample(self.runner.execute_greedy(plan, prev_tokens))
            elif prev_tokens is None:
                cur.logits = self.runner.execute(plan)
            else:
                cur.logits = self.runner.execute(plan, prev_tokens=prev_tokens)
        return cur

    def _sample(self, cur: _InFlight) -> None:
        """Queue the sampling of `cur` (unless the runner already picked its greedy tokens)
        and the copy of its tokens to the host."""
        if cur.sample is None:
            assert cur.logits is not None
            cur.sample = self.sampler.sample(cur.logits, cur.states)
            cur.logits = None
        cur.copy = self.to_host.start(cur.sample.device_tensors())

    def _finish(self, cur: _InFlight) -> None:
        """Wait for `cur`'s tokens, record them in the scheduler and route the outputs."""
        assert cur.sample is not None and cur.copy is not None
        self._record(cur.plan, cur.rids, cur.rows, cur.sample.finish(cur.copy.wait()))
