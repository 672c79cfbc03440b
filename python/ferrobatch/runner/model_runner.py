"""`ModelRunner`: runs one `StepPlan` through a transformers causal LM over the paged cache."""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from transformers import PreTrainedModel

from ferrobatch.attention import context, registry
from ferrobatch.attention.kernel_step import KernelStep, build_kernel_step
from ferrobatch.attention.kernels import decode_kernel_available
from ferrobatch.attention.kv_cache import PagedKVCache
from ferrobatch.attention.paged_step import PagedStep, build_step
from ferrobatch.cpu.threads import share_torch_openmp
from ferrobatch.cuda import triton_attention
from ferrobatch.cuda.staging import upload
from ferrobatch.errors import FieldError
from ferrobatch.model_config import FULL, model_configs, text_config
from ferrobatch.models import layer_types_of, sliding_window_of
from ferrobatch.runner import linear_policy
from ferrobatch.runner.activations import PackedActivations
from ferrobatch.runner.direct_forward import DirectForward
from ferrobatch.runner.graph_steps import GraphSteps
from ferrobatch.runner.output_head import OutputHead
from ferrobatch.runner.patches import eval_mode, install_packed_check_bypass
from ferrobatch.sampling.sampler import argmax_rows

if TYPE_CHECKING:
    from ferrobatch.attention.rope import LongRope
    from ferrobatch.config import ContinuousBatchingConfig
    from ferrobatch.core import StepPlan

logger = logging.getLogger("ferrobatch")


__all__ = ["ModelRunner"]


