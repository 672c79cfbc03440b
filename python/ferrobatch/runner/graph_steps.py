"""Decode-only steps padded to graph shapes and replayed through CUDA graphs (the runner's
`graphs` part; the graph cache and padding live in `ferrobatch.cuda.graphs`)."""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from ferrobatch.attention.kernel_step import KernelStep
from ferrobatch.attention.kv_cache import PagedKVCache
from ferrobatch.cuda import graphs
from ferrobatch.defaults import CAPTURE_AFTER, DEFAULT_MAX_GRAPHS
from ferrobatch.model_config import SLIDING

if TYPE_CHECKING:
    from ferrobatch.config import ContinuousBatchingConfig
    from ferrobatch.core import StepPlan

logger = logging.getLogger("ferrobatch")

__all__ = ["GraphSteps"]

_KEYS_REMEMBERED = 4096  # graph keys whose step count is kept before they get a graph

#: the base model's final hidden states [T, hidden] of (input_ids [1, T], positions [1, T])
#: over a step, through the paged attention (the runner's)
BaseForward = Callable[[torch.Tensor, torch.Tensor, KernelStep], torch.Tensor]


class GraphSteps:
    """The runner's CUDA-graph steps: set up (`setup`), capture, replay (`hidden`), counters
    (`stats`). Off until `setup`; `enabled` while a graph cache is held."""

    def __init__(
        self,
        *,
        kv_cache: PagedKVCache,
        layer_types: list[str],
        sliding_window: int | None,
        device: torch.device,
        attention_backend: str,
        num_sms: int,
        split_head: bool,
        base_forward: BaseForward,
    ) -> None:
        """`base_forward` runs the base model over a step (the padded forward a graph
        captures); `split_head`: whether the output head is separable from the base model
        (graphs output hidden states, the head runs eager)."""
        self._kv_cache = kv_cache
        self._layer_types = layer_types
        self._sliding_window = sliding_window
        self._device = device
        self._attention_backend = attention_backend
        self._num_sms = num_sms
        self._split_head = split_head
        self._base_forward = base_forward
        #: the graphs by key (`graphs.GraphCache`, an LRU), None while graph steps are off
        self.cache: graphs.GraphCache | None = None
        self.mode: str | None = None  # "cuda" | "eager" once set up
        self.buckets: graphs.GraphBuckets | None = None
        self.backend: str | None = None
        self.capture_after = 1
        #: CUDA graphs in use (False again after a failed capture)
        self.use_cuda_graph = False
        #: why the runner resolved CUDA graphs off at construction (None: it did not)
        self.off_reason: str | None = None
        self.error: str | None = None  # why graphs were turned off after a failed capture
        self._key_seen: OrderedDict[graphs.GraphKey, int] = OrderedDict()
        self._pool: Any = None
        self._counts = {"graph_steps": 0, "eager_steps": 0, "captures": 0}
        self._pool_bytes = 0
        self._input_bytes = 0

    @property
    def enabled(self) -> bool:
        """Whether decode-only steps try the padded graph path."""
        return self.cache is not None

    def setup(
        self,
        mode: str,
        *,
        config: ContinuousBatchingConfig | None = None,
        max_graphs: int | None = None,
        buckets: graphs.GraphBuckets | None = None,
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
        if mode not in ("cuda", "eager"):
            raise ValueError(f"unknown graph mode {mode!r}")
        if not self._split_head:
            raise ValueError("padded graph steps need an output head separable from the model")
        self.buckets = buckets or graphs.GraphBuckets.from_config(
            config, num_kv_heads=self._kv_cache.num_kv_heads, num_sms=self._num_sms
        )
        self.backend = backend or (self._attention_backend if mode == "cuda" else "torch")
        if self.backend not in ("triton", "flash_attn", "torch"):
            raise ValueError(f"no graphs with attention backend {self.backend!r}")
        self.mode = mode
        self.capture_after = max(1, capture_after or (CAPTURE_AFTER if mode == "cuda" else 1))
        self._key_seen = OrderedDict()
        self._pool = torch.cuda.graph_pool_handle() if mode == "cuda" else None
        self.cache = graphs.GraphCache(self._capture, max_graphs=max_graphs or DEFAULT_MAX_GRAPHS)
        self.use_cuda_graph = mode == "cuda"

    def _padded_forward(self, a: Any, key: graphs.GraphKey) -> torch.Tensor:
        """The forward a graph captures: the base model over the static inputs `a` (padded
        plan arrays, int32 device tensors) with a `KernelStep` whose integers all come from
        `key`; returns the final hidden states at `a["logits_indices"]` ([N_pad, hidden])."""
        widths = dict(key.table_widths)
        types = list(widths)
        step = KernelStep(
            cache=self._kv_cache,
            layer_types=self._layer_types,
            backend=self.backend,
            cu_seqlens_q=a["cu_seqlens_q"],
            seqlens_k=a["seqlens_k"],
            slot_mapping={t: a[f"slot_mapping/{t}"].long() for t in types},
            block_tables={t: a[f"block_tables/{t}"] for t in types},
            max_seqlen_q=key.max_seqlen_q,
            max_seqlen_k=key.max_seqlen_k,
            num_splits=dict(key.num_splits),
            sliding_window=self._sliding_window,
            ring_size=widths.get(SLIDING),
            num_tokens=key.tokens,
        )
        input_ids = a["input_ids"].long().unsqueeze(0)
        positions = a["positions"].long().unsqueeze(0)
        # (its count of attention calls is checked on the host: during a capture, once)
        hidden = self._base_forward(input_ids, positions, step)
        return hidden.index_select(0, a["logits_indices"].long())

    def _capture(self, key: graphs.GraphKey) -> graphs.EagerReplay:
        """A graph for `key` (GraphCache's capture function)."""

        def fn(a: Any) -> torch.Tensor:
            return self._padded_forward(a, key)

        self._counts["captures"] += 1
        if self.mode == "cuda":
            before = torch.cuda.memory_reserved(self._device)
            graph = graphs.CapturedGraph.for_plan(fn, key, self._device, pool=self._pool)
            self._pool_bytes += max(0, torch.cuda.memory_reserved(self._device) - before)
        else:
            graph = graphs.EagerReplay.for_plan(fn, key, self._device)
        self._input_bytes += graph.inputs.nbytes
        return graph

    def hidden(self, plan: StepPlan, *, page_size: int,
               fill_ids: Callable[[torch.Tensor], None] | None = None) -> torch.Tensor | None:
        """Hidden states [N, hidden] of `plan` through its padded graph, or None when the
        step runs eager (not decode-only, beyond the buckets, a key not seen often enough
        yet, or a failed capture: graphs off from then on) — counted as an eager step.
        `fill_ids(input_ids)` writes the inputs taken from the previous step's samples into
        the graph's static input ids (only they are uploaded: the plan's other arrays reach
        the static inputs through `graph.load`)."""
        out = self._replay(plan, page_size, fill_ids)
        if out is None:
            self._counts["eager_steps"] += 1
        return out

    def _replay(self, plan: StepPlan, page_size: int,
                fill_ids: Callable[[torch.Tensor], None] | None) -> torch.Tensor | None:
        assert self.cache is not None and self.buckets is not None
        padded = graphs.pad_plan(
            plan, self.buckets, page_size=page_size, sliding_window=self._sliding_window
        )
        if padded is None:
            return None
        key = padded.key
        if key not in self.cache and self.capture_after > 1:
            seen = self._key_seen.pop(key, 0) + 1
            if seen < self.capture_after:
                self._key_seen[key] = seen  # most recent last; bounded below
                while len(self._key_seen) > _KEYS_REMEMBERED:
                    self._key_seen.popitem(last=False)
                return None
        try:
            graph = self.cache.get(key)
        except Exception as exc:
            if self.mode != "cuda":
                raise
            # A capture that fails (an op that cannot be captured in this model or this
            # torch/transformers) must not stop the engine: eager from now on, said loudly.
            self.error = f"{type(exc).__name__}: {exc}"
            logger.warning("ferrobatch: CUDA graph capture failed for %s (%s); running eager "
                           "from now on", padded.key, self.error)
            self.cache.clear()
            self.cache = None
            self.use_cuda_graph = False
            return None
        graph.load(padded)
        if fill_ids is not None:
            fill_ids(graph.static_inputs["input_ids"])
        self._counts["graph_steps"] += 1
        return graph.run()[: padded.num_logits]

    def stats(self) -> dict[str, Any]:
        """Graph counters: `enabled`, `mode` ("cuda" | "eager" | None), `graphs` (cached now),
        `max_graphs`, `captures`, `hits`, `misses`, `evictions`, `graph_steps` /
        `eager_steps` (steps run padded / eager), `pool_bytes` (device memory reserved while
        capturing: the shared pool and the graphs' outputs; 0 off CUDA), `input_bytes`
        (static inputs of every graph captured so far), `capture_error` (why graphs were
        turned off after a failed capture, else None), `off_reason` (why the runner resolved
        graphs off at construction, else None)."""
        out: dict[str, Any] = {
            "enabled": self.cache is not None, "mode": self.mode, "graphs": 0,
            "max_graphs": 0, "hits": 0, "misses": 0, "evictions": 0,
            **self._counts,
            "pool_bytes": self._pool_bytes, "input_bytes": self._input_bytes,
            "capture_error": self.error, "off_reason": self.off_reason,
        }
        if self.cache is not None:
            st = self.cache.stats()
            out.update(graphs=st["graphs"], max_graphs=self.cache.max_graphs,
                       capture_after=self.capture_after,
                       hits=st["graph_hits"], misses=st["graph_misses"],
                       evictions=st["graph_evictions"])
        return out

    def close(self) -> None:
        if self.cache is not None:
            self.cache.clear()
