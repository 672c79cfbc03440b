"""Scenario tests of the Scheduler: prefix cache and scheduling policy, each with exact outcomes.

Every scenario runs through the checking Harness (sched_helpers), so the step contract, the
simulated KV read-back and the snapshot invariants are checked on every step as well.
"""

from __future__ import annotations

import numpy as np
import pytest
from ferrobatch.core import Scheduler
from sched_helpers import (
    FULL,
    SLIDING,
    Harness,
    ReqSpec,
    SchedConfig,
    read_snapshot,
    reference_generate,
)

PS = 4


def cfg(**kw) -> SchedConfig:
    base = dict(num_blocks=32, page_size=PS, max_batch_tokens=64, safety_margin=0.0)
    base.update(kw)
    return SchedConfig(**base)


def toks(start: int, n: int) -> list[int]:
    """Distinct prompt ids (>= 1000, never produced by the 64-token simulated model)."""
    return [1000 + start + i for i in range(n)]


def req(rid, prompt, max_new=4, **kw) -> ReqSpec:
    return ReqSpec(request_id=rid, prompt=list(prompt), max_new_tokens=max_new, **kw)


def rows(plan) -> dict[str, tuple[int, int]]:
    """request id -> (start position, number of query tokens) of each row."""
    out = {}
    for r, rid in enumerate(plan.request_ids):
        a, b = int(plan.cu_seqlens_q[r]), int(plan.cu_seqlens_q[r + 1])
        out[rid] = (int(plan.positions[a]), b - a)
    return out


def step(h: Harness, tokens=None):
    plan = h.schedule()
    assert plan is not None
    r = rows(plan)
    h.update(tokens if tokens is not None else h.model_tokens())
    return plan, r


def held(h: Harness, rid: str, ty: str = FULL) -> list[int]:
    return read_snapshot(h.s).requests[rid].held.get(ty, [])


def first_row_start(h: Harness, rid: str, max_steps=50) -> int:
    for _ in range(max_steps):
        plan = h.schedule()
        assert plan is not None
        r = rows(plan)
        h.update(h.model_tokens())
        if rid in r:
            return r[rid][0]
    raise AssertionError(f"{rid} never scheduled")


# ================================================================================ prefix cache


def test_prefix_hit_and_refcounts_with_shared_prefix():
    h = Harness(cfg())
    prefix = toks(0, 8)  # two full blocks
    h.add(req("a", prefix + toks(123, 3), max_new=20))
    plan, r = step(h)
    assert r["a"] == (0, 11)
    st0 = h.stats()
    h.add(req("b", prefix + toks(231, 2), max_new=20))
    assert first_row_start(h, "b") == 8, "b should reuse a's two full prefix blocks"
    st1 = h.stats()
    assert st1["prefix_hit_tokens"] - st0["prefix_hit_tokens"] == 8
    assert st1["prompt_tokens"] - st0["prompt_tokens"] == 10
    snap = read_snapshot(h.s)
    a_blocks, b_blocks = snap.requests["a"].held[FULL], snap.requests["b"].held[FULL]
    assert a_blocks[:2] == b_blocks[:2]
    assert not set(a_blocks[2:]) & set(b_blocks[2:])
    for c in a_blocks[:2]:
        assert snap.refcounts[c] == 2
    for c in a_blocks[2:] + b_blocks[2:]:
        assert snap.refcounts[c] == 1
    # a third sharer
    h.add(req("c", prefix + toks(337, 5), max_new=20))
    assert first_row_start(h, "c") == 8
    snap = read_snapshot(h.s)
    for c in a_blocks[:2]:
        assert snap.refcounts[c] == 3
    # shared blocks go back to the free side only when the last user finishes
    assert h.cancel("a") and h.cancel("b")
    step(h)
    snap = read_snapshot(h.s)
    for c in a_blocks[:2]:
        assert snap.refcounts[c] == 1 and c not in snap.free and c not in snap.cached
    assert h.cancel("c")
    h.run_to_completion()
    snap = read_snapshot(h.s)
    for c in a_blocks[:2]:
        assert c in snap.cached, "freed full blocks keep their content and hash"


def test_partial_match_hits_only_matching_blocks():
    h = Harness(cfg())
    h.add(req("a", toks(0, 12) + [55], max_new=1))
    h.run_to_completion()
    before = h.stats()["prefix_hit_tokens"]
    # same first block, different second block: only the first one hits (token-verified chain)
    h.add(req("b", toks(0, 4) + toks(427, 9), max_new=1))
    assert first_row_start(h, "b") == 4
    assert h.stats()["prefix_hit_tokens"] - before == 4
    # a different first block: the identical second block must not hit (hash chains the parent)
    h.add(req("c", toks(333, 4) + toks(4, 8) + [1], max_new=1))
    assert first_row_start(h, "c") == 0
    h.run_to_completion()


