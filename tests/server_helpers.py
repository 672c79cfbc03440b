"""What the server tests share: the tiny tokenizer and model, `FakeEngine` (a deterministic
stand-in with the ARCHITECTURE.md §6 surface the server uses), a live server in a thread
(`serve`), and request / response helpers."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import socket
import subprocess
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import openai
import pytest
import tiny_models
import torch
from ferrobatch.engine.outputs import RequestOutput
from ferrobatch.sampling.params import SamplingParams
from ferrobatch.server import BackgroundServer, create_app

torch.set_num_threads(1)

MODEL = "tiny-test"
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [
    "The capital of France is Paris.",
    "Hello world, how are you today?",
    "A quick brown fox jumps over the lazy dog.",
    "Continuous batching keeps the accelerator busy with many requests.",
    "Paged attention stores keys and values in fixed-size blocks.",
]


# ---------------------------------------------------------------------------------------
# tiny tokenizer / model / engines


def build_tokenizer() -> Any:
    """A byte-level BPE tokenizer trained on a few sentences, with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 3, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|endoftext|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
    )


def build_model(tokenizer: Any, max_len: int = 256) -> Any:
    """A tiny random-init Llama matching the tokenizer's vocabulary."""
    return tiny_models.llama(
        0,
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        max_position_embeddings=max_len,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def real_engine_or_skip(tokenizer: Any) -> Any:
    """A real Engine on the tiny model; skipped only when the extension is not built."""
    try:
        from ferrobatch import ContinuousBatchingConfig, Engine
        from ferrobatch.core import Scheduler  # noqa: F401  (needs ferrobatch._core)
    except ImportError as exc:
        pytest.skip(f"real Engine unavailable: {exc}")
    return Engine(
        build_model(tokenizer),
        tokenizer=tokenizer,
        config=ContinuousBatchingConfig(num_blocks=1024, page_size=16),
    )


class FakeEngine:
    """Deterministic stand-in for ``ferrobatch.Engine`` (the §6 surface the server uses).

    Every request emits ``max_new_tokens`` tokens, one per ``delay`` seconds, each a function
    of the prompt and the step. ``gate`` (cleared) holds every request before its first
    token. Holds ``ceil(len(prompt) / page_size)`` "blocks" per live request.
    """

    def __init__(self, tokenizer: Any, *, delay: float = 0.002, max_model_len: int = 256):
        self.tokenizer = tokenizer
        self.model_name = "fake-model"
        self.max_model_len = max_model_len
        self.vocab_size = len(tokenizer)
        self.num_blocks = 4096
        self.delay = delay
        self.gate = threading.Event()
        self.gate.set()
        self.active: dict[str, int] = {}
        self.cancelled: list[str] = []
        self.cancel_calls: list[str] = []
        self.submitted: list[tuple[str, list[int], SamplingParams]] = []
        self.closed = False
        self._cancel_set: set[str] = set()

    @property
    def max_request_tokens(self) -> int:
        return self.num_blocks * 16  # blocks of 16 tokens, full attention

    def check_request(self, prompt: Any, sampling: Any = None) -> list[int]:
        """Admits anything `check_context` let through (the server's own checks)."""
        return list(prompt)

    def encode_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        out = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        if hasattr(out, "keys"):
            out = out["input_ids"]
        return [int(t) for t in out]

    def token(self, ids: list[int], step: int) -> int:
        return 3 + (sum(ids) * 31 + step * 7) % (self.vocab_size - 3)

    async def astream(
        self, prompt: Any, sampling: Any = None, *, request_id: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        sp = sampling or SamplingParams()
        ids = list(self.tokenizer(prompt)["input_ids"]) if isinstance(prompt, str) else prompt
        rid = request_id or uuid.uuid4().hex
        if rid in self.active:
            raise ValueError(f"request_id {rid!r} is already in use")
        self.submitted.append((rid, list(ids), sp))
        self.active[rid] = math.ceil(len(ids) / 16)
        done = False
        try:
            while not self.gate.is_set():
                await asyncio.sleep(0.005)
            for step in range(sp.max_new_tokens):
                await asyncio.sleep(self.delay)
                if rid in self._cancel_set:
                    return
                tok = self.token(ids, step)
                last = step == sp.max_new_tokens - 1
                lp = None
                if sp.logprobs is not None:
                    lp = [{tok: -0.25, **{(tok + k) % self.vocab_size: -1.0 - k
                                          for k in range(1, sp.logprobs + 1)}}]  # fmt: skip
                yield RequestOutput(
                    request_id=rid,
                    prompt_token_ids=list(ids),
                    token_ids=[tok],
                    text=self.tokenizer.decode([tok]),
                    finish_reason="length" if last else None,
                    finished=last,
                    logprobs=lp,
                )
            done = True
        finally:
            if not done:
                self.cancelled.append(rid)
            self.active.pop(rid, None)

    def cancel(self, request_id: str) -> bool:
        self.cancel_calls.append(request_id)
        if request_id in self.active:
            self._cancel_set.add(request_id)
            return True
        return False

    def take_step_records(self) -> list[tuple[float, int]]:
        """One fake step per scrape (seconds, prefill budget tokens)."""
        return [(0.02, 2048)]

    def stats(self) -> dict[str, Any]:
        used = sum(self.active.values())
        return {  # the names of the Rust scheduler's stats
            "waiting": 0 if self.gate.is_set() else len(self.active),
            "running": len(self.active) if self.gate.is_set() else 0,
            "num_used_blocks": used,
            "num_free_blocks": self.num_blocks - used,
            "num_cached_blocks": 0,
            "num_blocks": self.num_blocks,
            "prefix_hit_tokens": 3,
            "prompt_tokens": 12,
            "num_offloads": 1,
            "num_soft_resets": 2,
        }

    def close(self) -> None:
        self.closed = True


# ---------------------------------------------------------------------------------------
# fixtures


@contextlib.contextmanager
def serve(engine: Any = None, **kwargs: Any) -> Iterator[BackgroundServer]:
    kwargs.setdefault("model_name", MODEL)
    app = create_app(engine, **kwargs)
    srv = BackgroundServer(app, "127.0.0.1", 0)
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


def client(url: str, key: str = "none") -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=60)


def wait_until(pred: Any, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.01)
    return bool(pred())


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_healthy(proc: subprocess.Popen, url: str, timeout: float) -> int | None:
    """Poll `url`/health of the server process `proc` until it answers 200, the process
    exits or `timeout` seconds pass; the last status (None: no answer). Before 200 the
    server may only be unreachable or answer 503."""
    deadline = time.monotonic() + timeout
    status = None
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            status = httpx.get(url + "/health", timeout=2).status_code
        except httpx.TransportError:
            status = None
        if status == 200:
            break
        assert status in (None, 503)
        time.sleep(0.2)
    return status


def used_blocks(engine: Any) -> int:
    stats = engine.stats()
    return int(stats.get("num_used_blocks", stats.get("used_blocks", 0)))


def parse_sse(text: str) -> tuple[list[dict[str, Any]], bool]:
    """(JSON payloads, saw [DONE]) of an SSE body; asserts the framing is well formed."""
    payloads: list[dict[str, Any]] = []
    done = False
    for block in text.split("\n\n"):
        if not block.strip():
            continue
        assert block.startswith("data: "), block
        assert not done, "data after [DONE]"
        data = block[len("data: ") :]
        if data == "[DONE]":
            done = True
            continue
        payloads.append(json.loads(data))
    return payloads, done


def _post(url: str, path: str, body: Any, headers: dict[str, str]) -> httpx.Response:
    if isinstance(body, bytes):
        return httpx.post(url + path, content=body,
                          headers={"content-type": "application/json", **headers})  # fmt: skip
    return httpx.post(url + path, json=body, headers=headers)


def _check_error(r: httpx.Response, status: int, param: str | None, fragment: str) -> None:
    assert r.status_code == status, (r.status_code, r.text)
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert fragment.lower() in err["message"].lower(), err
    if param is not None:
        assert err["param"] == param, err
