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
import gc
import itertools
import logging
import os
import queue
import threading
import time
import uuid
import weakref
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from tqdm.auto import tqdm
from transformers import AutoTokenizer

from ferrobatch import models
from ferrobatch.attention.rope import LongRope
from ferrobatch.config import ContinuousBatchingConfig
from ferrobatch.core import Scheduler
from ferrobatch.cpu import f32_ops, pages
from ferrobatch.cpu.threads import ThreadGovernor
from ferrobatch.distributed import setup as tp_setup
from ferrobatch.distributed import shard as tp_shard
from ferrobatch.engine import embedding, memory
from ferrobatch.engine.model_checks import check_architecture, eos_ids, generation_defaults
from ferrobatch.engine.outputs import EmbeddingOutput, RequestOutput
from ferrobatch.engine.pipeline import AsyncStepper
from ferrobatch.engine.probes import ModelProbes
from ferrobatch.engine.request import (
    Listener,
    Prompt,
    Request,
    as_prompt_list,
    make_request,
    sampling_list,
)
from ferrobatch.engine.routing import OutputRouter
from ferrobatch.engine.stepper import Stepper
from ferrobatch.errors import EngineClosedError, FieldError, QueueFullError
from ferrobatch.gguf import modules as quant_modules
from ferrobatch.gguf import narrow_read
from ferrobatch.gguf import source as gguf_source
from ferrobatch.lora.manager import LoraManager
from ferrobatch.model_config import text_config
from ferrobatch.model_dtype import resolve_dtype
from ferrobatch.runner import panel_weights
from ferrobatch.runner.model_runner import ModelRunner
from ferrobatch.sampling.guided import GuideFactory
from ferrobatch.sampling.params import SamplingParams
from ferrobatch.sampling.sampler import Sampler
from ferrobatch.spec.config import SpeculativeConfig
from ferrobatch.spec.setup import build_controller

if TYPE_CHECKING:
    from transformers import GenerationConfig

    from ferrobatch.spec.controller import SpecController

    # what `sampling=` accepts (`coerce_sampling`); a list: one per prompt
    SamplingLike = (
        SamplingParams | GenerationConfig | dict[str, Any] | Sequence[SamplingParams] | None
    )

__all__ = ["Engine", "Listener", "Prompt"]

logger = logging.getLogger("ferrobatch")


