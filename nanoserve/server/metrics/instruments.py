"""Every counter, gauge and histogram nanoserve updates, created on one registry.

Names follow Prometheus conventions: `nanoserve_` prefix, base units (seconds, bytes) as suffixes,
`_total` on counters. Labels stay low-cardinality: routes are templated paths, never raw URLs.
The gauges that describe the engine's state are not here: they are read from `Engine.stats()` at
scrape time (nanoserve/server/metrics/engine_collector.py), so they can never drift from the truth.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# About 1 ms to 100 s: a decode step on a small CPU model is ~1 ms, a long queued generation ~minutes.
LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 50.0, 100.0,
)
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
TOKEN_COUNT_BUCKETS = tuple(2**i for i in range(15))  # 1 to 16384 tokens per request


class Instruments:
    """The metric objects themselves; `Metrics` and its helpers update them."""

    def __init__(self, registry: CollectorRegistry) -> None:
        def counter(name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
            return Counter(name, doc, labels, registry=registry)

        def seconds(name: str, doc: str, labels: tuple[str, ...] = ()) -> Histogram:
            return Histogram(name, doc, labels, buckets=LATENCY_BUCKETS, registry=registry)

        # HTTP layer (nanoserve/server/metrics/http.py).
        self.http_requests = counter(
            "nanoserve_http_requests_total",
            "HTTP requests answered, by route template, method and status code.",
            ("route", "method", "code"),
        )
        self.http_in_flight = Gauge(
            "nanoserve_http_requests_in_flight",
            "HTTP requests being handled now (streams included), by route.",
            ("route",), registry=registry,
        )
        self.http_duration = seconds(
            "nanoserve_http_request_duration_seconds",
            "End-to-end request duration from HTTP arrival to the last byte sent, by route.",
            ("route",),
        )
        # Connections (nanoserve/server/http/connection_guard.py, updated by the server's protocol).
        self.connection_limit_hits = counter(
            "nanoserve_connection_limit_hits_total",
            "Connections refused or closed by a connection limit, by limit (docs/limits.md).",
            ("limit",),
        )
        self.connections_open = Gauge(
            "nanoserve_connections_open", "Client connections open now (refused ones not counted).",
            registry=registry,
        )
        self.connections_capacity = Gauge(
            "nanoserve_connections_capacity",
            "Connections beyond which new ones get 503 (max_connections, lowered to fit the file limit).",
            registry=registry,
        )
        # Generation requests (nanoserve/server/metrics/stream.py).
        self.finished = counter(
            "nanoserve_requests_finished_total",
            "Generation requests that ended, by route and finish reason (one series per request).",
            ("route", "finish_reason"),
        )
        self.cancelled = counter(
            "nanoserve_requests_cancelled_total",
            "Generation requests abandoned by their client (disconnect or stop) before they finished.",
            ("route",),
        )
        self.ttft = seconds(
            "nanoserve_time_to_first_token_seconds",
            "Time from HTTP arrival to the first generated token (queueing and prefill included).",
        )
        self.itl = seconds(
            "nanoserve_inter_token_latency_seconds",
            "Time between consecutive generated tokens of one request, as its consumer sees them.",
        )
        self.queue = seconds(
            "nanoserve_queue_duration_seconds",
            "Time from HTTP arrival until the engine first scheduled the request.",
        )
        self.prompt_tokens = counter(
            "nanoserve_prompt_tokens_total", "Prompt tokens of generation requests, after cropping."
        )
        self.generated_tokens = counter(
            "nanoserve_generated_tokens_total", "Tokens generated and delivered to clients."
        )
        self.request_prompt_tokens = Histogram(
            "nanoserve_request_prompt_tokens", "Prompt tokens per generation request, after cropping.",
            buckets=TOKEN_COUNT_BUCKETS, registry=registry,
        )
        self.request_generated_tokens = Histogram(
            "nanoserve_request_generated_tokens", "Tokens generated per request (counted when it ends).",
            buckets=TOKEN_COUNT_BUCKETS, registry=registry,
        )
        self.cropped_tokens = counter(
            "nanoserve_cropped_prompt_tokens_total",
            "Prompt tokens dropped from the left so the prompt fits the model's window.",
        )
        # Engine thread (nanoserve/server/metrics/engine_collector.py, EngineObserver hooks).
        self.prefill = seconds(
            "nanoserve_prefill_duration_seconds", "Time the engine spent prefilling one request's prompt."
        )
        self.step = seconds(
            "nanoserve_engine_step_duration_seconds", "Duration of one engine step (a batched forward pass)."
        )
        self.batch_size = Histogram(
            "nanoserve_engine_batch_size", "Sequences in one engine step.",
            buckets=BATCH_SIZE_BUCKETS, registry=registry,
        )
        self.prefill_tokens = counter(
            "nanoserve_engine_prefill_tokens_total",
            "Tokens run through prefill: prompts plus re-prefills after a context shift.",
        )
        self.rejected = counter(
            "nanoserve_requests_rejected_total",
            "Generation requests the engine refused before running them, by reason (e.g. overloaded).",
            ("reason",),
        )
