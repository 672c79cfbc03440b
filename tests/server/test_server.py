"""Tests of the OpenAI-compatible server (python/ferrobatch/server/) and its metrics.

A live uvicorn server on 127.0.0.1 (a free port) is started per test module in a thread.
Two engines back it:

* ``real``: ``ferrobatch.Engine`` on a tiny random-init Llama with a small byte-level BPE
  tokenizer trained offline (with a chat template) — skipped when the extension is not built;
* ``fake``: a deterministic stand-in implementing the ARCHITECTURE.md §6 surface the server
  uses, for server logic in isolation (queue limits, loading, disconnect bookkeeping).

All traffic stays on loopback; every load loop is bounded in count and time.
"""


from __future__ import annotations

import asyncio
import contextlib
import random
import threading
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import openai
import pytest
import tiny_models
import torch
from ferrobatch.engine.outputs import RequestOutput
from ferrobatch.metrics import ServerMetrics
from ferrobatch.sampling.params import SamplingParams
from ferrobatch.server import BackgroundServer, create_app
from server_helpers import (
    CORPUS,
    MODEL,
    FakeEngine,
    _check_error,
    _post,
    build_model,
    build_tokenizer,
    client,
    parse_sse,
    serve,
    used_blocks,
    wait_until,
)

torch.set_num_threads(1)


# ---------------------------------------------------------------------------------------
# metrics unit tests


def test_metrics_exposition_parses() -> None:
    """Both formats parse with prometheus_client's own parsers; label values are escaped."""
    from prometheus_client.openmetrics.parser import (  # local: only this test reads it
        text_string_to_metric_families as openmetrics_families,
    )
    from prometheus_client.parser import text_string_to_metric_families  # local: as above

    m = ServerMetrics()
    m.on_admitted(4)
    m.on_first_token(0.05)
    m.on_tokens(2, 0.5)
    m.on_finished("chat", "stop", True, 5.55)
    m.on_request_error(400)
    stats = {'we"ird\nkey': 1.5, "num_used_blocks": 1, "num_free_blocks": 3}
    text = m.render(stats)
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert families["ferrobatch_requests"].type == "counter"
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in families.values() for s in f.samples}  # fmt: skip
    assert samples[("ferrobatch_requests_total",
                    (("endpoint", "chat"), ("finish_reason", "stop")))] == 1  # fmt: skip
    assert samples[("ferrobatch_http_errors_total", (("code", "400"),))] == 1
    assert samples[("ferrobatch_request_duration_seconds_bucket", (("le", "5.0"),))] == 0
    assert samples[("ferrobatch_request_duration_seconds_bucket", (("le", "10.0"),))] == 1
    assert samples[("ferrobatch_request_duration_seconds_bucket", (("le", "+Inf"),))] == 1
    assert samples[("ferrobatch_inter_token_latency_seconds_count", ())] == 2
    assert samples[("ferrobatch_request_duration_seconds_sum", ())] == 5.55
    assert samples[("ferrobatch_engine_stat", (("key", "we_ird_key"),))] == 1.5
    assert samples[("ferrobatch_cache_blocks", (("state", "total"),))] == 4
    body, ctype = m.exposition(stats, True, "application/openmetrics-text; version=1.0.0")
    assert ctype.startswith("application/openmetrics-text")
    om = {f.name for f in openmetrics_families(body.decode())}
    assert {"ferrobatch_requests", "ferrobatch_time_to_first_token_seconds"} <= om
    body, ctype = m.exposition(stats, True, None)
    assert ctype.startswith("text/plain; version=0.0.4") and body.decode() == m.render(stats)
    # two servers in one process keep their own registries
    fresh = {s.name for f in text_string_to_metric_families(ServerMetrics().render({}))
             for s in f.samples}  # fmt: skip
    assert "ferrobatch_prompt_tokens_total" in fresh
    assert "ferrobatch_requests_total" not in fresh


