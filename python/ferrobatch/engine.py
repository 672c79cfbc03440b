"""`Engine`: continuous-batching generation over any transformers causal LM.

Each step: the Rust scheduler plans a batch, the runner computes logits for the sampled
rows, the sampler picks tokens, the scheduler records them and reports per-request deltas,
which are detokenized, checked against stop strings and routed to their callers.

Only the stepping thread touches the scheduler: `add_request` and `cancel` post to an
inbox that the next step drains, so callers on any thread (or an asyncio loop) never race
with an outstanding plan.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import math
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ferrobatch.config import ContinuousBatchingConfig
from ferrobatch.detok import IncrementalDetokenizer
from ferrobatch.outputs import RequestOutput
from ferrobatch.sampling import Sampler, SamplingParams, SamplingState, coerce_sampling

logger = logging.getLogger("ferrobatch")

Prompt = str | Sequence[int]
Listener = Callable[[RequestOutput | BaseException], None]

_FINISH_REASONS = ("stop", "length", "cancelled")


class EngineClosedError(RuntimeError):
    """The engine was closed while the request was waiting."""


class QueueFullError(RuntimeError):
    """`max_queue_size` unfinished requests are already in the engine."""


@dataclass
class _Request:
    """Engine-side state of one request."""

    request_id: str
    prompt_ids: list[int]
    prompt_text: str | None
    params: SamplingParams
    sstate: SamplingState
    detok: IncrementalDetokenizer
    eos_token_ids: list[int]
    arrival: float
    output: RequestOutput
    listener: Listener | None = None
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None
    in_scheduler: bool = False
    keep: bool = False  # stays in the table after finishing until get_output claims it


class Engine:
    """Continuous-batching inference over a Hugging Face causal LM.

    `model` is a path, a loaded `PreTrainedModel`, or None for the bundled
    SmolLM2-135M-Instruct. `config` is a ferrobatch or transformers
    `ContinuousBatchingConfig` (never mutated). The caller's model, model config and
    generation config are left as they were.
    """

    def __init__(
        self,
        model: Any = None,
        *,
        config: Any = None,
        tokenizer: Any = None,
        device: str | torch.device | None = None,
        dtype: torch.dtype | None = None,
        seed: int | None = None,
    ) -> None:
        from ferrobatch import models
        from ferrobatch.runner import ModelRunner

        self.config = ContinuousBatchingConfig.coerce(config)
        loaded, loaded_tok = models.load_model(model, device=device, dtype=dtype)
        self.model = loaded
        if isinstance(tokenizer, str):
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(tokenizer)
        self.tokenizer = tokenizer if tokenizer is not None else loaded_tok
        param = next(loaded.parameters())
        self.device = torch.device(device) if device is not None else param.device
        self.dtype = dtype or param.dtype

        mcfg = loaded.config
        tcfg = mcfg.get_text_config() if hasattr(mcfg, "get_text_config") else mcfg
        self.model_name = str(
            getattr(mcfg, "_name_or_path", "") or getattr(mcfg, "model_type", "model")
        )
        self.max_model_len = int(getattr(tcfg, "max_position_embeddings", 0) or 1 << 30)
        self.vocab_size = int(tcfg.vocab_size)
        self.eos_token_ids = _eos_ids(loaded, self.tokenizer)
        self.layer_types = list(models.layer_types_of(tcfg))
        self.sliding_window = models.sliding_window_of(tcfg)
        self.default_max_new_tokens = 128

        cfg = self.config
        self.chunk_bytes = _chunk_bytes(tcfg, cfg.page_size, self.dtype)
        self.memory_explanation = ""
        num_blocks = cfg.num_blocks
        if num_blocks is None:
            num_blocks, self.memory_explanation = _choose_num_blocks(self, loaded)
            logger.info("ferrobatch cache: %s", self.memory_explanation)
        self.num_blocks = int(num_blocks)
        self.cpu_offload_blocks = (
            int(cfg.cpu_offload_space * (1 << 30)) // self.chunk_bytes
            if cfg.cpu_offload_space > 0
            else 0
        )
        self.runner = ModelRunner(
            loaded,
            num_blocks=self.num_blocks,
            page_size=cfg.page_size,
            cpu_offload_blocks=self.cpu_offload_blocks,
            device=self.device,
            dtype=dtype,
        )
        self.scheduler = self._build_scheduler()
        self.sampler = Sampler(self.device, seed=seed)

        self._requests: dict[str, _Request] = {}
        self._inbox: collections.deque[_Request] = collections.deque()
        self._cancel_inbox: collections.deque[str] = collections.deque()
        self._table_lock = threading.Lock()  # guards _requests
        self._step_lock = threading.RLock()  # one stepper at a time; guards the scheduler
        self._wakeup = threading.Event()
        self._thread: threading.Thread | None = None
        self._stop_loop = False
        self._closed = False
        self._error: BaseException | None = None
        self._ids = itertools.count()
        self._stats = collections.Counter()
        self._busy_time = 0.0
        self._first_step: float | None = None

    # ------------------------------------------------------------------ construction

    def _build_scheduler(self) -> Any:
        from ferrobatch.core import Scheduler

        cfg = self.config
        return Scheduler(
            self.num_blocks,
            cfg.page_size,
            cfg.max_batch_tokens,
            max_requests_per_batch=cfg.max_requests_per_batch,
            scheduler_type=cfg.scheduler_type,
            safety_margin=cfg.resolved_safety_margin,
            allow_block_sharing=cfg.allow_block_sharing,
            layer_types=list(self.layer_types),
            sliding_window=self.sliding_window,
            cpu_offload_blocks=self.cpu_offload_blocks,
        )

    # ------------------------------------------------------------------ public API

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling: Any = None,
        *,
        max_new_tokens: int | None = None,
        progress: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt; results in input order."""
        plist = _as_prompt_list(prompts)
        params = self._params_list(sampling, len(plist), max_new_tokens)
        reqs = [self._make_request(p, sp, None) for p, sp in zip(plist, params, strict=True)]
        return self._run_batch(reqs, progress=progress, desc="generate")

    def chat(
        self,
        conversations: Any,
        sampling: Any = None,
        *,
        max_new_tokens: int | None = None,
        progress: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them (the tokenizer's template)."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        ids = [self.encode_chat(c, **(chat_template_kwargs or {})) for c in conversations]
        return self.generate(ids, sampling, max_new_tokens=max_new_tokens, progress=progress)

    def encode_chat(self, messages: Sequence[dict[str, Any]], **kwargs: Any) -> list[int]:
        """Prompt token ids for a conversation, through the tokenizer's chat template."""
        if self.tokenizer is None:
            raise ValueError("chat needs a tokenizer; pass tokenizer= to Engine")
        kwargs.setdefault("add_generation_prompt", True)
        out = self.tokenizer.apply_chat_template(list(messages), tokenize=True, **kwargs)
        if hasattr(out, "keys") and "input_ids" in out:
            out = out["input_ids"]
        if hasattr(out, "tolist"):
            out = out.tolist()
        if out and isinstance(out[0], list):
            out = out[0]
        return [int(t) for t in out]

    def add_request(
        self, prompt: Prompt, sampling: Any = None, *, request_id: str | None = None
    ) -> str:
        """Queue a request (validated now) and start the background loop; returns its id."""
        sp = self._params_list(sampling, 1, None)[0]
        req = self._make_request(prompt, sp, request_id)
        req.keep = True
        self._submit(req)
        self.start()
        return req.request_id

    def get_output(self, request_id: str, timeout: float | None = None) -> RequestOutput:
        """Wait until the request finishes and return its output (re-raises loop errors)."""
        with self._table_lock:
            req = self._requests.get(request_id)
        if req is None:
            raise KeyError(f"unknown request_id {request_id!r}")
        if not req.done.is_set() and (self._thread is None or not self._thread.is_alive()):
            if self._error is None and not self._closed:
                self.start()
        if not req.done.wait(timeout):
            raise TimeoutError(f"request {request_id!r} did not finish within {timeout} s")
        with self._table_lock:
            self._requests.pop(request_id, None)
        if req.error is not None:
            raise req.error
        return req.output

    def cancel(self, request_id: str) -> bool:
        """Cancel a running or waiting request; False if unknown or already finished."""
        with self._table_lock:
            req = self._requests.get(request_id)
        if req is None or req.done.is_set():
            return False
        self._cancel_inbox.append(request_id)
        self._wakeup.set()
        return True

    def stream(self, prompt: Prompt, sampling: Any = None) -> Iterator[RequestOutput]:
        """Yield deltas (new tokens and text) as they are generated; the last is finished.

        Closing the iterator early cancels the request.
        """
        sp = self._params_list(sampling, 1, None)[0]
        q: queue.SimpleQueue[RequestOutput | BaseException] = queue.SimpleQueue()
        req = self._make_request(prompt, sp, None, listener=q.put, incremental=True)
        self._submit(req)
        self.start()
        return self._stream_iter(req, q)

    def _stream_iter(
        self, req: _Request, q: queue.SimpleQueue[RequestOutput | BaseException]
    ) -> Iterator[RequestOutput]:
        finished = False
        try:
            while True:
                try:
                    item = q.get(timeout=0.5)
                except queue.Empty:
                    self._raise_if_dead(req)
                    continue
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.cancel(req.request_id)
            self._forget(req)

    def astream(
        self, prompt: Prompt, sampling: Any = None, *, request_id: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Async form of `stream`; closing the generator (or cancelling the task) cancels.

        The request is validated now (`ValueError` naming the field) and starts when the
        iteration does.
        """
        sp = self._params_list(sampling, 1, None)[0]
        req = self._make_request(prompt, sp, request_id, incremental=True)
        return self._astream_gen(req)

    async def _astream_gen(self, req: _Request) -> AsyncIterator[RequestOutput]:
        loop = asyncio.get_running_loop()
        aq: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()

        def listener(item: RequestOutput | BaseException) -> None:
            try:
                loop.call_soon_threadsafe(aq.put_nowait, item)
            except RuntimeError:  # event loop closed: the consumer is gone
                pass

        req.listener = listener
        req.arrival = time.perf_counter()
        self._submit(req)
        self.start()
        finished = False
        try:
            while True:
                try:
                    item = await asyncio.wait_for(aq.get(), timeout=0.5)
                except TimeoutError:
                    self._raise_if_dead(req)
                    continue
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.cancel(req.request_id)
            self._forget(req)

    def check_request(self, prompt: Prompt, sampling: Any = None) -> list[int]:
        """Validate a request without running it; returns its prompt token ids.

        Raises the same `ValueError`s (naming the field) that `generate`, `add_request`,
        `stream` and `astream` raise.
        """
        sp = self._params_list(sampling, 1, None)[0]
        return self._make_request(prompt, sp, "check").prompt_ids

    @property
    def error(self) -> BaseException | None:
        """The exception that killed the stepping loop, or None while healthy."""
        return self._error

    @property
    def healthy(self) -> bool:
        """True while the engine is open and its loop has not died."""
        return self._error is None and not self._closed

    def start(self) -> None:
        """Start the background stepping loop (no-op if running)."""
        if self._closed:
            raise EngineClosedError("engine is closed")
        if self._error is not None:
            raise RuntimeError("the engine loop died earlier") from self._error
        if self._thread is not None and self._thread.is_alive():
            return
        self._stop_loop = False
        self._thread = threading.Thread(target=self._loop, name="ferrobatch-loop", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop the loop, cancel unfinished requests and give the model back untouched."""
        if self._closed:
            return
        self._stop_loop = True
        self._wakeup.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._closed = True
        with self._step_lock:  # a step running in a generate() caller's thread ends first
            self._fail_all(EngineClosedError("engine closed before the request finished"))
            self.runner.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:  # best effort; close() is the real API
        try:
            if not self._closed and self._thread is not None:
                self._stop_loop = True
                self._wakeup.set()
        except Exception:
            pass

    def stats(self) -> dict[str, Any]:
        """Scheduler statistics plus throughput, cache usage, prefix hits, preemptions."""
        out: dict[str, Any] = {}
        with self._step_lock:
            sched_stats = self.scheduler.stats() if hasattr(self.scheduler, "stats") else {}
        if not isinstance(sched_stats, dict):
            sched_stats = {k: getattr(sched_stats, k) for k in dir(sched_stats) if k[0] != "_"}
        out.update(sched_stats)
        gen = self._stats["generated_tokens"]
        out.update(
            steps=self._stats["steps"],
            generated_tokens=gen,
            submitted_prompt_tokens=self._stats["prompt_tokens"],
            finished_requests=self._stats["finished_requests"],
            busy_time_s=self._busy_time,
            throughput_tok_s=gen / self._busy_time if self._busy_time > 0 else 0.0,
            page_size=self.config.page_size,
            running_requests=sum(1 for r in list(self._requests.values()) if not r.done.is_set()),
        )
        out.setdefault("num_blocks", self.num_blocks)
        out.setdefault("cpu_offload_blocks", self.cpu_offload_blocks)
        used = sched_stats.get("num_used_blocks")
        if used is not None:
            out["cache_usage"] = used / max(1, self.num_blocks)
        hits, looked = sched_stats.get("prefix_hit_tokens"), sched_stats.get("prompt_tokens")
        if hits is not None:
            out["prefix_hit_rate"] = hits / looked if looked else 0.0
        return out

    # ------------------------------------------------------------------ requests

    def _params_list(
        self, sampling: Any, n: int, max_new_tokens: int | None
    ) -> list[SamplingParams]:
        if isinstance(sampling, list | tuple):
            if len(sampling) != n:
                raise ValueError(f"sampling: got {len(sampling)} SamplingParams for {n} prompts")
            items = list(sampling)
        else:
            items = [sampling] * n
        out = []
        for s in items:
            sp = coerce_sampling(s, default_max_new_tokens=self.default_max_new_tokens)
            if max_new_tokens is not None:
                sp = SamplingParams(**{**sp.__dict__, "max_new_tokens": max_new_tokens})
            out.append(sp)
        return out

    def _make_request(
        self,
        prompt: Prompt,
        sp: SamplingParams,
        request_id: str | None,
        *,
        listener: Listener | None = None,
        incremental: bool = False,
    ) -> _Request:
        prompt_text = None
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            if self.tokenizer is None:
                raise ValueError("prompt: a string prompt needs a tokenizer; pass token ids")
            prompt_text = prompt
            ids = list(self.tokenizer(prompt)["input_ids"])
        else:
            ids = _as_id_list(prompt)
        if not ids:
            raise ValueError("prompt must not be empty")
        lo, hi = min(ids), max(ids)
        if lo < 0 or hi >= self.vocab_size:
            bad = lo if lo < 0 else hi
            raise ValueError(
                f"prompt: token id {bad} is outside the vocabulary [0, {self.vocab_size})"
            )
        assert sp.max_new_tokens is not None
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"prompt is {len(ids)} tokens, longer than the model's context "
                f"(max_position_embeddings={self.max_model_len})"
            )
        if len(ids) + sp.max_new_tokens > self.max_model_len:
            raise ValueError(
                f"max_new_tokens={sp.max_new_tokens} with a {len(ids)}-token prompt exceeds the "
                f"model's context (max_position_embeddings={self.max_model_len})"
            )
        if "full_attention" in self.layer_types:
            need = math.ceil((len(ids) + sp.max_new_tokens) / self.config.page_size)
            if need > self.num_blocks:
                raise ValueError(
                    f"max_new_tokens: prompt + max_new_tokens needs {need} cache blocks but the "
                    f"cache has num_blocks={self.num_blocks}"
                )
        if sp.stop and self.tokenizer is None:
            raise ValueError("stop: stop strings need a tokenizer")
        for t in sp.stop_token_ids:
            if t >= self.vocab_size:
                raise ValueError(f"stop_token_ids: {t} is outside the vocabulary")
        if request_id is None:
            request_id = f"req-{next(self._ids)}-{uuid.uuid4().hex[:8]}"
        elif not isinstance(request_id, str) or not request_id:
            raise ValueError("request_id must be a non-empty string")
        eos_ids = [] if sp.ignore_eos else list(self.eos_token_ids)
        now = time.perf_counter()
        detok = IncrementalDetokenizer(
            self.tokenizer,
            ids,
            skip_special_tokens=sp.skip_special_tokens,
            stop=sp.stop,
            incremental=incremental,
        )
        out = RequestOutput(
            request_id=request_id,
            prompt_token_ids=ids,
            prompt=prompt_text,
            logprobs=[] if sp.logprobs is not None else None,
        )
        return _Request(
            request_id=request_id,
            prompt_ids=ids,
            prompt_text=prompt_text,
            params=sp,
            sstate=SamplingState(sp, ids),
            detok=detok,
            eos_token_ids=eos_ids,
            arrival=now,
            output=out,
            listener=listener,
        )

    def _submit(self, req: _Request, *, bounded: bool = True) -> None:
        if self._closed:
            raise EngineClosedError("engine is closed")
        if self._error is not None:
            raise RuntimeError("the engine loop died earlier") from self._error
        with self._table_lock:
            if req.request_id in self._requests:
                raise ValueError(f"request_id {req.request_id!r} is already in use")
            limit = self.config.max_queue_size
            busy = sum(not r.done.is_set() for r in self._requests.values()) if limit else 0
            if bounded and limit and busy >= limit:
                raise QueueFullError(
                    f"max_queue_size={limit} unfinished requests are already queued or running"
                )
            self._requests[req.request_id] = req
        self._inbox.append(req)
        self._wakeup.set()

    def _run_batch(self, reqs: list[_Request], *, progress: bool, desc: str) -> list[RequestOutput]:
        for r in reqs:
            self._submit(r, bounded=False)
        bar = None
        if progress and reqs:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(reqs), desc=desc, unit="req", dynamic_ncols=True)
        t0 = time.perf_counter()
        gen0 = self._stats["generated_tokens"]
        try:
            background = self._thread is not None and self._thread.is_alive()
            pending = list(reqs)
            while pending:
                if background:
                    pending[0].done.wait(0.1)
                    if self._error is not None and not pending[0].done.is_set():
                        raise self._error
                else:
                    self._drive_once()
                still = [r for r in pending if not r.done.is_set()]
                if bar is not None and len(still) != len(pending):
                    bar.update(len(pending) - len(still))
                    dt = time.perf_counter() - t0
                    bar.set_postfix_str(
                        f"{(self._stats['generated_tokens'] - gen0) / max(dt, 1e-9):.0f} tok/s"
                    )
                pending = still
        except BaseException:
            for r in reqs:
                if not r.done.is_set():
                    self.cancel(r.request_id)
            raise
        finally:
            if bar is not None:
                bar.close()
            for r in reqs:
                self._forget(r)
        for r in reqs:
            if r.error is not None:
                raise r.error
        return [r.output for r in reqs]

    def _forget(self, req: _Request) -> None:
        """Drop a finished request from the table (unfinished ones drop when they finish)."""
        with self._table_lock:
            if req.done.is_set() and self._requests.get(req.request_id) is req:
                del self._requests[req.request_id]
            else:
                req.keep = False

    def _raise_if_dead(self, req: _Request) -> None:
        if req.done.is_set():
            return
        if self._error is not None:
            raise self._error
        if self._closed:
            raise EngineClosedError("engine closed before the request finished")
        if self._thread is None or not self._thread.is_alive():
            self.start()

    # ------------------------------------------------------------------ stepping

    def _drive_once(self) -> None:
        """One step in the caller's thread; errors fail every request and propagate."""
        try:
            worked = self._step()
        except BaseException as exc:
            self._fail_all(exc, fatal=True)
            raise
        if not worked:
            with self._table_lock:
                waiting = [r for r in self._requests.values() if not r.done.is_set()]
            if waiting and not self._inbox and not self._cancel_inbox:
                if self._thread is not None and self._thread.is_alive():
                    time.sleep(0.001)
                    return
                err = RuntimeError(
                    f"scheduler returned no plan with {len(waiting)} unfinished requests"
                )
                self._fail_all(err, fatal=True)
                raise err

    def _loop(self) -> None:
        idle_misses = 0
        while not self._stop_loop:
            try:
                worked = self._step()
            except BaseException as exc:  # delivered to every waiting caller
                logger.exception("ferrobatch engine loop died")
                self._fail_all(exc, fatal=True)
                return
            if worked:
                idle_misses = 0
                continue
            with self._table_lock:
                waiting = any(
                    r.in_scheduler and not r.done.is_set() for r in self._requests.values()
                )
            if waiting and not self._inbox and not self._cancel_inbox:
                idle_misses += 1
                if idle_misses > 3:
                    self._fail_all(
                        RuntimeError("scheduler returned no plan while requests are unfinished"),
                        fatal=True,
                    )
                    return
                continue
            self._wakeup.wait(0.05)
            self._wakeup.clear()

    def _step(self) -> bool:
        """Run one scheduler step; False when there was nothing to do."""
        with self._step_lock:
            if self._closed:
                raise EngineClosedError("engine is closed")
            changed = self._drain_inboxes()
            plan = self.scheduler.schedule()
            if plan is None:
                return changed
            t0 = time.perf_counter()
            if self._first_step is None:
                self._first_step = t0
            logits = self.runner.execute(plan)
            rids = list(plan.request_ids)
            rows = np.asarray(plan.logits_rows).tolist()
            states = []
            for r in rows:
                req = self._requests[rids[r]]
                states.append(req.sstate)
            result = self.sampler(logits, states)
            tokens = result.token_ids.numpy().astype(np.int32)
            step_out = self.scheduler.update(tokens)
            now = time.perf_counter()
            lp_by_rid: dict[str, dict[int, float]] = {}
            if result.logprobs is not None:
                for r, lp in zip(rows, result.logprobs, strict=True):
                    if lp is not None:
                        lp_by_rid[rids[r]] = lp
            self._route(step_out, lp_by_rid, now)
            self._stats["steps"] += 1
            self._stats["step_tokens"] += len(plan.input_ids)
            self._busy_time += time.perf_counter() - t0
            return True

    def _drain_inboxes(self) -> bool:
        changed = False
        while self._inbox:
            req = self._inbox.popleft()
            if req.done.is_set():
                continue
            try:
                self.scheduler.add_request(
                    req.request_id,
                    req.prompt_ids,
                    req.params.max_new_tokens,
                    eos_token_ids=req.eos_token_ids,
                    stop_token_ids=list(req.params.stop_token_ids),
                )
            except (ValueError, KeyError, TypeError) as exc:  # this request only
                self._finish_error(req, exc)
                continue
            req.in_scheduler = True
            self._stats["prompt_tokens"] += len(req.prompt_ids)
            changed = True
        while self._cancel_inbox:
            rid = self._cancel_inbox.popleft()
            req = self._requests.get(rid)
            if req is None or req.done.is_set():
                continue
            if req.in_scheduler:
                self.scheduler.cancel(rid)
            self._finish(req, "cancelled", [], None, time.perf_counter())
            changed = True
        return changed

    def _route(self, step_out: Any, lp_by_rid: dict[str, dict[int, float]], now: float) -> None:
        """Hand each request its delta; the common case (one token, no streaming, no stop
        string, no logprobs) touches only plain lists."""
        bulk = hasattr(step_out, "token_ids") and hasattr(step_out, "request_ids")
        if not bulk:  # any iterable of deltas (request_id, new_token_ids, finished, ...)
            for d in step_out:
                reason = d.finish_reason if d.finished else None
                if d.finished and reason not in _FINISH_REASONS:
                    reason = "stop"
                self._route_one(
                    d.request_id, [int(t) for t in d.new_token_ids], reason, lp_by_rid, now
                )
            return
        rids = step_out.request_ids
        toks = step_out.token_ids.tolist()
        finished = step_out.finished.tolist() if getattr(step_out, "num_finished", 1) else None
        reasons = step_out.finish_reasons if finished is not None else None
        requests = self._requests
        generated = 0
        for i, rid in enumerate(rids):
            t = toks[i]
            reason = None
            if finished is not None and finished[i]:
                reason = reasons[i] if reasons[i] in _FINISH_REASONS else "stop"
            req = requests.get(rid)
            if req is None or req.done.is_set():
                continue  # already finished here (stop string, cancel)
            if (
                reason is None
                and t >= 0
                and req.listener is None
                and not req.detok.incremental
                and req.output.logprobs is None
            ):
                req.sstate.output_ids.append(t)
                out = req.output
                out.token_ids.append(t)
                dt = now - req.arrival
                if out.ttft is None:
                    out.ttft = dt
                out.token_times.append(dt)
                req.detok.add((t,))
                generated += 1
                continue
            self._deliver(req, [t] if t >= 0 else [], reason, lp_by_rid.get(rid), now)
        self._stats["generated_tokens"] += generated

    def _route_one(
        self,
        rid: str,
        new: list[int],
        reason: str | None,
        lp_by_rid: dict[str, dict[int, float]],
        now: float,
    ) -> None:
        req = self._requests.get(rid)
        if req is None or req.done.is_set():
            return
        self._deliver(req, new, reason, lp_by_rid.get(rid), now)

    def _deliver(
        self,
        req: _Request,
        new: list[int],
        reason: str | None,
        lp: dict[int, float] | None,
        now: float,
    ) -> None:
        out = req.output
        if new:
            req.sstate.output_ids.extend(new)
            out.token_ids.extend(new)
            t = now - req.arrival
            if out.ttft is None:
                out.ttft = t
            out.token_times.extend([t] * len(new))
            if out.logprobs is not None:
                out.logprobs.extend([lp or {}] * len(new))
            self._stats["generated_tokens"] += len(new)
        text = req.detok.add(new) if new else ""
        if req.detok.stopped and reason != "stop":
            # a stop string: end it here; the scheduler must not run it again
            if reason is None:
                self.scheduler.cancel(req.request_id)
            reason = "stop"
        if reason is not None:
            self._finish(req, reason, new, lp, now, text_so_far=text)
            return
        if req.listener is not None and (new or text):
            req.listener(self._delta(req, new, text, None, lp))

    def _finish(
        self,
        req: _Request,
        reason: str,
        new: list[int],
        lp: dict[int, float] | None,
        now: float,
        *,
        text_so_far: str = "",
    ) -> None:
        text = text_so_far + req.detok.finish()
        req.output.text = req.detok.text
        req.output.finish_reason = reason
        req.output.finished = True
        self._stats["finished_requests"] += 1
        if req.listener is not None:
            req.listener(self._delta(req, new, text, reason, lp))
        self._done(req)

    def _done(self, req: _Request) -> None:
        with self._table_lock:
            req.done.set()
            if not req.keep and self._requests.get(req.request_id) is req:
                del self._requests[req.request_id]

    def _delta(
        self,
        req: _Request,
        new: list[int],
        text: str,
        reason: str | None,
        lp: dict[int, float] | None,
    ) -> RequestOutput:
        n = len(new)
        out = req.output
        return RequestOutput(
            request_id=req.request_id,
            prompt_token_ids=req.prompt_ids,
            token_ids=list(new),
            text=text,
            finish_reason=reason,
            finished=reason is not None,
            logprobs=(list(out.logprobs[-n:]) if n else []) if out.logprobs is not None else None,
            ttft=out.ttft,
            token_times=list(out.token_times[-n:]) if n else [],
            prompt=req.prompt_text,
        )

    def _finish_error(self, req: _Request, exc: BaseException) -> None:
        req.error = exc
        if req.listener is not None:
            req.listener(exc)
        self._done(req)

    def _fail_all(self, exc: BaseException, *, fatal: bool = False) -> None:
        if fatal:
            self._error = exc
        with self._table_lock:
            reqs = [r for r in self._requests.values() if not r.done.is_set()]
        for r in reqs:
            self._finish_error(r, exc)


# ---------------------------------------------------------------------- helpers


def _as_prompt_list(prompts: Any) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, torch.Tensor | np.ndarray):
        prompts = prompts.tolist()
    prompts = list(prompts)
    if prompts and all(isinstance(p, int | np.integer) for p in prompts):
        return [prompts]
    return prompts


