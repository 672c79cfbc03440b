"""The Rust/Python boundary: bad values cross as `ferrobatch.errors.FieldError` (a ValueError)
whose `.field` names the argument, whether the bindings or the core reject them; calls at
the wrong time stay RuntimeError."""

from __future__ import annotations

import numpy as np
import pytest
from ferrobatch.errors import FieldError

_core = pytest.importorskip("ferrobatch._core")
Scheduler = _core.Scheduler

GOOD = dict(num_blocks=16, page_size=4, max_batch_tokens=64)


def field_of(fn, *args, **kwargs) -> str | None:
    """Call `fn`, expecting a FieldError; return its `.field`."""
    with pytest.raises(FieldError) as info:
        fn(*args, **kwargs)
    assert isinstance(info.value, ValueError)
    return info.value.field


# Scheduler(...) arguments the bindings reject (negative counts).
@pytest.mark.parametrize("field", [
    "num_blocks", "page_size", "max_batch_tokens", "max_requests_per_batch",
    "cpu_offload_blocks", "max_batch_cache_tokens",
])
def test_negative_config_counts(field):
    assert field_of(Scheduler, **{**GOOD, field: -1}) == field


def test_negative_sliding_window():
    kw = dict(GOOD, layer_types=["sliding_attention"], sliding_window=-3)
    assert field_of(Scheduler, **kw) == "sliding_window"


# add_request arguments the bindings reject (types and int32 range).
@pytest.mark.parametrize("kwargs,field", [
    (dict(prompt_token_ids="abc"), "prompt"),
    (dict(prompt_token_ids=[1, -2]), "prompt"),
    (dict(prompt_token_ids=np.array([1, -2], dtype=np.int32)), "prompt"),
    (dict(prompt_token_ids=[1, 2**31]), "prompt"),
    (dict(prompt_token_ids=[1, None]), "prompt"),
    (dict(max_new_tokens=-1), "max_new_tokens"),
    (dict(eos_token_ids=[-1]), "eos_token_ids"),
    (dict(eos_token_ids="x"), "eos_token_ids"),
    (dict(stop_token_ids=[2**40]), "stop_token_ids"),
    (dict(stop_sequences=5), "stop_sequences"),
    (dict(stop_sequences=[[1], "ab"]), "stop_sequences"),
    (dict(stop_sequences=[[1, -1]]), "stop_sequences"),
])
def test_add_request_arguments(kwargs, field):
    s = Scheduler(**GOOD)
    args = dict(request_id="r", prompt_token_ids=[1, 2, 3], max_new_tokens=4) | kwargs
    assert field_of(s.add_request, **args) == field
    assert not s.has_unfinished()


@pytest.mark.parametrize("tokens", [
    "ab", [1, -1], np.array([1, -1], dtype=np.int64), np.array([1, 2**40], dtype=np.int64),
    [1.5, 2],
])
def test_update_arguments(tokens):
    s = Scheduler(**GOOD)
    s.add_request("a", [1, 2, 3], 4)
    s.add_request("b", [4, 5, 6], 4)
    plan = s.schedule()
    assert plan is not None and plan.num_sampled == 2
    assert field_of(s.update, tokens) == "sampled_token_ids"
    s.update(np.array([7, 7], dtype=np.int32))  # the plan is still outstanding


def test_wrong_time_is_runtime_error():
    s = Scheduler(**GOOD)
    s.add_request("a", [1, 2, 3], 4)
    assert s.schedule() is not None
    with pytest.raises(RuntimeError) as info:
        s.schedule()
    assert not isinstance(info.value, ValueError)