def test_server_metrics_from_stats() -> None:
    m = ServerMetrics()
    m.on_admitted(10)
    m.on_first_token(0.02)
    m.on_tokens(3, 0.03)
    m.on_finished("chat", "length", True, 0.1)
    m.on_steps([(0.2, 64), (0.3, 2048)])
    stats = {"num_used_blocks": 3, "num_free_blocks": 5, "num_cached_blocks": 2,
             "prefix_hit_tokens": 1, "prompt_tokens": 4, "num_offloads": 7,
             "num_soft_resets": 1, "waiting": 2, "flag": True}  # fmt: skip
    text = m.render(stats, ready=True)
    assert 'ferrobatch_requests_total{endpoint="chat",finish_reason="length"} 1' in text
    assert 'ferrobatch_cache_blocks{state="used"} 3' in text
    assert 'ferrobatch_cache_blocks{state="total"} 10' in text
    assert "ferrobatch_prefix_cache_hit_rate 0.25" in text
    assert "ferrobatch_offloads_total 7" in text
    assert "ferrobatch_soft_resets_total 1" in text
    assert "ferrobatch_scheduler_waiting_requests 2" in text
    assert "ferrobatch_prompt_tokens_total 10" in text
    assert "ferrobatch_generation_tokens_total 3" in text
    assert "ferrobatch_inter_token_latency_seconds_count 3" in text
    assert "ferrobatch_time_to_first_token_seconds_count 1" in text
    assert "ferrobatch_requests_waiting 0" in text
    assert "ferrobatch_requests_running 0" in text
    assert 'ferrobatch_engine_stat{key="flag"} 1' in text
    assert "ferrobatch_step_duration_seconds_count 2" in text
    assert 'ferrobatch_step_duration_seconds_bucket{le="0.25"} 1' in text
    assert 'ferrobatch_step_prefill_budget_tokens_bucket{le="64.0"} 1' in text
    assert "ferrobatch_step_prefill_budget_tokens_sum 2112" in text


# ---------------------------------------------------------------------------------------
# OpenAI client, both engines


def test_models_health_metrics(any_server: tuple[Any, str]) -> None:
    engine, url = any_server
    assert httpx.get(url + "/health").json()["status"] == "ok"
    models = client(url).models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert client(url).models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client(url).models.retrieve("gpt-9")
    text = httpx.get(url + "/metrics").text
    for name in (
        "ferrobatch_requests_total",
        "ferrobatch_requests_waiting",
        "ferrobatch_requests_running",
        "ferrobatch_time_to_first_token_seconds_bucket",
        "ferrobatch_inter_token_latency_seconds_bucket",
        "ferrobatch_step_duration_seconds_bucket",
        "ferrobatch_step_prefill_budget_tokens_bucket",
        "ferrobatch_generation_tokens_total",
        "ferrobatch_prompt_tokens_total",
        "ferrobatch_engine_ready 1",
        'ferrobatch_cache_blocks{state="used"}',
    ):
        assert name in text, name
    from prometheus_client.parser import text_string_to_metric_families  # local: test only

    families = {f.name: f.type for f in text_string_to_metric_families(text)}
    assert families["ferrobatch_requests"] == "counter"
    assert families["ferrobatch_time_to_first_token_seconds"] == "histogram"
    r = httpx.get(url + "/metrics", headers={"Accept": "application/openmetrics-text"})
    assert r.headers["content-type"].startswith("application/openmetrics-text")
    assert r.text.rstrip().endswith("# EOF")


def test_completion_and_chat_nonstream(any_server: tuple[Any, str], tokenizer: Any) -> None:
    engine, url = any_server
    c = client(url)
    prompt = "The capital of France is"
    out = c.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0)
    assert out.object == "text_completion"
    assert len(out.choices) == 1
    ch = out.choices[0]
    assert ch.finish_reason in ("length", "stop")
    n_prompt = len(tokenizer(prompt)["input_ids"])
    assert out.usage.prompt_tokens == n_prompt
    assert 1 <= out.usage.completion_tokens <= 6
    assert out.usage.total_tokens == n_prompt + out.usage.completion_tokens
    if ch.finish_reason == "length":
        assert out.usage.completion_tokens == 6

    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    chat = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=5, temperature=0)
    assert chat.object == "chat.completion"
    assert chat.choices[0].message.role == "assistant"
    assert isinstance(chat.choices[0].message.content, str)
    assert chat.usage.prompt_tokens == len(engine.encode_chat(msgs))
    assert 1 <= chat.usage.completion_tokens <= 5

    # null means "not given": max_tokens falls back to 16 for completions
    r = httpx.post(url + "/v1/completions", json={"prompt": "Hello", "max_tokens": None,
                   "n": None, "stream": None, "stop": None, "temperature": 0})  # fmt: skip
    assert r.status_code == 200, r.text
    assert 1 <= r.json()["usage"]["completion_tokens"] <= 16

    # n choices, token-id prompt, batch of prompts
    many = c.completions.create(model=MODEL, prompt=[[5, 6, 7], [8, 9]], max_tokens=3,
                                n=2, temperature=0)  # fmt: skip
    assert sorted(ch.index for ch in many.choices) == [0, 1, 2, 3]
    assert many.usage.prompt_tokens == 5
    # greedy choices of one prompt are identical
    by_index = {ch.index: ch.text for ch in many.choices}
    assert by_index[0] == by_index[1] and by_index[2] == by_index[3]


