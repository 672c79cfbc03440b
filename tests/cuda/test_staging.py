"""Host->device staging of the eager steps' inputs (`ferrobatch.cuda.staging`), tested on
CPU with the packing forced and pinning off (pinning needs CUDA), and what a step uploads:
graph steps never upload the plan's arrays (only the previous-sample fill indices)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import tiny_models as tm
import torch
from ferrobatch.cuda import staging
from ferrobatch.cuda.graphs import GraphBuckets
from ferrobatch.runner.model_runner import ModelRunner
from ref_planner import RefPlanner

torch.set_num_threads(1)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_packed_upload_keeps_values_shapes_and_16_byte_alignment(dtype):
    arrays = {
        "a": np.arange(5, dtype=np.int32),
        "table": np.arange(12, dtype=np.int64).reshape(3, 4) * 7,
        "skipped": None,
        "one": [9],
        "empty": np.zeros(0, np.int32),
        "b": np.array([3, -1, 2], dtype=np.int64),
    }
    got = staging.upload(arrays, dtype, "cpu", pack=True)
    assert list(got) == ["a", "table", "one", "empty", "b"]
    base = got["a"].untyped_storage().data_ptr()
    for name, t in got.items():
        want = np.asarray(arrays[name])
        assert t.dtype == dtype and tuple(t.shape) == want.shape and t.is_contiguous()
        np.testing.assert_array_equal(t.numpy(), want)
        # one buffer, each view on a 16-byte boundary (Triton specialises pointers on it)
        assert t.untyped_storage().data_ptr() == base
        assert (t.data_ptr() - base) % staging.ALIGN_BYTES == 0
    assert got["table"].stride() == (4, 1)


def test_unpacked_upload_is_what_the_cpu_path_always_did():
    """Off CUDA (the default there) each array is its own tensor, sharing the array's
    memory when it already has the dtype: no copy, no pinning."""
    a = np.arange(6, dtype=np.int64)
    got = staging.upload({"a": a, "b": [1, 2], "none": None}, torch.int64, "cpu")
    assert list(got) == ["a", "b"]
    assert got["a"].data_ptr() == a.ctypes.data
    assert got["b"].tolist() == [1, 2]
    assert not got["a"].is_pinned()


def _uploads(monkeypatch, runner):
    """Record the names of every array the runner uploads (its `_upload`)."""
    seen: list[list[str]] = []
    real = runner._upload

    def spy(arrays):
        seen.append([k for k, v in arrays.items() if v is not None])
        return real(arrays)

    monkeypatch.setattr(runner, "_upload", spy)
    return seen


def test_graph_steps_upload_no_plan_arrays_and_eager_steps_one_batch(monkeypatch):
    """An eager step uploads its arrays in one `_upload` (one copy on CUDA); a padded
    (graph) decode step uploads none of the plan's arrays (they reach the graph's static
    inputs through its one staging copy), only the indices of inputs filled from the
    previous step's samples."""
    model = tm.llama()
    runner = ModelRunner(model, num_blocks=64, page_size=4, attention_backend="torch")
    runner.graphs.setup("eager", max_graphs=2, buckets=GraphBuckets(
        q_interval=4, kv_interval=8, max_tokens=64, max_rows=64,
        num_kv_heads=runner.cache.num_kv_heads))
    seen = _uploads(monkeypatch, runner)
    planner = RefPlanner(page_size=4, num_blocks=64, layer_types=runner.layer_types,
                         sliding_window=None)
    rng = random.Random(0)
    for i in range(3):
        planner.add(f"r{i}", [rng.randrange(3, tm.VOCAB) for _ in range(5 + i)])
    prefill = planner.plan([(f"r{i}", 5 + i) for i in range(3)])
    logits = runner.execute(prefill)  # mixed shapes: eager
    assert seen == [["input_ids", "positions", "logits_indices"]]
    sampled = logits.argmax(-1)
    for i in range(3):
        planner.append(f"r{i}", int(sampled[i]))
    decode = planner.plan([(f"r{i}", 1) for i in range(3)])
    seen.clear()
    runner.execute(decode)
    assert runner.graph_stats()["graph_steps"] == 1
    assert seen == []  # nothing of the plan uploaded by a graph step
    # with inputs from the previous samples: only their indices go up
    plan = type("Plan", (), {})()
    for k in ("request_ids", "input_ids", "positions", "cu_seqlens_q", "seqlens_k",
              "logits_indices", "logits_rows", "slot_mapping", "block_tables", "swap_out",
              "swap_in"):
        setattr(plan, k, getattr(decode, k))
    plan.prev_token_index = np.array([0, 1, 2], np.int32)
    seen.clear()
    runner.execute(plan, prev_tokens=sampled)
    assert runner.graph_stats()["graph_steps"] == 2
    assert seen == [["pos", "src"]]
    # the same step eager: one batch with the fill indices
    saved, runner.graphs.cache = runner.graphs.cache, None
    seen.clear()
    runner.execute(plan, prev_tokens=sampled)
    assert seen == [["input_ids", "positions", "logits_indices", "fill_pos", "fill_src"]]
    runner.graphs.cache = saved
    runner.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_upload_packs_into_one_aligned_device_buffer():  # pragma: no cover - GPU only
    arrays = {"a": np.arange(5), "table": np.arange(6).reshape(2, 3), "b": np.array([7])}
    for dtype in (torch.int32, torch.int64):
        got = staging.upload(arrays, dtype, "cuda")
        base = got["a"].untyped_storage().data_ptr()
        for name, t in got.items():
            assert t.device.type == "cuda" and t.dtype == dtype
            assert t.untyped_storage().data_ptr() == base
            assert t.data_ptr() % staging.ALIGN_BYTES == 0
            np.testing.assert_array_equal(t.cpu().numpy(), arrays[name])