def test_kernel_arguments():
    q = np.zeros((1, 2, 4), dtype=np.float32)
    cache = np.zeros((8, 1, 4), dtype=np.float32)
    table = np.zeros((1, 2), dtype=np.int32)
    seqlens = np.ones(1, dtype=np.int32)
    kw = dict(q_dtype="float32", cache_dtype="float32", out_dtype="float32", page=4, window=0,
              scale=1.0, softcap=0.0, threads=1)
    out = np.zeros_like(q)
    _core.paged_decode_attention(q, cache, cache, table, seqlens, out, **kw)
    assert field_of(_core.paged_decode_attention, q.astype(np.float64), cache, cache, table,
                    seqlens, out, **kw) == "q"
    # a dtype name the kernel does not know is the dtype argument's fault
    assert field_of(_core.paged_decode_attention, q, cache, cache, table, seqlens, out,
                    **(kw | {"cache_dtype": "int4"})) == "cache_dtype"
    # an int8 cache needs its scales, and int8 storage
    assert field_of(_core.paged_decode_attention, q, cache, cache, table, seqlens, out,
                    **(kw | {"cache_dtype": "int8"})) == "k_scales"
    scales = np.ones((8, 1), dtype=np.float32)
    int8 = kw | {"cache_dtype": "int8", "k_scales": scales, "v_scales": scales}
    assert field_of(_core.paged_decode_attention, q, cache, cache, table, seqlens, out,
                    **int8) == "k_cache"
    c8 = np.zeros((8, 1, 4), dtype=np.int8)
    _core.paged_decode_attention(q, c8, c8, table, seqlens, out, **int8)
    assert field_of(_core.paged_decode_attention, q, c8, c8, table, seqlens, out,
                    **(int8 | {"v_scales": scales[:4]})) == "v_scales"
    strided = np.zeros((1, 2, 8), dtype=np.float32)[:, :, ::2]
    assert field_of(_core.paged_decode_attention, q, cache, cache, table, seqlens, strided,
                    **kw) == "out"
    # Fortran order, a read-only output and an output aliasing an input are refused too
    q2, out2, lens2 = np.zeros((2, 2, 4), np.float32), np.zeros((2, 2, 4), np.float32), \
        np.ones(2, np.int32)
    fortran = np.asfortranarray(np.zeros((2, 2), dtype=np.int32))
    assert not fortran.flags.c_contiguous
    assert field_of(_core.paged_decode_attention, q2, cache, cache, fortran, lens2, out2,
                    **kw) == "block_tables"
    frozen = np.zeros_like(q)
    frozen.setflags(write=False)
    assert field_of(_core.paged_decode_attention, q, cache, cache, table, seqlens, frozen,
                    **kw) == "out"
    both = np.zeros(16, dtype=np.float32)
    assert field_of(_core.paged_decode_attention, both[:8].reshape(1, 2, 4), cache, cache,
                    table, seqlens, both[:8].reshape(1, 2, 4).view(), **kw) in ("q", "out")


# Scheduler(...) values the core rejects.
@pytest.mark.parametrize("kwargs,field", [
    (dict(num_blocks=0), "num_blocks"),
    (dict(num_blocks=2**30), "num_blocks"),
    (dict(page_size=0), "page_size"),
    (dict(max_batch_tokens=0), "max_batch_tokens"),
    (dict(max_requests_per_batch=0), "max_requests_per_batch"),
    (dict(max_batch_cache_tokens=0), "max_batch_cache_tokens"),
    (dict(scheduler_type="lifo"), "scheduler_type"),
    (dict(safety_margin=1.0), "safety_margin"),
    (dict(safety_margin=float("nan")), "safety_margin"),
    (dict(layer_types=[]), "layer_types"),
    (dict(layer_types=["global"]), "layer_types"),
    (dict(layer_types=["sliding_attention"]), "sliding_window"),
    (dict(layer_types=["sliding_attention"], sliding_window=0), "sliding_window"),
])
def test_config_values(kwargs, field):
    assert field_of(Scheduler, **(GOOD | kwargs)) == field