def test_streaming_chat_and_completion(any_server: tuple[Any, str]) -> None:
    engine, url = any_server
    c = client(url)
    msgs = [{"role": "user", "content": "Hello world"}]
    full = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, temperature=0)
    stream = c.chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=8, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    finishes = [ch.choices[0].finish_reason for ch in chunks if ch.choices]
    assert finishes[-1] in ("stop", "length") and all(f is None for f in finishes[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert all(ch.usage is None for ch in chunks[:-1])
    assert text == full.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens

    comp = c.completions.create(model=MODEL, prompt="Hello", max_tokens=5, temperature=0)
    parts = list(c.completions.create(model=MODEL, prompt="Hello", max_tokens=5,
                                      temperature=0, stream=True))  # fmt: skip
    assert "".join(p.choices[0].text for p in parts) == comp.choices[0].text
    assert parts[-1].choices[0].finish_reason == comp.choices[0].finish_reason

    # raw framing: every event is "data: <json>\n\n" and the stream ends with [DONE]
    r = httpx.post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 3, "stream": True,
                                                   "n": 2})  # fmt: skip
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    payloads, done = parse_sse(r.text)
    assert done and r.text.endswith("data: [DONE]\n\n")
    assert {p["choices"][0]["index"] for p in payloads} == {0, 1}


def test_logprobs_and_sampling_fields(any_server: tuple[Any, str]) -> None:
    engine, url = any_server
    c = client(url)
    chat = c.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
        temperature=0.8, top_p=0.9, seed=7, logprobs=True, top_logprobs=2,
        presence_penalty=0.5, frequency_penalty=0.5, stop=["zzzz"],
    )  # fmt: skip
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
    again = c.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
        temperature=0.8, top_p=0.9, seed=7,
    )  # fmt: skip
    assert again.choices[0].message.content == chat.choices[0].message.content

    comp = c.completions.create(model=MODEL, prompt="Hello", max_tokens=3, logprobs=2,
                                extra_body={"top_k": 5})  # fmt: skip
    lp = comp.choices[0].logprobs
    # logprobs cover the text's tokens: an EOS that ended the choice is not among them
    n = comp.usage.completion_tokens - (comp.choices[0].finish_reason == "stop")
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n
    assert not n or lp.text_offset[0] == 0


def test_every_sampling_field_at_once(any_server: tuple[Any, str]) -> None:
    engine, url = any_server
    body = {
        "model": MODEL, "prompt": ["Hello world", "A quick fox"], "n": 3, "max_tokens": 6,
        "temperature": 0.9, "top_p": 0.8, "top_k": 20, "min_p": 0.05,
        "repetition_penalty": 1.2, "presence_penalty": 0.4, "frequency_penalty": -0.3,
        "seed": 11, "stop": ["\n\n", "zz"], "logprobs": 3, "stream": True,
        "stream_options": {"include_usage": True}, "user": "u1", "ignore_eos": True,
    }  # fmt: skip
    r = httpx.post(url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200
    payloads, done = parse_sse(r.text)
    assert done and "error" not in payloads[-1]
    finished = {p["choices"][0]["index"] for p in payloads
                if p["choices"] and p["choices"][0]["finish_reason"]}  # fmt: skip
    assert finished == set(range(6))
    n_prompt = sum(len(engine.tokenizer(p)["input_ids"]) for p in body["prompt"])
    assert payloads[-1]["usage"]["prompt_tokens"] == n_prompt
    assert httpx.get(url + "/health").status_code == 200
    assert wait_until(lambda: used_blocks(engine) == 0)


def test_greedy_matches_engine_generate(real_engine: Any, real_server: BackgroundServer) -> None:
    c = client(real_server.url)
    for prompt in ("The capital of France is", "A quick brown fox"):
        ref = real_engine.generate([prompt], SamplingParams(max_new_tokens=12), progress=False)[0]
        out = c.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
        assert out.choices[0].text == ref.text
        assert out.usage.completion_tokens == len(ref.token_ids)
        assert out.usage.prompt_tokens == len(ref.prompt_token_ids)
    msgs = [{"role": "user", "content": "Hello world, how are you?"}]
    ref = real_engine.chat(msgs, SamplingParams(max_new_tokens=10), progress=False)[0]
    out = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=10, temperature=0)
    assert out.choices[0].message.content == ref.text
    assert out.usage.completion_tokens == len(ref.token_ids)


# ---------------------------------------------------------------------------------------
# bad input