def _as_id_list(prompt: Any) -> list[int]:
    if isinstance(prompt, torch.Tensor | np.ndarray):
        prompt = prompt.tolist()
    try:
        ids = list(prompt)
    except TypeError:
        raise ValueError(
            f"prompt must be a string or a list of token ids, got {prompt!r}"
        ) from None
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, int | np.integer):
            raise ValueError(f"prompt: token ids must be integers, got {t!r}")
    return [int(t) for t in ids]


def _eos_ids(model: Any, tokenizer: Any) -> list[int]:
    gc = getattr(model, "generation_config", None)
    eos = getattr(gc, "eos_token_id", None) if gc is not None else None
    if eos is None:
        eos = getattr(model.config, "eos_token_id", None)
    if eos is None and tokenizer is not None:
        eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        return []
    if isinstance(eos, int):
        return [eos]
    return [int(e) for e in eos]


def _chunk_bytes(tcfg: Any, page_size: int, dtype: torch.dtype) -> int:
    """Bytes of one chunk across all layers (K and V)."""
    heads = int(tcfg.num_attention_heads)
    kv_heads = int(getattr(tcfg, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(tcfg, "head_dim", None) or tcfg.hidden_size // heads)
    layers = int(tcfg.num_hidden_layers)
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * layers * page_size * kv_heads * head_dim * elem


def _choose_num_blocks(engine: Engine, model: Any) -> tuple[int, str]:
    from ferrobatch import memory

    return memory.choose_num_blocks(
        model,
        config=engine.config,
        device=engine.device,
        dtype=engine.dtype,
        max_model_len=engine.max_model_len,
    )