# add_request values the core rejects.
@pytest.mark.parametrize("kwargs,field", [
    (dict(prompt_token_ids=[]), "prompt"),
    (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(stop_sequences=[[1], []]), "stop_sequences"),
    (dict(max_new_tokens=10_000), "max_new_tokens"),  # more than the pool holds
    (dict(prompt_token_ids=[1] * 100), "prompt"),  # too long even with one new token
])
def test_add_request_values(kwargs, field):
    s = Scheduler(**GOOD)
    args = dict(request_id="r", prompt_token_ids=[1, 2, 3], max_new_tokens=4) | kwargs
    assert field_of(s.add_request, **args) == field


def test_duplicate_request_id():
    s = Scheduler(**GOOD)
    s.add_request("r", [1, 2], 2)
    assert field_of(s.add_request, "r", [3, 4], 2) == "request_id"


def test_update_count():
    s = Scheduler(**GOOD)
    s.add_request("a", [1, 2, 3], 4)
    s.schedule()
    assert field_of(s.update, [1, 2]) == "sampled_token_ids"


def test_cache_read_budget_names_max_new_tokens():
    s = Scheduler(**GOOD, max_batch_cache_tokens=8)
    assert field_of(s.add_request, "r", [1, 2, 3], 7) == "max_new_tokens"
    s.add_request("r", [1, 2, 3], 6)


def test_constants():
    assert (_core.ZERO_CHUNK, _core.SCRATCH_CHUNK) == (0, 1)


@pytest.mark.parametrize("kwargs", [
    {}, dict(max_batch_cache_tokens=20), dict(num_blocks=3),
    dict(layer_types=["sliding_attention", "full_attention"], sliding_window=6),
    dict(layer_types=["sliding_attention"], sliding_window=6),
])
def test_check_fits_is_add_requests_rule(kwargs):
    s = Scheduler(**(GOOD | kwargs))
    most = s.max_request_tokens()
    assert most > 0
    prompts = sorted({p for p in (*range(0, 12), most - 2, most - 1, most, most + 1)
                      if 0 <= p <= 200})
    for prompt_len in prompts:
        news = {*range(0, 6), *(most - prompt_len + d for d in (-2, -1, 0, 1, 2))}
        for new in sorted(n for n in news if n >= 0):
            try:
                s.check_fits(prompt_len, new)
                fits = None
            except FieldError as e:
                fits = e.field
            try:
                s.add_request("probe", [1] * prompt_len, new)
                added = None
                assert s.cancel("probe")
                s.update(())
            except FieldError as e:
                added = e.field
            assert fits == added, (prompt_len, new)
            if prompt_len >= 1 and new >= 1:
                assert (fits is None) == (prompt_len + new <= most), (prompt_len, new)
                if fits is None:
                    assert s.lifetime_chunks(prompt_len + new - 1) <= s.num_blocks
    assert field_of(s.check_fits, -1, 1) == "prompt"
    assert field_of(s.check_fits, 1, -1) == "max_new_tokens"
    assert field_of(s.lifetime_chunks, -1) == "cached_tokens"


def test_lifetime_chunks():
    full = Scheduler(**GOOD)
    assert [full.lifetime_chunks(n) for n in (1, 4, 5, 8, 9)] == [1, 1, 2, 2, 3]
    ring = Scheduler(**GOOD, layer_types=["sliding_attention"], sliding_window=6)
    assert ring.lifetime_chunks(1000) == ring.ring_size


def test_getters_match_stats():
    s = Scheduler(num_blocks=8, page_size=4, max_batch_tokens=64, cpu_offload_blocks=8,
                  safety_margin=0.0)
    for i in range(4):
        s.add_request(f"r{i}", [i + 1] * 6, 12)
    for _ in range(12):
        st = s.stats()
        assert s.num_free_blocks == st["num_free_blocks"]
        assert s.num_cached_blocks == st["num_cached_blocks"]
        assert s.num_waiting == st["waiting"]
        assert s.num_running == st["running"]
        assert s.num_swapped == st["swapped"]
        assert s.num_stalled == st["stalled_requests"]
        snap = s.snapshot()
        assert s.num_free_blocks == len(snap["free_chunks"]) + len(snap["cached_chunks"])
        plan = s.schedule()
        if plan is None:
            break
        s.update(np.full(plan.num_sampled, 5, dtype=np.int32))


