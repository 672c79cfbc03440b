"""Batch-invariant mode with activation widths that are not a whole vector loop (an
intermediate size of 300): torch's elementwise functions run a flat array's last elements in
a scalar loop, so without `aligned_activations` a row's SiLU / GELU bits depend on how many
rows share its step. With it, a request's logprobs are the same bits alone and beside others
in a model's own forward: a quantized model whose float layers keep it from the lean layers
(quantize-on-load q5_1 / q4_1 with a float down projection)."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from ferrobatch import ContinuousBatchingConfig, Engine, SamplingParams
from ferrobatch.cpu import f32_ops
from ferrobatch.runner import aligned_activations
from isa_helpers import needs_isa

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gguf"))
from gguf_files import tiny_model  # noqa: E402

pytestmark = needs_isa(f32_ops.available(), "avx512f", what="batch-invariant products")
torch.set_num_threads(1)

MATE = [7, 8, 9]


def _rows_alone_equal_rows_together(fn, x: torch.Tensor) -> bool:
    return all(torch.equal(fn(x[:t])[i], fn(x[i:i + 1])[0])
               for t in range(1, x.shape[0] + 1) for i in range(t))


def test_padded_activations_do_not_depend_on_the_row_count():
    module = torch.nn.SiLU()
    x = torch.randn(40, 300)
    with aligned_activations.aligned([module], lambda: True):
        assert "forward" in module.__dict__
        assert _rows_alone_equal_rows_together(module, x)
        assert torch.equal(module(x), F.silu(x))  # the same function, padding dropped
        y = torch.randn(3, 256)
        assert torch.equal(module(y), F.silu(y))  # an aligned width as it is
    assert "forward" not in module.__dict__


def test_only_ferrobatch_threads_are_padded():
    module = torch.nn.GELU(approximate="tanh")
    calls = []
    own = type(module).forward

    def spy(self, x):
        calls.append(x.shape[-1])
        return own(self, x)

    type(module).forward = spy
    try:
        with aligned_activations.aligned([module], lambda: False):
            module(torch.randn(2, 300))
        with aligned_activations.aligned([module], lambda: True):
            module(torch.randn(2, 300))
    finally:
        type(module).forward = own
    assert calls == [300, 320]


def _logprobs_alone_and_beside_a_mate(engine: Engine, prompt: list[int]):
    sp = SamplingParams(max_new_tokens=3, ignore_eos=True, logprobs=1)
    alone = engine.generate([prompt], sp, progress=False)[0].logprobs
    mate = SamplingParams(max_new_tokens=3, ignore_eos=True)
    together = engine.generate([prompt, MATE], [sp, mate], progress=False)[0].logprobs
    return alone, together


@pytest.mark.parametrize("quantization", ["q5_1", "q4_1"])
def test_quantized_model_with_float_layers(tmp_path, quantization):
    # (intermediate 300 is not whole 32-weight blocks: the down projections stay float and
    # the decoder layers run their own forward; an outside audit's case: without the
    # padding the third token's logprob of a 20-token prompt moved by an ulp beside a mate)
    tiny_model("llama", hidden_size=224, intermediate_size=300).save_pretrained(tmp_path)
    rng = random.Random(2)
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randint(1, 30))] for _ in range(4)]
    config = ContinuousBatchingConfig(page_size=4, num_blocks=128, allow_block_sharing=False)
    with Engine(str(tmp_path), config=config, quantization=quantization,
                batch_invariant=True) as engine:
        for prompt in prompts:
            sp = SamplingParams(max_new_tokens=13, ignore_eos=True)
            tokens = engine.generate([prompt], sp, progress=False)[0].token_ids
            for cut in (9, 10):
                alone, together = _logprobs_alone_and_beside_a_mate(engine, prompt + tokens[:cut])
                assert alone == together
