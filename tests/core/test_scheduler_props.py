"""Hypothesis stateful tests: random add / schedule / update / cancel against the Scheduler,
and (``InFlight*`` machines) the same with ``schedule_ahead()``: up to two plans outstanding.

Tiny pools (few chunks, page_size 4-8) so preemption (offload or soft reset) is frequent. After
every step the harness in sched_helpers checks the plan against the step contract, reads the
simulated KV cache back through the block tables, checks snapshot() (conservation, refcounts =
holders, reserved chunks, swap slots) and calls check_invariants(). At teardown everything is
run to completion: every request must finish exactly once and every chunk be free or cached.

The in-flight machines drive ``AheadHarness``: random interleavings of schedule / schedule_ahead
/ update (oldest plan) / cancel / add, with the device simulated in plan order
(``prev_token_index`` resolved from the previous plan's sampled tokens, every key read back);
after every call conservation and the chunk lifetime are checked from outside through
``snapshot()``; at teardown everything runs to completion (pipelined) and every request's output
must equal an unconstrained synchronous run.
"""

from __future__ import annotations

import itertools
import os
import random

import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)
from sched_helpers import FULL, SLIDING, AheadHarness, Harness, ReqSpec, SchedConfig

settings.register_profile(
    "sched",
    max_examples=int(os.environ.get("FB_SCHED_EXAMPLES", "60")),
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)

VOCAB = 64
EOS = 2
STOP_ID = 3
# stop sequences start with 4, a token no prompt contains, so they can only match generated text
STOP_SEQS = ((4, 5), (4, 4, 6))
SPECIAL = (EOS, STOP_ID, 4, 5, 6)
MAX_LIVE = 10

token_st = st.integers(0, 99).map(lambda x: SPECIAL[x % len(SPECIAL)] if x < 12 else 10 + x % 54)


