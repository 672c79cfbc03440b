"""`ModelRunner`: runs one `StepPlan` through a transformers causal LM over the paged cache."""

from __future__ import annotations

import logging
import time
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from . import attention
from .cpu_linear import PackedLinears
from .greedy_head import GreedyHead
from .kv_cache import PagedKVCache
from .models import layer_types_of, sliding_window_of, text_config
from .sampling import _argmax_rows

logger = logging.getLogger("ferrobatch")

__all__ = ["DEFAULT_MAX_GRAPHS", "ModelRunner"]

# Graph cache bound. Graphs share one memory pool (about the largest captured step's
# activations); each adds its static inputs (a few int32 arrays of the padded shape) and its
# output (hidden states [N_pad, hidden]), so 32 graphs of the largest bucket cost a few MiB
# beyond the pool.
DEFAULT_MAX_GRAPHS = 32
# A decode shape gets its CUDA graph on its second step (the first runs eager).
CAPTURE_AFTER = 2
_KEYS_REMEMBERED = 4096


class ModelRunner:
    """Executes step plans (ARCHITECTURE.md §3) on `model` with ferrobatch's paged KV cache.

    The caller's model is used as is: its attention implementation is switched to the paged
    one only for the duration of each forward and restored afterwards; its weights, config
    and generation config are never changed.
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
        config: Any = None,
        max_graphs: int | None = None,
        activations: str = "auto",
    ) -> None:
        """`attention_backend`: None chooses (the SDPA path on CPU; on CUDA the Triton or
        flash-attn kernels of `ferrobatch.cuda` when available, else SDPA); "sdpa",
        "triton", "flash_attn" or "torch" (the kernels' reference) force one.

        `use_cuda_graph`: None = CUDA graphs for decode-only steps when on CUDA with a kernel
        backend (no dense mask), else eager (logged); True forces them where possible and
        warns + runs eager where not (CPU, the SDPA backend); False = always eager.
        `config` (a `ContinuousBatchingConfig`) supplies the graph padding intervals and
        `max_requests_per_batch`; `max_graphs` bounds the graph cache (default
        `DEFAULT_MAX_GRAPHS`).

        `activations` (bf16 / fp16 models on CPU, whose linear layers then run on weights
        packed once for oneDNN, `ferrobatch.cpu_linear`): "float32" keeps activations in
        fp32 between the half-precision products (the default, "auto", when the model runs
        that way: checked once against its own forward), "model" keeps the model's dtype
        throughout (what the model's own forward computes)."""
        if page_size < 1:
            raise ValueError("page_size must be >= 1")
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
        self.cache = PagedKVCache(
            num_layers=len(self.layer_types),
            num_blocks=num_blocks,
            page_size=page_size,
            num_kv_heads=kv_heads,
            head_dim=int(head_dim),
            device=self.device,
            dtype=self.dtype,
            cpu_offload_blocks=cpu_offload_blocks,
        )
        self.attention_backend = self._choose_backend(attention_backend)
        # decode rows attended in place by the CPU kernel of `ferrobatch._core` (no gather);
        # attention sinks keep the SDPA path
        self.decode_kernel: bool = (
            self.attention_backend == "sdpa"
            and attention.decode_kernel_available(self.cache)
            and not self._has_sinks()
        )
        self._num_sms = (
            torch.cuda.get_device_properties(self.device).multi_processor_count
            if self.device.type == "cuda" else 132
        )
        self._configs = attention.model_configs(model)
        self._base = getattr(model, "base_model", None)
        self._head = model.get_output_embeddings()
        self._final_softcap = getattr(cfg, "final_logit_softcapping", None)
        self._logit_scale = getattr(model, "logit_scale", None) or getattr(
            cfg, "logit_scale", None
        )
        self._logits_scaling = getattr(cfg, "logits_scaling", None)
        self._head_wt = _WeightDerived(lambda w: w.t().contiguous())
        self._head_packed = _WeightDerived(
            lambda w: torch.ops.mkldnn._reorder_linear_weight(w, 64)
        )
        self._use_head_wt = False
        self._use_head_packed = False
        if activations not in ("auto", "float32", "model"):
            raise ValueError(f"activations must be 'auto', 'float32' or 'model', "
                             f"not {activations!r}")
        self._linears: PackedLinears | None = None
        if self.device.type == "cpu":
            self._linears = self._make_packed_linears(activations)
        self._split_head = self._check_split_head()
        if self._split_head:
            self._use_head_packed = self._packed_head_wins()
            self._use_head_wt = not self._use_head_packed and self._transposed_head_wins()
        self._greedy_head = self._make_greedy_head()
        # execute_greedy screens the vocabulary instead of computing every fp32 logit
        self.fast_greedy: bool = self._greedy_head is not None
        self._closed = False
        # Set by the engine: a `ferrobatch.rope.LongRope` giving each request its own rope
        # factors (the rotary module would take them from the whole packed step).
        self.rope: Any = None
        self._graphs: Any = None  # GraphCache when padded (graph) steps are on
        self._graph_mode: str | None = None
        self._graph_counts = {"graph_steps": 0, "eager_steps": 0, "captures": 0}
        self._graph_pool_bytes = 0
        self._graph_input_bytes = 0
        self._graph_error: str | None = None
        if self.device.type == "cuda":
            _install_packed_check_bypass()
        self.cuda_graph_off_reason: str | None = None  # why graphs are off, when they are
        self.use_cuda_graph = self._resolve_cuda_graph(use_cuda_graph)
        if self.use_cuda_graph:
            self._setup_graphs("cuda", config=config, max_graphs=max_graphs)
            logger.info(
                "ferrobatch: CUDA graphs on for decode-only steps (backend %s, at most %d "
                "graphs, q interval %d, kv interval %d)", self.attention_backend,
                self._graphs.max_graphs, self._buckets.q_interval, self._buckets.kv_interval,
            )

    def _resolve_cuda_graph(self, requested: bool | None) -> bool:
        """Whether decode-only steps run through CUDA graphs (see `__init__`)."""
        if requested is False:
            return False
        why = None
        if self.device.type != "cuda":
            why = f"the model is on {self.device.type}, not CUDA"
        elif self.attention_backend not in ("triton", "flash_attn", "torch"):
            why = f"attention backend {self.attention_backend!r} builds masks per step"
        elif not self._split_head:
            why = ("the output head is not separable from the base model: "
                   f"{self.split_head_error}")
        if why is None:
            return True
        self.cuda_graph_off_reason = why
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
        from .cuda import triton_attention as ta

        chosen = ta.select_backend(self.device, page_size=self.page_size, dtype=self.dtype)
        backend = chosen if chosen in ("triton", "flash_attn") else "sdpa"
        logger.info("ferrobatch: attention backend %s", backend)
        return backend

    # --- CUDA graphs ---------------------------------------------------------------------

    def _setup_graphs(
        self,
        mode: str,
        *,
        config: Any = None,
        max_graphs: int | None = None,
        buckets: Any = None,
        capture_after: int | None = None,
        backend: str | None = None,
    ) -> None:
        """Run decode-only steps padded to graph shapes: `mode` "cuda" captures CUDA graphs;
        "eager" runs the same padded forward over the same static inputs without capture
        (`graphs.EagerReplay`: how the padded path is tested on CPU).

        `capture_after`: a key gets its graph on its n-th step (default: 2 with "cuda", 1
        with "eager"); before that the step runs eager. A capture costs a few forwards, so
        shapes seen once (the tail of a wave of finishing requests) are not worth one.
        `backend`: the attention backend inside the graphs (default: the runner's with
        "cuda", "torch" with "eager"; "triton" runs on CPU under `TRITON_INTERPRET=1`)."""
        from .cuda import graphs

        if mode not in ("cuda", "eager"):
            raise ValueError(f"unknown graph mode {mode!r}")
        if not self._split_head:
            raise ValueError("padded graph steps need an output head separable from the model")
        self._buckets = buckets or graphs.GraphBuckets.from_config(
            config, num_kv_heads=self.cache.num_kv_heads, num_sms=self._num_sms
        )
        self._graph_backend = backend or (self.attention_backend if mode == "cuda" else "torch")
        if self._graph_backend not in ("triton", "flash_attn", "torch"):
            raise ValueError(f"no graphs with attention backend {self._graph_backend!r}")
        self._graph_mode = mode
        self._capture_after = max(1, capture_after or (CAPTURE_AFTER if mode == "cuda" else 1))
        self._key_seen: OrderedDict[Any, int] = OrderedDict()
        self._graph_pool = torch.cuda.graph_pool_handle() if mode == "cuda" else None
        self._graphs = graphs.GraphCache(self._capture, max_graphs=max_graphs or DEFAULT_MAX_GRAPHS)

    def _padded_forward(self, a: Any, key: Any) -> torch.Tensor:
        """The forward a graph captures: the base model over the static inputs `a` (padded
        plan arrays, int32 device tensors) with a `KernelStep` whose integers all come from
        `key`; returns the final hidden states at `a["logits_indices"]` ([N_pad, hidden])."""
        from .cuda.graphs import SLIDING

        widths = dict(key.table_widths)
        types = list(widths)
        step = attention.KernelStep(
            cache=self.cache,
            layer_types=self.layer_types,
            backend=self._graph_backend,
            cu_seqlens_q=a["cu_seqlens_q"],
            seqlens_k=a["seqlens_k"],
            slot_mapping={t: a[f"slot_mapping/{t}"].long() for t in types},
            block_tables={t: a[f"block_tables/{t}"] for t in types},
            max_seqlen_q=key.max_seqlen_q,
            max_seqlen_k=key.max_seqlen_k,
            num_splits=dict(key.num_splits),
            sliding_window=self.sliding_window,
            ring_size=widths.get(SLIDING),
            num_tokens=key.tokens,
        )
        input_ids = a["input_ids"].long().unsqueeze(0)
        positions = a["positions"].long().unsqueeze(0)
        kwargs = {attention.STEP_KWARG: step, "use_cache": False}
        with _eval_mode(self.model), attention.paged_attention_enabled(self._configs, step):
            out = self._base(input_ids=input_ids, position_ids=positions, **kwargs)
        # Host-side count: during a capture this runs once, at capture time.
        self._check_calls(step)
        return out[0][0].index_select(0, a["logits_indices"].long())

    def _capture(self, key: Any) -> Any:
        """A graph for `key` (GraphCache's capture function)."""
        from .cuda import graphs

        def fn(a: Any) -> torch.Tensor:
            return self._padded_forward(a, key)

        self._graph_counts["captures"] += 1
        if self._graph_mode == "cuda":
            before = torch.cuda.memory_reserved(self.device)
            graph = graphs.CapturedGraph.for_plan(fn, key, self.device, pool=self._graph_pool)
            self._graph_pool_bytes += max(0, torch.cuda.memory_reserved(self.device) - before)
        else:
            graph = graphs.EagerReplay.for_plan(fn, key, self.device)
        self._graph_input_bytes += graph.inputs.nbytes
        return graph

    def _execute_graph(
        self, plan: Any, fill: Any, prev_tokens: torch.Tensor | None
    ) -> torch.Tensor | None:
        """Hidden states [N, hidden] of `plan` through its padded graph, or None when the
        step runs eager (not decode-only, or beyond the buckets)."""
        from .cuda import graphs

        padded = graphs.pad_plan(
            plan, self._buckets, page_size=self.page_size, sliding_window=self.sliding_window
        )
        if padded is None:
            return None
        key = padded.key
        if key not in self._graphs and self._capture_after > 1:
            seen = self._key_seen.pop(key, 0) + 1
            if seen < self._capture_after:
                self._key_seen[key] = seen  # most recent last; bounded below
                while len(self._key_seen) > _KEYS_REMEMBERED:
                    self._key_seen.popitem(last=False)
                return None
        try:
            graph = self._graphs.get(key)
        except Exception as exc:
            if self._graph_mode != "cuda":
                raise
            # A capture that fails (an op that cannot be captured in this model or this
            # torch/transformers) must not stop the engine: eager from now on, said loudly.
            self._graph_error = f"{type(exc).__name__}: {exc}"
            logger.warning("ferrobatch: CUDA graph capture failed for %s (%s); running eager "
                           "from now on", padded.key, self._graph_error)
            self._graphs.clear()
            self._graphs = None
            self.use_cuda_graph = False
            return None
        graph.load(padded)
        self._fill_prev_tokens(graph.static_inputs["input_ids"], fill, prev_tokens)
        self._graph_counts["graph_steps"] += 1
        return graph.run()[: padded.num_logits]

    def graph_stats(self) -> dict[str, Any]:
        """Graph counters: `enabled`, `mode` ("cuda" | "eager" | None), `graphs` (cached now),
        `max_graphs`, `captures`, `hits`, `misses`, `evictions`, `graph_steps` /
        `eager_steps` (steps run padded / eager), `pool_bytes` (device memory reserved while
        capturing: the shared pool and the graphs' outputs; 0 off CUDA), `input_bytes`
        (static inputs of every graph captured so far), `capture_error` (why graphs were
        turned off after a failed capture, else None), `off_reason` (why the runner resolved
        graphs off at construction, else None)."""
        out: dict[str, Any] = {
            "enabled": self._graphs is not None, "mode": self._graph_mode, "graphs": 0,
            "max_graphs": 0, "hits": 0, "misses": 0, "evictions": 0,
            **self._graph_counts,
            "pool_bytes": self._graph_pool_bytes, "input_bytes": self._graph_input_bytes,
            "capture_error": self._graph_error, "off_reason": self.cuda_graph_off_reason,
        }
        if self._graphs is not None:
            st = self._graphs.stats()
            out.update(graphs=st["graphs"], max_graphs=self._graphs.max_graphs,
                       capture_after=self._capture_after,
                       hits=st["graph_hits"], misses=st["graph_misses"],
                       evictions=st["graph_evictions"])
        return out

    def _check_calls(self, step: attention.PagedStep | attention.KernelStep) -> None:
        if step.calls != len(self.layer_types):
            raise RuntimeError(
                f"{type(self.model).__name__}: {step.calls} of {len(self.layer_types)} "
                "attention layers went through ferrobatch's paged attention; the model must "
                "dispatch attention through transformers' AttentionInterface"
            )

    # --- logits ----------------------------------------------------------------------------

    def _cpu_fp32_linear_head(self) -> bool:
        head = self._head
        return (
            self.device.type == "cpu"
            and type(head) is torch.nn.Linear
            and head.weight.dtype == torch.float32
        )

    def _packed_head_wins(self) -> bool:
        """On CPU, whether oneDNN's matmul with the head weight reordered once into its
        blocked layout (`mkldnn._reorder_linear_weight`, the op inductor uses for frozen
        linears) is clearly faster than `F.linear` (MKL sgemm repacks the whole 32000-wide
        weight on every call: ~2x slower at decode batch sizes on the brief's model).
        Checked against `F.linear` on random input first; False when unavailable."""
        if not self._cpu_fp32_linear_head() or not _HAVE_MKLDNN_LINEAR:
            return False
        head = self._head
        weight = head.weight.detach()
        bias = head.bias.detach() if head.bias is not None else None
        x = torch.randn(64, weight.shape[1])
        try:
            with torch.inference_mode():
                packed = self._head_packed.get(head.weight)
                got = _mkldnn_linear(x, packed, bias)
                ref = F.linear(x, weight, bias)
        except Exception as exc:  # noqa: BLE001 - an op missing from this build: skip it
            logger.info("ferrobatch: no packed output head (%s)", exc)
            self._head_packed.clear()
            return False
        if got.shape != ref.shape or not torch.allclose(got, ref, rtol=1e-5, atol=1e-5):
            self._head_packed.clear()
            return False
        t_packed, t_linear = _best_times(
            (lambda: _mkldnn_linear(x, packed, bias), lambda: F.linear(x, weight, bias))
        )
        if t_packed < 0.9 * t_linear:
            return True
        self._head_packed.clear()
        return False

    def _transposed_head_wins(self) -> bool:
        """On CPU, time the output head as `F.linear` against a product with a transposed
        contiguous copy of its weight (MKL is often faster on the latter at decode batch
        sizes, depending on the shape); True when the copy is clearly faster."""
        if not self._cpu_fp32_linear_head():
            return False
        weight = self._head.weight.detach()
        wt = self._head_wt.get(self._head.weight)
        x = torch.randn(64, weight.shape[1])
        best = _best_times((lambda: F.linear(x, weight), lambda: torch.mm(x, wt)))
        if best[1] < 0.93 * best[0]:
            return True
        self._head_wt.clear()
        return False

    def _head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self._use_head_packed:
            packed = self._head_packed.get(self._head.weight)
            logits = _mkldnn_linear(hidden, packed, self._head.bias)
        elif self._use_head_wt:
            logits = torch.mm(hidden, self._head_wt.get(self._head.weight))
            if self._head.bias is not None:
                logits += self._head.bias
        else:
            logits = self._head(hidden)
        if self._logit_scale is not None:
            logits = logits * self._logit_scale
        if self._logits_scaling is not None:
            logits = logits / self._logits_scaling
        if self._final_softcap:
            logits = torch.tanh(logits / self._final_softcap) * self._final_softcap
        return logits

    def _make_greedy_head(self) -> GreedyHead | None:
        """The bounded int8 screen of `ferrobatch.greedy_head` for greedy rows, when the
        head is a plain fp32 CPU `nn.Linear` (no bias, scale or softcap) and the screen agrees
        with the fp32 argmax and is clearly faster here; else None."""
        head = self._head
        if not (
            self._split_head
            and type(head) is torch.nn.Linear
            and head.bias is None
            and self.device.type == "cpu"
            and self._logit_scale is None
            and self._logits_scaling is None
            and not self._final_softcap
            and GreedyHead.supported(head.weight)
        ):
            return None
        greedy = GreedyHead(head.weight)
        return greedy if greedy.wins() else None

    def execute_greedy(self, plan: Any, prev_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """Greedy next tokens [N] (int64, CPU) of `plan`'s sampled tokens: the argmax (first
        maximum) of the logits `execute` returns, without those logits when `fast_greedy`
        (bounded int8 screen + fp32 rescoring of the candidates)."""
        out = self.execute(plan, prev_tokens, _greedy=True)
        return out if out.dtype == torch.int64 else _argmax_rows(out)

    def execute_with_prompt(
        self, plan: Any, prompt_indices: Any, prev_tokens: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`execute`'s logits [N, vocab], and fp32 logits [M, vocab] of the tokens at
        `prompt_indices` (token indices into the plan: prompt positions whose next-token
        logprobs a request wants, `ferrobatch.prompt_logprobs`), from the same forward
        (always eager)."""
        n = len(plan.logits_indices)
        out = self.execute(plan, prev_tokens, _extra=prompt_indices)
        return out[:n], out[n:]

    @property
    def activation_dtype(self) -> torch.dtype:
        """The dtype of the activations between the linear layers."""
        return self._linears.activation_dtype if self._linears is not None else self.dtype

    def _linears_active(self) -> Any:
        return self._linears.active() if self._linears is not None else nullcontext()

    def _make_packed_linears(self, activations: str) -> PackedLinears | None:
        """Packed half-precision linears (`ferrobatch.cpu_linear`), fp32 activations when
        asked or, with "auto", when a forward that way is at least about as close to the
        exact computation as the model's own (a model whose code mixes its activations with
        half-precision tensors outside `nn.Linear` fails that check and keeps its dtype);
        layers sharing an input grouped from one calibration forward."""
        if self.model.dtype not in (torch.bfloat16, torch.float16):
            return None
        in_fwd = attention.in_ferrobatch_forward
        linears = None
        if activations != "model":
            linears = PackedLinears.of(
                self.model, activation_dtype=torch.float32, in_thread=in_fwd,
                hidden_size=getattr(text_config(self.model.config), "hidden_size", None),
            )
            if linears is not None and activations == "auto" and not self._widening_holds(
                linears
            ):
                logger.info("ferrobatch: %s keeps %s activations (its forward with fp32 "
                            "activations is further from the exact one than its own)",
                            type(self.model).__name__, self.model.dtype)
                linears = None
        if linears is None:
            linears = PackedLinears.of(self.model, in_thread=in_fwd)
        if linears is not None:
            ids = self._check_ids(16)
            try:
                with torch.inference_mode(), _eval_mode(self.model), \
                        attention.cast_attention_enabled(self._configs):
                    linears.calibrate(lambda: self.model(input_ids=ids, use_cache=False))
            except Exception as exc:  # noqa: BLE001 - no groups then: each layer alone
                logger.info("ferrobatch: no stacked linear groups (calibration forward "
                            "failed: %s: %s)", type(exc).__name__, exc)
            logger.info("ferrobatch: %d linear layers on packed %s weights (%d stacked groups, "
                        "%.0f MiB), %s activations", linears.num_layers, linears.weight_dtype,
                        linears.num_groups, linears.packed_bytes / 2**20,
                        linears.activation_dtype)
        return linears

    def _check_ids(self, n: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(0)
        return torch.randint(0, self.vocab_size, (1, n), generator=gen).to(self.device)

    def _widening_holds(self, wide: PackedLinears) -> bool:
        """Whether the model's forward with fp32 activations runs and is at least as close
        to the exact computation (fp32 products of the same weights) as its own forward."""
        ids = self._check_ids(16)
        try:
            with torch.inference_mode(), _eval_mode(self.model):
                own = self.model(input_ids=ids, use_cache=False).logits[0].float()
                with wide.active(everywhere=True), attention.cast_attention_enabled(self._configs):
                    got = self.model(input_ids=ids, use_cache=False).logits[0]
                with wide.active(exact=True):
                    ref = self.model(input_ids=ids, use_cache=False).logits[0].float()
        except Exception as exc:  # noqa: BLE001 - a model that can't: keep its dtype
            logger.info("ferrobatch: fp32 activations fail (%s: %s)", type(exc).__name__, exc)
            return False
        got = got.float()
        if not bool(torch.isfinite(got).all()):
            return False
        return bool((got - ref).norm() <= (own - ref).norm() * 1.5 + 1e-3 * ref.norm())

    def _check_split_head(self) -> bool:
        """Whether base model + output head reproduces the full forward (checked once on a
        short input with the model's own attention). Like with like: the head runs over the
        same 6 rows as the full forward's (a matmul of another M may take another kernel),
        within a tolerance of a few units in the last place of the logits' dtype (bf16: one
        ulp at |logit| 0.5 is 0.002). Why it fails is kept in `split_head_error`."""
        self.split_head_error: str | None = None
        if self._base is None or self._base is self.model or self._head is None:
            self.split_head_error = "the model has no separable base model / output head"
            return False
        ids = torch.arange(3, 9, device=self.device).unsqueeze(0) % self.vocab_size
        try:
            with torch.inference_mode(), _eval_mode(self.model):
                full = self.model(input_ids=ids, use_cache=False).logits[0]
                hidden = self._base(input_ids=ids, use_cache=False)[0][0]
                split = self._head_logits(hidden)
        except Exception as exc:  # noqa: BLE001 - fall back to the full forward
            self.split_head_error = f"{type(exc).__name__}: {exc}"[:300]
            logger.info("ferrobatch: full forward for logits (%s)", exc)
            return False
        if full.shape != split.shape:
            self.split_head_error = f"shapes {tuple(full.shape)} != {tuple(split.shape)}"
        else:
            ulp = max(torch.finfo(t.dtype).eps for t in (full, split, hidden)
                      if t.is_floating_point())
            tol = max(1e-3, 4 * ulp)
            diff = (full.float() - split.float()).abs()
            bound = tol + tol * full.float().abs()
            if not bool((diff <= bound).all()):
                self.split_head_error = (f"max |logit diff| {diff.max().item():.3g} over "
                                         f"tolerance {tol:.3g} (rtol = atol)")
        if self.split_head_error is not None:
            logger.info("ferrobatch: output head not separable (%s); using logits_to_keep",
                        self.split_head_error)
            return False
        return True

    # --- execution -------------------------------------------------------------------------

    def _tensor(self, values: Any) -> torch.Tensor:
        arr = np.ascontiguousarray(values, dtype=np.int64)
        return torch.from_numpy(arr).to(self.device, non_blocking=True)

    def _prev_token_fill(
        self, plan: Any, prev_tokens: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Device (token index, index into `prev_tokens`) pairs for the tokens whose input id
        is the previous plan's sample (`plan.prev_token_index >= 0`); None when there are
        none. Checked on the host (the index array is host data): no device sync."""
        idx = getattr(plan, "prev_token_index", None)
        if idx is None:
            return None
        idx = np.asarray(idx, dtype=np.int64)
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
        return self._tensor(pos), self._tensor(src)

    def _fill_prev_tokens(
        self,
        input_ids: torch.Tensor,
        fill: tuple[torch.Tensor, torch.Tensor] | None,
        prev_tokens: torch.Tensor | None,
    ) -> None:
        """`input_ids[pos] = prev_tokens[src]` on the device, in place (any int dtype)."""
        if fill is None or prev_tokens is None:
            return
        pos, src = fill
        prev = prev_tokens.reshape(-1).to(self.device, non_blocking=True)
        input_ids.index_copy_(0, pos, prev.index_select(0, src).to(input_ids.dtype))

    def execute(
        self, plan: Any, prev_tokens: torch.Tensor | None = None, *, _greedy: bool = False,
        _extra: Any = None,
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
            self.cache.swap(getattr(plan, "swap_out", None), getattr(plan, "swap_in", None))
            fill = self._prev_token_fill(plan, prev_tokens)
            flat_ids = self._tensor(plan.input_ids)
            if flat_ids.shape[0] == 0:
                return torch.empty(0, self.vocab_size, device=self.device)
            if self._graphs is not None and self.rope is None and _extra is None:
                hidden = self._execute_graph(plan, fill, prev_tokens)
                if hidden is not None:
                    return self._head_logits(hidden).float()
                self._graph_counts["eager_steps"] += 1
            self._fill_prev_tokens(flat_ids, fill, prev_tokens)
            input_ids = flat_ids.unsqueeze(0)
            positions = self._tensor(plan.positions).unsqueeze(0)
            logits_indices = self._tensor(plan.logits_indices)
            if _extra is not None:  # prompt positions too (execute_with_prompt)
                logits_indices = torch.cat([logits_indices, self._tensor(_extra)])
                _greedy = False
            if self.attention_backend == "sdpa":
                step = attention.build_step(
                    plan, self.cache, self.layer_types, self.sliding_window,
                    decode_kernel=self.decode_kernel,
                )
                if self._linears is not None and self._linears.widens:
                    step.out_dtype = self.cache.dtype  # o_proj rounds its input to it
            else:
                step = attention.build_kernel_step(
                    plan, self.cache, self.layer_types, self.sliding_window,
                    self.attention_backend, self._num_sms,
                )
            rope = self.rope.forward(plan, self.device) if self.rope is not None else nullcontext()
            with _eval_mode(self.model), rope:
                logits = self._forward(input_ids, positions, logits_indices, step, _greedy)
            self._check_calls(step)
            return logits if logits.dtype == torch.int64 else logits.float()

    def _forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        logits_indices: torch.Tensor,
        step: attention.PagedStep | attention.KernelStep,
        greedy: bool = False,
    ) -> torch.Tensor:
        """Logits of the sampled tokens; with `greedy` and a greedy head, their argmax
        token ids (int64) when the screen decides."""
        kwargs = {attention.STEP_KWARG: step, "use_cache": False}
        with attention.paged_attention_enabled(self._configs, step), self._linears_active():
            if self._split_head:
                out = self._base(input_ids=input_ids, position_ids=positions, **kwargs)
                hidden = out[0][0].index_select(0, logits_indices)
                if greedy and self._greedy_head is not None:
                    tokens = self._greedy_head.argmax(hidden)
                    if tokens is not None:
                        return tokens
                return self._head_logits(hidden)
            out = self.model(
                input_ids=input_ids, position_ids=positions, logits_to_keep=logits_indices,
                **kwargs,
            )
            return out.logits[0]

    def close(self) -> None:
        """Release the cache and forget the model (its config is already restored)."""
        if self._closed:
            return
        self._closed = True
        if self._graphs is not None:
            self._graphs.clear()
        attention.forget(self._configs)
        self.cache = None  # type: ignore[assignment]
        self._head_wt.clear()
        self._head_packed.clear()
        self._greedy_head = None
        self.fast_greedy = False

    def __enter__(self) -> ModelRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_HAVE_MKLDNN_LINEAR = bool(
    torch.backends.mkldnn.is_available()
    and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    and hasattr(torch.ops.mkldnn, "_linear_pointwise")
)


class _WeightDerived:
    """A tensor derived from a weight (a transposed copy, a reordered layout), recomputed
    only when the weight object or its in-place version counter changes."""

    def __init__(self, derive: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self._derive = derive
        self._key: tuple[int, int] | None = None
        self._value: torch.Tensor | None = None

    def get(self, weight: torch.Tensor) -> torch.Tensor:
        key = (id(weight), weight._version)
        if self._value is None or self._key != key:
            with torch.no_grad():
                self._value = self._derive(weight.detach())
            self._key = key
        return self._value

    def clear(self) -> None:
        self._key = self._value = None


def _mkldnn_linear(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def _best_times(fns: Any, rounds: int = 5) -> list[float]:
    """Best CPU time of each function over `rounds` (the first a warm-up; the machine may be
    busy, so process time and the best of the rest)."""
    best = [float("inf")] * len(fns)
    with torch.inference_mode():
        for rnd in range(rounds):
            for i, fn in enumerate(fns):
                start = time.process_time()
                fn()
                if rnd:
                    best[i] = min(best[i], time.process_time() - start)
    return best


_PACKED_CHECK_BYPASS = False


def _install_packed_check_bypass() -> None:
    """transformers' mask preparation calls `find_packed_sequence_indices(position_ids)`
    whenever a forward has position ids and no mask or cache, and decides on its result on
    the host (`.all()`): a device sync on every eager CUDA step, which would stall the async
    pipeline (transformers 5.17+ skip it while a CUDA graph is being captured). Inside a
    ferrobatch forward the mask function returns None whatever that finds, so on a thread
    that is inside a ferrobatch forward it returns None (no packing) without touching the
    device; everywhere else the original runs. Installed once, process-wide."""
    global _PACKED_CHECK_BYPASS
    if _PACKED_CHECK_BYPASS:
        return
    from transformers import masking_utils

    original = getattr(masking_utils, "find_packed_sequence_indices", None)
    if original is None:
        return

    def find_packed_sequence_indices(position_ids: torch.Tensor) -> torch.Tensor | None:
        if getattr(attention._STATE, "depth", 0):  # this thread is in a ferrobatch forward
            return None
        return original(position_ids)

    find_packed_sequence_indices.__wrapped__ = original  # type: ignore[attr-defined]
    masking_utils.find_packed_sequence_indices = find_packed_sequence_indices
    _PACKED_CHECK_BYPASS = True


@contextmanager
def _eval_mode(model: torch.nn.Module) -> Iterator[None]:
    """Dropout off for the block; every module's own training flag restored afterwards."""
    if not model.training:
        yield
        return
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for m, mode in modes:
            m.training = mode
