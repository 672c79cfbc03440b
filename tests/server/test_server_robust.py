"""Robustness of the OpenAI-compatible server: requests larger than the
queue, huge bodies off the event loop, clients that leave mid-body, slow or short bodies,
graceful shutdown on SIGTERM, typed OpenAPI (schemathesis), backpressure on unread streams.

Every server listens on 127.0.0.1 (a free port); every loop is bounded in count and time.
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from ferrobatch.cli.serve import freeze_startup_heap
from ferrobatch.server import BackgroundServer, create_app
from server_helpers import (
    MODEL,
    FakeEngine,
    build_model,
    client,
    free_port,
    parse_sse,
    serve,
    wait_until,
)


def _error(r: httpx.Response, status: int, param: str | None, fragment: str) -> dict[str, Any]:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param, err
    assert fragment in err["message"], err
    return err


# ---------------------------------------------------------------------------------------
# 4. a request larger than --max-queue is a 400, not a 429 that can never succeed


def test_request_larger_than_max_queue_is_400(tokenizer: Any) -> None:
    engine = FakeEngine(tokenizer)
    with serve(engine, max_queue=4) as srv:
        url = srv.url
        r = httpx.post(url + "/v1/completions", json={"prompt": "a", "n": 5})
        err = _error(r, 400, "n", "--max-queue")
        assert err["code"] == "too_many_choices" and "retry-after" not in r.headers
        r = httpx.post(url + "/v1/completions", json={"prompt": ["a", "b", "c"], "n": 2})
        _error(r, 400, "prompt", "6 choices")
        r = httpx.post(url + "/v1/chat/completions",
                       json={"messages": [{"role": "user", "content": "a"}], "n": 9})  # fmt: skip
        _error(r, 400, "n", "--max-queue")
        # the official client does not retry a 400 (it retries 429s), and says why
        c = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=2, timeout=30)
        with pytest.raises(openai.BadRequestError, match="max-queue"):
            c.completions.create(model=MODEL, prompt=["a"] * 5, max_tokens=1)
        assert not engine.submitted  # refused before anything ran
        out = c.completions.create(model=MODEL, prompt=["a", "b"], n=2, max_tokens=1)
        assert len(out.choices) == 4  # exactly at the limit still runs
        text = httpx.get(url + "/metrics").text
        assert 'ferrobatch_http_errors_total{code="400"} 4' in text


# ---------------------------------------------------------------------------------------
# 6. a client that leaves while sending its body is a client gone, not a 500


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@contextlib.contextmanager
def _logs(*names: str) -> Iterator[list[logging.LogRecord]]:
    handler = _Records()
    loggers = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.addHandler(handler)
        lg.setLevel(logging.DEBUG)
    try:
        yield handler.records
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.removeHandler(handler)
            lg.setLevel(level)


def _raw(url: str, data: bytes, *, timeout: float = 10.0) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=timeout)
    sock.sendall(data)
    return sock


def _metric(url: str, line_start: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(line_start + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_client_leaving_mid_body_is_not_a_server_error(tokenizer: Any) -> None:
    engine = FakeEngine(tokenizer)
    with serve(engine) as srv, _logs("uvicorn.error", "ferrobatch.server") as records:
        for path in ("/v1/completions", "/v1/chat/completions"):
            head = (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    "Content-Length: 5000\r\n\r\n").encode()  # fmt: skip
            sock = _raw(srv.url, head + b'{"prompt": "abc' + b"x" * 500)
            time.sleep(0.2)
            sock.close()
        gone = 'ferrobatch_client_disconnects_total{stage="body"}'
        assert wait_until(lambda: _metric(srv.url, gone) == 2)
        assert _metric(srv.url, 'ferrobatch_http_errors_total{code="500"}') == 0
        out = client(srv.url).completions.create(model=MODEL, prompt="a", max_tokens=1)
        assert out.usage.completion_tokens == 1
    bad = [r for r in records if r.levelno >= logging.WARNING]
    assert not bad, [r.getMessage() for r in bad]
    assert any("left while sending its body" in r.getMessage() for r in records)
    assert not engine.submitted[:-1]


# ---------------------------------------------------------------------------------------
# 9. read deadlines: slow request heads, bodies shorter than their Content-Length


@contextlib.contextmanager
def _serve(engine: Any, *, server: dict[str, Any] | None = None,
           **app_kwargs: Any) -> Iterator[BackgroundServer]:  # fmt: skip
    app_kwargs.setdefault("model_name", MODEL)
    srv = BackgroundServer(create_app(engine, **app_kwargs), "127.0.0.1", 0, **(server or {}))
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


def _closed_within(sock: socket.socket, seconds: float) -> bytes | None:
    """What the server sent before closing ``sock`` within ``seconds`` (None: still open)."""
    sock.settimeout(0.1)
    got = b""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            data = sock.recv(65536)
        except TimeoutError:
            continue
        except ConnectionResetError:
            return got
        if not data:
            return got
        got += data
    return None


def test_slow_request_heads_are_closed(tokenizer: Any) -> None:
    with _serve(FakeEngine(tokenizer), server={"read_timeout": 1.0}) as srv:
        start = time.monotonic()
        socks = [_raw(srv.url, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n") for _ in range(20)]
        socks.append(_raw(srv.url, b""))  # connects and says nothing
        for _ in range(3):  # a byte now and then does not extend the deadline
            time.sleep(0.2)
            for s in socks[:5]:
                s.sendall(b"X")
        # a kept-alive connection that starts a second request head and stalls
        kept = _raw(srv.url, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert kept.recv(65536).startswith(b"HTTP/1.1 200")
        kept.sendall(b"GET /health HTTP/1.1\r\n")
        for s in [*socks, kept]:
            assert _closed_within(s, 5.0) is not None
            s.close()
        assert time.monotonic() - start < 6.0
        assert httpx.get(srv.url + "/health").status_code == 200  # the server is fine


def test_body_shorter_than_content_length_gets_408(tokenizer: Any) -> None:
    engine = FakeEngine(tokenizer)
    with _serve(engine, body_timeout=1.0) as srv:
        head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: 1000\r\n\r\n")  # fmt: skip
        sock = _raw(srv.url, head + b'{"prompt": "a"}')
        start = time.monotonic()
        got = _closed_within(sock, 5.0)
        sock.close()
        assert got is not None and time.monotonic() - start < 4.0
        status, _, rest = got.partition(b"\r\n")
        assert status.startswith(b"HTTP/1.1 408"), got
        err = json.loads(rest.partition(b"\r\n\r\n")[2])["error"]
        assert err["code"] == "request_timeout" and "Content-Length" in err["message"]
        assert not engine.submitted
        assert _metric(srv.url, 'ferrobatch_http_errors_total{code="408"}') == 1


def test_stop_token_ids_out_of_vocabulary_names_the_field(tokenizer: Any) -> None:
    with serve(FakeEngine(tokenizer)) as srv:
        for path, body in (
            ("/v1/completions", {"prompt": "a", "stop_token_ids": [3, 999999]}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}],
                                      "stop_token_ids": [-1]}),
        ):  # fmt: skip
            r = httpx.post(srv.url + path, json=body)
            _error(r, 400, "stop_token_ids", "not a token id of this model")
        with pytest.raises(openai.BadRequestError) as info:
            client(srv.url).completions.create(
                model=MODEL, prompt="a", max_tokens=1, extra_body={"stop_token_ids": [10**6]}
            )
        assert info.value.body["param"] == "stop_token_ids"  # type: ignore[index]


def test_lone_surrogate_escape_gets_a_clear_message(tokenizer: Any) -> None:
    engine = FakeEngine(tokenizer)
    with serve(engine) as srv:
        cases = [
            ("/v1/completions", rb'{"prompt": "a\ud800b"}', "prompt"),
            ("/v1/completions", rb'{"prompt": ["ok", "\udc00"]}', "prompt[1]"),
            ("/v1/completions", rb'{"prompt": "a", "stop": "\ud83d"}', "stop"),
            ("/v1/chat/completions", rb'{"messages": [{"role": "user", "content": "\ud800"}]}',
             "messages[0].content"),
        ]  # fmt: skip
        for path, body, param in cases:
            r = httpx.post(srv.url + path, content=body,
                           headers={"content-type": "application/json"})  # fmt: skip
            err = _error(r, 400, param, "lone surrogate escape")
            assert err["code"] == "invalid_unicode" and "surrogate pair" in err["message"]
        r = httpx.post(srv.url + "/v1/completions", content=b'{"prompt": "\xff"}',
                       headers={"content-type": "application/json"})  # fmt: skip
        _error(r, 400, None, "not valid UTF-8")
        assert not engine.submitted
        # a proper surrogate pair is an ordinary character
        pair = rb'{"prompt": "\ud83d\ude00", "max_tokens": 1}'
        r = httpx.post(srv.url + "/v1/completions", content=pair,
                       headers={"content-type": "application/json"})  # fmt: skip
        assert r.status_code == 200, r.text


# ---------------------------------------------------------------------------------------
# 9. a stream the client never reads is bounded in server memory


def test_unread_stream_is_bounded_then_cancelled(tokenizer: Any) -> None:
    engine = FakeEngine(tokenizer, delay=0.0, max_model_len=10**7)
    engine.num_blocks = 10**6
    with _serve(engine, stream_buffer=32, stream_stall_timeout=1.0) as srv:
        state = srv.server.config.app.state.ferrobatch
        body = json.dumps({"prompt": "a", "max_tokens": 2_000_000, "stream": True}).encode()
        head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                f"\r\nContent-Length: {len(body)}\r\n\r\n").encode()  # fmt: skip
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        host, port = srv.url.removeprefix("http://").split(":")
        sock.connect((host, int(port)))
        sock.sendall(head + body)  # ... and never read
        peak = 0
        deadline = time.monotonic() + 60
        while not engine.cancelled and time.monotonic() < deadline:
            peak = max([peak, *(run.queue.qsize() for run in list(state.runs))])
            time.sleep(0.01)
        assert engine.cancelled, "the unread stream was never cancelled"
        assert peak <= 32 + 1
        produced = engine.submitted[0][2].max_new_tokens
        assert produced == 2_000_000  # it asked for a lot; it got cancelled long before
        assert wait_until(lambda: not engine.active)
        # the stream itself is given up after another stall timeout: the connection closes
        assert wait_until(lambda: not state.runs, 10)
        assert _metric(srv.url, "ferrobatch_requests_waiting") == 0
        assert _metric(srv.url, 'ferrobatch_requests_total{endpoint="completions",'
                       'finish_reason="cancelled"}') == 1  # fmt: skip
        sock.settimeout(5)
        with contextlib.suppress(OSError):
            while sock.recv(1 << 20):
                pass  # buffered chunks, then the end of the connection
        sock.close()
        assert httpx.get(srv.url + "/health").status_code == 200


# ---------------------------------------------------------------------------------------
# 7. SIGTERM with requests in flight: a real `ferrobatch serve` process


def test_sigterm_drains_then_ends_requests_openai_shaped(tokenizer: Any, tmp_path: Any) -> None:
    model_dir = tmp_path / "tiny"
    build_model(tokenizer, max_len=8192).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "ferrobatch.cli", "serve", str(model_dir), "--port", str(port),
         "--served-model-name", MODEL, "--shutdown-timeout", "2", "--num-blocks", "2048",
         "--page-size", "16", "--log-level", "info"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert proc.poll() is None, proc.communicate()[0]
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            time.sleep(0.2)
        else:
            pytest.fail("the server did not become ready")
        long = {"model": MODEL, "prompt": "The capital", "max_tokens": 8000, "ignore_eos": True}
        results: dict[str, Any] = {}
        started = threading.Event()
        short_started = threading.Event()

        def stream(key: str, body: dict[str, Any]) -> None:
            with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True},
                              timeout=60) as r:  # fmt: skip
                text = ""
                for chunk in r.iter_text():
                    text += chunk
                    (short_started if key == "short" else started).set()
                results[key] = (r.status_code, text)

        def whole(key: str, body: dict[str, Any]) -> None:
            r = httpx.post(url + "/v1/completions", json=body, timeout=60)
            results[key] = (r.status_code, r.headers.get("content-type"), r.json())

        def official() -> None:
            c = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)
            try:
                for _ in c.completions.create(
                    model=MODEL,
                    prompt="Hello",
                    max_tokens=8000,
                    stream=True,
                    extra_body={"ignore_eos": True},
                ):
                    pass  # fmt: skip
                results["official"] = "finished"
            except openai.APIError as exc:
                results["official"] = exc

        threads = [
            threading.Thread(target=stream, args=("long_stream", long)),
            threading.Thread(target=whole, args=("long_whole", long)),
            threading.Thread(target=official),
        ]
        for t in threads:
            t.start()
        assert started.wait(60)
        time.sleep(0.3)
        short = threading.Thread(target=stream, args=("short", {**long, "max_tokens": 24}))
        short.start()  # in flight at SIGTERM, finishes well within the shutdown timeout
        # (SIGTERM once its first chunk came: a fixed pause let a loaded machine send the
        # SIGTERM before the short request had even connected)
        assert short_started.wait(30)
        proc.send_signal(signal.SIGTERM)
        sigterm = time.monotonic()
        for t in [*threads, short]:
            t.join(60)
        out, _ = proc.communicate(timeout=30)
        assert proc.returncode == 0, out
        assert time.monotonic() - sigterm < 2 + 5, out
        # the short stream ran to its end
        status, text = results["short"]
        payloads, done = parse_sse(text)
        assert status == 200 and done and payloads[-1]["choices"][0]["finish_reason"] == "length"
        # the long stream: an OpenAI-shaped error event, then [DONE]
        status, text = results["long_stream"]
        payloads, done = parse_sse(text)
        assert status == 200 and done, text[-300:]
        err = payloads[-1]["error"]
        assert err["code"] == "shutting_down" and err["type"] == "service_unavailable"
        assert set(err) == {"message", "type", "param", "code"}
        # the non-streaming one: a JSON error, not a text/plain 500
        status, ctype, body = results["long_whole"]
        assert status == 503 and ctype.startswith("application/json"), body
        assert body["error"]["code"] == "shutting_down"
        # the official client surfaces the error event as an APIError
        assert isinstance(results["official"], openai.APIError), results["official"]
        assert "shutting down" in str(results["official"])
        assert "Traceback" not in out and "Exception in ASGI" not in out, out
        with pytest.raises(httpx.ConnectError):  # nothing listens any more
            httpx.get(url + "/health", timeout=2)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


# ---------------------------------------------------------------------------------------
# 8. typed OpenAPI; schemathesis against the served document


def test_openapi_declares_bodies_and_typed_responses(tokenizer: Any) -> None:
    with serve(FakeEngine(tokenizer)) as srv:
        doc = httpx.get(srv.url + "/openapi.json").json()
    comps = doc["components"]["schemas"]
    for path, req, resp in (
        ("/v1/completions", "CompletionRequest", "CompletionResponse"),
        ("/v1/chat/completions", "ChatCompletionRequest", "ChatCompletionResponse"),
    ):
        op = doc["paths"][path]["post"]
        body = op["requestBody"]["content"]["application/json"]["schema"]
        assert op["requestBody"]["required"] and body == {"$ref": f"#/components/schemas/{req}"}
        ok = op["responses"]["200"]["content"]
        assert ok["application/json"]["schema"] == {"$ref": f"#/components/schemas/{resp}"}
        assert "text/event-stream" in ok
        for code in ("400", "429", "503"):
            err = op["responses"][code]["content"]["application/json"]["schema"]
            assert err == {"$ref": "#/components/schemas/ErrorResponse"}
    assert "prompt" in comps["CompletionRequest"]["required"]
    assert comps["ChatCompletionRequest"]["properties"]["messages"]["minItems"] == 1
    assert {"choices", "usage", "id"} <= set(comps["CompletionResponse"]["required"])
    metrics = doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    assert list(metrics) == ["text/plain"]
    for path in ("/health", "/v1/models"):
        assert doc["paths"][path]["get"]["responses"]["200"]["content"]["application/json"]


def _schemathesis() -> str:
    pytest.importorskip("schemathesis")
    exe = Path(sys.executable).with_name("schemathesis")
    return str(exe) if exe.exists() else (shutil.which("schemathesis") or "schemathesis")


def test_schemathesis_positive_and_negative(tokenizer: Any, tmp_path: Any) -> None:
    """Generated valid and invalid requests against the served document: no 5xx, every
    response (JSON and SSE events) conforms, invalid data is rejected. Bounded: a fixed
    number of cases per operation on the fast fake engine (a few seconds)."""
    exe = _schemathesis()
    engine = FakeEngine(tokenizer, delay=0.0)
    with serve(engine, max_queue=256) as srv:
        r = subprocess.run(
            [exe, "run", srv.url + "/openapi.json", "--checks", "all",
             # valid by the schema but refused on meaning (a prompt over the context, 17
             # stop strings, ...) is a 400 the schema cannot express
             "--exclude-checks", "positive_data_acceptance",
             "--mode", "all", "-n", "25", "--seed", "10", "--workers", "1",
             "--request-timeout", "30", "--no-color"],
            capture_output=True, text=True, timeout=180, cwd=tmp_path,
        )  # fmt: skip
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-6000:]
    # (a warning may say most generated /v1/completions bodies were refused: they are valid
    # JSON Schema instances the server rejects on meaning, see above)
    counts = re.search(r"(\d+) generated, (\d+) passed", out)
    assert counts and counts[1] == counts[2] and int(counts[1]) > 100, out[-3000:]


# ---------------------------------------------------------------------------------------
# 5. a huge body of tiny prompts does not block the event loop


def _health_while(url: str, work: Any) -> tuple[Any, float, int]:
    """(work's result, the slowest /health answer meanwhile, how many were answered)."""
    result: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: result.setdefault("r", work()))
    worst, count = 0.0, 0
    with httpx.Client(timeout=30) as hc:
        hc.get(url + "/health")
        thread.start()
        while thread.is_alive() and count < 2000:
            t = time.perf_counter()
            assert hc.get(url + "/health").status_code == 200
            worst = max(worst, time.perf_counter() - t)
            count += 1
            time.sleep(0.005)
    thread.join(60)
    return result["r"], worst, count


