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
    assert field_of(_core.paged_decode_attention, q, cache, cache, table, seqlens, out,
                    **(kw | {"cache_dtype": "int8"})) == "k_cache"
    strided = np.zeros((1, 2, 8), dtype=np.float32)[:, :, ::2]
    assert field_of(_core.paged_decode_attention, q, cache, cache, table, seqlens, strided,
                    **kw) == "out"