def test_last_prompt_token_always_computed():
    h = Harness(cfg())
    prompt = toks(0, 8)  # exactly two full blocks
    h.add(req("a", prompt, max_new=3))
    h.run_to_completion()
    h.add(req("b", prompt, max_new=3))
    start = first_row_start(h, "b")
    assert start < len(prompt), "the last prompt token must be computed to sample from it"
    assert start == 4, "the longest block-aligned hit that leaves the last token to compute"
    h.run_to_completion()
    assert h.tracks["a"].generated == h.tracks["b"].generated
    assert reference_generate(h.model, h.tracks["b"].spec)[0] == h.tracks["b"].generated


def test_twin_requests_identical_prompts():
    """Two identical prompts admitted together, then a third after they finish."""
    h = Harness(cfg())
    prompt = toks(7, 13)
    h.add(req("t1", prompt, max_new=6))
    h.add(req("t2", prompt, max_new=6))
    h.run_to_completion()
    assert h.tracks["t1"].generated == h.tracks["t2"].generated
    before = h.stats()["prefix_hit_tokens"]
    h.add(req("t3", prompt, max_new=6))
    assert first_row_start(h, "t3") == 12
    assert h.stats()["prefix_hit_tokens"] - before == 12
    h.run_to_completion()
    assert h.tracks["t3"].generated == h.tracks["t1"].generated


def test_twins_in_flight_share_after_prefill():
    """A twin arriving after its sibling prefilled shares every full block of the prompt."""
    h = Harness(cfg())
    prompt = toks(3, 17)
    h.add(req("x", prompt, max_new=10))
    step(h)
    h.add(req("y", prompt, max_new=10))
    assert first_row_start(h, "y") == 16
    snap = read_snapshot(h.s)
    assert snap.requests["x"].held[FULL][:4] == snap.requests["y"].held[FULL][:4]
    for c in snap.requests["x"].held[FULL][:4]:
        assert snap.refcounts[c] == 2
    h.run_to_completion()
    assert h.tracks["x"].generated == h.tracks["y"].generated


def test_freed_blocks_kept_until_free_pool_dry_then_lru_eviction():
    nb = 12
    h = Harness(cfg(num_blocks=nb, max_batch_tokens=64))
    X, Y = toks(0, 8), toks(20, 8)
    # X then Y run and finish: their full blocks become cached (initialized)
    h.add(req("x", X, max_new=1))
    plan, _ = step(h)
    x_chunks = held_from_plan(plan, "x")[:2]
    h.run_to_completion()
    h.add(req("y", Y, max_new=1))
    plan, _ = step(h)
    y_chunks = held_from_plan(plan, "y")[:2]
    h.run_to_completion()
    snap = read_snapshot(h.s)
    assert set(x_chunks + y_chunks) <= set(snap.cached)
    # touch X again (a hit makes it the most recently used)
    h.add(req("z", X + toks(80, 4), max_new=1))
    assert first_row_start(h, "z") == 8
    h.run_to_completion()
    st_ = h.stats()
    n_free = st_["num_free_blocks"] - st_["num_cached_blocks"]  # uninitialized
    assert st_["num_cached_blocks"] >= 4
    # V fits in the uninitialized blocks: no cached block may be reclaimed
    if n_free >= 2:
        h.add(req("v", toks(40, 2 * PS), max_new=1))
        plan, _ = step(h)
        v_chunks = held_from_plan(plan, "v")
        assert not set(v_chunks) & set(x_chunks + y_chunks), "cached block reclaimed too early"
        h.run_to_completion()
        st_ = h.stats()
        n_free = st_["num_free_blocks"] - st_["num_cached_blocks"]  # uninitialized
    # W needs every uninitialized block plus two more: the two least recently used (Y's) go
    n_w = n_free + 2
    h.add(req("w", toks(60, n_w * PS - 1), max_new=1))
    plan, _ = step(h)
    w_chunks = held_from_plan(plan, "w")
    assert len(w_chunks) == n_w
    assert set(y_chunks) <= set(w_chunks), f"LRU: Y {y_chunks} should be evicted, W {w_chunks}"
    assert not set(x_chunks) & set(w_chunks), f"X {x_chunks} was used more recently than Y"
    h.run_to_completion()
    h.add(req("x2", X + [3], max_new=1))
    assert first_row_start(h, "x2") == 8
    h.add(req("y2", Y + [3], max_new=1))
    assert first_row_start(h, "y2") == 0
    h.run_to_completion()


def held_from_plan(plan, rid: str, ty: str = FULL) -> list[int]:
    r = list(plan.request_ids).index(rid)
    return [int(c) for c in plan.block_tables[ty][r] if c != 0]