class Engine(ModelProbes):
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

    A GGUF file (or a directory holding exactly one) loads with its matrices kept
    quantized (`ferrobatch.gguf`); `quantization` ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1",
    "q4_k", "q5_k", "q6_k"; a checkpoint path or the bundled model, CPU) quantizes a float
    checkpoint's linears on load.

    `tensor_parallel_size` (a checkpoint path, a GGUF file or the bundled model): shard the
    model over that many ranks with its transformers tensor-parallel plan (quantized
    weights: `distributed.quant_shard`; `ferrobatch.distributed`:
    worker processes started here, or the ranks of a ``torchrun`` launch; gloo on CPU, NCCL
    on CUDA); `FieldError` (field ``tensor_parallel_size``) where it cannot be sharded.

    `batch_invariant` (overrides the config's field of that name; None keeps it): each
    request's tokens and logprobs are bit-identical whatever else shares its steps (see
    `ContinuousBatchingConfig.batch_invariant`); `FieldError` (field ``batch_invariant``)
    where that cannot hold (off the CPU, sliding-window layers, tensor parallelism).
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
        tensor_parallel_size: int = 1,
        speculative_config: Any = None,
        quantization: str | None = None,
        lora_modules: dict[str, str] | None = None,
        enable_lora: bool = False,
        max_loras: int = 4,
        batch_invariant: bool | None = None,
    ) -> None:
        self.config = ContinuousBatchingConfig.coerce(config)
        if batch_invariant is not None:  # overrides the config's field
            self.config = self.config.replace(batch_invariant=batch_invariant)
        # LoRA adapters to load (name -> PEFT directory); `enable_lora` without any: loaded
        # at run time (`load_lora`)
        self._lora_setup = _lora_setup(lora_modules, enable_lora, max_loras,
                                       tensor_parallel_size)
        if self._lora_setup is not None and self.config.batch_invariant:
            raise FieldError("LoRA adapters are not supported with batch_invariant (their "
                             "low-rank products are torch's, not the mode's kernel)",
                             "lora_modules")
        if self._lora_setup is not None and (quantization is not None
                                             or gguf_source.gguf_path_of(model) is not None):
            raise FieldError("LoRA adapters are not supported on quantized weights (a GGUF "
                             "model or quantization=...): they wrap float linear layers",
                             "lora_modules")
        if tensor_parallel_size not in (None, 1) and \
                SpeculativeConfig.coerce(speculative_config) is not None:
            # (refused before any worker starts; `spec.setup` says the same later)
            raise FieldError("speculative decoding with tensor_parallel_size > 1 is not "
                             "supported yet", "speculative_config")
        # quantize a checkpoint's linears on load (`ferrobatch.gguf.quantize`; CPU; under
        # tensor parallelism each rank quantizes its share, `distributed.quant_shard`)
        self._quantization = quantization
        # tensor parallelism (`ferrobatch.distributed`): None, or this process's rank; the
        # spawned ranks build an `Engine` too, from these arguments
        self.tp = tp_setup.start(
            tensor_parallel_size, model, device=device, make_engine=Engine,
            worker_kwargs=dict(config=self.config, dtype=dtype, seed=seed, device=device,
                               quantization=quantization,
                               tokenizer=tokenizer if isinstance(tokenizer, str) else None),
        )
        self.tensor_parallel_size = 1 if self.tp is None else self.tp.world_size
        try:
            self._build(model, tokenizer, device, dtype, seed, speculative_config)
        except BaseException:
            if self.tp is not None and self.tp.rank == 0:
                self.tp.fail(RuntimeError("engine construction failed"))
                self.tp.shutdown()
            raise

    # ------------------------------------------------------------------ construction

    def _build(self, model: Any, tokenizer: Any, device: Any, dtype: Any, seed: int | None,
               speculative_config: Any) -> None:
        """The engine's parts, in build order; each is given what it needs when it is made.

        model and tokenizer → what the model is (names, lengths, EOS, layer types) and what
        is refused → guides → per-request rope → cache size → runner → scheduler → the
        construction probes → the tensor-parallel runner → sampler → speculative
        controller → output router → stepper → thread governor → loop state.
        """
        # a model read here (from a path) is the engine's own, and goes when it closes
        self._owns_model = isinstance(model, str | os.PathLike)
        self.model, self.tokenizer = self._load(model, tokenizer, device, dtype)
        # A loaded model is never moved or converted (`load_model` says so when device/dtype
        # differ), so the cache follows the model: a cache in another dtype would silently
        # round every key and value, one on another device could not be read at all.
        param = next(self.model.parameters())
        self.device = param.device
        self.dtype = param.dtype

        tcfg = self._read_model_config(self.model)
        check_architecture(
            self.model,
            tcfg if self.tp is None else tp_shard.per_rank_config(tcfg, self.tp.world_size))
        # grammar matchers of guided requests (json_schema / regex / grammar)
        self.guides = GuideFactory(self.tokenizer, self.vocab_size, self.eos_token_ids)
        self.rope = self._make_rope()
        self._size_cache(self.model, tcfg)
        # (the checks of the runner's parts and the probes share their dequantized weights)
        with quant_modules.probe_cache():
            self.runner = self._make_runner()
            self.lora = self._make_lora()
            self.scheduler = self._build_scheduler()
            try:
                self._probe_model()
            except BaseException:
                self.runner.close()
                raise
        # weights packed for the kernels once, the file's pages of them given back (GGUF
        # rows; a checkpoint's half-precision or fp32 linears)
        quant_modules.prepare_for_serving(self.model,
                                          self.runner.activations.stacked_quant_layers())
        self.runner.activations.release_sources()
        if self.tp is None and not isinstance(model, torch.nn.Module):
            self._hold_in_panels()
        if self.tp is not None:  # rank 0: steps go to every rank; torchrun ranks > 0 serve
            self.runner = tp_setup.attach(self.runner, self.tp, self._tp_failed)
        self.sampler = Sampler(self.device, seed=seed)
        self.spec = self._make_spec(speculative_config)

        self._stats: collections.Counter[str] = collections.Counter()
        self._router = OutputRouter(self.scheduler, self._stats)
        self._requests = self._router.requests  # live requests by id (the router's table)
        self._table_lock = self._router.lock  # guards _requests
        # a speculative plan's accepted counts decide the next positions: nothing is planned
        # ahead of it, so speculation steps synchronously
        self.async_batching = self._resolve_async_batching() and self.spec is None
        self._stepper = self._make_stepper()
        # CPU: fewer torch threads while other processes keep the cores busy
        self._threads = ThreadGovernor.of(self.device.type, self.config.adaptive_threads) \
            if self.tp is None else None
        self._step_lock = threading.RLock()  # one stepper at a time; guards the scheduler
        self._wakeup = threading.Event()
        self._thread: threading.Thread | None = None
        self._stop_loop = False
        self._closed = False
        self._error: BaseException | None = None
        self._ids = itertools.count()
        # embed()'s pooling when the caller names none (a sentence-transformers checkpoint's)
        self.pooling_defaults = embedding.pooling_defaults(
            getattr(self.model.config, "_name_or_path", None))

    def _hold_in_panels(self) -> None:
        """A model this engine loaded (never one the caller passed in): the fp32 weights
        whose bf16 panels are their only copy are let go, and its input embedding is held as
        bf16 where its values allow (`runner.panel_weights`)."""
        let_go = self.runner.activations.hold_in_panels()
        greedy = self.runner.head.greedy  # (its screen keeps a reference to a tied head)
        let_go += self.runner.activations.narrow_embedding(
            lambda w: greedy is not None and greedy.holds(w))
        if any(isinstance(p, panel_weights.HeldWeight) for p in self.model.parameters()):
            panel_weights.guard_conversions(self.model)
        if let_go:
            gc.collect()
            pages.trim_heap()
            logger.info("ferrobatch: %.0f MiB of fp32 weights let go (held as bf16)",
                        let_go / 2**20)

    def _load(self, model: Any, tokenizer: Any, device: Any, dtype: Any) -> tuple[Any, Any]:
        """(model, tokenizer): this rank's shard under tensor parallelism, else
        `models.load_model`; a tokenizer given by name is loaded, None takes the model's."""
        if self.tp is not None:
            loaded, loaded_tok = tp_setup.load(self.tp, model, dtype, self._quantization,
                                               ordered=self.config.batch_invariant)
        else:
            wide = self._narrow_read(model, device, dtype)
            loaded, loaded_tok = models.load_model(
                model, device=device, dtype=dtype if wide is None else torch.bfloat16,
                quantization=self._quantization)
            if wide is not None:
                panel_weights.hold_narrow_read(loaded, wide)
        if isinstance(tokenizer, str):
            if models.names_nothing(tokenizer):
                raise FieldError(f"tokenizer {tokenizer!r}: no such file or directory "
                                 "(ferrobatch never downloads one)", "tokenizer")
            tokenizer = AutoTokenizer.from_pretrained(str(Path(tokenizer).expanduser()),
                                                      local_files_only=True)
        return loaded, tokenizer if tokenizer is not None else loaded_tok

    def _narrow_read(self, model: Any, device: Any, dtype: Any) -> dict[str, Any] | None:
        """Where this engine reads a bf16 checkpoint directory to run it in fp32 on a CPU
        whose `f32_ops` hold such weights as bf16 panels: each tensor's dtype in an fp32
        read (`narrow_read.read_dtype`), the checkpoint then read in bf16 and its matrices
        held so (`panel_weights.hold_narrow_read`: no fp32 copy of them is made); else
        None."""
        if self._quantization is not None or not self._owns_model or not f32_ops.available():
            return None
        path = Path(model).expanduser()
        if not path.is_dir() or gguf_source.gguf_path_of(model) is not None:
            return None
        cpu = torch.device("cpu")
        if device is not None and models.parse_device(device) != cpu:
            return None
        if resolve_dtype(dtype, cpu, path) != torch.float32:
            return None
        read_in, wide = narrow_read.read_dtype(path, torch.float32)
        return wide if read_in == torch.bfloat16 else None

    def _read_model_config(self, loaded: Any) -> Any:
        """Name, context, vocabulary, EOS ids and layer types; returns the text config."""
        mcfg = loaded.config
        tcfg = mcfg.get_text_config() if hasattr(mcfg, "get_text_config") else mcfg
        self.model_name = str(
            getattr(mcfg, "_name_or_path", "") or getattr(mcfg, "model_type", "model")
        )
        self.max_model_len = int(getattr(tcfg, "max_position_embeddings", 0) or 1 << 30)
        self.vocab_size = int(tcfg.vocab_size)
        self.eos_token_ids = eos_ids(loaded, self.tokenizer)
        # what the forward does, not what the config declares (`models.attention_layout`)
        self.layer_types = list(models.layer_types_of(loaded))
        self.sliding_window = models.sliding_window_of(loaded)
        self.default_max_new_tokens = 128
        self.generation_defaults = generation_defaults(loaded)
        return tcfg

    def _make_rope(self) -> LongRope | None:
        """Per-request rope factors of a longrope model (transformers takes them from the
        whole forward); None for other models."""
        rope = LongRope.of(self.model, self.max_model_len)
        if rope is None:
            return None
        if self.tp is not None:
            raise FieldError(
                "longrope models keep per-request rope state on rank 0 only: "
                "tensor_parallel_size > 1 is not supported for them", field="tensor_parallel_size")
        logger.info(
            "ferrobatch: %s uses longrope (short/long factors at %d tokens): per-request "
            "factors, recompute on crossing=%s, no prefix caching, no CUDA graphs",
            type(self.model).__name__, rope.threshold, rope.recompute,
        )
        return rope

    def _size_cache(self, loaded: Any, tcfg: Any) -> None:
        """`num_blocks` (given, or sized from free memory) and the CPU swap slots."""
        cfg = self.config
        if self.tp is not None:  # one rank's share of the heads: per-rank memory
            tcfg = tp_shard.per_rank_config(tcfg, self.tp.world_size)
            loaded = tcfg
        if cfg.kv_cache_dtype != "auto" and self.device.type != "cpu":
            raise FieldError(
                f"kv_cache_dtype={cfg.kv_cache_dtype!r} is CPU only (the {self.device.type} "
                "attention kernels read the model's dtype); use kv_cache_dtype='auto'",
                "kv_cache_dtype")
        self.chunk_bytes = memory.kv_bytes_per_chunk(tcfg, cfg.page_size, self.dtype,
                                                     cfg.kv_cache_dtype)
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
        if self.tp is not None:  # every rank's cache has rank 0's size
            self.num_blocks = tp_setup.agree(self.num_blocks, self.tp)
        self.cpu_offload_blocks = (
            int(cfg.cpu_offload_space * (1 << 30)) // self.chunk_bytes
            if cfg.cpu_offload_space > 0
            else 0
        )

    def _make_runner(self) -> ModelRunner:
        """The model runner over a cache of `num_blocks` chunks, with the per-request rope."""
        # None: on with CUDA + a kernel backend; off with per-request rope factors
        use_cuda_graph = self.config.use_cuda_graph if self.rope is None else False
        lora = self._lora_setup is not None
        if lora:  # graphs would replay one step's adapter rows
            use_cuda_graph = False
        return ModelRunner(
            self.model,
            num_blocks=self.num_blocks,
            page_size=self.config.page_size,
            cpu_offload_blocks=self.cpu_offload_blocks,
            device=self.device,
            dtype=self.dtype,
            use_cuda_graph=use_cuda_graph,
            config=self.config,
            rope=self.rope,
            batch_invariant=self.config.batch_invariant,
        )

    def _make_lora(self) -> LoraManager | None:
        """The LoRA adapters (`ferrobatch.lora`) with those of `lora_modules` loaded, or None
        when the engine was not asked for LoRA."""
        if self._lora_setup is None:
            return None
        modules, max_loras = self._lora_setup
        manager = LoraManager(self.model, max_loras)
        try:
            for name, path in modules.items():
                manager.load(name, path)
        except BaseException:
            manager.close()
            self.runner.close()
            raise
        if modules:
            logger.info("ferrobatch: LoRA adapters %s (at most %d active)", list(modules),
                        max_loras)
        return manager

    def _build_scheduler(self, max_batch_tokens: int | None = None) -> Scheduler:
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
            defer_shared_prefixes=cfg.defer_shared_prefixes,
            priority_preemption=cfg.scheduling_policy == "priority",
            max_step_ms=self._max_step_ms(),
        )

    def _max_step_ms(self) -> float | None:
        """The step-time budget the scheduler gets: the config's, on CPU without async
        batching (planned ahead, a step's time is not the forward's alone); else None."""
        cfg = self.config
        if self.device.type != "cpu" or cfg.use_async_batching:
            return None
        return cfg.max_step_ms

    def _tp_failed(self, exc: BaseException) -> None:
        """The tensor-parallel watchdog's report (a worker died or hung): fail every caller."""
        self._fail_all(exc, fatal=True)
        self._wakeup.set()

    def _make_spec(self, speculative_config: Any) -> SpecController | None:
        """Speculative decoding (`ferrobatch.spec`), or None."""
        return build_controller(
            speculative_config, config=self.config, device=self.device, dtype=self.dtype,
            vocab_size=self.runner.vocab_size, num_blocks=self.num_blocks,
            spec_cap=self.scheduler.spec_cap, tensor_parallel=self.tp is not None,
        )  # fmt: skip

    def _make_stepper(self) -> Stepper:
        """The async pipeline (`async_batching`), else synchronous steps."""
        if self.async_batching:
            return AsyncStepper(self.scheduler, self.runner, self.sampler, self._router,
                                self._stats, device=self.device, lora=self.lora)  # fmt: skip
        return Stepper(self.scheduler, self.runner, self.sampler, self._router, self._stats,
                       spec=self.spec, lora=self.lora)  # fmt: skip

    def _resolve_async_batching(self) -> bool:
        """`use_async_batching`: True → the async pipeline on any device (on CPU it runs
        step after step, for testing); False → synchronous steps; None → on with CUDA
        graphs on CUDA (the pipeline hides the host's planning behind the device's work,
        which only pays once graph replays make the device side short), else off."""
        want = self.config.use_async_batching
        graphs = self.runner.use_cuda_graph
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

    # ------------------------------------------------------------------ public API

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling: SamplingLike = None,
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
        sampling: SamplingLike = None,
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

    def embed(
        self,
        prompts: Prompt | Sequence[Prompt],
        *,
        pooling: str | None = None,
        normalize: bool | None = None,
        progress: bool = False,
    ) -> list[EmbeddingOutput]:
        """One embedding per prompt (a string or token ids), in input order: the base
        model's final hidden states pooled ("last" token, "mean" of all, "cls": the first),
        L2-normalized with `normalize`. None takes the checkpoint's own sentence-transformers
        settings where it has them (`pooling_defaults`), else "last" and True. Embedding
        requests batch with generation requests in the same steps."""
        reqs = self._embedding_requests(as_prompt_list(prompts), pooling, normalize)
        self._run_batch(reqs, progress=progress, desc="embed")
        return [embedding.embedding_output(r) for r in reqs]

    async def aembed(
        self,
        prompts: Sequence[Prompt],
        *,
        pooling: str | None = None,
        normalize: bool | None = None,
    ) -> list[EmbeddingOutput]:
        """Async form of `embed` (every prompt validated before any runs; cancelling the
        call cancels its requests)."""
        reqs = self._embedding_requests(list(prompts), pooling, normalize)

        async def run(req: Request) -> EmbeddingOutput:
            async for _ in self._astream_gen(req):
                pass
            return embedding.embedding_output(req)

        try:
            async with asyncio.TaskGroup() as group:
                tasks = [group.create_task(run(r)) for r in reqs]
        except BaseExceptionGroup as grouped:  # the first failure as the caller's error
            raise grouped.exceptions[0] from None
        return [t.result() for t in tasks]

    def _embedding_requests(
        self, prompts: list[Prompt], pooling: str | None, normalize: bool | None
    ) -> list[Request]:
        """Validated embedding requests (`FieldError` naming the field)."""
        self._check_open()
        if self.tp is not None:
            raise FieldError("embeddings are not supported with tensor_parallel_size > 1",
                             "tensor_parallel_size")
        if not self.runner.head.split:
            raise FieldError(
                f"{type(self.model).__name__} can't embed: its base model is not separable "
                f"from its output head ({self.runner.head.split_error})", "model")
        if not prompts:
            raise FieldError("prompts must not be empty", "prompt")
        mode, norm = embedding.resolve_pooling(self.pooling_defaults, pooling, normalize)
        return [embedding.embedding_request(self, p, mode, norm, self._new_request_id)
                for p in prompts]

    def load_lora(self, name: str, path: str) -> None:
        """Load the PEFT adapter at `path` as `name`, for requests with
        `SamplingParams(lora=name)` (`FieldError`: the engine was started without LoRA, the
        name is taken, the adapter doesn't fit the model)."""
        self._require_lora().load(name, path)

    def unload_lora(self, name: str) -> None:
        """Stop serving adapter `name` (its running requests finish with it)."""
        self._require_lora().unload(name)

    @property
    def lora_adapters(self) -> list[str]:
        """The names of the loaded LoRA adapters."""
        return [] if self.lora is None else self.lora.names()

    def _require_lora(self) -> LoraManager:
        if self.lora is None:
            raise FieldError("this engine was started without LoRA support (pass "
                             "lora_modules= or enable_lora=True)", "lora_name")
        return self.lora

    @property
    def embedding_size(self) -> int:
        """The length of the embeddings `embed` returns (the model's hidden size)."""
        return int(text_config(self.runner.config).hidden_size)

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
        _check_messages(messages)
        out = self.tokenizer.apply_chat_template(list(messages), tokenize=True, **kwargs)
        if hasattr(out, "keys") and "input_ids" in out:
            out = out["input_ids"]
        if hasattr(out, "tolist"):
            out = out.tolist()
        if out and isinstance(out[0], list):
            out = out[0]
        return [int(t) for t in out]

    def add_request(
        self, prompt: Prompt, sampling: SamplingLike = None, *, request_id: str | None = None
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
        """Cancel a running or waiting request; False if unknown, already finished or
        already being cancelled."""
        with self._table_lock:
            req = self._requests.get(request_id)
            if req is None or req.done.is_set() or req.cancelling:
                return False
            req.cancelling = True
        self._stepper.cancel_inbox.append(request_id)
        self._wakeup.set()
        return True

    def stream(self, prompt: Prompt, sampling: SamplingLike = None) -> Iterator[RequestOutput]:
        """Yield deltas (new tokens and text) as they are generated; the last is finished.

        The request is validated now (`ValueError` naming the field) and starts when the
        iteration does; closing the iterator early cancels it.
        """
        sp = self._params_list(sampling, 1, None)[0]
        q: queue.SimpleQueue[RequestOutput | BaseException] = queue.SimpleQueue()
        req = self._make_request(prompt, sp, None, listener=q.put, incremental=True)
        return self._stream_iter(req, q)

    def _stream_iter(
        self, req: Request, q: queue.SimpleQueue[RequestOutput | BaseException]
    ) -> Iterator[RequestOutput]:
        self._submit(req)
        self.start()
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
        self, prompt: Prompt, sampling: SamplingLike = None, *, request_id: str | None = None
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

    def check_request(self, prompt: Prompt, sampling: SamplingLike = None) -> list[int]:
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
        self._check_open()
        if self._error is not None:
            raise RuntimeError("the engine loop died earlier") from self._error
        if self._thread is not None and self._thread.is_alive():
            return
        self._stop_loop = False
        # (the thread holds the engine weakly between turns: an engine its caller drops
        # without close() is collected, and its loop stops)
        self._thread = threading.Thread(target=_background_loop, name="ferrobatch-loop",
                                        args=(weakref.ref(self), self._wakeup), daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop the loop, cancel unfinished requests and give the model back untouched.

        The cache and every packed copy of the weights are freed; so is the model where the
        engine read it itself (from a path: `engine.model` is None afterwards). Requests
        after `close()` raise `EngineClosedError`."""
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
            if self.spec is not None:
                self.spec.close()
            self.runner.close()
            if self.lora is not None:  # the adapters' hooks off the caller's model
                self.lora.close()
            if self._owns_model:
                self.model = None
            if self._threads is not None:
                self._threads.close()
        if self.tp is not None and self.tp.rank == 0:
            self.tp.shutdown(self.runner.stop_workers)

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

    def take_step_records(self) -> list[tuple[float, int]]:
        """(seconds, prefill budget tokens) of each step since the last call, oldest first
        (at most `engine.stepper.STEP_RECORDS`): the metrics' step-time histograms."""
        return self._stepper.take_step_records()

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
            batch_invariant=self.config.batch_invariant,
            tensor_parallel_size=self.tensor_parallel_size,
            ahead_steps=self._stats["ahead_steps"],
            pipeline_drains=self._stats["pipeline_drains"],
            stall_drains=self._stats["stall_drains"],
            swap_drains=self._stats["swap_drains"],
            priority_drains=self._stats["priority_drains"],
            rope_drains=self._stats["rope_drains"],
            throughput_tok_s=gen / busy if busy > 0 else 0.0,
            page_size=self.config.page_size,
            running_requests=sum(1 for r in list(self._requests.values()) if not r.done.is_set()),
        )
        if self.spec is not None:
            out.update(self.spec.engine_stats(sched_stats))
        out["cuda_graphs"] = self.runner.graph_stats()
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
        self._check_open()
        return make_request(self, prompt, sp, request_id, self._new_request_id, **kwargs)

    def _new_request_id(self) -> str:
        return f"req-{next(self._ids)}-{uuid.uuid4().hex[:8]}"

    def check_room(self, count: int = 1) -> None:
        """`QueueFullError` when `count` more requests would pass `max_queue_size` (which
        counts every unfinished request, running or waiting) now; nothing without a bound.
        For a caller that must answer before its requests are submitted (a server choosing
        between a 429 and a stream)."""
        with self._table_lock:
            full = self._queue_full(count)
        if full is not None:
            raise full

    def _queue_full(self, count: int) -> QueueFullError | None:
        """The error when `count` more requests would pass `max_queue_size` (None: room, or
        no bound); the caller holds the table lock."""
        limit = self.config.max_queue_size
        if not limit:
            return None
        busy = sum(not r.done.is_set() for r in self._requests.values())
        if busy + count <= limit:
            return None
        return QueueFullError(f"max_queue_size={limit} unfinished requests are already "
                              f"queued or running ({busy}, and {count} more asked)")

    def _check_open(self) -> None:
        """`EngineClosedError` once `close()` has run."""
        if self._closed:
            raise EngineClosedError("engine is closed")

    def _submit(self, req: Request, *, bounded: bool = True) -> None:
        self._check_open()
        if self._error is not None:
            raise RuntimeError("the engine loop died earlier") from self._error
        with self._table_lock:
            if req.request_id in self._requests:
                raise FieldError(f"request_id {req.request_id!r} is already in use", "request_id")
            full = self._queue_full(1) if bounded else None
            if full is not None:
                raise full
            self._requests[req.request_id] = req
        self._stepper.inbox.append(req)
        self._wakeup.set()

    def _run_batch(self, reqs: list[Request], *, progress: bool, desc: str,
                   offline: bool = True) -> list[RequestOutput]:
        for r in reqs:
            # (offline: the caller waits for the whole batch, not on any step)
            r.offline = offline
            self._submit(r, bounded=False)
        bar = None
        if progress and reqs:
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
        except KeyboardInterrupt as exc:
            # (the step stopped half-way in this thread: its plan was never applied)
            self._fail_all(RuntimeError(
                "a KeyboardInterrupt stopped a step half-way in the caller's thread, so this "
                "engine cannot go on: build a new one (with the background loop running, "
                "Engine.start(), an interrupt leaves the engine usable)"), fatal=True)
            raise exc
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

    def _loop_turn(self, idle_misses: int) -> tuple[int, bool] | None:
        """One turn of the background loop (`_background_loop`): the next count of idle
        misses and whether to wait for work, or None when the loop ends."""
        if self._stop_loop:
            return None
        try:
            worked = self._step()
        except BaseException as exc:  # delivered to every waiting caller
            logger.exception("ferrobatch engine loop died")
            self._fail_all(exc, fatal=True)
            return None
        if worked:
            return 0, False
        with self._table_lock:
            waiting = any(
                r.in_scheduler and not r.done.is_set() for r in self._requests.values()
            )
        if waiting and not self._stepper.has_mail():
            if idle_misses + 1 > 3:
                self._fail_all(
                    RuntimeError("scheduler returned no plan while requests are unfinished"),
                    fatal=True,
                )
                return None
            return idle_misses + 1, False
        return idle_misses, True

    def _step(self) -> bool:
        """Run one scheduler step; False when there was nothing to do."""
        with self._step_lock:
            self._check_open()
            if self._threads is not None:
                self._threads.tick()
            return self._stepper.step()

    def _fail_all(self, exc: BaseException, *, fatal: bool = False) -> None:
        if fatal:
            self._error = exc
        router = getattr(self, "_router", None)  # (a failure while building: no callers)
        if router is not None:
            router.fail_all(exc)


def _background_loop(ref: weakref.ReferenceType[Engine], wakeup: threading.Event) -> None:
    """The background stepping loop: `Engine._loop_turn` until it says stop or the engine
    is gone, the engine held only for the length of a turn."""
    idle_misses = 0
    while True:
        engine = ref()
        turn = None if engine is None else engine._loop_turn(idle_misses)
        del engine
        if turn is None:
            return
        idle_misses, wait = turn
        if wait:
            wakeup.wait(0.05)
            wakeup.clear()


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


def _lora_setup(modules: Any, enable: bool, max_loras: int,
                tensor_parallel_size: int) -> tuple[dict[str, str], int] | None:
    """(adapters to load, max_loras), or None without LoRA; `FieldError` naming the
    argument otherwise."""
    if not modules and not enable:
        return None
    if modules is not None and not isinstance(modules, dict):
        raise FieldError("lora_modules must be a dict of adapter name -> PEFT directory",
                         "lora_modules")
    if tensor_parallel_size != 1:
        raise FieldError("LoRA adapters are not supported with tensor_parallel_size > 1",
                         "lora_modules")
    return {str(k): str(v) for k, v in (modules or {}).items()}, max_loras


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


def _check_messages(messages: Any) -> None:
    """`FieldError` (field "messages") unless `messages` is a non-empty list of message
    dicts, each with a string `role` and a `content` the chat templates read (a string, a
    list of parts, or None; a message with tool calls may leave it out)."""
    if isinstance(messages, str | bytes | dict) or not isinstance(messages, Sequence) \
            or not messages:
        raise FieldError("messages must be a non-empty list of {'role', 'content'} dicts",
                         "messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise FieldError(f"messages[{i}] must be a dict with 'role' and 'content', not "
                             f"{type(m).__name__}", "messages")
        if not isinstance(m.get("role"), str):
            raise FieldError(f"messages[{i}] needs a string 'role'", "messages")
        content = m.get("content")
        if "content" not in m and not m.get("tool_calls"):
            raise FieldError(f"messages[{i}] needs a 'content'", "messages")
        if content is not None and not isinstance(content, str | list):
            raise FieldError(f"messages[{i}].content must be a string or a list of parts, "
                             f"not {type(content).__name__}", "messages")