def _bad_requests(max_len: int) -> list[tuple[str, str, Any, dict[str, str], int, str | None, str]]:
    """(name, path, body (bytes or JSON), headers, status, param, message fragment)."""
    ok_msgs = [{"role": "user", "content": "hi"}]
    long_prompt = list(range(3, 3 + max_len + 10))
    return [
        ("malformed json", "/v1/chat/completions", b'{"messages": [', {}, 400, None,
         "not valid JSON"),
        ("not an object", "/v1/completions", b"[1, 2]", {}, 400, None, "JSON object"),
        ("empty body", "/v1/completions", b"", {}, 400, None, "empty"),
        ("missing messages", "/v1/chat/completions", {"model": MODEL}, {}, 400, "messages",
         "Missing required field 'messages'"),
        ("missing prompt", "/v1/completions", {"max_tokens": 3}, {}, 400, "prompt",
         "Missing required field 'prompt'"),
        ("wrong type max_tokens", "/v1/completions", {"prompt": "a", "max_tokens": "ten"}, {},
         400, "max_tokens", "max_tokens"),
        ("wrong type stream", "/v1/chat/completions", {"messages": ok_msgs, "stream": 1}, {},
         400, "stream", "stream"),
        ("wrong type prompt", "/v1/completions", {"prompt": {"a": 1}}, {}, 400, "prompt",
         "expected a string"),
        ("wrong type content", "/v1/chat/completions",
         {"messages": [{"role": "user", "content": 5}]}, {}, 400, "messages[0].content",
         "content"),
        ("bad role", "/v1/chat/completions", {"messages": [{"role": "x", "content": "a"}]}, {},
         400, "messages[0].role", "role"),
        ("negative max_tokens", "/v1/completions", {"prompt": "a", "max_tokens": -1}, {}, 400,
         "max_tokens", "greater than or equal to 0"),
        ("temperature too high", "/v1/chat/completions",
         {"messages": ok_msgs, "temperature": 3.5}, {}, 400, "temperature", "temperature"),
        ("empty messages", "/v1/chat/completions", {"messages": []}, {}, 400, "messages",
         "at least 1"),
        ("empty prompt list", "/v1/completions", {"prompt": []}, {}, 400, "prompt", "empty"),
        ("token out of vocab", "/v1/completions", {"prompt": [1, 10**7]}, {}, 400, "prompt",
         "Token ids"),
        ("prompt over context", "/v1/completions", {"prompt": long_prompt, "max_tokens": 1}, {},
         400, "prompt", "maximum context length"),
        ("max_tokens over context", "/v1/completions",
         {"prompt": "hello", "max_tokens": max_len * 2}, {}, 400, "max_tokens",
         "maximum context length"),
        ("unknown model", "/v1/chat/completions", {"model": "gpt-9", "messages": ok_msgs}, {},
         404, "model", "does not exist"),
        ("oversized body", "/v1/completions", {"prompt": "x" * 300_000}, {}, 413, None,
         "too large"),
        ("unknown route", "/v1/audio/speech", {"input": "x"}, {}, 404, None, "Not Found"),
    ]  # fmt: skip



def test_bad_input_during_stream(tokenizer: Any, request: pytest.FixtureRequest) -> None:
    """Every bad request gets its status and message; a concurrent stream is unharmed."""
    try:
        engine = request.getfixturevalue("real_engine")
        ctx: Any = serve(engine, max_body_bytes=256 * 1024)
    except pytest.skip.Exception:
        engine = FakeEngine(tokenizer, delay=0.01)
        ctx = serve(engine, max_body_bytes=256 * 1024)
    with ctx as srv:
        c = client(srv.url)
        msgs = [{"role": "user", "content": "Tell me about Paris."}]
        ref = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=60,
                                        temperature=0)  # fmt: skip
        result: dict[str, Any] = {}

        def consume() -> None:
            stream = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=60,
                                               temperature=0, stream=True)  # fmt: skip
            chunks = list(stream)
            result["text"] = "".join(ch.choices[0].delta.content or "" for ch in chunks)
            result["finish"] = chunks[-1].choices[0].finish_reason

        t = threading.Thread(target=consume)
        t.start()
        for name, path, body, headers, status, param, fragment in _bad_requests(
            engine.max_model_len
        ):
            r = _post(srv.url, path, body, headers)
            try:
                _check_error(r, status, param, fragment)
            except AssertionError as exc:
                raise AssertionError(f"{name}: {exc}") from exc
        t.join(60)
        assert not t.is_alive()
        assert result["text"] == ref.choices[0].message.content
        assert result["finish"] == ref.choices[0].finish_reason
        assert wait_until(lambda: used_blocks(engine) == 0)
        text = httpx.get(srv.url + "/metrics").text
        assert 'ferrobatch_http_errors_total{code="400"}' in text