def test_failed_allocation_leaves_hit_blocks_untouched():
    nb = 10
    h = Harness(cfg(num_blocks=nb, scheduler_type="prefill_first"))
    P = toks(0, 8)
    h.add(req("a", P, max_new=1))
    plan, _ = step(h)
    p_chunks = held_from_plan(plan, "a")[:2]
    h.run_to_completion()
    # R takes every uninitialized block (8 blocks for 31 tokens + the decode at position 31)
    h.add(req("r", toks(100, 31), max_new=9))
    plan, _ = step(h)
    assert not set(held_from_plan(plan, "r")) & set(p_chunks)
    # B hits P's two blocks but needs one more block: none is free -> admission must fail
    h.add(req("b", P + toks(200, 4), max_new=2))
    plan, r = step(h)
    assert "b" not in r, "b cannot be admitted: no block left beyond its prefix hit"
    snap = read_snapshot(h.s)
    for c in p_chunks:
        assert snap.refcounts.get(c, 0) == 0, "a failed admission left a refcount on a hit block"
        assert c in snap.cached, "a failed admission moved a hit block out of the cache"
    assert snap.requests["b"].held.get(FULL, []) == []
    h.s.check_invariants()
    # once R goes, B is admitted with its hit intact
    assert h.cancel("r")
    assert first_row_start(h, "b") == 8
    h.run_to_completion()


def test_no_sharing_when_disabled_or_sliding():
    for c in (cfg(allow_block_sharing=False),
              cfg(layer_types=(FULL, SLIDING), sliding_window=6)):
        h = Harness(c)
        P = toks(0, 12)
        h.add(req("a", P + [1], max_new=2))
        h.run_to_completion()
        h.add(req("b", P + [2], max_new=2))
        assert first_row_start(h, "b") == 0
        h.run_to_completion()
        assert h.stats()["prefix_hit_tokens"] == 0


# ================================================================================ scheduling


def test_chunked_prefill_fills_budget_fifo():
    h = Harness(cfg(max_batch_tokens=16, scheduler_type="fifo"))
    for i, rid in enumerate("ABC"):
        h.add(req(rid, toks(100 * i + 1, 20), max_new=3))
    plan, r = step(h)
    assert r == {"A": (0, 16)} and len(plan.logits_indices) == 0
    plan, r = step(h)
    assert list(plan.request_ids) == ["A", "B"] and r == {"A": (16, 4), "B": (0, 12)}
    assert list(plan.logits_rows) == [0]
    plan, r = step(h)
    # decodes first, then in-flight prefills, then new requests
    assert list(plan.request_ids) == ["A", "B", "C"]
    assert r == {"A": (20, 1), "B": (12, 8), "C": (0, 7)}
    assert list(plan.logits_rows) == [0, 1]
    plan, r = step(h)
    assert list(plan.request_ids) == ["A", "B", "C"]
    assert r == {"A": (21, 1), "B": (20, 1), "C": (7, 13)}
    h.run_to_completion()


def test_prefill_first_finishes_chunked_prefill_before_decodes():
    for sched in ("fifo", "prefill_first"):
        h = Harness(cfg(max_batch_tokens=8, scheduler_type=sched))
        h.add(req("d", toks(0, 3), max_new=30))
        step(h)  # d prefilled, now decoding
        h.add(req("p", toks(50, 30), max_new=2))
        plan, r = step(h)
        assert "p" in r
        plan, r = step(h)  # p is now in flight
        order = list(plan.request_ids)
        if sched == "fifo":
            assert order[0] == "d" and r["d"][1] == 1, (sched, r)
            assert r["p"][1] == 7
        else:
            assert order[0] == "p" and r["p"][1] == 8, (sched, r)
            assert "d" not in r
        h.run_to_completion()


def test_fifo_admission_in_arrival_order():
    h = Harness(cfg(max_requests_per_batch=1))
    for i in range(5):
        h.add(req(f"r{i}", toks(10 * i, 5), max_new=3))
    h.run_to_completion()
    assert h.finished_order == [f"r{i}" for i in range(5)]


def test_priority_order_lower_first_ties_by_arrival():
    h = Harness(cfg(max_requests_per_batch=1))
    for rid, prio in (("a", 5), ("b", 1), ("c", 1), ("d", 0), ("e", 5)):
        h.add(req(rid, toks(ord(rid), 5), max_new=2, priority=prio))
    h.run_to_completion()
    assert h.finished_order == ["d", "b", "c", "a", "e"]


def test_max_requests_per_batch_and_budget_respected():
    h = Harness(cfg(max_requests_per_batch=3, max_batch_tokens=10, num_blocks=64))
    for i in range(8):
        h.add(req(f"r{i}", toks(i, 6), max_new=5))
    while h.step():
        assert len(h.plan_rows) <= 3
    h.run_to_completion()


# ---------------------------------------------------------------------- stop conditions


