"""Logprobs on a live loopback server with the bundled SmolLM2: `/v1/completions` echo +
logprobs (prompt scoring, max_tokens 1 and 0, stream and not) against transformers' own
fp32 log-softmax; each token's real bytes (partial UTF-8 tokens) and consistent
`text_offset`; logprobs covering exactly the returned text (no EOS, no stop-string tokens)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
import torch
from ferrobatch import ContinuousBatchingConfig, Engine
from ferrobatch.server import BackgroundServer, create_app

MODEL = "smol"
PROMPT = "The capital of France is Paris. 😀 Café, naïve"


@pytest.fixture(scope="module")
def served() -> Any:
    engine = Engine(config=ContinuousBatchingConfig(num_blocks=256, page_size=16,
                                                    max_batch_tokens=8))  # chunked prefill
    with BackgroundServer(create_app(engine, model_name=MODEL), port=0) as srv:
        yield engine, srv.url
    engine.close()


@pytest.fixture(scope="module")
def hf_model() -> Any:
    from ferrobatch.models import bundled_model_dir
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(bundled_model_dir(), dtype=torch.float32).eval()


def _post(url: str, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(url + path, json={"model": MODEL, **body}, timeout=120)


def _stream(url: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    r = _post(url, "/v1/completions", {**body, "stream": True})
    assert r.status_code == 200, r.text
    out = []
    for line in r.text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            out.append(json.loads(line[6:]))
    assert r.text.rstrip().endswith("data: [DONE]")
    return out


def _merge(chunks: list[dict[str, Any]]) -> tuple[str, dict[str, list]]:
    text, lp = "", {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for c in chunks:
        for ch in c["choices"]:
            text += ch["text"]
            if ch["logprobs"]:
                for k in lp:
                    lp[k] += ch["logprobs"][k]
    return text, lp


def _token_bytes(tokens: list[str]) -> bytes:
    """The bytes of OpenAI-style token strings (``bytes:\\xNN`` for partial UTF-8)."""
    out = b""
    for t in tokens:
        if t.startswith("bytes:"):
            out += bytes(int(h, 16) for h in t[len("bytes:"):].split("\\x")[1:])
        else:
            out += t.encode("utf-8")
    return out


def _check_offsets(text: str, lp: dict[str, list]) -> None:
    offs = lp["text_offset"]
    assert offs == sorted(offs) and all(0 <= o <= len(text) for o in offs)
    for tok, off in zip(lp["tokens"], offs, strict=True):
        if not tok.startswith("bytes:") and tok:
            # (a last token may run past a stop string's cut)
            assert text[off:off + len(tok)] == tok[: len(text) - off], (tok, off)


@pytest.mark.parametrize("max_tokens", [1, 0])
def test_echo_scoring_matches_transformers(served, hf_model, max_tokens):
    engine, url = served
    body = {"prompt": PROMPT, "max_tokens": max_tokens, "logprobs": 2, "echo": True,
            "temperature": 0}
    r = _post(url, "/v1/completions", body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    lp = choice["logprobs"]
    ids = engine.tokenizer(PROMPT)["input_ids"]
    assert len(lp["tokens"]) == len(ids) + max_tokens
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert r.json()["usage"]["completion_tokens"] == max_tokens
    assert choice["text"].startswith(PROMPT)
    if max_tokens == 0:
        assert choice["text"] == PROMPT and choice["finish_reason"] == "length"
    # real bytes: the prompt's tokens rebuild its UTF-8 exactly (emoji split across tokens)
    assert _token_bytes(lp["tokens"][: len(ids)]) == PROMPT.encode("utf-8")
    assert any(t.startswith("bytes:") for t in lp["tokens"])
    assert all("\ufffd" not in t for t in lp["tokens"][: len(ids)])
    _check_offsets(choice["text"], lp)
    with torch.no_grad():
        ref = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), -1)
    for i in range(1, len(ids)):
        assert abs(lp["token_logprobs"][i] - ref[i - 1, ids[i]].item()) < 2e-4, i
        top = lp["top_logprobs"][i]
        assert len(top) in (1, 2) and max(top.values()) == pytest.approx(
            ref[i - 1].max().item(), abs=2e-4
        )
    # the same through a stream
    chunks = _stream(url, body)
    text, slp = _merge(chunks)
    assert text == choice["text"]
    assert slp["tokens"] == lp["tokens"] and slp["text_offset"] == lp["text_offset"]
    assert slp["token_logprobs"][1:] == pytest.approx(lp["token_logprobs"][1:], abs=1e-5)


def test_max_tokens_zero_needs_echo(served):
    _, url = served
    r = _post(url, "/v1/completions", {"prompt": "a", "max_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


def _chat_bytes(content: list[dict[str, Any]]) -> bytes:
    return b"".join(bytes(e["bytes"]) for e in content)


@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprobs_cover_the_text_without_eos(served, stream):
    _, url = served
    body = {"messages": [{"role": "user", "content": "Say hi in three words."}],
            "max_tokens": 60, "logprobs": True, "top_logprobs": 1, "temperature": 0}
    if not stream:
        r = _post(url, "/v1/chat/completions", body)
        ch = r.json()["choices"][0]
        text, content, reason = ch["message"]["content"], ch["logprobs"]["content"], \
            ch["finish_reason"]  # fmt: skip
    else:
        r = _post(url, "/v1/chat/completions", {**body, "stream": True})
        text, content, reason = "", [], None
        for line in r.text.splitlines():
            if line.startswith("data: {"):
                c = json.loads(line[6:])["choices"][0]
                text += c["delta"].get("content") or ""
                content += (c["logprobs"] or {}).get("content") or []
                reason = c["finish_reason"] or reason
    assert reason == "stop"  # ended by EOS (<|im_end|>)
    assert all(e["token"] != "<|im_end|>" for e in content)
    assert _chat_bytes(content).decode("utf-8") == text


@pytest.mark.parametrize("stream", [False, True])
def test_completion_logprobs_stop_at_the_stop_string(served, stream):
    _, url = served
    base = {"prompt": "List three colors: red, green,", "max_tokens": 24, "logprobs": 1,
            "temperature": 0, "ignore_eos": True}
    full = _post(url, "/v1/completions", base).json()["choices"][0]
    # a stop string in the middle of the greedy output, starting inside a token
    cut = len(full["text"]) // 2
    stop = full["text"][cut: cut + 3]
    assert stop and full["text"].find(stop) == cut
    body = {**base, "stop": [stop]}
    if stream:
        text, lp = _merge(_stream(url, body))
    else:
        ch = _post(url, "/v1/completions", body).json()["choices"][0]
        text, lp = ch["text"], ch["logprobs"]
    assert text == full["text"][:cut]
    joined = _token_bytes(lp["tokens"]).decode("utf-8", errors="replace")
    # the tokens that make the text, not one more: the last one starts inside the text
    assert joined.startswith(text)
    assert lp["text_offset"][-1] < len(text)
    assert lp["tokens"] == full["logprobs"]["tokens"][: len(lp["tokens"])]
    _check_offsets(text, lp)