@contextlib.contextmanager
def _startup_heap_frozen() -> Iterator[None]:
    """The heap as ``ferrobatch serve`` has it (frozen after loading): here the test
    suite's whole heap, which a full collection would otherwise walk for seconds."""
    freeze_startup_heap()
    try:
        yield
    finally:
        gc.unfreeze()


@_startup_heap_frozen()
def test_huge_body_of_tiny_prompts_keeps_the_loop_responsive(tokenizer: Any) -> None:
    engine = FakeEngine(tokenizer)
    prompts = ["a"] * 380_000
    body = json.dumps({"prompt": prompts, "max_tokens": 1}, separators=(",", ":")).encode()
    assert len(body) > 1_500_000
    with serve(engine, max_body_bytes=4 * 1024 * 1024) as srv:

        def post() -> httpx.Response:
            return httpx.post(srv.url + "/v1/completions", content=body, timeout=60,
                              headers={"content-type": "application/json"})  # fmt: skip

        r, worst, count = _health_while(srv.url, post)
        _error(r, 400, "prompt", "380000 choices")  # refused on its count, before tokenizing
        assert count >= 1 and worst < 1.0, (worst, count)
        assert not engine.submitted
    # as many as the queue takes, each a paragraph: tokenized off the loop
    text = " ".join(["Paged attention stores keys and values in fixed-size blocks."] * 8)
    body = json.dumps({"prompt": [text] * 1000, "max_tokens": 1}).encode()
    engine = FakeEngine(tokenizer, max_model_len=4096)
    with serve(engine) as srv:
        r, worst, count = _health_while(srv.url, lambda: httpx.post(
            srv.url + "/v1/completions", content=body, timeout=120,
            headers={"content-type": "application/json"}))  # fmt: skip
        assert r.status_code == 200 and len(r.json()["choices"]) == 1000
        assert count >= 1 and worst < 1.0, (worst, count)