def run_with(h: Harness, rid: str, feed: list[int]) -> None:
    """Drive until rid finishes, sampling tokens from feed for rid (others get 10)."""
    it = iter(feed)
    for _ in range(200):
        plan = h.schedule()
        if plan is None:
            break
        toks_ = []
        for row in h.plan_rows:
            if row["sampled"]:
                toks_.append(next(it) if row["rid"] == rid else 10)
        h.update(toks_)
        if h.tracks[rid].finished:
            return
    raise AssertionError("did not finish")


@pytest.mark.parametrize(
    "kw,feed,want_tokens,reason",
    [
        (dict(max_new=3), [11, 12, 13, 14], [11, 12, 13], "length"),
        (dict(max_new=9, eos_token_ids=(2, 7)), [11, 7, 13], [11, 7], "stop"),
        (dict(max_new=9, stop_token_ids=(5,)), [11, 12, 5, 13], [11, 12, 5], "stop"),
        (dict(max_new=2, eos_token_ids=(2,)), [11, 2], [11, 2], "stop"),  # stop beats length
        (dict(max_new=20, stop_sequences=((4, 5, 6),)), [4, 5, 4, 5, 7, 4, 5, 6, 9],
         [4, 5, 4, 5, 7, 4, 5, 6], "stop"),
        (dict(max_new=20, stop_sequences=((4, 4),)), [4, 5, 4, 4], [4, 5, 4, 4], "stop"),
        (dict(max_new=1), [11], [11], "length"),
    ],
)
def test_stop_conditions(kw, feed, want_tokens, reason):
    h = Harness(cfg())
    max_new = kw.pop("max_new")
    h.add(req("s", toks(0, 6), max_new=max_new, **kw))
    h.add(req("other", toks(30, 6), max_new=40))
    run_with(h, "s", feed)
    tr = h.tracks["s"]
    assert tr.generated == want_tokens and tr.finish_reason == reason
    assert h.s.has_unfinished()  # "other" still runs
    h.run_to_completion()


def test_stop_sequence_not_matched_across_prompt():
    h = Harness(cfg())
    h.add(req("s", toks(0, 5) + [4], max_new=4, stop_sequences=((4, 5),)))
    run_with(h, "s", [5, 11, 12, 13])
    assert h.tracks["s"].generated == [5, 11, 12, 13]
    assert h.tracks["s"].finish_reason == "length"


def test_eos_in_prompt_does_not_stop():
    h = Harness(cfg())
    h.add(req("s", [2, 3] + toks(0, 4) + [2], max_new=3, eos_token_ids=(2,),
              stop_token_ids=(3,), stop_sequences=((2,),)))
    run_with(h, "s", [11, 12, 13])
    assert h.tracks["s"].generated == [11, 12, 13]
    assert h.tracks["s"].finish_reason == "length"


def test_hybrid_admission_is_atomic_across_allocators():
    """A hybrid request needs a full block and a ring chunk to start: with one free chunk it
    is not admitted and nothing is allocated for it."""
    c = cfg(num_blocks=10, layer_types=(FULL, SLIDING), sliding_window=4)  # R = 2
    h = Harness(c)
    h.add(req("big", toks(0, 28), max_new=3))  # 7 full blocks + 2 ring chunks
    h.add(req("small", toks(100, 3), max_new=2))
    plan = h.schedule()
    assert list(plan.request_ids) == ["big"]
    snap = read_snapshot(h.s)
    assert h.stats()["num_free_blocks"] == 1
    assert snap.requests["small"].held == {FULL: [], SLIDING: []}
    assert snap.requests["small"].state == "waiting"
    h.update(h.model_tokens())
    h.run_to_completion()


# ---------------------------------------------------------------------- cancel


def test_cancel_in_every_state():
    h = Harness(cfg(num_blocks=40, max_batch_tokens=8, max_requests_per_batch=2))
    h.add(req("dec", toks(0, 3), max_new=50))
    h.add(req("pre", toks(10, 20), max_new=50))
    h.add(req("wait", toks(40, 5), max_new=50))
    step(h)
    step(h)
    snap = read_snapshot(h.s)
    assert snap.requests["pre"].num_computed_tokens < 20 and held(h, "pre")
    # waiting (never scheduled), prefilling, decoding, with a plan outstanding
    assert h.cancel("wait")
    assert h.cancel("pre")
    assert not h.cancel("pre"), "second cancel of the same request must return False"
    assert not h.cancel("unknown")
    step(h)  # reports both as cancelled
    assert h.tracks["wait"].finish_reason == "cancelled"
    assert h.tracks["pre"].finish_reason == "cancelled"
    h.add(req("late", toks(70, 4), max_new=50))
    assert h.schedule() is not None
    assert h.cancel("dec")  # a plan is outstanding
    h.update(h.model_tokens())
    assert h.tracks["dec"].finish_reason == "cancelled"
    assert not h.cancel("dec")
    h.run_to_completion()
    assert not h.cancel("late")  # finished


