"""Per-model series, labelled `model`, for a server serving several (nanoserve/server/models/).

The unlabelled engine gauges (engine_collector.py) read the default model, as they did when one
model was served; these read each model's engine at scrape time, and count reloads by outcome.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import NamedTuple

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from nanoserve.server.metrics.engine_collector import StatsSource

log = logging.getLogger(__name__)


class ModelSample(NamedTuple):
    name: str
    version: str
    engine: StatsSource


_GAUGES = (
    ("nanoserve_model_ready", "1 when this model accepts requests."),
    ("nanoserve_model_running_sequences", "This model's sequences being generated now."),
    ("nanoserve_model_waiting_requests", "This model's requests queued for a KV slot."),
    ("nanoserve_model_kv_slots_in_use", "This model's KV cache slots in use."),
    ("nanoserve_model_kv_slots_capacity", "This model's KV cache slots in total."),
)


class ModelsCollector(Collector):
    """Each served model's gauges and version, read at scrape time; never raises."""

    def __init__(self, models: Callable[[], list[ModelSample]]) -> None:
        self._models = models

    def describe(self) -> Iterator[Metric]:
        return iter(self._families())

    def collect(self) -> Iterator[Metric]:
        families = self._families()
        by_name = {f.name: f for f in families}
        for m in self._models():
            by_name["nanoserve_served_model_info"].add_metric([m.name, m.version], 1.0)
            try:
                ready = float(bool(m.engine.ready))
                stats = m.engine.stats()
            except Exception:
                log.exception("reading %s's engine for /metrics failed", m.name)
                continue
            values = (ready, stats.running, stats.waiting, stats.slots_used, stats.slots_total)
            for (name, _), value in zip(_GAUGES, values, strict=True):
                by_name[name].add_metric([m.name], float(value))
        return iter(families)

    @staticmethod
    def _families() -> list[GaugeMetricFamily]:
        families = [GaugeMetricFamily(n, d, labels=["model"]) for n, d in _GAUGES]
        families.append(GaugeMetricFamily(
            "nanoserve_served_model_info", "Each served model and its checkpoint's version (content "
            "hash and training step); always 1.", labels=["model", "version"]))
        return families


def reload_counter(registry: CollectorRegistry) -> Counter:
    return Counter("nanoserve_model_reloads", "Reloads of a model's checkpoint by result: reloaded "
                   "(now serving the new files) or failed (the previous version still serves).",
                   ["model", "result"], registry=registry)