def test_api_key(fake_engine: FakeEngine) -> None:
    with serve(fake_engine, api_key="s3cret") as srv:
        with pytest.raises(openai.AuthenticationError):
            client(srv.url, "wrong").models.list()
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "a"})
        _check_error(r, 401, None, "Missing API key")
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "a"},
                       headers={"Authorization": "Bearer nope"})  # fmt: skip
        _check_error(r, 401, None, "Incorrect API key")
        out = client(srv.url, "s3cret").completions.create(model=MODEL, prompt="a", max_tokens=2)
        assert out.usage.completion_tokens == 2
        assert httpx.get(srv.url + "/health").status_code == 200  # no key needed
        assert httpx.get(srv.url + "/metrics").status_code == 200


def test_engine_queue_full_is_a_429_before_any_stream(fake_engine: FakeEngine) -> None:
    # the engine's own bound (max_queue_size) refuses before the stream's 200 goes out
    from ferrobatch.errors import QueueFullError

    def check_room(count: int = 1) -> None:
        if len(fake_engine.active) + count > 1:
            raise QueueFullError("max_queue_size=1 unfinished requests")

    fake_engine.check_room = check_room  # type: ignore[attr-defined]
    fake_engine.gate.clear()
    with serve(fake_engine) as srv:
        hog = threading.Thread(target=lambda: httpx.post(
            srv.url + "/v1/completions", json={"prompt": "a", "max_tokens": 2}, timeout=30))
        hog.start()
        assert wait_until(lambda: len(fake_engine.active) == 1)
        for stream in (True, False):
            r = httpx.post(srv.url + "/v1/completions",
                           json={"prompt": "b", "max_tokens": 2, "stream": stream})
            _check_error(r, 429, None, "engine's queue is full")
            assert r.headers["retry-after"] == "1"
        assert len(fake_engine.submitted) == 1  # the refused ones never reached it
        fake_engine.gate.set()
        hog.join(30)
        r = httpx.post(srv.url + "/v1/completions",
                       json={"prompt": "b", "max_tokens": 2, "stream": True})
        assert r.status_code == 200 and "[DONE]" in r.text


def test_a_client_gone_before_its_tokenizer_turn_is_skipped(fake_engine: FakeEngine) -> None:
    # one tokenizer thread: a prompt behind a slow one is not tokenized once its client left
    import time

    own = fake_engine.encode_chat
    encoded: list[str] = []
    release = threading.Event()

    def encode_chat(messages: list[dict[str, Any]]) -> list[int]:
        encoded.append(messages[-1]["content"])
        if messages[-1]["content"] == "slow":
            release.wait(30)
        return own(messages)

    fake_engine.encode_chat = encode_chat  # type: ignore[method-assign]
    with serve(fake_engine) as srv:
        def chat(content: str, timeout: float) -> None:
            with contextlib.suppress(httpx.TimeoutException):
                httpx.post(srv.url + "/v1/chat/completions", timeout=timeout, json={
                    "messages": [{"role": "user", "content": content}], "max_tokens": 2})

        slow = threading.Thread(target=chat, args=("slow", 30))
        slow.start()
        assert wait_until(lambda: encoded == ["slow"])
        chat("gone", 0.3)  # waits behind "slow", then its client leaves
        time.sleep(0.3)
        release.set()
        slow.join(30)
        metrics = httpx.get(srv.url + "/metrics").text
    assert encoded == ["slow"]
    assert 'client_disconnects_total{stage="tokenize"} 1.0' in metrics


def test_queue_full_429(fake_engine: FakeEngine) -> None:
    fake_engine.gate.clear()
    with serve(fake_engine, max_queue=2) as srv:
        results: list[int] = []

        def one() -> None:
            r = httpx.post(srv.url + "/v1/completions", json={"prompt": "a", "max_tokens": 2},
                           timeout=30)  # fmt: skip
            results.append(r.status_code)

        threads = [threading.Thread(target=one) for _ in range(2)]
        for t in threads:
            t.start()
        assert wait_until(lambda: len(fake_engine.active) == 2)
        r = httpx.post(srv.url + "/v1/chat/completions",
                       json={"messages": [{"role": "user", "content": "a"}]})  # fmt: skip
        _check_error(r, 429, None, "queue is full")
        assert r.headers["retry-after"] == "1"
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "a", "n": 2})
        assert r.status_code == 429  # fits --max-queue, but not now
        fake_engine.gate.set()
        for t in threads:
            t.join(30)
        assert results == [200, 200]
        out = client(srv.url).completions.create(model=MODEL, prompt="a", max_tokens=2, n=2)
        assert len(out.choices) == 2
        text = httpx.get(srv.url + "/metrics").text
        assert 'ferrobatch_http_errors_total{code="429"} 2' in text
        assert "ferrobatch_requests_waiting 0" in text


