"""Decode-only steps padded to graph shapes and replayed through CUDA graphs (the runner's
`GraphSteps` part; the graph cache and padding live in `ferrobatch.cuda.graphs`)."""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ferrobatch.attention import context, registry
from ferrobatch.attention.kernel_step import KernelStep
from ferrobatch.defaults import CAPTURE_AFTER, DEFAULT_MAX_GRAPHS
from ferrobatch.runner.patches import eval_mode

if TYPE_CHECKING:
    from ferrobatch.config import ContinuousBatchingConfig
    from ferrobatch.core import StepPlan
    from ferrobatch.cuda.graphs import EagerReplay, GraphBuckets, GraphKey

logger = logging.getLogger("ferrobatch")

_KEYS_REMEMBERED = 4096  # graph keys whose step count is kept before they get a graph


class GraphSteps:
    """`ModelRunner`'s CUDA-graph steps: set up, capture, replay, counters."""

    def _setup_graphs(
        self,
        mode: str,
        *,
        config: ContinuousBatchingConfig | None = None,
        max_graphs: int | None = None,
        buckets: GraphBuckets | None = None,
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
        from ferrobatch.cuda import graphs

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
        self._key_seen: OrderedDict[GraphKey, int] = OrderedDict()
        self._graph_pool = torch.cuda.graph_pool_handle() if mode == "cuda" else None
        self._graphs = graphs.GraphCache(self._capture, max_graphs=max_graphs or DEFAULT_MAX_GRAPHS)

    def _padded_forward(self, a: Any, key: GraphKey) -> torch.Tensor:
        """The forward a graph captures: the base model over the static inputs `a` (padded
        plan arrays, int32 device tensors) with a `KernelStep` whose integers all come from
        `key`; returns the final hidden states at `a["logits_indices"]` ([N_pad, hidden])."""
        from ferrobatch.cuda.graphs import SLIDING

        widths = dict(key.table_widths)
        types = list(widths)
        step = KernelStep(
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
        kwargs = {context.STEP_KWARG: step, "use_cache": False}
        with eval_mode(self.model), registry.paged_attention_enabled(self._configs, step):
            out = self._base(input_ids=input_ids, position_ids=positions, **kwargs)
        # Host-side count: during a capture this runs once, at capture time.
        self._check_calls(step)
        return out[0][0].index_select(0, a["logits_indices"].long())

    def _capture(self, key: GraphKey) -> EagerReplay:
        """A graph for `key` (GraphCache's capture function)."""
        from ferrobatch.cuda import graphs

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
        self, plan: StepPlan, fill: tuple[np.ndarray, np.ndarray] | None,
        prev_tokens: torch.Tensor | None,
    ) -> torch.Tensor | None:
        """Hidden states [N, hidden] of `plan` through its padded graph, or None when the
        step runs eager (not decode-only, or beyond the buckets). `fill`: the host (pos,
        src) of `_prev_token_fill`, uploaded here (only they: the plan's other arrays reach
        the graph's static inputs through `graph.load`)."""
        from ferrobatch.cuda import graphs

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
        if fill is not None:
            dev = self._upload({"pos": fill[0], "src": fill[1]})
            self._fill_prev_tokens(graph.static_inputs["input_ids"], (dev["pos"], dev["src"]),
                                   prev_tokens)
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
