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
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

import torch

from ferrobatch.attention.rope import LongRope
from ferrobatch.config import ContinuousBatchingConfig
from ferrobatch.engine import memory
from ferrobatch.engine.outputs import RequestOutput
from ferrobatch.engine.pipeline import AsyncStepper
from ferrobatch.engine.request import (
    Listener,
    Prompt,
    Request,
    as_prompt_list,
    make_request,
    sampling_list,
)
from ferrobatch.engine.routing import OutputRouter
from ferrobatch.engine.stepper import Stepper, model_lock
from ferrobatch.errors import EngineClosedError, FieldError, QueueFullError
from ferrobatch.sampling.guided import GuideFactory
from ferrobatch.sampling.params import SamplingParams
from ferrobatch.sampling.sampler import Sampler

__all__ = ["Engine", "Listener", "Prompt"]

logger = logging.getLogger("ferrobatch")


class Engine:
    """Continuous-batching inference over a Hugging Face causal LM.

    `model` is a path, a loaded `PreTrainedModel`, or None for the bundled
    SmolLM2-135M-Instruct. `config` is a ferrobatch or transformers
    `ContinuousBatchingConfig` (never mutated). The caller's model, model config and
    generation config are left as they were.

    `dtype` (a path or the bundled model; a loaded model keeps its own and a different
    request is warned about, never applied): None = float32 on CPU (greedy output equal to
    `model.generate` in fp32), "auto" = bf16 on CPUs with native bf16 for checkpoints stored
    in half precision (`models.resolve_dtype`), or "float32" / "bfloat16" / "float16" / a
    `torch.dtype`. On CPU a bf16 / fp16 model runs its linear layers on weights packed once
    for the matrix units, with fp32 activations between them (`ferrobatch.runner.cpu_linear`).
    """

    def __init__(
        self,
        model: Any = None,
        *,
        config: Any = None,
        tokenizer: Any = None,
        device: str | torch.device | None = None,
        dtype: torch.dtype | str | None = None,
        seed: int | None = None,
    ) -> None:
        from ferrobatch import models
        from ferrobatch.runner.model_runner import ModelRunner

        self.config = ContinuousBatchingConfig.coerce(config)
        loaded, loaded_tok = models.load_model(model, device=device, dtype=dtype)
        self.model = loaded
        if isinstance(tokenizer, str):
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(tokenizer)
        self.tokenizer = tokenizer if tokenizer is not None else loaded_tok
        # A loaded model is never moved or converted (`load_model` says so when device/dtype
        # differ), so the cache follows the model: a cache in another dtype would silently
        # round every key and value, one on another device could not be read at all.
        param = next(loaded.parameters())
        self.device = param.device
        self.dtype = param.dtype
        _note_spinning_threads(self.device)

        tcfg = self._read_model_config(loaded)
        _check_architecture(loaded, tcfg)
        # rope factors that transformers takes from the whole forward, made per request
        self.rope = LongRope.of(loaded, self.max_model_len)
        use_cuda_graph = self.config.use_cuda_graph  # None: on with CUDA + a kernel backend
        if self.rope is not None:
            logger.info(
                "ferrobatch: %s uses longrope (short/long factors at %d tokens): per-request "
                "factors, recompute on crossing=%s, no prefix caching, no CUDA graphs",
                type(loaded).__name__, self.rope.threshold, self.rope.recompute,
            )
            use_cuda_graph = False
        self._size_cache(loaded, tcfg)
        self.runner = ModelRunner(
            loaded,
            num_blocks=self.num_blocks,
            page_size=self.config.page_size,
            cpu_offload_blocks=self.cpu_offload_blocks,
            device=self.device,
            dtype=self.dtype,
            use_cuda_graph=use_cuda_graph,
            config=self.config,
        )
        self.runner.rope = self.rope
        self.scheduler = self._build_scheduler()
        try:
            self._probe_model()
        except BaseException:
            self.runner.close()
            raise
        self.sampler = Sampler(self.device, seed=seed)

        self._stats: collections.Counter[str] = collections.Counter()
        self._router = OutputRouter(self.scheduler, self._stats)
        self._requests = self._router.requests  # live requests by id (the router's table)
        self._table_lock = self._router.lock  # guards _requests
        self.async_batching = self._resolve_async_batching()
        self._stepper: Stepper
        if self.async_batching:
            self._stepper = AsyncStepper(self.scheduler, self.runner, self.sampler, self._router,
                                         self._stats, device=self.device)  # fmt: skip
        else:
            self._stepper = Stepper(self.scheduler, self.runner, self.sampler, self._router,
                                    self._stats)  # fmt: skip
        self._step_lock = threading.RLock()  # one stepper at a time; guards the scheduler
        self._wakeup = threading.Event()
        self._thread: threading.Thread | None = None
        self._stop_loop = False
        self._closed = False
        self._error: BaseException | None = None
        self._ids = itertools.count()

    # ------------------------------------------------------------------ construction

    def _read_model_config(self, loaded: Any) -> Any:
        """Name, context, vocabulary, EOS ids and layer types; returns the text config."""
        from ferrobatch import models

        mcfg = loaded.config
        tcfg = mcfg.get_text_config() if hasattr(mcfg, "get_text_config") else mcfg
        self.model_name = str(
            getattr(mcfg, "_name_or_path", "") or getattr(mcfg, "model_type", "model")
        )
        self.max_model_len = int(getattr(tcfg, "max_position_embeddings", 0) or 1 << 30)
        self.vocab_size = int(tcfg.vocab_size)
        self.eos_token_ids = _eos_ids(loaded, self.tokenizer)
        # grammar matchers of guided requests (json_schema / regex / grammar)
        self.guides = GuideFactory(self.tokenizer, self.vocab_size, self.eos_token_ids)
        # what the forward does, not what the config declares (`models.attention_layout`)
        self.layer_types = list(models.layer_types_of(loaded))
        self.sliding_window = models.sliding_window_of(loaded)
        self.default_max_new_tokens = 128
        self.generation_defaults = _generation_defaults(loaded)
        return tcfg

    def _resolve_async_batching(self) -> bool:
        """`use_async_batching`: True → the async pipeline on any device (on CPU it runs
        step after step, for testing); False → synchronous steps; None → on with CUDA
        graphs on CUDA (the pipeline hides the host's planning behind the device's work,
        which only pays once graph replays make the device side short), else off."""
        want = self.config.use_async_batching
        graphs = bool(getattr(self.runner, "use_cuda_graph", False))
        if want is None:
            on = self.device.type == "cuda" and graphs
            why = "auto: " + (
                "CUDA with CUDA graphs" if on
                else "CUDA graphs are off" if self.device.type == "cuda"
                else f"off on {self.device.type}"
            )
        else:
            on = bool(want)
            why = f"use_async_batching={want}"
        # Off on CUDA by default only because graphs are off: a downgrade, said loudly (the
        # runner's graph_stats()["off_reason"] says why graphs are off).
        downgrade = want is None and self.device.type == "cuda" and not on
        (logger.warning if downgrade else logger.info)(
            "ferrobatch: async batching %s (%s)", "on" if on else "off", why)
        return on

    def _size_cache(self, loaded: Any, tcfg: Any) -> None:
        """`num_blocks` (given, or sized from free memory) and the CPU swap slots."""
        cfg = self.config
        self.chunk_bytes = memory.kv_bytes_per_chunk(tcfg, cfg.page_size, self.dtype)
        self.memory_explanation = ""
        num_blocks = cfg.num_blocks
        if num_blocks is None:
            num_blocks, self.memory_explanation = memory.choose_num_blocks(
                loaded,
                config=cfg,
                device=self.device,
                dtype=self.dtype,
                max_model_len=self.max_model_len,
            )
            logger.info("ferrobatch cache: %s", self.memory_explanation)
        self.num_blocks = int(num_blocks)
        self.cpu_offload_blocks = (
            int(cfg.cpu_offload_space * (1 << 30)) // self.chunk_bytes
            if cfg.cpu_offload_space > 0
            else 0
        )

    def _probe_model(self) -> None:
        """Check at construction that the paged path computes what the model computes.

        1. A short prompt and one decode step through the paged path (a scratch scheduler
           over the same cache), compared with the model's own forward: a model whose
           attention does not go through transformers' attention interface, or goes through
           it with something the paged attention ignores, fails here.
        2. A packed step (`_probe_packed`): several requests of different lengths in one
           batch, one of them a chunked prefill, then decode steps side by side, each
           compared with the same request run alone through the same runner: a model that
           derives something from the whole forward (the batch, the step's length, the
           cache) fails here instead of answering differently next to other requests.

        Failures raise `NotImplementedError`. The chunks the probe writes are rewritten
        before any real request reads them.
        """
        self.probe_relative_error: float | None = None
        self.probe_packed_error: float | None = None
        try:
            # another engine on the same model must not switch its attention meanwhile
            with model_lock(self.model):
                self._probe_own_forward()
                self._probe_packed()
        except NotImplementedError:
            raise
        except Exception as exc:
            raise NotImplementedError(
                f"{type(self.model).__name__} cannot run through ferrobatch's paged attention: "
                f"the probe forward failed with {type(exc).__name__}: {exc}"
            ) from exc

    def _half_precision(self) -> bool:
        """Whether the runner's products round to half precision (a bf16 / fp16 model or
        cache, or linears run in half precision by the runner)."""
        half = (torch.float16, torch.bfloat16)
        act = getattr(self.runner, "activation_dtype", None)
        return (
            self.runner.cache.keys[0].dtype in half
            or next(self.model.parameters()).dtype in half
            or act in half
        )

    def _probe_tolerance(self) -> float:
        # fp32 agrees to ~1e-6 on CPU (TF32 matmuls on CUDA: ~1e-3); half precision only
        # rounds differently (bf16 SmolLM2: ~0.016), so there only a gross error is refused.
        if self._half_precision():
            return 0.25
        return 2e-3 if self.device.type == "cpu" else 1e-2

    def _probe_drive(
        self, prompts: dict[str, list[int]], decodes: int, max_batch_tokens: int
    ) -> dict[str, list[torch.Tensor]] | None:
        """Run `prompts` together through a scratch scheduler (`max_batch_tokens` per step)
        and the runner, feeding each request fixed tokens (not its samples, so two runs see
        the same inputs whatever their logits); returns each request's `decodes + 1`
        sampled logits (fp32, CPU), or None when the cache cannot hold them."""
        scratch = self._build_scheduler(max_batch_tokens=max_batch_tokens)
        try:
            for rid, p in prompts.items():
                scratch.add_request(rid, p, decodes + 1)
        except ValueError:
            return None
        got: dict[str, list[torch.Tensor]] = {rid: [] for rid in prompts}
        rope = self.rope
        for rid, p in prompts.items():
            if rope is not None:
                rope.add(rid, len(p))
        try:
            for _ in range(64 * (decodes + 1) * len(prompts)):
                plan = scratch.schedule()
                if plan is None:
                    break
                logits = self.runner.execute(plan)
                rids = list(plan.request_ids)
                tokens = []
                for i, row in enumerate(plan.logits_rows):
                    rid = rids[int(row)]
                    got[rid].append(logits[i].detach().float().cpu())
                    tokens.append((13 * len(got[rid]) + 7 * len(rid) + 5) % self.vocab_size)
                out = scratch.update(tokens)
                if rope is not None:
                    rope.after_update(scratch, plan, out.finished_request_ids)
        finally:
            if rope is not None:
                for rid in prompts:
                    rope.forget(rid)
        if any(len(v) != decodes + 1 for v in got.values()):
            return None
        return got

    def _probe_own_forward(self) -> None:
        """Probe 1 (see `_probe_model`)."""
        from ferrobatch.runner.patches import eval_mode

        name = type(self.model).__name__
        n = max(2, min(12, self.max_model_len - 3, self.num_blocks * self.config.page_size - 1))
        prompt = [(7 * i + 3) % self.vocab_size for i in range(n)]
        scratch = self._build_scheduler()
        try:
            scratch.add_request("ferrobatch-probe", prompt, 2)
        except ValueError:
            return  # a cache too small for even the probe: requests will be refused anyway
        got: list[torch.Tensor] = []
        tokens = list(prompt)
        while len(got) < 2:
            plan = scratch.schedule()
            if plan is None:
                break
            logits = self.runner.execute(plan)
            if len(plan.logits_indices):
                got.append(logits[-1].detach().float().cpu())
                tokens.append(int(logits[-1].argmax()))
            scratch.update([int(logits[i].argmax()) for i in range(len(plan.logits_indices))])
        with torch.inference_mode(), eval_mode(self.model):
            ids = torch.tensor([tokens[: n + 1]], device=self.device)
            ref = self.model(input_ids=ids, use_cache=False).logits[0, n - 1 :]
        ref = ref.detach().float().cpu()
        if len(got) != 2 or ref.shape[0] != 2:
            return
        out = torch.stack(got)
        tol = self._probe_tolerance()
        err = float((out - ref).norm() / ref.norm().clamp_min(1e-6))
        self.probe_relative_error = err
        if not err <= tol:
            raise NotImplementedError(
                f"{name}: logits through ferrobatch's paged attention differ from the model's "
                f"own forward (relative error {err:.2g} > {tol}); this architecture uses "
                "attention features the paged attention does not implement"
            )
        if self._half_precision() and err > 0.05:
            logger.warning(
                "ferrobatch: %s logits through the paged attention differ from the model's own "
                "forward by %.2g (relative); expected rounding in half precision is smaller",
                name,
                err,
            )

    def _probe_lengths(self) -> list[int]:
        """Prompt lengths of the packed probe: short and page-crossing ones, plus lengths
        on both sides of every length the model's config names (sliding window, attention
        chunk, rope switch: `_config_lengths`) when small enough to run at construction;
        all within the context and the cache."""
        page = self.config.page_size
        lengths = [3, 9, page + 5]
        small = 4 * page + 8
        for v in _config_lengths(self.model.config):
            if v + 3 <= small:
                lengths += [v - 2, v + 3]
        room = min(self.max_model_len - 6, self.num_blocks * page // 2 - 6)
        return sorted({max(1, min(n, room)) for n in lengths})

    def _probe_packed(self) -> None:
        """Probe 2 (see `_probe_model`): the lengths of `_probe_lengths`, 4 decode steps
        each, packed with a token budget that chunks the longest prompt, against each
        request alone (one prefill step, then its decodes)."""
        name = type(self.model).__name__
        lengths = self._probe_lengths()
        if len(lengths) < 2:
            return
        decodes = 4
        prompts = {
            f"ferrobatch-probe-{i}": [(11 * j + 17 * i + 3) % self.vocab_size for j in range(n)]
            for i, n in enumerate(lengths)
        }
        longest = max(lengths)
        budget = max(len(lengths) + 1, sum(lengths[:-1]) + max(1, longest // 3))
        packed = self._probe_drive(prompts, decodes, budget)
        if packed is None:
            return
        err = 0.0
        worst = ""
        for rid, p in prompts.items():
            alone = self._probe_drive({rid: p}, decodes, len(p) + 1)
            if alone is None:
                return
            a, b = torch.stack(packed[rid]), torch.stack(alone[rid])
            e = float((a - b).norm() / b.norm().clamp_min(1e-6))
            if e > err:
                err, worst = e, f"{len(p)}-token prompt"
        self.probe_packed_error = err
        tol = self._probe_tolerance()
        if not err <= tol:
            raise NotImplementedError(
                f"{name}: a request's logits in a packed step (next to requests of other "
                f"lengths, with a chunked prefill) differ from the same request run alone "
                f"(relative error {err:.2g} > {tol}, {worst}); the model derives something "
                "from the whole forward (the batch, the step's length or the cache) that "
                "ferrobatch does not make per request"
            )

    def _build_scheduler(self, max_batch_tokens: int | None = None) -> Any:
        from ferrobatch.core import Scheduler

        cfg = self.config
        return Scheduler(
            self.num_blocks,
            cfg.page_size,
            max_batch_tokens or cfg.max_batch_tokens,
            max_requests_per_batch=cfg.max_requests_per_batch,
            scheduler_type=cfg.scheduler_type,
            safety_margin=cfg.resolved_safety_margin,
            # a longrope request's keys depend on its length, not on its tokens alone
            allow_block_sharing=cfg.allow_block_sharing and self.rope is None,
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
        plist = as_prompt_list(prompts)
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
        if getattr(self.tokenizer, "chat_template", None) is None and not kwargs.get(
            "chat_template"
        ):
            raise ValueError(
                "chat: the tokenizer has no chat template; pass token ids to generate(), or "
                "a template as chat_template_kwargs={'chat_template': ...}"
            )
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
        self._stepper.cancel_inbox.append(request_id)
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
        self, req: Request, q: queue.SimpleQueue[RequestOutput | BaseException]
    ) -> Iterator[RequestOutput]:
        sub = _Subscription(self, req)
        try:
            while not sub.finished:
                try:
                    item = q.get(timeout=0.5)
                except queue.Empty:
                    self._raise_if_dead(req)
                    continue
                yield sub.take(item)
        finally:
            sub.close()

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

    async def _astream_gen(self, req: Request) -> AsyncIterator[RequestOutput]:
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
        sub = _Subscription(self, req)
        try:
            while not sub.finished:
                item = await _get_or_none(aq, 0.5)
                if item is None:
                    self._raise_if_dead(req)
                    continue
                yield sub.take(item)
        finally:
            sub.close()

    def check_request(self, prompt: Prompt, sampling: Any = None) -> list[int]:
        """Validate a request without running it; returns its prompt token ids.

        Raises the same `ValueError`s (naming the field) that `generate`, `add_request`,
        `stream` and `astream` raise.
        """
        sp = self._params_list(sampling, 1, None)[0]
        return self._make_request(prompt, sp, "check").prompt_ids

    @property
    def max_request_tokens(self) -> int:
        """The largest `prompt + max_new_tokens` the cache can ever hold for one request (the
        scheduler's rule, `Scheduler.max_request_tokens`; the model's context,
        `max_model_len`, is a limit of its own)."""
        return self.scheduler.max_request_tokens()

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
            try:
                self._stepper.close()  # the async pipeline's step in flight
            except Exception:  # a dead device: nothing left to wait for
                logger.exception("ferrobatch: dropping the step in flight failed")
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
            sched_stats = self.scheduler.stats()
        out.update(sched_stats)
        gen = self._stats["generated_tokens"]
        busy = self._stepper.busy_time
        out.update(
            steps=self._stats["steps"],
            generated_tokens=gen,
            submitted_prompt_tokens=self._stats["prompt_tokens"],
            finished_requests=self._stats["finished_requests"],
            busy_time_s=busy,
            async_batching=self.async_batching,
            ahead_steps=self._stats["ahead_steps"],
            pipeline_drains=self._stats["pipeline_drains"],
            stall_drains=self._stats["stall_drains"],
            swap_drains=self._stats["swap_drains"],
            throughput_tok_s=gen / busy if busy > 0 else 0.0,
            page_size=self.config.page_size,
            running_requests=sum(1 for r in list(self._requests.values()) if not r.done.is_set()),
        )
        graph_stats = getattr(self.runner, "graph_stats", None)
        if graph_stats is not None:
            out["cuda_graphs"] = graph_stats()
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
        return sampling_list(sampling, n, max_new_tokens, self.generation_defaults)

    def _make_request(
        self, prompt: Prompt, sp: SamplingParams, request_id: str | None, **kwargs: Any
    ) -> Request:
        return make_request(self, prompt, sp, request_id, self._new_request_id, **kwargs)

    def _new_request_id(self) -> str:
        return f"req-{next(self._ids)}-{uuid.uuid4().hex[:8]}"

    def _submit(self, req: Request, *, bounded: bool = True) -> None:
        if self._closed:
            raise EngineClosedError("engine is closed")
        if self._error is not None:
            raise RuntimeError("the engine loop died earlier") from self._error
        with self._table_lock:
            if req.request_id in self._requests:
                raise FieldError(f"request_id {req.request_id!r} is already in use", "request_id")
            limit = self.config.max_queue_size
            busy = sum(not r.done.is_set() for r in self._requests.values()) if limit else 0
            if bounded and limit and busy >= limit:
                raise QueueFullError(
                    f"max_queue_size={limit} unfinished requests are already queued or running"
                )
            self._requests[req.request_id] = req
        self._stepper.inbox.append(req)
        self._wakeup.set()

    def _run_batch(self, reqs: list[Request], *, progress: bool, desc: str) -> list[RequestOutput]:
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
            if not background:
                # an ahead plan still in flight holds the finished requests' chunks until
                # its update: finish it, so the engine is idle when generate returns
                for _ in range(4):  # at most two plans are outstanding
                    if not self.scheduler.num_outstanding or self._router.unfinished():
                        break
                    self._drive_once()
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

    def _forget(self, req: Request) -> None:
        self._router.forget(req)

    def _raise_if_dead(self, req: Request) -> None:
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
            waiting = self._router.unfinished()
            if waiting and not self._stepper.has_mail():
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
            if waiting and not self._stepper.has_mail():
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
            return self._stepper.step()

    def _fail_all(self, exc: BaseException, *, fatal: bool = False) -> None:
        if fatal:
            self._error = exc
        self._router.fail_all(exc)


class _Subscription:
    """A caller's side of a streamed request: takes its deltas and, if the caller stops
    early, cancels it; the request leaves the table when both sides are done."""

    def __init__(self, engine: Engine, req: Request) -> None:
        self.engine = engine
        self.req = req
        self.finished = False

    def take(self, item: RequestOutput | BaseException) -> RequestOutput:
        """The delta, or raise the request's error."""
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        self.finished = item.finished
        return item

    def close(self) -> None:
        """Cancel the request unless it finished; forget it."""
        if not self.finished:
            self.engine.cancel(self.req.request_id)
        self.engine._forget(self.req)


# ---------------------------------------------------------------------- helpers


async def _get_or_none(aq: asyncio.Queue[Any], timeout: float) -> Any:
    """The next item of `aq`, or None after `timeout` seconds.

    Not `asyncio.wait_for`: before Python 3.12 it swallows a cancellation of the caller
    that arrives just as the item does (the queue is busy while tokens stream), so a
    cancelled `astream` task would keep streaming its request to the end."""
    if not aq.empty():
        return aq.get_nowait()
    getter = asyncio.ensure_future(aq.get())
    try:
        done, _ = await asyncio.wait((getter,), timeout=timeout)
    finally:
        if not getter.done():
            getter.cancel()
    return getter.result() if done else None


_LENGTH_KEYS = ("sliding_window", "attention_chunk_size", "original_max_position_embeddings",
                "window_size", "local_window_size")


def _config_lengths(config: Any) -> set[int]:
    """Sequence lengths a model's config names (windows, chunks, rope switch points), in the
    config, its text config and their rope parameters (per layer type too)."""
    out: set[int] = set()
    cfgs = [config]
    getter = getattr(config, "get_text_config", None)
    if getter is not None:
        cfgs.append(getter())
    dicts: list[dict[str, Any]] = []
    for cfg in cfgs:
        dicts.append({k: getattr(cfg, k, None) for k in _LENGTH_KEYS})
        rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None)
        if isinstance(rope, dict):
            dicts.append(rope)
            dicts.extend(v for v in rope.values() if isinstance(v, dict))
    for d in dicts:
        for k in _LENGTH_KEYS:
            v = d.get(k)
            if isinstance(v, int) and not isinstance(v, bool) and v > 2:
                out.add(v)
    return out


def _generation_defaults(model: Any) -> SamplingParams | None:
    """What `sampling=None` means: the model's own `generation_config` (as `model.generate`
    and vLLM apply it): its do_sample / temperature / top_k / top_p / min_p /
    repetition_penalty / max_new_tokens, transformers' defaults for what it leaves unset,
    except the length, which stays the engine's default unless the config sets
    `max_new_tokens`. Fields ferrobatch cannot honour are named in a warning and left out.
    None when the model has no generation config (greedy)."""
    gc = getattr(model, "generation_config", None)
    if gc is None:
        return None
    return SamplingParams.from_generation_config(gc, unsupported="warn", lengths=False)


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


def _check_architecture(model: Any, tcfg: Any) -> None:
    """Refuse, with a clear error, models the paged attention cannot run."""
    name = type(model).__name__
    if not getattr(model, "_supports_attention_backend", False):
        raise NotImplementedError(
            f"{name} does not dispatch attention through transformers' AttentionInterface "
            "(_supports_attention_backend is False); ferrobatch cannot run it"
        )
    if getattr(tcfg, "kv_lora_rank", None):
        raise NotImplementedError(
            f"{name} uses multi-head latent attention (kv_lora_rank): keys and values of "
            "different head sizes are not supported by ferrobatch's paged cache"
        )
    # Attention sinks (GPT-OSS) run on the SDPA path (the runner routes them there).
    for m in model.modules():
        if getattr(m, "attn_temperature_tuning", False) and not getattr(m, "use_rope", True):
            raise NotImplementedError(
                f"{name} uses attention temperature tuning on its no-rope layers (Llama-4): the "
                "layer computes its positions from the cache length inside its forward, which "
                "in a packed step are not each request's positions; not supported"
            )
    from ferrobatch.models import attention_layout

    layout = attention_layout(model)
    shapes = layout.shapes
    if layout.recorded and len(set(shapes)) > 1:
        per_layer = ", ".join(f"layer {i}: {kv} KV heads x {d}" for i, (_, kv, d, _) in
                              enumerate(shapes))
        raise NotImplementedError(
            f"{name} has per-layer KV shapes ({per_layer}): ferrobatch's paged cache holds "
            "one KV shape for every layer"
        )
    if layout.recorded and shapes and shapes[0][2] != shapes[0][3]:
        raise NotImplementedError(
            f"{name}: keys and values of different head sizes ({shapes[0][2]} and "
            f"{shapes[0][3]}) are not supported by ferrobatch's paged cache"
        )
    heads = int(getattr(tcfg, "num_attention_heads", 0) or 0)
    kv = int(getattr(tcfg, "num_key_value_heads", None) or heads)
    hd = int(getattr(tcfg, "head_dim", None) or (tcfg.hidden_size // heads if heads else 0))
    if layout.recorded and shapes and shapes[0][1:3] != (kv, hd):
        raise NotImplementedError(
            f"{name}: its attention layers get {shapes[0][1]} KV heads of size {shapes[0][2]} "
            f"(grouped or repeated KV heads), not the config's num_key_value_heads={kv} x "
            f"head_dim={hd} ferrobatch's paged cache is built with; not supported"
        )


_SPIN_NOTED = False


def _note_spinning_threads(device: torch.device) -> None:
    """Warn once when torch's OpenMP threads spin-wait (torch imported before ferrobatch
    with no OMP_WAIT_POLICY): steps then stall whenever other work shares the cores."""
    global _SPIN_NOTED
    import ferrobatch

    if _SPIN_NOTED or device.type != "cpu" or not ferrobatch.OPENMP_SPINS:
        return
    if torch.get_num_threads() > 1:
        _SPIN_NOTED = True
        logger.warning(
            "ferrobatch: torch was imported before ferrobatch, so its %d OpenMP threads "
            "spin while they wait; on a busy machine steps can take many times longer. Set "
            "OMP_WAIT_POLICY=PASSIVE before importing torch (or import ferrobatch first), or "
            "use torch.set_num_threads(1).", torch.get_num_threads())

