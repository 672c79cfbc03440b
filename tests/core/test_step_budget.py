"""The step-time budget (`max_step_ms`) through the bindings: validation, the cost-model
feedback (`report_step_time`), and the fair prefill order on the checking Harness (the step
contract, simulated KV read-back, snapshot invariants and `check_fair_order` on every step):
a short request is served beside a long prefill, nothing starves, outputs equal an
unconstrained run."""

from __future__ import annotations

import math

import hypothesis.strategies as st
import pytest
from ferrobatch.core import Scheduler
from ferrobatch.errors import FieldError
from hypothesis import HealthCheck, given, settings
from sched_helpers import Harness, ReqSpec, SchedConfig, reference_generate


def toks(start: int, n: int) -> list[int]:
    """Distinct prompt ids (>= 1000, never produced by the 64-token simulated model)."""
    return [1000 + start + i for i in range(n)]


def cfg(max_step_ms: float | None = 40.0, **kw) -> SchedConfig:
    base = dict(num_blocks=400, page_size=4, max_batch_tokens=256, safety_margin=0.0,
                max_step_ms=max_step_ms)  # fmt: skip
    base.update(kw)
    return SchedConfig(**base)


def rows(h: Harness) -> dict[str, tuple[int, int]]:
    return {r["rid"]: (r["start"], r["end"] - r["start"]) for r in h.plan_rows}


@pytest.mark.parametrize("value", [0.0, -5.0, math.nan, math.inf])
def test_bad_max_step_ms_names_the_field(value: float) -> None:
    with pytest.raises(FieldError) as e:
        Scheduler(8, 4, 16, max_step_ms=value)
    assert e.value.field == "max_step_ms"


def test_report_step_time() -> None:
    s = Scheduler(64, 4, 64, max_step_ms=50.0)
    assert s.max_step_ms == 50.0
    assert not s.report_step_time(0.01), "no step yet"
    with pytest.raises(FieldError) as e:
        s.report_step_time(-1.0)
    assert e.value.field == "seconds"
    s.add_request("a", toks(0, 10), 3)
    plan = s.schedule()
    s.update([5] * len(plan.logits_indices))
    assert s.report_step_time(0.02)
    assert not s.report_step_time(0.02), "a step's time is taken once"
    stats = s.stats()
    assert stats["cost_samples"] == 1
    assert stats["step_predicted_ms"] > 0
    # one request alone: the budget did not bind
    assert stats["time_budget_steps"] == 0 and s.prefill_budget_ms == 0.0
    assert s.prefill_budget_tokens == 64
    off = Scheduler(64, 4, 64)
    assert off.max_step_ms is None
    off.add_request("a", toks(0, 10), 3)
    plan = off.schedule()
    off.update([5] * len(plan.logits_indices))
    assert not off.report_step_time(0.02), "without max_step_ms nothing is taken"


def test_short_request_is_served_beside_a_long_prefill() -> None:
    h = Harness(cfg())
    h.add(ReqSpec("stream", toks(0, 6), max_new_tokens=200))
    for _ in range(3):
        h.step()
    h.add(ReqSpec("long", toks(100, 1500), max_new_tokens=2))
    for _ in range(6):  # the cost model learns from the synthetic timings
        h.step()
    assert "long" in rows(h) and rows(h)["long"][1] < 256, "the long prompt is chunked"
    assert h.s.prefill_budget_ms > 0
    h.add(ReqSpec("short", toks(2000, 9), max_new_tokens=3))
    h.step()
    r = rows(h)
    assert r["short"] == (0, 9), "the whole short prompt in the next step"
    assert "long" in r and "stream" in r
    h.run_to_completion()
    for rid, spec in (("long", h.tracks["long"].spec), ("short", h.tracks["short"].spec)):
        assert (h.tracks[rid].generated, h.tracks[rid].finish_reason) == reference_generate(
            h.model, spec)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    target=st.sampled_from([1.0, 15.0, 60.0]),
    longs=st.lists(st.integers(40, 400), min_size=1, max_size=3),
    shorts=st.lists(st.tuples(st.integers(1, 12), st.integers(1, 6)), min_size=1,
                    max_size=25),
    every=st.integers(1, 3),
    mbt=st.sampled_from([16, 64, 256]),
)  # fmt: skip
def test_no_starvation_under_arrivals(target, longs, shorts, every, mbt) -> None:
    """Long prompts in flight while short requests keep arriving: every request finishes,
    each step's row order is the fair order (checked by the Harness), outputs equal an
    unconstrained run."""
    h = Harness(cfg(target, max_batch_tokens=mbt), strict=False)
    specs = [ReqSpec(f"long{i}", toks(3000 * i, n), max_new_tokens=2)
             for i, n in enumerate(longs)]  # fmt: skip
    specs.append(ReqSpec("stream", toks(20000, 5), max_new_tokens=40))
    for sp in specs:
        h.add(sp)
    pending = [ReqSpec(f"s{i}", toks(30000 + 50 * i, n), max_new_tokens=m)
               for i, (n, m) in enumerate(shorts)]  # fmt: skip
    steps = 0
    while pending or h.unfinished():
        if pending and steps % every == 0:
            sp = pending.pop(0)
            h.add(sp)
            specs.append(sp)
        h.step()
        steps += 1
        assert steps < 5000, "no end in sight"
    for sp in specs:
        tr = h.tracks[sp.request_id]
        assert (tr.generated, tr.finish_reason) == reference_generate(h.model, sp)
