"""The engine side of the metrics: observer hooks (engine thread) and scrape-time gauges.

The observer is called from the engine's model thread on every step, so it only updates
prometheus-client objects (thread-safe, a lock and an add). The scheduler gauges are not pushed at
all: a custom collector asks `Engine.stats()` when Prometheus scrapes, so a gauge can never be left
stale by a missed update and an idle server always reads zero.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any, Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from nanoserve.engine.types import EngineStats, FinishReason, Usage
from nanoserve.server.metrics.instruments import Instruments

log = logging.getLogger(__name__)


class EngineMetricsObserver:
    """An `EngineObserver` (nanoserve/engine/types.py) that records into `Instruments`."""

    def __init__(self, instruments: Instruments) -> None:
        self._m = instruments

    def on_step(self, duration_s: float, batch_size: int, prefill_tokens: int) -> None:
        self._m.step.observe(duration_s)
        if batch_size > 0:
            self._m.batch_size.observe(batch_size)
        if prefill_tokens > 0:
            self._m.prefill_tokens.inc(prefill_tokens)

    def on_finish(self, reason: FinishReason, usage: Usage) -> None:
        # Request-level counters live in the stream tracker (they need the route and the HTTP arrival
        # time); prefill time is only known to the engine. A request cancelled while queued has none.
        if usage.prefill_time_s > 0:
            self._m.prefill.observe(usage.prefill_time_s)

    def on_rejected(self, reason: str) -> None:
        self._m.rejected.labels(reason=reason).inc()


class StatsSource(Protocol):
    """What the collector needs from `Engine` (a Protocol so tests can pass a small fake)."""

    @property
    def ready(self) -> bool: ...

    def health(self) -> bool: ...

    def stats(self) -> EngineStats: ...

    def info(self) -> dict[str, Any]: ...


# Prompt prefix reuse (nanoserve/engine/prefix_cache.py); the hit rate is hits over lookups.
_PREFIX_CACHE_COUNTERS = {
    "prefix_cache_lookups": "Requests placed in a KV slot with a look for a cached prefix of their prompt.",
    "prefix_cache_hits": "Of those, requests that reused a cached prefix (at least one token).",
    "prefix_cache_reused_tokens": "Prompt tokens not prefilled: their keys and values were reused.",
}

MODEL_INFO_LABELS = ("checkpoint", "parameters", "device", "dtype", "window")


def model_info_labels(info: dict[str, Any]) -> dict[str, str]:
    """The model-info labels from `Engine.info()` (the GET /info payload)."""
    keys = {"checkpoint": "model", "parameters": "parameters", "device": "device", "dtype": "dtype",
            "window": "window"}
    return {label: str(info.get(key, "")) for label, key in keys.items()}


class EngineCollector(Collector):
    """Gauges read from the engine at scrape time; never raises (a scrape must not 500)."""

    def __init__(self, engine: StatsSource, queue_capacity: int | None) -> None:
        self._engine = engine
        self._queue_capacity = queue_capacity

    def describe(self) -> Iterator[Metric]:
        # Names only, so registering checks for clashes without touching the engine.
        return iter(self._families())

    def collect(self) -> Iterator[Metric]:
        families = self._families()
        values: dict[str, float] = {
            # Probed on their own: when the engine is broken these must read 0, not vanish (alerts).
            "nanoserve_ready": _probe(lambda: self._engine.ready),
            "nanoserve_engine_healthy": _probe(self._engine.health),
        }
        if self._queue_capacity is not None:
            values["nanoserve_queue_capacity"] = self._queue_capacity
        try:
            stats = self._engine.stats()
            values |= {
                "nanoserve_running_sequences": stats.running,
                "nanoserve_waiting_requests": stats.waiting,
                "nanoserve_kv_slots_in_use": stats.slots_used,
                "nanoserve_kv_slots_capacity": stats.slots_total,
                "nanoserve_kv_cache_bytes": stats.kv_cache_bytes,
            }
            if "context_shifts_total" in stats.extra:
                values["nanoserve_engine_context_shifts"] = stats.extra["context_shifts_total"]
            if "preemptions_total" in stats.extra:
                values["nanoserve_engine_preemptions"] = stats.extra["preemptions_total"]
            if "prefill_tokens_shared_total" in stats.extra:
                values["nanoserve_engine_prefill_tokens_shared"] = stats.extra["prefill_tokens_shared_total"]
            for key in _PREFIX_CACHE_COUNTERS:
                if f"{key}_total" in stats.extra:
                    values[f"nanoserve_engine_{key}"] = stats.extra[f"{key}_total"]
        except Exception:  # missing scheduler gauges, never stale or made-up ones; the scrape still works
            log.exception("reading engine stats for /metrics failed")
        for family in families:
            if family.name in values:
                family.add_metric([], float(values[family.name]))
            elif family.name == "nanoserve_model_info" and (labels := self._model_info()):
                family.add_metric([labels[k] for k in MODEL_INFO_LABELS], 1.0)
        return iter(f for f in families if f.samples)

    @staticmethod
    def _families() -> list[GaugeMetricFamily | CounterMetricFamily]:
        specs = [
            ("nanoserve_running_sequences", "Sequences being generated now (holding a KV slot)."),
            ("nanoserve_waiting_requests", "Requests queued for a KV slot."),
            ("nanoserve_kv_slots_in_use", "KV cache slots in use."),
            ("nanoserve_kv_slots_capacity", "KV cache slots in total (max concurrent sequences)."),
            ("nanoserve_kv_cache_bytes", "Bytes allocated for the KV cache."),
            ("nanoserve_queue_capacity", "Waiting requests beyond which new ones are rejected (429)."),
            ("nanoserve_ready", "1 when the server accepts generation requests (warmed up, not draining)."),
            ("nanoserve_engine_healthy", "1 while the engine's model thread is alive."),
        ]
        families: list[GaugeMetricFamily | CounterMetricFamily] = [GaugeMetricFamily(n, d) for n, d in specs]
        families.append(CounterMetricFamily(
            "nanoserve_engine_context_shifts",
            "Context shifts: a sequence reached the window and was re-prefilled from its recent tokens.",
        ))
        families.append(CounterMetricFamily(
            "nanoserve_engine_preemptions",
            "Sequences that gave their KV slot to a client holding none (re-prefilled when readmitted).",
        ))
        families.append(CounterMetricFamily(
            "nanoserve_engine_prefill_tokens_shared",
            "Prompt tokens not recomputed: copied from one choice's prefill to the others (n, best_of).",
        ))
        families += [CounterMetricFamily(f"nanoserve_engine_{key}", text)
                     for key, text in _PREFIX_CACHE_COUNTERS.items()]
        families.append(
            GaugeMetricFamily("nanoserve_model_info", "The served model; always 1.", labels=MODEL_INFO_LABELS)
        )
        return families

    def _model_info(self) -> dict[str, str] | None:
        try:
            return model_info_labels(self._engine.info())
        except Exception:
            log.exception("reading engine info for /metrics failed")
            return None


def _probe(read: Callable[[], bool]) -> int:
    try:
        return int(bool(read()))
    except Exception:
        log.exception("probing the engine for /metrics failed")
        return 0