def test_cancel_swapped_request_frees_swap_slots():
    h = Harness(cfg(num_blocks=8, max_batch_tokens=32, cpu_offload_blocks=8,
                    scheduler_type="prefill_first"))
    h.add(req("old", toks(0, 14), max_new=16))
    h.add(req("new", toks(50, 14), max_new=16))
    swapped = None
    for _ in range(60):
        if h.schedule() is None:
            break
        h.update(h.model_tokens())
        snap = read_snapshot(h.s)
        sw = [r for r, sr in snap.requests.items() if sr.swap_slots]
        if sw:
            swapped = sw[0]
            break
    assert swapped == "new", "the newest request is offloaded, never the last active one"
    assert h.stats()["num_offloads"] >= 1
    assert h.cancel(swapped)
    h.run_to_completion()
    snap = read_snapshot(h.s)
    assert all(not sr.swap_slots for sr in snap.requests.values())


def test_cancelled_reported_once_when_nothing_else_runs():
    h = Harness(cfg())
    h.add(req("a", toks(0, 5), max_new=5))
    assert h.cancel("a")
    assert h.s.schedule() is None
    out = h.s.update(np.zeros(0, dtype=np.int32))
    assert [(d.request_id, d.finished, d.finish_reason) for d in out] == [("a", True, "cancelled")]
    assert list(h.s.update(np.zeros(0, dtype=np.int32))) == []
    assert not h.s.has_unfinished()


# ---------------------------------------------------------------------- preemption


def test_preemption_when_full_soft_reset_keeps_outputs():
    c = cfg(num_blocks=8, max_batch_tokens=32, scheduler_type="prefill_first")
    h = Harness(c, strict=True)
    specs = [req(f"p{i}", toks(13 * i, 10), max_new=14) for i in range(3)]
    for s in specs:
        h.add(s)
    h.run_to_completion()
    st_ = h.stats()
    assert st_["num_soft_resets"] > 0, st_
    for s in specs:
        want = reference_generate(h.model, s)
        assert (h.tracks[s.request_id].generated, h.tracks[s.request_id].finish_reason) == want


def test_preemption_with_offload_swaps_and_resumes_without_recompute():
    c = cfg(num_blocks=8, max_batch_tokens=32, cpu_offload_blocks=16,
            scheduler_type="prefill_first")
    h = Harness(c, strict=True)
    specs = [req(f"p{i}", toks(13 * i, 10), max_new=14) for i in range(3)]
    for s in specs:
        h.add(s)
    saw_out = saw_in = False
    while True:
        plan = h.schedule()
        if plan is None:
            break
        saw_out |= len(plan.swap_out) > 0
        saw_in |= len(plan.swap_in) > 0
        h.update(h.model_tokens())
    h.run_to_completion()
    assert saw_out and saw_in
    st_ = h.stats()
    assert st_["num_offloads"] > 0 and st_["num_soft_resets"] == 0, st_
    for s in specs:
        assert (h.tracks[s.request_id].generated,
                h.tracks[s.request_id].finish_reason) == reference_generate(h.model, s)


def test_never_preempts_the_last_active_request():
    h = Harness(cfg(num_blocks=6, max_batch_tokens=32))
    h.add(req("solo", toks(0, 5), max_new=18))  # 23 tokens fit in 6 blocks of 4
    h.run_to_completion()
    st_ = h.stats()
    assert st_["num_soft_resets"] == 0 and st_["num_offloads"] == 0


def test_safety_margin_blocks_new_admissions():
    h = Harness(cfg(num_blocks=10, scheduler_type="fifo", safety_margin=0.5))
    h.add(req("a", toks(0, 22), max_new=6))  # 6 of 10 blocks: free 40% < 50%
    step(h)
    h.add(req("b", toks(40, 3), max_new=2))
    for _ in range(3):
        plan, r = step(h)
        assert "b" not in r, "no new prefill while free capacity is under the margin"
        assert "a" in r, "decodes continue"
    h.run_to_completion()
    # with the margin off, b would have been admitted alongside a
    h2 = Harness(cfg(num_blocks=10, scheduler_type="fifo", safety_margin=0.0))
    h2.add(req("a", toks(0, 22), max_new=6))
    step(h2)
    h2.add(req("b", toks(40, 3), max_new=2))
    plan, r = step(h2)
    assert "b" in r
    h2.run_to_completion()


def test_default_safety_margins():
    """fifo defaults to 0.15, prefill_first to 0.0 (observable through admission)."""
    for sched, admitted in (("fifo", False), ("prefill_first", True)):
        h = Harness(cfg(num_blocks=20, scheduler_type=sched, safety_margin=None,
                        max_batch_tokens=128))
        h.add(req("a", toks(0, 70), max_new=2))  # 18 of 20 blocks: 10% free
        step(h)
        h.add(req("b", toks(40, 3), max_new=2))
        plan, r = step(h)
        assert ("b" in r) == admitted, (sched, r)
        h.run_to_completion()