class _RequestMachine(RuleBasedStateMachine):
    """What both machines share: a configuration drawn from the class's families (variants
    fix them, see VARIANTS), request arrivals and cancellations. Subclasses say which
    harness drives the scheduler and which request ids it knows."""

    layer_types: tuple[str, ...] = (FULL,)
    sharing = st.booleans()
    offload = st.sampled_from([0, 0, 2, 6])
    cache_budget = st.none()

    def __init__(self):
        super().__init__()
        self.h: Harness | AheadHarness | None = None
        self.n = 0

    def new_harness(self, cfg: SchedConfig) -> Harness | AheadHarness:
        raise NotImplementedError

    def known_ids(self) -> list[str]:
        raise NotImplementedError

    @initialize(
        data=st.data(),
        page_size=st.sampled_from([4, 5, 8]),
        scheduler_type=st.sampled_from(["fifo", "prefill_first"]),
    )
    def setup(self, data, page_size, scheduler_type):
        ps = page_size
        sliding = SLIDING in self.layer_types
        window = data.draw(st.integers(2, 3 * ps)) if sliding else None
        ring = (-(-window // ps) + 1) if sliding else 0
        if FULL in self.layer_types:
            num_blocks = data.draw(st.integers(4 + 2 * ring, 14 + 2 * ring))
        else:  # sliding only: a request never holds more than R chunks
            num_blocks = data.draw(st.integers(ring + 1, 3 * ring + 4))
        cfg = SchedConfig(
            num_blocks=num_blocks,
            page_size=ps,
            max_batch_tokens=data.draw(st.integers(4, 40)),
            max_requests_per_batch=data.draw(st.integers(1, 6)),
            scheduler_type=scheduler_type,
            safety_margin=data.draw(st.sampled_from([None, 0.0, 0.2])),
            allow_block_sharing=data.draw(self.sharing),
            layer_types=self.layer_types,
            sliding_window=window,
            cpu_offload_blocks=data.draw(self.offload),
            max_batch_cache_tokens=data.draw(self.cache_budget),
        )
        self.h = self.new_harness(cfg)
        # a request must always fit alone (with room to spare): cap its total length
        full_chunks = num_blocks - ring
        self.max_len = (max(3, (full_chunks * 2 // 3) * ps) if FULL in self.layer_types
                        else 8 * ps)
        if cfg.max_batch_cache_tokens is not None:
            # add_request rejects lifetimes (prompt + max_new - 1) above the cache budget
            self.max_len = min(self.max_len, cfg.max_batch_cache_tokens + 1)
        rnd = data.draw(st.randoms(use_true_random=False))
        self.prefixes = [
            [rnd.randrange(10, VOCAB) for _ in range(rnd.choice([ps, 2 * ps, ps + 1]))]
            for _ in range(3)
        ]

    @precondition(lambda self: len(self.h.live()) < MAX_LIVE)
    @rule(
        data=st.data(),
        prefix=st.integers(-1, 2),
        suffix_len=st.integers(0, 16),
        priority=st.integers(0, 2),
        stops=st.booleans(),
    )
    def add(self, data, prefix, suffix_len, priority, stops):
        pre = self.prefixes[prefix] if prefix >= 0 else []
        suffix = data.draw(st.lists(st.integers(10, VOCAB - 1), min_size=suffix_len,
                                    max_size=suffix_len))
        prompt = (pre + suffix)[: self.max_len - 1] or [10]
        max_new = data.draw(st.integers(1, max(1, min(32, self.max_len - len(prompt)))))
        rid = f"r{self.n}"
        self.n += 1
        self.h.add(ReqSpec(
            request_id=rid, prompt=prompt, max_new_tokens=max_new,
            eos_token_ids=(EOS,) if stops else (),
            stop_token_ids=(STOP_ID,) if stops else (),
            stop_sequences=STOP_SEQS if stops else (),
            priority=priority,
        ))

    @rule(which=st.integers(0, 60))
    def cancel(self, which):
        """Cancel a known request (any state, also finished), or an unknown id."""
        if which > 30:
            return
        ids = self.known_ids()
        rid = ids[which % len(ids)] if ids and which < 28 else f"nope{which}"
        self.h.cancel(rid)


class SchedulerMachine(_RequestMachine):
    """schedule / update / cancel / add with at most one plan outstanding."""

    def new_harness(self, cfg: SchedConfig) -> Harness:
        return Harness(cfg, strict=True, vocab=VOCAB)

    def known_ids(self) -> list[str]:
        return list(self.h.tracks)

    @precondition(lambda self: self.h.plan is None)
    @rule()
    def schedule(self):
        plan = self.h.schedule()
        if plan is None:
            self.h.flush_cancels()
            assert not self.h.live(), (
                f"schedule() returned None with live requests {self.h.live()}: {self.h.stats()}"
            )

    @precondition(lambda self: self.h.plan is not None)
    @rule(data=st.data())
    def update(self, data):
        n = len(self.h.plan.logits_indices)
        toks = data.draw(st.lists(token_st, min_size=n, max_size=n))
        self.h.update(toks)

    @precondition(lambda self: self.h.plan is None)
    @rule(n=st.integers(1, 10), seed=st.integers(0, 2**32 - 1))
    def run_steps(self, n, seed):
        """n schedule/update cycles with pseudo-random tokens (~4% stop-ish tokens)."""
        rnd = random.Random(seed)
        for _ in range(n):
            if self.h.schedule() is None:
                self.h.flush_cancels()
                assert not self.h.live(), f"stalled: {self.h.live()} {self.h.stats()}"
                return
            k = len(self.h.plan.logits_indices)
            self.h.update([rnd.choice(SPECIAL) if rnd.random() < 0.04
                           else rnd.randrange(10, VOCAB) for _ in range(k)])

    @invariant()
    def invariants(self):
        if self.h is not None:
            self.h.s.check_invariants()

    def teardown(self):
        if self.h is None:
            return
        counter = itertools.count()

        def sampler():  # plain tokens (no stop ids): requests end by length
            n = sum(1 for r in self.h.plan_rows if r["sampled"])
            return [10 + (next(counter) * 7) % 50 for _ in range(n)]

        self.h.run_to_completion(sampler=sampler)


class InFlightMachine(_RequestMachine):
    """schedule / schedule_ahead / update / cancel / add with up to two plans outstanding."""

    def new_harness(self, cfg: SchedConfig) -> AheadHarness:
        return AheadHarness(cfg, vocab=VOCAB)

    def known_ids(self) -> list[str]:
        return list(self.h.specs)

    @precondition(lambda self: not self.h.queue)
    @rule()
    def schedule(self):
        if self.h.schedule() is None:
            self.h.update()  # only cancellation reports can remain
            assert not self.h.live(), f"schedule() returned None with live {self.h.live()}"

    @precondition(lambda self: len(self.h.queue) == 1)
    @rule()
    def schedule_ahead(self):
        self.h.schedule_ahead()

    @precondition(lambda self: bool(self.h.queue))
    @rule()
    def update(self):
        self.h.update()

    @rule(ahead=st.booleans())
    def misuse(self, ahead):
        """schedule() / schedule_ahead() in any state: refused unless allowed (checked)."""
        if ahead:
            self.h.schedule_ahead()
        elif not self.h.queue:
            self.schedule()
        else:
            self.h.schedule()

    @rule(n=st.integers(1, 8))
    def pipeline(self, n):
        """n pipelined steps: keep one plan ahead, update the oldest."""
        for _ in range(n):
            if not self.h.queue:
                if self.h.schedule() is None:
                    self.h.update()
                    return
            if len(self.h.queue) == 1:
                self.h.schedule_ahead()
            self.h.update()

    @invariant()
    def invariants(self):
        if self.h is not None:
            self.h.check_state()

    def teardown(self):
        if self.h is None:
            return
        self.h.drain(ahead=True)
        self.h.check_outputs()


# Each machine under each pool layout: (layer types, extra class attributes).
VARIANTS: dict[str, dict] = {
    "FullAttention": dict(layer_types=(FULL, FULL)),
    "FullSharedOffload": dict(
        layer_types=(FULL,), sharing=st.just(True), offload=st.sampled_from([1, 3, 8])
    ),
    "Sliding": dict(layer_types=(SLIDING, SLIDING)),
    "Hybrid": dict(layer_types=(SLIDING, FULL, SLIDING)),
    "CacheBudget": dict(layer_types=(FULL,), cache_budget=st.sampled_from([16, 40, 100])),
}

for _prefix, _base in (("", SchedulerMachine), ("InFlight", InFlightMachine)):
    for _name, _attrs in VARIANTS.items():
        _machine = type(f"{_prefix}{_name}Machine", (_base,), dict(_attrs))
        _machine.TestCase.settings = settings.get_profile("sched")
        globals()[f"Test{_prefix}{_name}"] = _machine.TestCase
del _prefix, _base, _name, _attrs, _machine
