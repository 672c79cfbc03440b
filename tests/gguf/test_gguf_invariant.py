"""Batch-invariant mode on GGUF models: on the quantized kernels (and the plain fp32 layers
of a mixed file) a target request's tokens and logprob bits are the same alone and among
batch mates under prompt chunking, greedy and seeded."""

from __future__ import annotations

import random

import pytest
import torch
from ferrobatch import Engine, SamplingParams
from ferrobatch.cpu import f32_ops
from invariance_helpers import Other, run_target
from isa_helpers import needs_isa


def _mates(rng: random.Random, vocab: int) -> list[Other]:
    return [Other(tuple(rng.randrange(3, vocab) for _ in range(rng.randint(1, 70))),
                  SamplingParams(max_new_tokens=rng.randint(1, 10), ignore_eos=True),
                  arrive=rng.randint(0, 3), cancel=rng.choice([None, 4]))
            for _ in range(5)]


@pytest.mark.kernel_products
@pytest.mark.parametrize(("arch", "qtype", "kw"), [
    ("llama", "Q4_K", {}),
    ("qwen2", "Q8_0", {}),
    pytest.param("llama", "Q4_0", dict(output_qtype="F32", types={"blk.0.attn_q.weight": "F32"}),
                 marks=needs_isa(f32_ops.available(), "avx512f", what="fp32 layers"),
                 id="mixed-F32"),
])
@pytest.mark.parametrize("kind", ["greedy", "seeded"])
def test_quantized_target_alone_equals_target_in_mixes(gguf_file, arch, qtype, kw,
                                                       kind) -> None:
    written, _ = gguf_file(arch, qtype, **kw)
    rng = random.Random(7)
    sp = SamplingParams(max_new_tokens=8, logprobs=2, ignore_eos=True,
                        **({} if kind == "greedy" else dict(temperature=0.8, seed=11)))
    with Engine(str(written.path), config=dict(num_blocks=64, page_size=16),
                batch_invariant=True) as engine:
        vocab = engine.vocab_size
        target = tuple(rng.randrange(3, vocab) for _ in range(45))
        want = run_target(engine, target, sp)
    threads = torch.get_num_threads()
    try:
        for mbt, n_threads in ((7, 2), (32, 1), (2048, 2)):
            torch.set_num_threads(n_threads)
            with Engine(str(written.path), config=dict(num_blocks=64, page_size=16,
                                                       max_batch_tokens=mbt),
                        batch_invariant=True) as engine:
                got = run_target(engine, target, sp, _mates(rng, vocab), target_arrives=1)
            assert got == want, (mbt, n_threads)
    finally:
        torch.set_num_threads(threads)