# ---------------------------------------------------------------------- argument checking


@pytest.mark.parametrize(
    "kw,field",
    [
        (dict(num_blocks=0), "num_blocks"),
        (dict(num_blocks=-3), "num_blocks"),
        (dict(page_size=0), "page_size"),
        (dict(page_size=-4), "page_size"),
        (dict(max_batch_tokens=0), "max_batch_tokens"),
        (dict(max_requests_per_batch=0), "max_requests_per_batch"),
        (dict(scheduler_type="lifo"), "scheduler_type"),
        (dict(safety_margin=-0.1), "safety_margin"),
        (dict(safety_margin=1.5), "safety_margin"),
        (dict(layer_types=["full_attention", "dense"]), "layer_types"),
        (dict(layer_types=[]), "layer_types"),
        (dict(layer_types=["sliding_attention"]), "sliding_window"),
        (dict(layer_types=["sliding_attention"], sliding_window=0), "sliding_window"),
        (dict(cpu_offload_blocks=-1), "cpu_offload_blocks"),
    ],
)
def test_bad_scheduler_arguments_raise_value_error_naming_field(kw, field):
    args = dict(num_blocks=8, page_size=4, max_batch_tokens=16)
    args.update(kw)
    with pytest.raises(ValueError, match=field):
        Scheduler(args.pop("num_blocks"), args.pop("page_size"), args.pop("max_batch_tokens"),
                  **args)


def test_bad_add_request_arguments():
    s = Scheduler(8, 4, 16)
    s.add_request("a", [1, 2, 3], 4)
    with pytest.raises(ValueError, match="request_id|duplicate|already"):
        s.add_request("a", [1, 2], 4)
    with pytest.raises(ValueError, match="prompt"):
        s.add_request("b", [], 4)
    with pytest.raises(ValueError, match="max_new_tokens"):
        s.add_request("c", [1], 0)
    s.check_invariants()
    assert s.stats()["waiting"] == 1


def test_schedule_twice_without_update_raises():
    s = Scheduler(8, 4, 16)
    s.add_request("a", [11, 12, 13], 4)
    plan = s.schedule()
    assert plan is not None
    with pytest.raises(Exception):  # noqa: B017 - any error; must not hand out a second plan
        s.schedule()
    with pytest.raises(ValueError):
        s.update(np.array([1, 2], dtype=np.int32))  # wrong count
    out = s.update([7])  # a list is accepted too
    assert [(d.request_id, list(d.new_token_ids)) for d in out] == [("a", [7])]
    s.check_invariants()


def test_cache_read_budget_limits_rows_and_chunks():
    """max_batch_cache_tokens bounds sum(seqlens_k): it shortens a prefill chunk and holds
    rows back once spent."""
    h = Harness(cfg(max_batch_cache_tokens=40))
    for rid, start in (("A", 0), ("B", 100), ("C", 200)):
        h.add(req(rid, toks(start, 15), max_new=6))
    plan, r = step(h)
    assert r == {"A": (0, 15), "B": (0, 15), "C": (0, 10)}
    assert int(plan.seqlens_k.sum()) == 40
    plan, r = step(h)
    assert r == {"A": (15, 1), "B": (15, 1)}  # C's next chunk would read 11+ keys: 8 left
    h.run_to_completion()


def test_update_rejects_bad_tokens_and_keeps_the_plan():
    s = Scheduler(8, 4, 16)
    s.add_request("a", [11, 12, 13], 4)
    s.add_request("b", [21, 22], 4)
    assert s.schedule() is not None
    with pytest.raises(ValueError, match="sampled_token_ids"):
        s.update([5, -1])
    with pytest.raises(ValueError, match="sampled_token_ids"):
        s.update([5])
    # the plan is still outstanding and a correct update goes through; int64 and strided
    # arrays are accepted
    out = s.update(np.array([7, 0, 8, 0], dtype=np.int64)[::2])
    assert [(d.request_id, list(d.new_token_ids)) for d in out] == [("a", [7]), ("b", [8])]
    with pytest.raises(RuntimeError):
        s.update([1])  # tokens without a plan
    s.check_invariants()


def test_add_request_validates_token_ids():
    s = Scheduler(8, 4, 16)
    with pytest.raises(ValueError, match="prompt_token_ids"):
        s.add_request("a", [1, -2], 3)
    with pytest.raises(ValueError, match="stop_sequences"):
        s.add_request("b", [1], 3, stop_sequences=[[]])
    with pytest.raises(ValueError, match="num_blocks|never fit"):
        s.add_request("c", list(range(30)), 10)  # 39 tokens > 8 blocks of 4
    s.add_request("d", np.array([5, 6, 7], dtype=np.int64), 3)  # numpy prompt accepted
    assert s.stats()["waiting"] == 1
    s.check_invariants()


