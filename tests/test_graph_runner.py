"""ModelRunner's padded (CUDA-graph) path on CPU, and inputs taken from the previous step's
samples (`plan.prev_token_index`)."""

from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np
import pytest
import tiny_models as tm
import torch
from ferrobatch.runner import ModelRunner
from ref_planner import RefPlanner

torch.set_num_threads(1)


def _prompts(seed: int, n: int, lo: int, hi: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, tm.VOCAB) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def _with_prev_index(plan, prev_index: np.ndarray, placeholder: int = 0):
    """A copy of `plan` (a fake plan object) whose input ids at `prev_index >= 0` are
    placeholders, as the core's in-flight plans have them."""
    fields = {k: getattr(plan, k) for k in (
        "request_ids", "positions", "cu_seqlens_q", "seqlens_k", "logits_indices",
        "logits_rows", "slot_mapping", "block_tables", "swap_out", "swap_in")}
    ids = np.array(plan.input_ids, dtype=np.int32)
    ids[prev_index >= 0] = placeholder
    return SimpleNamespace(input_ids=ids, prev_token_index=prev_index.astype(np.int32),
                           **fields)


@pytest.mark.parametrize("backend", [None, "torch"])
def test_input_ids_from_previous_samples(backend):
    """A decode plan whose input ids are placeholders filled from `prev_tokens` gives the
    logits of the plan with the real ids; without prev_tokens it is refused."""
    model = tm.llama()
    runner = ModelRunner(model, num_blocks=64, page_size=4, attention_backend=backend)
    ref = ModelRunner(model, num_blocks=64, page_size=4, attention_backend=backend)
    planner = RefPlanner(page_size=4, num_blocks=64, layer_types=runner.layer_types,
                         sliding_window=None)
    prompts = _prompts(0, 3, 3, 9)
    for i, p in enumerate(prompts):
        planner.add(f"r{i}", p)
    first = planner.plan([(f"r{i}", len(p)) for i, p in enumerate(prompts)])
    logits = runner.execute(first)
    ref.execute(first)
    sampled = logits.argmax(-1)  # [N] in logits_indices order (rows r0, r1, r2)
    # Next step: rows in another order, so index j != row; plus a row with a real id.
    order = [2, 0, 1]
    for i in order:
        planner.append(f"r{i}", int(sampled[i]))
    plan = planner.plan([(f"r{i}", 1) for i in order])
    prev_index = np.array(order, dtype=np.int64)
    prev_index[1] = -1  # r0's id stays in input_ids
    fake = _with_prev_index(plan, prev_index)
    fake.input_ids[1] = plan.input_ids[1]
    with pytest.raises(ValueError, match="prev_tokens"):
        runner.execute(fake)
    got = runner.execute(fake, prev_tokens=sampled.to(torch.int32))
    want = ref.execute(plan)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # All -1 (a plan from schedule()): prev_tokens is ignored.
    for i in order:
        planner.append(f"r{i}", int(got[order.index(i)].argmax()))
    plan2 = planner.plan([(f"r{i}", 1) for i in order])
    fake2 = _with_prev_index(plan2, np.full(3, -1))
    torch.testing.assert_close(runner.execute(fake2, prev_tokens=sampled),
                               ref.execute(plan2), atol=1e-5, rtol=1e-5)
    runner.close()
    ref.close()


def test_use_cuda_graph_on_cpu_warns_and_runs_eager():
    model = tm.llama()
    with pytest.warns(UserWarning, match="CUDA graphs off"):
        runner = ModelRunner(model, num_blocks=16, page_size=4, use_cuda_graph=True)
    assert runner.use_cuda_graph is False
    runner.close()
    assert ModelRunner(model, num_blocks=16, page_size=4).use_cuda_graph is False
