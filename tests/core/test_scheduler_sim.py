"""Simulated-model test: outputs under memory pressure must equal an unconstrained run.

The "model" (sched_helpers) computes each next token from the KV contents it READS BACK through
the plan's block tables (full: every earlier position; sliding: the window through the ring).
A content is a chained hash of the request's tokens, so a wrong block table, a stale or wrongly
shared block, a lost swap or a wrong soft-reset recompute yields a different token. The reference
is the same function on the true history (pure Python), and an unconstrained scheduler run.
"""

from __future__ import annotations

import os
import random
from dataclasses import replace

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings
from sched_helpers import (
    FULL,
    SLIDING,
    AheadHarness,
    Harness,
    ModelSpec,
    ReqSpec,
    SchedConfig,
    reference_generate,
)

VOCAB = 64
EOS = 2
STOP_ID = 3


def workload(seed: int, ps: int, n: int = 16, max_len: int = 48, shared: bool = True,
             model: ModelSpec | None = None):
    """Requests with shared prefixes (some exactly identical prompts), arrival step for each."""
    rnd = random.Random(seed)
    prefixes = [[rnd.randrange(10, VOCAB) for _ in range(rnd.choice([ps, 2 * ps, 3 * ps - 1]))]
                for _ in range(3)]
    reqs = []
    for i in range(n):
        if shared and rnd.random() < 0.7:
            pre = prefixes[rnd.randrange(3)]
        else:
            pre = []
        prompt = pre + [rnd.randrange(10, VOCAB) for _ in range(rnd.randrange(0, 12))]
        if not prompt:
            prompt = [rnd.randrange(10, VOCAB)]
        if i > 0 and rnd.random() < 0.1:
            prompt = list(reqs[-1][1].prompt)  # a twin
        prompt = prompt[: max_len - 4]
        max_new = rnd.randrange(1, max(2, min(24, max_len - len(prompt))))
        stops = rnd.random() < 0.5
        spec = ReqSpec(
            request_id=f"q{i}", prompt=prompt, max_new_tokens=max_new,
            eos_token_ids=(EOS,) if stops else (),
            stop_token_ids=(STOP_ID,) if stops else (),
            priority=rnd.randrange(3) if rnd.random() < 0.3 else 0,
        )
        if model is not None and max_new >= 4 and rnd.random() < 0.3:
            # a stop sequence taken from the request's own unconstrained output (2-3 tokens),
            # so it really triggers (at its first occurrence in the generated tokens)
            gen, _ = reference_generate(model, spec)
            if len(gen) >= 4:
                k = rnd.randrange(0, len(gen) - 2)
                spec.stop_sequences = (tuple(gen[k:k + rnd.choice([2, 3])]), (999, 998))
        reqs.append((rnd.randrange(0, 12), spec))  # arrival step
    return reqs


def run(cfg: SchedConfig, reqs, *, strict=False, use_snapshot=True) -> Harness:
    h = Harness(cfg, strict=strict, use_snapshot=use_snapshot, vocab=VOCAB)
    pending = sorted(reqs, key=lambda x: x[0])
    step = 0
    while pending or h.s.has_unfinished():
        while pending and pending[0][0] <= step:
            h.add(pending.pop(0)[1])
        if not h.step():
            if pending:
                step = pending[0][0]
                continue
            assert not h.s.has_unfinished(), f"stalled with unfinished requests: {h.stats()}"
            break
        step += 1
        assert step < 5000, "no progress"
    h.run_to_completion()
    return h


def _model(cfg: SchedConfig) -> ModelSpec:
    return replace(cfg.model, vocab=VOCAB)


def expected(cfg: SchedConfig, reqs):
    model = _model(cfg)
    return {spec.request_id: reference_generate(model, spec) for _, spec in reqs}


def unconstrained(cfg: SchedConfig) -> SchedConfig:
    return replace(cfg, num_blocks=4096, max_batch_tokens=8192, max_requests_per_batch=256,
                   cpu_offload_blocks=0, safety_margin=0.0, max_batch_cache_tokens=None)


CONFIGS = {
    "fifo-tiny-softreset": SchedConfig(num_blocks=14, page_size=4, max_batch_tokens=16,
                                       scheduler_type="fifo"),
    "prefill_first-tiny-softreset": SchedConfig(num_blocks=14, page_size=4, max_batch_tokens=16,
                                                scheduler_type="prefill_first"),
    "fifo-offload": SchedConfig(num_blocks=14, page_size=4, max_batch_tokens=16,
                                scheduler_type="fifo", cpu_offload_blocks=8),
    "prefill_first-offload-small-swap": SchedConfig(num_blocks=14, page_size=4,
                                                    max_batch_tokens=12,
                                                    scheduler_type="prefill_first",
                                                    cpu_offload_blocks=3),
    "fifo-noshare": SchedConfig(num_blocks=14, page_size=4, max_batch_tokens=16,
                                allow_block_sharing=False),
    "fifo-chunky-ps8": SchedConfig(num_blocks=8, page_size=8, max_batch_tokens=7,
                                   max_requests_per_batch=3),
    "sliding": SchedConfig(num_blocks=12, page_size=4, max_batch_tokens=16,
                           layer_types=(SLIDING, SLIDING), sliding_window=6),
    "hybrid-offload": SchedConfig(num_blocks=20, page_size=4, max_batch_tokens=16,
                                  layer_types=(SLIDING, FULL), sliding_window=5,
                                  cpu_offload_blocks=6, scheduler_type="prefill_first"),
    "hybrid-softreset": SchedConfig(num_blocks=20, page_size=4, max_batch_tokens=10,
                                    layer_types=(FULL, SLIDING), sliding_window=9),
    "cache-budget": SchedConfig(num_blocks=14, page_size=4, max_batch_tokens=16,
                                max_batch_cache_tokens=40),
}