def test_update_without_plan_and_no_cancel_is_harmless():
    s = Scheduler(8, 4, 16)
    assert s.schedule() is None
    assert not s.has_unfinished()
    s.check_invariants()


def test_stats_keys():
    s = Scheduler(8, 4, 16)
    st_ = s.stats()
    for k in ("num_blocks", "num_free_blocks", "num_cached_blocks", "num_used_blocks", "waiting",
              "running", "prefix_hit_tokens", "prompt_tokens", "num_offloads", "num_soft_resets"):
        assert k in st_, k
    assert st_["num_blocks"] == 8 and st_["num_free_blocks"] == 8


def test_no_leak_after_mixed_workload():
    h = Harness(cfg(num_blocks=12, max_batch_tokens=12, cpu_offload_blocks=4))
    for i in range(12):
        h.add(req(f"m{i}", toks(i % 3 * 8, 6 + i % 5), max_new=3 + i % 7,
                  eos_token_ids=(2,)))
    for i in range(20):
        if not h.step():
            break
        if i == 5:
            h.cancel("m3")
            h.cancel("m11")
    h.run_to_completion()
    st_ = h.stats()
    assert st_["num_used_blocks"] == 0
    assert st_["num_free_blocks"] == 12


# ---------------------------------------------------------------------- harness self-test


class Corrupting:
    """Wraps a Scheduler and corrupts the first plan where `corrupt(plan)` returns True, to
    prove the harness's outside checks catch real faults (they are not vacuous)."""

    def __init__(self, inner, corrupt):
        self._inner = inner
        self._corrupt = corrupt
        self.done = False

    def schedule(self):
        plan = self._inner.schedule()
        if plan is not None and not self.done and self._corrupt(plan):
            self.done = True
        return plan

    def __getattr__(self, name):
        return getattr(self._inner, name)


def _swap_full_blocks(plan):
    bt = plan.block_tables[FULL]
    for r in range(bt.shape[0]):
        a = int(plan.cu_seqlens_q[r])
        if int(plan.positions[a]) >= 2 * PS and bt[r, 1] != 0:
            bt[r, 0], bt[r, 1] = int(bt[r, 1]), int(bt[r, 0])
            return True
    return False


def _slot_off_by_one(plan):
    sm = plan.slot_mapping[FULL]
    sm[len(sm) - 1] += 1 if int(sm[len(sm) - 1]) % PS != PS - 1 else -1
    return True


def _wrong_token(plan):
    if len(plan.input_ids) == 0:
        return False
    plan.input_ids[0] += 1
    return True


def _drop_swap_out(plan):
    if len(plan.swap_out) == 0:
        return False
    plan.swap_out[:, 1] = plan.swap_out[::-1, 1].copy() if len(plan.swap_out) > 1 else 0
    if len(plan.swap_out) == 1:
        plan.swap_out[0, 0] = 0  # copy the zero chunk instead of the request's
    return True


def _roll_ring(plan):
    bt = plan.block_tables[SLIDING]
    for r in range(bt.shape[0]):
        a = int(plan.cu_seqlens_q[r])
        if int(plan.positions[a]) >= 2 * PS and bt[r, 1] != 0:
            bt[r] = np.roll(bt[r].copy(), 1)
            return True
    return False


def _shift_positions(plan):
    for r in range(len(plan.request_ids)):
        a, b = int(plan.cu_seqlens_q[r]), int(plan.cu_seqlens_q[r + 1])
        if int(plan.positions[a]) > 0:
            plan.positions[a:b] += 1
            return True
    return False


@pytest.mark.parametrize(
    "corrupt,config",
    [
        (_swap_full_blocks, cfg()),
        (_slot_off_by_one, cfg()),
        (_wrong_token, cfg()),
        (_shift_positions, cfg()),
        (_drop_swap_out, cfg(num_blocks=8, cpu_offload_blocks=16, scheduler_type="prefill_first")),
        (_roll_ring, cfg(layer_types=(SLIDING,), sliding_window=8)),
    ],
    ids=["block-table", "slot", "input-id", "positions", "swap", "sliding-ring"],
)
@pytest.mark.parametrize("use_snapshot", [True, False], ids=["snapshot", "plan-only"])
def test_harness_catches_corrupted_plans(corrupt, config, use_snapshot):
    from sched_helpers import ContractError

    h = Harness(config, use_snapshot=use_snapshot)
    h.s = Corrupting(h.s, corrupt)
    for i in range(3):
        h.add(req(f"h{i}", toks(20 * i, 10), max_new=14))
    with pytest.raises(ContractError):
        h.run_to_completion()
    assert h.s.done