class ModelRunner:
    """Executes step plans (ARCHITECTURE.md §3) on `model` with ferrobatch's paged KV cache.

    The caller's model is used as is: its attention implementation is switched to the paged
    one only for the duration of each forward and restored afterwards; its weights, config
    and generation config are never changed.

    Its parts: `activations` (a CPU model's packed linears and lean decoder layers,
    `PackedActivations`), `head` (the output head and the greedy screen, `OutputHead`) and
    `graphs` (decode-only steps through CUDA graphs, `GraphSteps`).
    """

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        num_blocks: int,
        page_size: int,
        cpu_offload_blocks: int = 0,
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
        attention_backend: str | None = None,
        use_cuda_graph: bool | None = None,
        config: ContinuousBatchingConfig | None = None,
        max_graphs: int | None = None,
        activations: str = "auto",
        lean_layers: bool = True,
        rope: LongRope | None = None,
        batch_invariant: bool = False,
    ) -> None:
        """`attention_backend`: None chooses (the SDPA path on CPU; on CUDA the Triton or
        flash-attn kernels of `ferrobatch.cuda` when available, else SDPA); "sdpa",
        "triton", "flash_attn" or "torch" (the kernels' reference) force one.

        `use_cuda_graph`: None = CUDA graphs for decode-only steps when on CUDA with a kernel
        backend (no dense mask), else eager (logged); True forces them where possible and
        warns + runs eager where not (CPU, the SDPA backend); False = always eager.
        `config` (a `ContinuousBatchingConfig`) supplies the graph padding intervals,
        `max_requests_per_batch` and `kv_cache_dtype` (an int8 cache: CPU only);
        `max_graphs` bounds the graph cache (default `DEFAULT_MAX_GRAPHS`).

        `activations` (bf16 / fp16 models on CPU, whose linear layers then run on weights
        packed once for oneDNN, `ferrobatch.runner.cpu_linear`): "float32" keeps activations in
        fp32 between the half-precision products (the default, "auto", when the model runs
        that way: checked once against its own forward), "model" keeps the model's dtype
        throughout (what the model's own forward computes).

        `lean_layers`: with fp32 activations over packed weights (an fp32 model, or
        half-precision weights widened), run Llama-style decoder layers through fused
        kernels (`ferrobatch.runner.lean_layers`; checked once against the model's own
        forward).

        `rope`: a `ferrobatch.attention.rope.LongRope` giving each request its own rope
        factors (also settable later as `runner.rope`).

        `batch_invariant`: a row's logits never depend on what else its step holds (CPU, full
        attention: every row attended by the decode kernel, every product on
        `linear_policy.choose_invariant`'s backend, no greedy screen); `FieldError` on
        `batch_invariant` where that cannot hold."""
        self.model = model
        self.config = model.config
        cfg = text_config(model.config)
        # what the model's forward does (models.attention_layout), not what its config says
        self.layer_types: list[str] = layer_types_of(model)
        self.sliding_window: int | None = sliding_window_of(model)
        self.vocab_size: int = int(cfg.vocab_size)
        self.page_size = page_size
        self.num_blocks = num_blocks
        self.device = torch.device(device) if device is not None else model.device
        self.dtype = dtype if dtype is not None else model.dtype
        heads = int(cfg.num_attention_heads)
        kv_heads = int(getattr(cfg, "num_key_value_heads", None) or heads)
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        tp_shard = getattr(model, "ferrobatch_tp", None)  # a tensor-parallel rank's share
        if tp_shard is not None:
            kv_heads, head_dim = tp_shard.kv_heads, tp_shard.head_dim
        self.cache = PagedKVCache(
            num_layers=len(self.layer_types),
            num_blocks=num_blocks,
            page_size=page_size,
            num_kv_heads=kv_heads,
            head_dim=int(head_dim),
            device=self.device,
            dtype=self.dtype,
            cpu_offload_blocks=cpu_offload_blocks,
            kv_dtype=getattr(config, "kv_cache_dtype", "auto") or "auto",
        )
        self.attention_backend = self._choose_backend(attention_backend)
        # decode rows attended in place by the CPU kernel of `ferrobatch._core` (no gather);
        # attention sinks keep the SDPA path
        self.decode_kernel: bool = (
            self.attention_backend == "sdpa"
            and decode_kernel_available(self.cache)
            and not self._has_sinks()
        )
        # with the decode kernel, prompt rows on the tiled CPU prefill kernel (False: on
        # SDPA, the route before it; kept for A/B benches)
        self.prefill_kernel = True
        self._num_sms = (
            torch.cuda.get_device_properties(self.device).multi_processor_count
            if self.device.type == "cuda" else 132
        )
        self.batch_invariant = batch_invariant
        if batch_invariant:
            self._check_invariant()
        self._configs = model_configs(model)
        if self.device.type == "cpu":
            share_torch_openmp()
        self.activations = PackedActivations(
            model, device=self.device, dtype=self.dtype, kv_dtype=self.cache.dtype,
            vocab_size=self.vocab_size, configs=self._configs, activations=activations,
            lean_layers=lean_layers, batch_invariant=batch_invariant)
        if self.device.type == "cpu":
            linear_policy.log_table()
        linears = self.activations.linears
        self.head = OutputHead(
            model, self.device, self.vocab_size, batch_invariant,
            packed=linears is not None and linears.holds(model.get_output_embeddings()))
        # execute_greedy screens the vocabulary instead of computing every fp32 logit
        self.fast_greedy: bool = self.head.greedy is not None
        #: the base model's forward with its layer stack in one call, for plain decoders
        #: (`direct_forward`; None: the model's own forward)
        self.direct_forward: DirectForward | None = DirectForward.of(
            self.head.base, self.activations.lean) \
            if self.head.split and DirectForward.ENABLED else None
        self._closed = False
        # execute_with_rows' request for final hidden states, and the rows it got
        self._hidden_indices: np.ndarray | None = None
        self._hidden_rows: torch.Tensor | None = None
        # A `ferrobatch.attention.rope.LongRope` giving each request its own rope factors (the
        # rotary module would take them from the whole packed step); the engine's.
        self.rope: LongRope | None = rope
        if self.device.type == "cuda":
            install_packed_check_bypass()
        self.graphs = GraphSteps(
            kv_cache=self.cache, layer_types=self.layer_types,
            sliding_window=self.sliding_window, device=self.device,
            attention_backend=self.attention_backend, num_sms=self._num_sms,
            split_head=self.head.split, base_forward=self._base_forward)
        if self._resolve_cuda_graph(use_cuda_graph):
            self.graphs.setup("cuda", config=config, max_graphs=max_graphs)
            assert self.graphs.cache is not None and self.graphs.buckets is not None
            logger.info(
                "ferrobatch: CUDA graphs on for decode-only steps (backend %s, at most %d "
                "graphs, q interval %d, kv interval %d)", self.attention_backend,
                self.graphs.cache.max_graphs, self.graphs.buckets.q_interval,
                self.graphs.buckets.kv_interval,
            )

    # --- what the engine reads -------------------------------------------------------------

    @property
    def use_cuda_graph(self) -> bool:
        """Whether decode-only steps run through CUDA graphs (resolved at construction; off
        again after a failed capture)."""
        return self.graphs.use_cuda_graph

    @property
    def cuda_graph_off_reason(self) -> str | None:
        """Why CUDA graphs were resolved off at construction (None: they were not)."""
        return self.graphs.off_reason

    @property
    def activation_dtype(self) -> torch.dtype:
        """The dtype of the activations between the linear layers."""
        return self.activations.activation_dtype

    @property
    def head_skippable(self) -> bool:
        """Whether a plan with no `logits_indices` runs the base model only (a separable
        head and eager steps): what a tensor-parallel worker, which samples nothing, asks."""
        return self.head.split and not self.graphs.enabled

    def graph_stats(self) -> dict[str, Any]:
        """Graph counters (`GraphSteps.stats`): graphs, captures, hits, misses, evictions,
        graph / eager steps, pool bytes, why graphs are off."""
        return self.graphs.stats()

    def _resolve_cuda_graph(self, requested: bool | None) -> bool:
        """Whether decode-only steps run through CUDA graphs (see `__init__`)."""
        if requested is False:
            return False
        why = None
        if self.device.type != "cuda":
            why = f"the model is on {self.device.type}, not CUDA"
        elif self.attention_backend not in ("triton", "flash_attn", "torch"):
            why = f"attention backend {self.attention_backend!r} builds masks per step"
        elif not self.head.split:
            why = ("the output head is not separable from the base model: "
                   f"{self.head.split_error}")
        if why is None:
            return True
        self.graphs.off_reason = why
        msg = f"ferrobatch: CUDA graphs off ({why}); running eager"
        if requested:
            warnings.warn(msg, stacklevel=3)
        elif self.device.type == "cuda":
            # A downgrade the caller did not ask for (graphs are the CUDA default): loud,
            # and kept in graph_stats()["off_reason"].
            logger.warning(msg)
        else:
            logger.info(msg)
        return False

    def _check_invariant(self) -> None:
        """Batch-invariant mode's needs of the attention: the CPU decode kernel for every row
        (a CPU model, a cache dtype it reads, no attention sinks); sliding-window layers
        only over an unquantized cache (their prompt rows are attended over a scratch copy of
        their window, `paged_step._WindowRows`, whose new keys are not rounded to int8);
        else `FieldError` on `batch_invariant`."""
        why = None
        if self.device.type != "cpu":
            why = f"the model is on {self.device.type}; the mode runs on CPU only"
        elif not self.decode_kernel:
            why = (f"the CPU attention kernel does not run this model (cache dtype "
                   f"{self.cache.dtype}, attention sinks: {self._has_sinks()})")
        elif self.cache.quantized and any(t != FULL for t in self.layer_types):
            why = "sliding-window attention layers are not supported with an int8 KV cache"
        if why is not None:
            raise FieldError(f"batch_invariant: {why}", "batch_invariant")

    def _has_sinks(self) -> bool:
        """Attention sinks (GPT-OSS `sinks`, passed to attention as `s_aux`)."""
        return any(
            isinstance(getattr(m, "sinks", None), torch.Tensor) for m in self.model.modules()
        )

    def _choose_backend(self, requested: str | None) -> str:
        # Attention sinks (GPT-OSS `sinks`, passed as `s_aux`) are implemented by the SDPA
        # path only, not by the kernels of `ferrobatch.cuda`.
        sinks = self._has_sinks()
        if requested is not None:
            if requested not in ("sdpa", "triton", "flash_attn", "torch"):
                raise ValueError(f"unknown attention_backend {requested!r}")
            if sinks and requested != "sdpa":
                raise NotImplementedError(
                    f"attention_backend={requested!r} does not implement attention sinks "
                    f"({type(self.model).__name__}); use 'sdpa'"
                )
            return requested
        if self.device.type != "cuda" or sinks:
            return "sdpa"
        chosen = triton_attention.select_backend(self.device, page_size=self.page_size,
                                                 dtype=self.dtype)
        backend = chosen if chosen in ("triton", "flash_attn") else "sdpa"
        logger.info("ferrobatch: attention backend %s", backend)
        return backend

    def _check_calls(self, step: PagedStep | KernelStep) -> None:
        if step.calls != len(self.layer_types):
            why = ("the model must dispatch attention through transformers' "
                   "AttentionInterface" if step.calls < len(self.layer_types) else
                   "the paged cache takes one attention call a layer a forward (a model "
                   "that attends twice in a layer, or runs its layers more than once, "
                   "does not fit it)")
            raise RuntimeError(
                f"{type(self.model).__name__}: {step.calls} attention calls went through "
                f"ferrobatch's paged attention for its {len(self.layer_types)} attention "
                f"layers; {why}")

    def _base_forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                      step: KernelStep) -> torch.Tensor:
        """The base model's final hidden states [T, hidden] over a step through the paged
        attention (the forward a graph captures; its attention calls checked on the host)."""
        kwargs = {context.STEP_KWARG: step, "use_cache": False}
        with eval_mode(self.model), registry.paged_attention_enabled(self._configs, step):
            out = self.head.base(input_ids=input_ids, position_ids=positions, **kwargs)
        self._check_calls(step)
        return out[0][0]

    def execute_greedy(
        self, plan: StepPlan, prev_tokens: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Greedy next tokens [N] (int64, CPU) of `plan`'s sampled tokens: the argmax (first
        maximum) of the logits `execute` returns, without those logits when `fast_greedy`
        (bounded int8 screen + fp32 rescoring of the candidates)."""
        out = self.execute(plan, prev_tokens, _greedy=True)
        return out if out.dtype == torch.int64 else argmax_rows(out)

    def execute_with_prompt(
        self, plan: StepPlan, prompt_indices: np.ndarray, prev_tokens: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`execute`'s logits [N, vocab], and fp32 logits [M, vocab] of the tokens at
        `prompt_indices` (token indices into the plan: prompt positions whose next-token
        logprobs a request wants, `ferrobatch.sampling.prompt_logprobs`), from the same forward
        (always eager)."""
        logits, prompt_logits, _ = self.execute_with_rows(plan, prompt_indices, None,
                                                          prev_tokens)
        assert prompt_logits is not None
        return logits, prompt_logits

    def execute_with_rows(
        self, plan: StepPlan, prompt_indices: np.ndarray | None,
        hidden_indices: np.ndarray | None, prev_tokens: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """`execute`'s logits [N, vocab]; fp32 logits [M, vocab] of the tokens at
        `prompt_indices` (as `execute_with_prompt`); and the final hidden states [K, hidden]
        (the base model's output, fp32) of the tokens at `hidden_indices` (token indices
        into the plan: the prompt positions embeddings pool, `ferrobatch.sampling.pooling`),
        from the same forward (always eager). None for an index array not given."""
        if hidden_indices is not None and not self.head.split:
            raise RuntimeError(
                f"{type(self.model).__name__}: hidden states need a base model separable "
                f"from the output head ({self.head.split_error})"
            )
        n = len(plan.logits_indices)
        extra = np.zeros(0, np.int64) if prompt_indices is None else prompt_indices
        self._hidden_indices = hidden_indices
        try:
            out = self.execute(plan, prev_tokens, _extra=extra)
        finally:
            hidden, self._hidden_rows = self._hidden_rows, None
            self._hidden_indices = None
        prompt_logits = None if prompt_indices is None else out[n:]
        if hidden_indices is not None and hidden is None:  # an empty plan
            hidden = torch.empty(0, 0)
        return out[:n], prompt_logits, hidden

    # --- execution -------------------------------------------------------------------------

    def _tensor(self, values: Any) -> torch.Tensor:
        arr = np.ascontiguousarray(values, dtype=np.int64)
        return torch.from_numpy(arr).to(self.device, non_blocking=True)

    def _upload(self, arrays: dict[str, Any]) -> dict[str, torch.Tensor]:
        """int64 device tensors of `arrays` (None values skipped): on CUDA one copy from one
        pinned staging buffer (`ferrobatch.cuda.staging`: a copy from pageable memory may
        sync the host with the stream), elsewhere each array as before."""
        if self.device.type == "cuda":
            return upload(arrays, torch.int64, self.device)
        return {k: self._tensor(a) for k, a in arrays.items() if a is not None}

    def _prev_token_fill(
        self, plan: StepPlan, prev_tokens: torch.Tensor | None
    ) -> tuple[np.ndarray, np.ndarray] | None:
        """Host (token index, index into `prev_tokens`) pairs for the tokens whose input id
        is the previous plan's sample (`plan.prev_token_index >= 0`); None when there are
        none. Checked on the host (the index array is host data): no device sync."""
        idx = np.asarray(plan.prev_token_index, dtype=np.int64)
        pos = np.flatnonzero(idx >= 0)
        if not len(pos):
            return None
        if prev_tokens is None:
            raise ValueError(
                "the plan takes input ids from the previous step's samples "
                "(prev_token_index >= 0) but execute() got no prev_tokens"
            )
        src = idx[pos]
        if int(src.max()) >= prev_tokens.shape[0]:
            raise ValueError(
                f"prev_token_index {int(src.max())} out of range for {prev_tokens.shape[0]} "
                "previous samples"
            )
        return pos, src

    def _graph_fill(
        self, fill: tuple[np.ndarray, np.ndarray] | None, prev_tokens: torch.Tensor | None
    ) -> Callable[[torch.Tensor], None] | None:
        """How a graph step writes the inputs taken from the previous step's samples into
        its static input ids: `fill`, the host (pos, src) of `_prev_token_fill`, uploaded
        (only they) and applied by `_fill_prev_tokens`; None when there are none."""
        if fill is None:
            return None

        def fill_ids(input_ids: torch.Tensor) -> None:
            dev = self._upload({"pos": fill[0], "src": fill[1]})
            self._fill_prev_tokens(input_ids, (dev["pos"], dev["src"]), prev_tokens)

        return fill_ids

    def _fill_prev_tokens(
        self,
        input_ids: torch.Tensor,
        fill: tuple[torch.Tensor, torch.Tensor] | None,
        prev_tokens: torch.Tensor | None,
    ) -> None:
        """`input_ids[pos] = prev_tokens[src]` on the device, in place (any int dtype);
        `fill` holds the device (pos, src) of `_prev_token_fill`."""
        if fill is None or prev_tokens is None:
            return
        pos, src = fill
        prev = prev_tokens.reshape(-1).to(self.device, non_blocking=True)
        input_ids.index_copy_(0, pos, prev.index_select(0, src).to(input_ids.dtype))

    def execute(
        self, plan: StepPlan, prev_tokens: torch.Tensor | None = None, *, _greedy: bool = False,
        _extra: np.ndarray | None = None,
    ) -> torch.Tensor:
        """Run `plan`: swaps, then one packed forward; returns fp32 logits [N, vocab] for the
        tokens of `plan.logits_indices`, in that order.

        `prev_tokens` (int tensor [N_prev], any device): the previous plan's sampled tokens,
        in its `logits_indices` order. Where `plan.prev_token_index[t] >= 0`, the input id of
        token `t` is `prev_tokens[prev_token_index[t]]` (filled on the device, before the
        forward); elsewhere `plan.input_ids[t]`."""
        if self._closed:
            raise RuntimeError("ModelRunner is closed")
        with torch.inference_mode():
            self.cache.swap(plan.swap_out, plan.swap_in)
            fill = self._prev_token_fill(plan, prev_tokens)
            if len(plan.input_ids) == 0:
                return torch.empty(0, self.vocab_size, device=self.device)
            if self.graphs.enabled and self.rope is None and _extra is None:
                # a graph step loads its inputs into the graph's static buffers: nothing
                # of the plan is uploaded here
                hidden = self.graphs.hidden(plan, page_size=self.page_size,
                                            fill_ids=self._graph_fill(fill, prev_tokens))
                if hidden is not None:
                    return self.head.logits(hidden).float()
            logits_indices: Any = plan.logits_indices
            if _extra is not None:  # prompt positions too (execute_with_prompt)
                logits_indices = np.concatenate([np.asarray(logits_indices, np.int64),
                                                 np.asarray(_extra, np.int64)])
                _greedy = False
            dev = self._upload({
                "input_ids": plan.input_ids, "positions": plan.positions,
                "logits_indices": logits_indices,
                "fill_pos": None if fill is None else fill[0],
                "fill_src": None if fill is None else fill[1],
            })
            flat_ids = dev["input_ids"]
            if fill is not None:
                self._fill_prev_tokens(flat_ids, (dev["fill_pos"], dev["fill_src"]), prev_tokens)
            input_ids = flat_ids.unsqueeze(0)
            positions = dev["positions"].unsqueeze(0)
            logits_indices = dev["logits_indices"]
            if self.attention_backend == "sdpa":
                step = build_step(
                    plan, self.cache, self.layer_types, self.sliding_window,
                    decode_kernel=self.decode_kernel, invariant=self.batch_invariant,
                    prefill_kernel=self.prefill_kernel,
                )
                step.out_dtype = self.activations.attention_dtype(step.num_tokens)
            else:
                step = build_kernel_step(
                    plan, self.cache, self.layer_types, self.sliding_window,
                    self.attention_backend, self._num_sms,
                )
            rope = self.rope.forward(plan, self.device) if self.rope is not None else nullcontext()
            with eval_mode(self.model), rope:
                logits = self._forward(input_ids, positions, logits_indices, step, _greedy)
            self._check_calls(step)
            return logits if logits.dtype == torch.int64 else logits.float()

    def _forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        logits_indices: torch.Tensor,
        step: PagedStep | KernelStep,
        greedy: bool = False,
    ) -> torch.Tensor:
        """Logits of the sampled tokens; with `greedy` and a greedy head, their argmax
        token ids (int64) when the screen decides."""
        kwargs = {context.STEP_KWARG: step, "use_cache": False}
        head = self.head
        with registry.paged_attention_enabled(self._configs, step), self.activations.active():
            if head.split:
                if self.direct_forward is not None:
                    last = self.direct_forward(input_ids, positions, step, **kwargs)
                else:
                    last = head.base(input_ids=input_ids, position_ids=positions, **kwargs)[0]
                if self._hidden_indices is not None:  # execute_with_rows' hidden rows
                    rows = torch.from_numpy(np.asarray(self._hidden_indices, np.int64))
                    self._hidden_rows = last[0].index_select(
                        0, rows.to(last.device)).float()
                hidden = last[0].index_select(0, logits_indices)
                if greedy and head.greedy is not None:
                    tokens = head.greedy.argmax(hidden)
                    if tokens is not None:
                        return tokens
                return head.logits(hidden)
            out = self.model(
                input_ids=input_ids, position_ids=positions, logits_to_keep=logits_indices,
                **kwargs,
            )
            return out.logits[0]

    def close(self) -> None:
        """Release the cache and forget the model (its config is already restored) and all
        that was made from it (packed weights, the head's copies): a closed runner holds no
        weights, so a model nobody else holds is freed."""
        if self._closed:
            return
        self._closed = True
        self.graphs.close()
        registry.forget(self._configs)
        self.cache = None  # type: ignore[assignment]
        self.head.close()
        self.direct_forward = None
        self.activations.close()
        self.fast_greedy = False
        self.model = None
        self.activations = None  # type: ignore[assignment]
        self.head = None  # type: ignore[assignment]

    def __enter__(self) -> ModelRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