def test_oversized_chunked_body(fake_engine: FakeEngine) -> None:
    """A body without Content-Length is counted as it arrives."""

    def chunks() -> Iterator[bytes]:
        yield b'{"prompt": "'
        for _ in range(40):
            yield b"x" * 4096
        yield b'"}'

    with serve(fake_engine, max_body_bytes=64 * 1024) as srv:
        r = httpx.post(srv.url + "/v1/completions", content=chunks(),
                       headers={"content-type": "application/json"})  # fmt: skip
        assert "content-length" not in r.request.headers
        _check_error(r, 413, None, "limit is 65536 bytes")
        out = client(srv.url).completions.create(model=MODEL, prompt="a", max_tokens=1)
        assert out.usage.completion_tokens == 1


def test_503_while_loading(tokenizer: Any) -> None:
    release = threading.Event()
    engine = FakeEngine(tokenizer)

    def loader() -> FakeEngine:
        release.wait(30)
        return engine

    with serve(None, engine_loader=loader) as srv:
        r = httpx.get(srv.url + "/health")
        assert r.status_code == 503 and r.json()["status"] == "loading"
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "a"})
        _check_error(r, 503, None, "loading")
        assert "ferrobatch_engine_ready 0" in httpx.get(srv.url + "/metrics").text
        release.set()
        assert wait_until(lambda: httpx.get(srv.url + "/health").status_code == 200)
        out = client(srv.url).completions.create(model=MODEL, prompt="a", max_tokens=2)
        assert out.usage.completion_tokens == 2
        # the model is served under both its configured and its engine name
        out = client(srv.url).completions.create(model="fake-model", prompt="a", max_tokens=1)
        assert out.model == "fake-model"
    assert engine.closed  # the app loaded it, so the app closed it


def test_503_when_load_fails(tokenizer: Any) -> None:
    def loader() -> Any:
        raise RuntimeError("no weights here")

    with serve(None, engine_loader=loader) as srv:
        assert wait_until(lambda: httpx.get(srv.url + "/health").json()["status"] == "failed")
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "a"})
        _check_error(r, 503, None, "no weights here")


def test_disconnect_cancels_immediately(tokenizer: Any) -> None:
    engine = FakeEngine(tokenizer, delay=0.05)
    with serve(engine) as srv:
        body = {"prompt": "Hello", "max_tokens": 200, "stream": True}
        with httpx.Client(timeout=30) as h:
            with h.stream("POST", srv.url + "/v1/completions", json=body) as r:
                lines = r.iter_lines()
                got = [next(lines) for _ in range(3)]
                assert got[0].startswith("data: ")
        assert wait_until(lambda: not engine.active, timeout=2.0)
        assert len(engine.cancelled) == 1
        # a request still queued (no token yet) is cancelled too
        engine.gate.clear()
        with httpx.Client(timeout=30) as h:
            with h.stream("POST", srv.url + "/v1/chat/completions",
                          json={"messages": [{"role": "user", "content": "x"}],
                                "stream": True, "n": 2}):  # fmt: skip
                assert wait_until(lambda: len(engine.active) == 2)
        assert wait_until(lambda: not engine.active, timeout=2.0)
        assert len(engine.cancelled) == 3
        # non-streaming: the client gives up; the request is cancelled, not left running
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(srv.url + "/v1/completions", json={"prompt": "a", "max_tokens": 100},
                       timeout=0.3)  # fmt: skip
        assert wait_until(lambda: not engine.active, timeout=2.0)
        assert len(engine.cancelled) == 4
        text = httpx.get(srv.url + "/metrics").text
        cancelled = sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("ferrobatch_requests_total{") and 'reason="cancelled"' in line
        )
        assert cancelled == 4
        engine.gate.set()


def _cancelled_count(url: str) -> float:
    text = httpx.get(url + "/metrics").text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("ferrobatch_requests_total{") and 'reason="cancelled"' in line
    )