def _max_len(cfg: SchedConfig) -> int:
    ring = cfg.ring if SLIDING in cfg.layer_types else 0
    return max(8, ((cfg.num_blocks - ring) // 2) * cfg.page_size)


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_outputs_equal_unconstrained(name, seed):
    cfg = CONFIGS[name]
    sharing = cfg.allow_block_sharing and SLIDING not in cfg.layer_types
    reqs = workload(seed, cfg.page_size, max_len=_max_len(cfg), shared=True, model=_model(cfg))
    want = expected(cfg, reqs)
    free_run = run(unconstrained(cfg), reqs)
    assert free_run.outputs() == want, "unconstrained scheduler run differs from the reference"
    h = run(cfg, reqs)
    got = h.outputs()
    bad = {r: (got[r], want[r]) for r in want if got[r] != want[r]}
    assert not bad, f"{len(bad)} outputs differ (got, want): {bad}"
    assert h.read_mismatches == 0
    st_ = h.stats()
    if sharing:
        assert st_["prefix_hit_tokens"] > 0, st_
    else:
        assert st_["prefix_hit_tokens"] == 0, st_


def test_preemption_paths_all_exercised():
    """Across the configurations above, soft resets and swap offloads both really happen."""
    offloads = resets = 0
    for name in ("fifo-tiny-softreset", "fifo-offload", "hybrid-offload"):
        cfg = CONFIGS[name]
        reqs = workload(0, cfg.page_size, max_len=_max_len(cfg), model=_model(cfg))
        h = run(cfg, reqs)
        st_ = h.stats()
        resets += st_["num_soft_resets"]
        if cfg.cpu_offload_blocks:
            offloads += st_["num_offloads"]
    assert resets > 0 and offloads > 0, (resets, offloads)


@settings(max_examples=int(os.environ.get("FB_SIM_EXAMPLES", "25")), deadline=None)
@given(
    seed=st.integers(0, 10**6),
    num_blocks=st.integers(8, 20),
    page_size=st.sampled_from([4, 6, 8]),
    max_batch_tokens=st.integers(3, 24),
    scheduler_type=st.sampled_from(["fifo", "prefill_first"]),
    offload=st.sampled_from([0, 2, 10]),
    kind=st.sampled_from(["full", "full-noshare", "sliding", "hybrid"]),
    window=st.integers(2, 12),
)
def test_random_configs_match_reference(seed, num_blocks, page_size, max_batch_tokens,
                                        scheduler_type, offload, kind, window):
    layer_types = {"full": (FULL,), "full-noshare": (FULL,), "sliding": (SLIDING,),
                   "hybrid": (FULL, SLIDING)}[kind]
    sliding = SLIDING in layer_types
    cfg = SchedConfig(
        num_blocks=num_blocks + (2 * (-(-window // page_size) + 1) if sliding else 0),
        page_size=page_size, max_batch_tokens=max_batch_tokens, scheduler_type=scheduler_type,
        allow_block_sharing=kind != "full-noshare", layer_types=layer_types,
        sliding_window=window if sliding else None, cpu_offload_blocks=offload,
    )
    reqs = workload(seed, page_size, n=10, max_len=_max_len(cfg), model=_model(cfg))
    want = expected(cfg, reqs)
    h = run(cfg, reqs)
    got = h.outputs()
    bad = {r: (got[r], want[r]) for r in want if got[r] != want[r]}
    assert not bad, f"outputs differ: {bad}"
    assert h.read_mismatches == 0


def run_ahead(cfg: SchedConfig, reqs, *, seed: int = 0) -> AheadHarness:
    """The workload pipelined as an async engine runs it: schedule(), then schedule_ahead()
    whenever one plan is outstanding, update() of the oldest; requests arrive (and a few are
    cancelled) between calls, also while two plans are outstanding."""
    h = AheadHarness(cfg, vocab=VOCAB)
    rnd = random.Random(seed)
    pending = sorted(reqs, key=lambda x: x[0])
    step = 0
    while pending or h.s.has_unfinished() or h.queue:
        while pending and pending[0][0] <= step:
            h.add(pending.pop(0)[1])
        if not h.queue:
            if h.schedule() is None:
                h.update()  # cancellation reports only
                if pending and not h.s.has_unfinished():
                    step = pending[0][0]
                continue
        if len(h.queue) == 1:
            h.schedule_ahead()
        if rnd.random() < 0.03 and h.live():
            h.cancel(rnd.choice(h.live()))
        h.update()
        step += 1
        assert step < 5000, "no progress"
    h.drain(ahead=True)
    return h


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("seed", [0, 1])
def test_ahead_pipeline_equals_sync_run(name, seed):
    """schedule_ahead() pipelining produces exactly the synchronous run's outputs (requests
    cancelled on the way aside), with every read checked and the chunk lifetime checked from
    outside after every call."""
    cfg = CONFIGS[name]
    reqs = workload(seed, cfg.page_size, max_len=_max_len(cfg), shared=True, model=_model(cfg))
    sync = run(cfg, reqs).outputs()
    assert sync == expected(cfg, reqs)
    h = run_ahead(cfg, reqs, seed=seed)
    assert h.ahead_plans > 0
    got = {r: v for r, v in h.results.items() if v[1] != "cancelled"}
    assert got, "everything was cancelled"
    bad = {r: (got[r], sync[r]) for r in got if got[r] != sync[r]}
    assert not bad, f"{len(bad)} pipelined outputs differ from the sync run (got, want): {bad}"
    h.check_outputs()