def test_table_columns():
    pos = np.array([0, 3, 4, 11, 12, 40], dtype=np.int64)
    full = _core.table_columns(pos, 4, None)
    assert full.dtype == np.int64 and full.tolist() == [0, 0, 1, 2, 3, 10]
    ring = _core.table_columns(pos.astype(np.int32), 4, 3)
    assert ring.dtype == np.int64 and ring.tolist() == [0, 0, 1, 2, 0, 1]
    assert _core.table_columns(np.zeros(0, dtype=np.int32), 4, None).shape == (0,)
    assert _core.table_columns(pos[::2], 4, None).tolist() == [0, 1, 3]
    assert field_of(_core.table_columns, np.array([-1]), 4, None) == "positions"
    assert field_of(_core.table_columns, [0, 1], 4, None) == "positions"
    assert field_of(_core.table_columns, np.array([0.5]), 4, None) == "positions"
    assert field_of(_core.table_columns, pos, 0, None) == "page_size"
    assert field_of(_core.table_columns, pos, 4, 0) == "ring"


def test_slots_bounds():
    table = np.array([[5, 6], [7, 8]], dtype=np.int32)
    rows = np.array([0, 1, 1])
    pos = np.array([1, 2, 5])
    assert _core.slots(table, rows, pos, 4, None).tolist() == [21, 30, 33]
    assert _core.slots(table.astype(np.int64), rows.astype(np.int32), pos, 4, 2).tolist() == [
        21, 30, 33]
    assert _core.slots(table, rows, np.array([1, 2, 9]), 4, 2).tolist() == [21, 30, 29]
    assert field_of(_core.slots, table, np.array([2]), np.array([0]), 4, None) == "rows"
    assert field_of(_core.slots, table, np.array([-1]), np.array([0]), 4, None) == "rows"
    assert field_of(_core.slots, table, np.array([0]), np.array([8]), 4, None) == "positions"
    assert field_of(_core.slots, table, np.array([0, 1]), np.array([0]), 4, None) == "positions"
    assert field_of(_core.slots, table[0], np.array([0]), np.array([0]), 4, None) == "table"
    assert field_of(_core.slots, table.astype(np.float32), rows, pos, 4, None) == "table"


@pytest.mark.parametrize("kwargs", [
    {}, dict(layer_types=["sliding_attention", "full_attention"], sliding_window=6),
])
def test_slots_agree_with_the_plans_slot_mapping(kwargs):
    """Every key a plan writes outside the scratch chunk lands where `slots` says."""
    s = Scheduler(num_blocks=64, page_size=4, max_batch_tokens=16, safety_margin=0.0,
                  **kwargs)
    rng = np.random.default_rng(0)
    for i in range(6):
        s.add_request(f"r{i}", rng.integers(1, 100, size=int(rng.integers(1, 20))).tolist(), 9)
    checked = 0
    while (plan := s.schedule()) is not None:
        cu = plan.cu_seqlens_q
        rows = np.repeat(np.arange(plan.num_rows), np.diff(cu))
        for typ in s.attention_types:
            table = plan.block_tables[typ]
            ring = s.ring_size if typ == "sliding_attention" else None
            want = plan.slot_mapping[typ].astype(np.int64)
            got = _core.slots(table, rows, plan.positions, plan.page_size, ring)
            written = want // plan.page_size != _core.SCRATCH_CHUNK
            assert (got[written] == want[written]).all()
            checked += int(written.sum())
        s.update(np.full(plan.num_sampled, 3, dtype=np.int32))
    assert checked > 50