def test_disconnect_frees_blocks_real_engine(
    real_engine: Any, real_server: BackgroundServer
) -> None:
    """With the real engine: hanging up mid-stream stops generation and frees the blocks."""
    url = real_server.url
    before = real_engine.stats()["generated_tokens"]
    cancelled = _cancelled_count(url)
    body = {"prompt": "Hello world", "max_tokens": 240, "stream": True, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    with httpx.Client(timeout=30) as h:
        with h.stream("POST", url + "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            # the first chunk can leave before the engine loop has admitted the request
            assert wait_until(lambda: used_blocks(real_engine) > 0, timeout=10.0)
    assert wait_until(lambda: used_blocks(real_engine) == 0, timeout=10.0)
    assert wait_until(lambda: _cancelled_count(url) == cancelled + 1, timeout=10.0)
    assert real_engine.stats()["generated_tokens"] - before < 240
    text = httpx.get(url + "/metrics").text
    assert 'ferrobatch_cache_blocks{state="used"} 0' in text


class FailingEngine(FakeEngine):
    """Fails every request after ``fail_after`` tokens, like a loop error delivered to callers."""

    fail_after = 2

    async def astream(
        self, prompt: Any, sampling: Any = None, *, request_id: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        inner = super().astream(prompt, sampling, request_id=request_id)
        try:
            count = 0
            async for delta in inner:
                if count == self.fail_after:
                    raise RuntimeError("device lost")
                count += 1
                yield delta
        finally:
            await inner.aclose()


def test_engine_errors_reach_the_client(tokenizer: Any) -> None:
    engine = FailingEngine(tokenizer)
    with serve(engine) as srv:
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "a", "max_tokens": 5})
        _check_error(r, 500, None, "device lost")
        r = httpx.post(srv.url + "/v1/chat/completions",
                       json={"messages": [{"role": "user", "content": "a"}], "max_tokens": 5,
                             "stream": True})  # fmt: skip
        assert r.status_code == 200
        payloads, done = parse_sse(r.text)
        assert done
        assert payloads[-1]["error"]["message"].endswith("device lost")
        assert sum(1 for p in payloads if "choices" in p and p["choices"][0]["delta"].get(
            "content")) == 2  # fmt: skip
        assert not engine.active
        # a dead engine loop makes /health and new requests answer 503
        engine._error = RuntimeError("loop died")
        assert httpx.get(srv.url + "/health").status_code == 503
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "a"})
        _check_error(r, 503, None, "loop died")


def test_cache_capacity_and_echo(tokenizer: Any) -> None:
    engine = FakeEngine(tokenizer)
    engine.num_blocks = 4  # 64 tokens per request at most
    with serve(engine) as srv:
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 100})
        _check_error(r, 400, "max_tokens", "KV cache holds at most 64 tokens")
        # chat without max_tokens fills what is left of the cache
        out = client(srv.url).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}]
        )
        assert out.usage.prompt_tokens + out.usage.completion_tokens == 64
        out = client(srv.url).completions.create(model=MODEL, prompt="Hello", max_tokens=2,
                                                 echo=True)  # fmt: skip
        assert out.choices[0].text.startswith("Hello")
        # echo + logprobs is prompt scoring now (tests/server/test_server_logprobs.py); max_tokens=0
        # needs echo
        r = httpx.post(srv.url + "/v1/completions",
                       json={"prompt": "a", "max_tokens": 0})  # fmt: skip
        _check_error(r, 400, "max_tokens", "echo")
        r = httpx.post(srv.url + "/v1/chat/completions",
                       json={"messages": [{"role": "user", "content": "a"}],
                             "tools": [{"type": "function"}]})  # fmt: skip
        _check_error(r, 400, "tools", "must be an object")  # a malformed tool


# ---------------------------------------------------------------------------------------
# load


async def _load(
    url: str, clients: int, seed: int, budget_s: float, token_range: tuple[int, int] = (2, 24)
) -> dict[str, int]:
    """``clients`` concurrent streaming clients, each asking for a max_tokens drawn from
    `token_range` (both ends included); ~30% hang up early. Returns counts."""
    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=clients + 10, max_keepalive_connections=0)
    stats = {"complete": 0, "disconnected": 0}
    problems: list[str] = []

    async def one(i: int, h: httpx.AsyncClient) -> None:
        chat = rng.random() < 0.5
        max_tokens = rng.randint(*token_range)
        hang_up_after = rng.randint(1, 4) if rng.random() < 0.3 else None
        body: dict[str, Any] = {
            "model": MODEL,
            "max_tokens": max_tokens,
            "stream": True,
            "temperature": 0,
            "stream_options": {"include_usage": True},
        }
        if chat:
            body["messages"] = [{"role": "user", "content": f"Request {i}: {CORPUS[i % 5]}"}]
        else:
            body["prompt"] = f"{CORPUS[i % 5]} ({i})"
        path = "/v1/chat/completions" if chat else "/v1/completions"
        async with h.stream("POST", url + path, json=body) as r:
            if r.status_code != 200:
                problems.append(f"client {i}: HTTP {r.status_code}")
                return
            text = []
            events = 0
            async for chunk in r.aiter_text():
                text.append(chunk)
                events += chunk.count("\n\n")
                if hang_up_after is not None and events >= hang_up_after:
                    stats["disconnected"] += 1
                    return  # leaving the block closes the connection
        body_text = "".join(text)
        try:
            payloads, done = parse_sse(body_text)
            assert done, "no [DONE]"
            usage = payloads[-1]["usage"]
            assert payloads[-1]["choices"] == [] and usage is not None
            content = [p for p in payloads[:-1] if p["choices"]]
            finishes = [p["choices"][0]["finish_reason"] for p in content]
            assert finishes[-1] in ("stop", "length"), finishes
            assert all(f is None for f in finishes[:-1])
            if finishes[-1] == "length":
                assert usage["completion_tokens"] == max_tokens
            assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
            stats["complete"] += 1
        except (AssertionError, ValueError, KeyError, IndexError) as exc:
            problems.append(f"client {i}: {exc!r}: {body_text[-300:]!r}")

    async with httpx.AsyncClient(limits=limits, timeout=budget_s) as h:
        await asyncio.wait_for(
            asyncio.gather(*(one(i, h) for i in range(clients))), timeout=budget_s
        )
    assert not problems, problems[:5]
    return stats


