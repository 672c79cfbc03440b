"""Prometheus metrics for the ferrobatch server, through ``prometheus_client``.

:class:`ServerMetrics` holds the metrics the OpenAI-compatible server exports at
``GET /metrics`` in a registry of its own (several servers in one process do not collide),
rendered in the Prometheus text format or, when the scraper asks for it, OpenMetrics.

Server-side metrics (request counts, latencies, token counts) are updated by the server as
requests run; engine-side metrics (cache blocks, prefix hit rate, offloads, soft resets,
scheduler queue) are read from ``Engine.stats()`` each time the endpoint is scraped.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import choose_encoder, generate_latest

__all__ = ["ServerMetrics"]


# Latency buckets (seconds): fine at the low end for CPU decode steps, long tail for queues.
TTFT_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075,
    0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
)  # fmt: skip
# Engine step times (seconds) and the prefill tokens a step's time budget allowed.
STEP_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.75, 1.0, 1.5, 2.5,
    5.0, 10.0,
)  # fmt: skip
PREFILL_BUDGET_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)

# Engine.stats() keys read for each engine metric, first present wins. Several spellings are
# accepted so the exporter keeps working while the stats dictionary evolves.
_STAT_KEYS: dict[str, tuple[str, ...]] = {
    "waiting": ("waiting", "num_waiting", "requests_waiting"),
    "running": ("running", "num_running", "running_requests"),
    "swapped": ("swapped", "num_swapped"),
    "blocks_used": ("num_used_blocks", "used_blocks"),
    "blocks_free": ("num_free_blocks", "free_blocks"),
    "blocks_cached": ("num_cached_blocks", "cached_blocks"),
    "blocks_total": ("num_blocks", "total_blocks"),
    "prefix_hit_rate": ("prefix_hit_rate", "prefix_cache_hit_rate"),
    "prefix_hits": ("prefix_hit_tokens", "prefix_hits"),
    "prefix_queries": ("prefix_query_tokens", "prompt_tokens"),
    "offloads": ("num_offloads", "offloads"),
    "soft_resets": ("num_soft_resets", "soft_resets"),
    "preemptions": ("num_preemptions", "preemptions"),
    "evictions": ("num_evictions", "evictions"),
    "spec_acceptance_rate": ("spec_acceptance_rate",),
    "spec_tokens_per_step": ("spec_tokens_per_step",),
}


def _lookup(stats: Mapping[str, Any], what: str) -> float | None:
    for key in _STAT_KEYS[what]:
        value = stats.get(key)
        if isinstance(value, bool):
            continue
        if isinstance(value, int | float):
            return float(value)
    return None


def _sanitize(name: str) -> str:
    cleaned = re.sub(r"[^a-zA-Z0-9_]", "_", name)
    return cleaned if cleaned and not cleaned[0].isdigit() else f"_{cleaned}"


class ServerMetrics:
    """Every metric the server exports, and the hooks that update them.

    The request-path hooks (``on_*``) are called by the server on the event loop; ``render``
    is called per scrape with the latest ``Engine.stats()`` (or ``None`` while the engine
    is loading).
    """

    def __init__(self, prefix: str = "ferrobatch") -> None:
        self.registry = CollectorRegistry()
        self._prefix = prefix
        self.requests = self._counter(
            "requests_total",
            "Finished generation requests (one per choice) by endpoint and finish reason "
            "(stop, length, cancelled = client gone, error).",
            ("endpoint", "finish_reason"),
        )
        self.http_errors = self._counter(
            "http_errors_total", "Requests rejected with an error status, by HTTP status code.",
            ("code",),
        )  # fmt: skip
        self.client_gone = self._counter(
            "client_disconnects_total",
            "Clients that left before their answer: while sending the body (body), before "
            "their prompt's turn in the tokenizer thread (tokenize) or while waiting for a "
            "non-streaming answer (response). Not errors of the server.",
            ("stage",),
        )
        self.prompt_tokens = self._counter(
            "prompt_tokens_total", "Prompt tokens of admitted requests (per choice)."
        )
        self.generation_tokens = self._counter(
            "generation_tokens_total", "Tokens generated and delivered to clients."
        )
        self.waiting = self._gauge(
            "requests_waiting",
            "Queue depth: requests accepted by the server that have no token yet "
            "(bounded by --max-queue).",
        )
        self.running = self._gauge("requests_running", "Requests producing tokens right now.")
        self.ttft = self._histogram(
            "time_to_first_token_seconds",
            "Time from request arrival to its first generated token.", TTFT_BUCKETS,
        )  # fmt: skip
        self.itl = self._histogram(
            "inter_token_latency_seconds",
            "Time between consecutive generated tokens of a request.", ITL_BUCKETS,
        )  # fmt: skip
        self.e2e = self._histogram(
            "request_duration_seconds", "Time from request arrival to its last token.",
            E2E_BUCKETS,
        )  # fmt: skip
        self.step_time = self._histogram(
            "step_duration_seconds",
            "Time of each engine step (forward, sampling, update).", STEP_BUCKETS,
        )  # fmt: skip
        self.prefill_budget = self._histogram(
            "step_prefill_budget_tokens",
            "Prefill tokens each step's time budget allowed (--max-step-ms; "
            "max_batch_tokens when it did not bind).", PREFILL_BUDGET_BUCKETS,
        )  # fmt: skip
        self.engine_ready = self._gauge(
            "engine_ready", "1 when the engine is loaded and accepting requests."
        )
        self.engine_waiting = self._gauge(
            "scheduler_waiting_requests",
            "Requests waiting in the scheduler queue (from Engine.stats()).",
        )
        self.engine_running = self._gauge(
            "scheduler_running_requests",
            "Requests prefilling or decoding in the scheduler (from Engine.stats()).",
        )
        self.engine_swapped = self._gauge(
            "scheduler_swapped_requests",
            "Requests offloaded to the CPU swap pool (from Engine.stats()).",
        )
        self.cache_blocks = self._gauge(
            "cache_blocks",
            "KV-cache blocks by state: used (held by requests), free (available, including "
            "cached), cached (free blocks still holding reusable prefix content), total.",
            ("state",),
        )
        self.cache_usage = self._gauge(
            "cache_usage_ratio", "Share of KV-cache blocks held by requests (0..1)."
        )
        self.prefix_hit_rate = self._gauge(
            "prefix_cache_hit_rate",
            "Share of prompt tokens served from the prefix cache since start (0..1).",
        )
        self.offloads = self._gauge(
            "offloads_total",
            "Requests offloaded to the CPU swap pool since start (counter kept by the engine).",
        )
        self.soft_resets = self._gauge(
            "soft_resets_total",
            "Requests soft-reset (blocks freed, recomputed later) since start "
            "(counter kept by the engine).",
        )
        self.preemptions = self._gauge(
            "preemptions_total",
            "Preemptions (offloads plus soft resets) since start (counter kept by the engine).",
        )
        self.evictions = self._gauge(
            "prefix_cache_evictions_total",
            "Cached prefix blocks reclaimed for new content since start.",
        )
        self.spec_acceptance = self._gauge(
            "spec_decode_acceptance_rate",
            "Speculative decoding: proposed tokens accepted / proposed (0 when off).",
        )
        self.spec_tokens_per_step = self._gauge(
            "spec_decode_tokens_per_step",
            "Speculative decoding: tokens a speculating row produced per step (1 = none).",
        )
        self.engine_stats = self._gauge(
            "engine_stat", "Every numeric entry of Engine.stats(), by key.", ("key",)
        )

    def _counter(self, name: str, help: str, labelnames: Sequence[str] = ()) -> Counter:
        """The counter ``<prefix>_<name>`` (``name`` ends in ``_total``)."""
        return Counter(f"{self._prefix}_{name}", help, labelnames, registry=self.registry)

    def _gauge(self, name: str, help: str, labelnames: Sequence[str] = ()) -> Gauge:
        """The gauge ``<prefix>_<name>``."""
        return Gauge(f"{self._prefix}_{name}", help, labelnames, registry=self.registry)

    def _histogram(self, name: str, help: str, buckets: Iterable[float]) -> Histogram:
        """The histogram ``<prefix>_<name>``."""
        return Histogram(f"{self._prefix}_{name}", help, buckets=tuple(buckets),
                         registry=self.registry)  # fmt: skip

    # -- request-path hooks -------------------------------------------------------------

    def on_request_error(self, status: int) -> None:
        """A request was rejected with HTTP ``status``."""
        self.http_errors.labels(code=str(status)).inc()

    def on_client_gone(self, stage: str) -> None:
        """A client disconnected at ``stage`` (body, tokenize, response)."""
        self.client_gone.labels(stage=stage).inc()

    def on_admitted(self, prompt_tokens: int) -> None:
        """A choice was submitted to the engine."""
        self.prompt_tokens.inc(prompt_tokens)
        self.waiting.inc()

    def on_first_token(self, ttft: float) -> None:
        """A choice got its first token ``ttft`` seconds after arrival."""
        self.waiting.dec()
        self.running.inc()
        self.ttft.observe(ttft)

    def on_tokens(self, count: int, gap: float | None) -> None:
        """``count`` tokens arrived together; ``gap`` = seconds since the previous delivery."""
        self.generation_tokens.inc(count)
        if gap is not None and count > 0:
            per_token = gap / count
            for _ in range(count):
                self.itl.observe(per_token)

    def on_finished(
        self, endpoint: str, finish_reason: str, started: bool, duration: float | None
    ) -> None:
        """A choice ended (``started``: it had produced a token)."""
        if started:
            self.running.dec()
        else:
            self.waiting.dec()
        self.requests.labels(endpoint=endpoint, finish_reason=finish_reason).inc()
        if duration is not None:
            self.e2e.observe(duration)

    def on_steps(self, records: Iterable[tuple[float, int]]) -> None:
        """Engine steps since the last call: (seconds, prefill budget tokens) each."""
        for seconds, budget in records:
            self.step_time.observe(seconds)
            self.prefill_budget.observe(budget)

    # -- scrape ---------------------------------------------------------------------------

    def update_from_stats(self, stats: Mapping[str, Any] | None, ready: bool) -> None:
        """Refresh the engine gauges from an ``Engine.stats()`` dictionary."""
        self.engine_ready.set(1.0 if ready else 0.0)
        if not stats:
            return
        for gauge, what in (
            (self.engine_waiting, "waiting"),
            (self.engine_running, "running"),
            (self.engine_swapped, "swapped"),
            (self.offloads, "offloads"),
            (self.soft_resets, "soft_resets"),
            (self.preemptions, "preemptions"),
            (self.evictions, "evictions"),
            (self.spec_acceptance, "spec_acceptance_rate"),
            (self.spec_tokens_per_step, "spec_tokens_per_step"),
        ):
            value = _lookup(stats, what)
            if value is not None:
                gauge.set(value)
        used = _lookup(stats, "blocks_used")
        free = _lookup(stats, "blocks_free")
        cached = _lookup(stats, "blocks_cached")
        total = _lookup(stats, "blocks_total")
        for state, value in (("used", used), ("free", free), ("cached", cached)):
            if value is not None:
                self.cache_blocks.labels(state=state).set(value)
        if total is None and used is not None and free is not None:
            total = used + free + (cached or 0.0)
        if total is not None:
            self.cache_blocks.labels(state="total").set(total)
            if used is not None and total > 0:
                self.cache_usage.set(used / total)
        rate = _lookup(stats, "prefix_hit_rate")
        if rate is None:
            hits = _lookup(stats, "prefix_hits")
            queries = _lookup(stats, "prefix_queries")
            if hits is not None and queries:
                rate = hits / queries
        if rate is not None:
            self.prefix_hit_rate.set(rate)
        self.engine_stats.clear()
        for key, value in stats.items():
            if isinstance(value, bool):
                value = int(value)
            if isinstance(value, int | float):
                self.engine_stats.labels(key=_sanitize(str(key))).set(float(value))

    def render(self, stats: Mapping[str, Any] | None = None, ready: bool = True) -> str:
        """The Prometheus text format, engine gauges refreshed from ``stats`` first."""
        self.update_from_stats(stats, ready)
        return generate_latest(self.registry).decode("utf-8")

    def exposition(
        self, stats: Mapping[str, Any] | None, ready: bool, accept: str | None
    ) -> tuple[bytes, str]:
        """(body, Content-Type) of a scrape whose ``Accept`` header is `accept`: OpenMetrics
        when it asks for it, else the Prometheus text format."""
        self.update_from_stats(stats, ready)
        encoder, content_type = choose_encoder(accept or "")
        return encoder(self.registry), content_type