def test_simulated_model_output_changes_with_a_wrong_block_table():
    """Non-strict mode: a corrupted block table turns into different generated tokens."""
    h = Harness(cfg(), strict=False, use_snapshot=False)
    h.s = Corrupting(h.s, _swap_full_blocks)
    spec = req("m", toks(0, 10), max_new=12)
    h.add(spec)
    h.run_to_completion()
    assert h.s.done and h.read_mismatches > 0
    assert h.tracks["m"].generated != reference_generate(h.model, spec)[0]


# ----------------------------------------------------------------------------------------------
# One plan ahead (schedule_ahead), through the bindings
# ----------------------------------------------------------------------------------------------


def test_schedule_ahead_bindings_contract():
    s = Scheduler(32, PS, 64, safety_margin=0.0)
    assert s.num_outstanding == 0 and not s.has_outstanding_plan
    with pytest.raises(RuntimeError, match="outstanding"):
        s.schedule_ahead()
    s.add_request("a", toks(0, 3), 8)
    s.add_request("b", toks(10, 2), 8)
    p0 = s.schedule()
    assert not p0.ahead
    pti = p0.prev_token_index
    assert pti.dtype == np.int32 and pti.flags["C_CONTIGUOUS"] and list(pti) == [-1] * 5
    assert p0.prev_token_index is pti  # cached like every attribute
    assert s.num_outstanding == 1 and s.has_outstanding_plan
    p1 = s.schedule_ahead()
    assert p1.ahead and "ahead=True" in repr(p1)
    assert s.num_outstanding == 2 and s.snapshot()["num_outstanding"] == 2
    assert list(p1.request_ids) == ["a", "b"]
    assert list(p1.input_ids) == [0, 0] and list(p1.prev_token_index) == [0, 1]
    assert list(p1.positions) == [3, 2]
    with pytest.raises(RuntimeError, match="two"):
        s.schedule_ahead()
    with pytest.raises(RuntimeError, match="outstanding"):
        s.schedule()
    with pytest.raises(ValueError, match="samples 2 rows"):
        s.update(np.array([5], dtype=np.int32))
    out = s.update(np.array([5, 6], dtype=np.int32))  # the oldest plan
    assert [(d.request_id, list(d.new_token_ids)) for d in out] == [("a", [5]), ("b", [6])]
    assert s.num_outstanding == 1
    out = s.update([7, 8])
    assert list(out.token_ids) == [7, 8] and s.num_outstanding == 0
    p = s.schedule()
    assert list(p.input_ids) == [7, 8] and list(p.prev_token_index) == [-1, -1]
    s.update([1, 1])
    s.check_invariants()


def test_schedule_ahead_eos_in_flight_defers_the_free():
    s = Scheduler(32, PS, 64, safety_margin=0.0)
    s.add_request("a", toks(0, 3), 8, eos_token_ids=[2])
    s.add_request("b", toks(10, 2), 8)
    s.schedule()
    s.schedule_ahead()
    a_chunks = s.snapshot()["requests"]["a"]["blocks"][FULL]
    out = s.update([2, 5])  # a stops while it has a row in the newer plan
    assert [d.finish_reason for d in out] == ["stop", None]
    snap = s.snapshot()
    assert "a" not in snap["requests"]
    assert sorted(snap["deferred_chunks"]) == sorted(a_chunks)
    assert all(snap["refcounts"][c] == 1 for c in a_chunks)
    out = s.update([9, 9])  # a's row dropped
    assert [d.request_id for d in out] == ["b"]
    snap = s.snapshot()
    assert snap["deferred_chunks"] == [] and all(snap["refcounts"][c] == 0 for c in a_chunks)
    s.check_invariants()


def test_schedule_ahead_cancel_with_two_outstanding_reported_once():
    s = Scheduler(32, PS, 64, safety_margin=0.0)
    s.add_request("a", toks(0, 3), 8)
    s.add_request("b", toks(10, 2), 8)
    s.schedule()
    s.schedule_ahead()
    assert s.cancel("b")
    out = s.update([5, 6])
    assert [(d.request_id, d.finish_reason, list(d.new_token_ids)) for d in out] == [
        ("a", None, [5]), ("b", "cancelled", [])]
    assert s.snapshot()["deferred_chunks"], "b's chunks held for the newer plan"
    out = s.update([7, 8])
    assert [d.request_id for d in out] == ["a"]
    assert s.snapshot()["deferred_chunks"] == []
    s.check_invariants()


def test_schedule_ahead_none_when_nothing_fits_and_no_preemption():
    s = Scheduler(2, 2, 64, safety_margin=0.0, cpu_offload_blocks=4)
    s.add_request("a", [1, 2], 3)
    s.add_request("b", [3, 4], 3)
    s.schedule()
    assert s.schedule_ahead() is None
    st = s.stats()
    assert st["stalled_requests"] == 2 and st["num_preemptions"] == 0
    assert s.num_outstanding == 1
    s.update([5, 6])
    p = s.schedule()  # the sync path preempts as usual
    assert p.swap_out.shape == (1, 2) and s.stats()["num_preemptions"] == 1