@pytest.mark.parametrize("kind", ["fake", "real"])
def test_load_200_streams_with_disconnects(kind: str, request: pytest.FixtureRequest,
                                           tokenizer: Any) -> None:  # fmt: skip
    if kind == "real":
        engine = request.getfixturevalue("real_engine")
        url = request.getfixturevalue("real_server").url
        stats = asyncio.run(_load(url, 200, seed=1, budget_s=240))
    else:
        engine = FakeEngine(tokenizer, delay=0.005)
        with serve(engine) as srv:
            stats = asyncio.run(_load(srv.url, 200, seed=2, budget_s=120))
    assert stats["complete"] + stats["disconnected"] == 200
    assert stats["disconnected"] > 20 and stats["complete"] > 100
    assert wait_until(lambda: used_blocks(engine) == 0, timeout=15)
    if kind == "real":
        text = httpx.get(url + "/metrics").text
        assert "ferrobatch_requests_waiting 0" in text
        assert "ferrobatch_requests_running 0" in text
        assert 'ferrobatch_cache_blocks{state="used"} 0' in text
        engine_stats = engine.stats()
        assert engine_stats.get("running_requests", 0) == 0


@contextlib.contextmanager
def _steps_held_until_queued(engine: Any, queued: int, timeout: float = 60.0) -> Iterator[None]:
    """Hold the engine's stepping until `queued` requests are in its table (or `timeout`
    passes), so the cache is oversubscribed however fast this machine steps: without it,
    whether anything gets preempted depended on how many streams overlapped."""
    held = threading.Event()

    def hold() -> None:
        with engine._step_lock:
            held.set()
            deadline = time.monotonic() + timeout
            while len(engine._requests) < queued and time.monotonic() < deadline:
                time.sleep(0.005)

    holder = threading.Thread(target=hold, daemon=True)
    holder.start()
    held.wait()
    try:
        yield
    finally:
        holder.join()


@pytest.mark.parametrize("offload", [0.0, 0.001], ids=["soft-reset", "offload"])
def test_load_with_preemption(offload: float, tokenizer: Any) -> None:
    """A cache far too small for 200 streams: requests get preempted (soft reset or CPU
    offload) mid-stream, and every surviving client still gets a complete stream."""
    try:
        from ferrobatch import ContinuousBatchingConfig, Engine
        from ferrobatch.core import Scheduler  # noqa: F401  (needs ferrobatch._core)
    except ImportError as exc:  # pragma: no cover - extension not built
        pytest.skip(f"real Engine unavailable: {exc}")
    cfg = ContinuousBatchingConfig(num_blocks=24, page_size=16, cpu_offload_space=offload)
    engine = Engine(build_model(tokenizer), tokenizer=tokenizer, config=cfg)
    try:
        with serve(engine) as srv, _steps_held_until_queued(engine, 200):
            stats = asyncio.run(_load(srv.url, 200, seed=3, budget_s=240, token_range=(24, 64)))
        assert stats["complete"] + stats["disconnected"] == 200
        assert wait_until(lambda: used_blocks(engine) == 0, timeout=15)
        st = engine.stats()
        key = "num_offloads" if offload else "num_soft_resets"
        assert st.get(key, 0) > 0, st
    finally:
        engine.close()


def test_engine_admission_checks_answer_400_before_a_stream_starts() -> None:
    """A request the server's own context check lets through but the engine cannot admit
    (a hybrid model's sliding-window ring chunks count too) is a 400 naming max_tokens, not
    an error event after the stream's headers."""
    from fastapi.testclient import TestClient
    from ferrobatch import ContinuousBatchingConfig, Engine

    config = ContinuousBatchingConfig(page_size=8, num_blocks=6)
    with Engine(tiny_models.gemma3(), config=config, tokenizer=build_tokenizer()) as eng:
        client = TestClient(create_app(eng, model_name="t"))
        body = {"model": "t", "prompt": [5] * 10, "max_tokens": 20, "stream": True}
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 400
        err = r.json()["error"]
        assert err["param"] == "max_tokens" and "num_blocks=6" in err["message"]
        ok = client.post("/v1/completions", json={**body, "max_tokens": 4, "stream": False})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] <= 4
