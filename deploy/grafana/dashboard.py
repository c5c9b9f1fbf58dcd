"""The Grafana dashboard as code: `python deploy/grafana/dashboard.py` writes dashboards/nanoserve.json.

Edit the panels here, not the JSON (tests/deploy/test_prometheus_rules.py checks the JSON is what this
writes, and that every query names a metric /metrics exports). Standard library only.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

OUT = Path(__file__).resolve().parent / "dashboards" / "nanoserve.json"
DS = {"type": "prometheus", "uid": "${datasource}"}
SEL = 'instance=~"$instance"'
API = 'route!~"/metrics|/health|/ready"'  # probes and scrapes are not traffic
FAILED = 'code=~"4..|5.."'
Target = tuple[str, str]  # (PromQL, legend)


def rate(metric: str, extra: str = "") -> str:
    return f"rate({metric}{{{SEL}{', ' + extra if extra else ''}}}[$__rate_interval])"


def quantiles(metric: str, by: str = "", qs: tuple[float, ...] = (0.5, 0.95, 0.99)) -> list[Target]:
    group = "le" + (f", {by}" if by else "")
    legend = f" {{{{{by}}}}}" if by else ""
    return [(f"histogram_quantile({q}, sum by ({group}) ({rate(metric + '_bucket')}))",
             f"p{round(q * 100)}{legend}") for q in qs]


def named(name: str, targets: list[Target]) -> list[Target]:
    """The same targets with `name` before each legend ("queue p50")."""
    return [(expr, f"{name} {legend}") for expr, legend in targets]


class Layout:
    """Panels placed left to right in rows of 24 grid units."""

    def __init__(self) -> None:
        self.panels: list[dict[str, Any]] = []
        self.y = 0

    def _id(self) -> int:
        return len(self.panels) + 1

    def row(self, title: str) -> None:
        self.panels.append({"type": "row", "title": title, "id": self._id(), "collapsed": False,
                            "gridPos": {"h": 1, "w": 24, "x": 0, "y": self.y}, "panels": []})
        self.y += 1

    def stats(self, specs: list[tuple[str, str, str, str, list[tuple[float, str]]]]) -> None:
        """One line of single-value panels: (title, description, expr, unit, thresholds)."""
        width = 24 // len(specs)
        for i, (title, desc, expr, unit, thresholds) in enumerate(specs):
            steps = [{"color": "green", "value": None}] + [{"color": c, "value": v} for v, c in thresholds]
            self.panels.append({
                "type": "stat", "title": title, "description": desc, "id": self._id(), "datasource": DS,
                "gridPos": {"h": 4, "w": width, "x": i * width, "y": self.y},
                "targets": [{"datasource": DS, "expr": expr, "refId": "A", "instant": True, "range": False}],
                "fieldConfig": {"overrides": [], "defaults": {
                    "unit": unit, "thresholds": {"mode": "absolute", "steps": steps}}},
                "options": {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                            "colorMode": "background", "graphMode": "none", "textMode": "auto"},
            })
        self.y += 4

    def graphs(self, specs: list[tuple[str, str, list[Target], str]], stacked: tuple[str, ...] = ()) -> None:
        """One line of time series: (title, description, targets, unit)."""
        width = 24 // len(specs)
        for i, (title, desc, targets, unit) in enumerate(specs):
            stacking = "normal" if title in stacked else "none"
            self.panels.append({
                "type": "timeseries", "title": title, "description": desc, "id": self._id(), "datasource": DS,
                "gridPos": {"h": 8, "w": width, "x": i * width, "y": self.y},
                "targets": [{"datasource": DS, "expr": e, "legendFormat": legend, "refId": chr(65 + j),
                             "range": True} for j, (e, legend) in enumerate(targets)],
                "fieldConfig": {"defaults": {"unit": unit, "min": 0, "custom": {
                    "drawStyle": "line", "lineWidth": 1, "fillOpacity": 10, "showPoints": "never",
                    "stacking": {"mode": stacking, "group": "A"}}}, "overrides": []},
                "options": {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                            "tooltip": {"mode": "multi", "sort": "desc"}},
            })
        self.y += 8


def overview(d: Layout) -> None:
    requests = f"sum({rate('nanoserve_http_requests_total', API)})"
    errors = rate("nanoserve_http_requests_total", f'{API}, code=~"5..", code!="503"')
    served = rate("nanoserve_http_requests_total", f'{API}, code!="503"')
    d.row("Overview")
    d.stats([
        ("Ready replicas", "Replicas whose /ready passes (warmed up, not draining).",
         f"sum(nanoserve_ready{{{SEL}}})", "none", []),
        ("Requests / s", "API requests answered per second (probes and scrapes excluded).", requests,
         "reqps", []),
        ("Generated tokens / s", "Tokens delivered to clients per second, all replicas.",
         f"sum({rate('nanoserve_generated_tokens_total')})", "none", []),
        ("p95 time to first token", "From HTTP arrival to the first token, queueing included.",
         quantiles("nanoserve_time_to_first_token_seconds", qs=(0.95,))[0][0], "s",
         [(1, "orange"), (2, "red")]),
        ("5xx ratio", "Share of API requests answered with a server error (503 while draining excluded).",
         f"(sum({errors}) or vector(0)) / sum({served})", "percentunit", [(0.01, "orange"), (0.05, "red")]),
        ("Queue fill", "Waiting requests as a share of the queue capacity (429s start at 100%).",
         f"max(nanoserve_waiting_requests{{{SEL}}} / nanoserve_queue_capacity{{{SEL}}})", "percentunit",
         [(0.5, "orange"), (0.8, "red")]),
    ])


def throughput_and_latency(d: Layout) -> None:
    d.row("Throughput")
    d.graphs([
        ("Requests / s by route and status", "HTTP requests answered, per route template and status code.",
         [(f"sum by (route, code) ({rate('nanoserve_http_requests_total', API)})", "{{route}} {{code}}")],
         "reqps"),
        ("Tokens / s", "Prompt tokens admitted and tokens generated per second; cropped prompt tokens were "
         "dropped to fit the window.",
         [(f"sum({rate('nanoserve_generated_tokens_total')})", "generated"),
          (f"sum({rate('nanoserve_prompt_tokens_total')})", "prompt"),
          (f"sum({rate('nanoserve_cropped_prompt_tokens_total')})", "cropped prompt")], "none"),
        ("Tokens per request", "Prompt and generated tokens per request (median and p95), when it ends.",
         named("prompt", quantiles("nanoserve_request_prompt_tokens", qs=(0.5, 0.95)))
         + named("generated", quantiles("nanoserve_request_generated_tokens", qs=(0.5, 0.95))),
         "none"),
    ])
    d.row("Latency")
    d.graphs([
        ("Time to first token", "From HTTP arrival to the first generated token (queueing and prefill "
         "included).", quantiles("nanoserve_time_to_first_token_seconds"), "s"),
        ("Inter-token latency", "Time between consecutive tokens of a request, as its client receives them.",
         quantiles("nanoserve_inter_token_latency_seconds"), "s"),
    ])
    d.graphs([
        ("End-to-end request duration (p95) by route", "From HTTP arrival to the last byte sent.",
         quantiles("nanoserve_http_request_duration_seconds", by="route", qs=(0.95,)), "s"),
        ("Queue time and prefill", "Time from arrival until the engine schedules a request, and the time its "
         "prefill takes.",
         named("queue", quantiles("nanoserve_queue_duration_seconds", qs=(0.5, 0.95)))
         + named("prefill", quantiles("nanoserve_prefill_duration_seconds", qs=(0.5, 0.95))),
         "s"),
    ])


def scheduler_errors_process(d: Layout) -> None:
    d.row("Scheduler and KV cache")
    d.graphs([
        ("Running and waiting", "Sequences holding a KV slot, requests waiting for one, and the queue "
         "capacity.",
         [(f"sum(nanoserve_running_sequences{{{SEL}}})", "running"),
          (f"sum(nanoserve_waiting_requests{{{SEL}}})", "waiting"),
          (f"sum(nanoserve_queue_capacity{{{SEL}}})", "queue capacity")], "none"),
        ("KV slots", "KV cache slots in use against the total (max concurrent sequences).",
         [(f"sum(nanoserve_kv_slots_in_use{{{SEL}}})", "in use"),
          (f"sum(nanoserve_kv_slots_capacity{{{SEL}}})", "capacity")], "none"),
        ("Engine step", "Duration of one batched forward pass (prefill chunks and decode steps).",
         named("step", quantiles("nanoserve_engine_step_duration_seconds", qs=(0.5, 0.95))),
         "s"),
    ])
    d.graphs([
        ("Mean batch size", "Sequences per engine step (higher = better use of each forward pass).",
         [(f"sum({rate('nanoserve_engine_batch_size_sum')}) / "
           f"sum({rate('nanoserve_engine_batch_size_count')})", "mean batch size")], "none"),
        ("KV cache memory", "Bytes allocated for the KV cache, per replica.",
         [(f"nanoserve_kv_cache_bytes{{{SEL}}}", "{{instance}}")], "bytes"),
        ("Prefill work", "Tokens run through prefill per second (re-prefills after context shifts included), "
         "prompt tokens a cached prefix spared per second, and context shifts per second.",
         [(f"sum({rate('nanoserve_engine_prefill_tokens_total')})", "prefill tokens / s"),
          (f"sum({rate('nanoserve_engine_prefix_cache_reused_tokens_total')})", "reused prompt tokens / s"),
          (f"sum({rate('nanoserve_engine_context_shifts_total')})", "context shifts / s")], "none"),
    ])
    d.row("Errors and outcomes")
    d.graphs([
        ("Errors by status", "4xx and 5xx answers per second (429 = overloaded, 503 = not ready or "
         "draining).",
         [(f"sum by (code) ({rate('nanoserve_http_requests_total', FAILED)})", "{{code}}")],
         "reqps"),
        ("Finish reasons", "Generations ending per second, by finish reason.",
         [(f"sum by (finish_reason) ({rate('nanoserve_requests_finished_total')})", "{{finish_reason}}")],
         "reqps"),
        ("Rejected and cancelled", "Requests refused by the engine (by reason) and generations abandoned by "
         "their client.",
         [(f"sum by (reason) ({rate('nanoserve_requests_rejected_total')})", "rejected {{reason}}"),
          (f"sum({rate('nanoserve_requests_cancelled_total')})", "cancelled by client")], "reqps"),
    ], stacked=("Finish reasons",))
    d.row("Process")
    d.graphs([
        ("Resident memory", "Resident set size of each replica.",
         [(f'process_resident_memory_bytes{{job="nanoserve", {SEL}}}', "{{instance}}")], "bytes"),
        ("CPU", "CPU seconds used per second (1 = one core busy).",
         [(rate("process_cpu_seconds_total", 'job="nanoserve"'), "{{instance}}")], "none"),
        ("In-flight requests", "HTTP requests being handled, streams included (a scrape counts itself).",
         [(f"sum by (route) (nanoserve_http_requests_in_flight{{{SEL}}})", "{{route}}")], "none"),
    ])


def dashboard() -> dict[str, Any]:
    d = Layout()
    overview(d)
    throughput_and_latency(d)
    scheduler_errors_process(d)
    instance_query = "label_values(nanoserve_model_info, instance)"
    return {
        "uid": "nanoserve",
        "title": "nanoserve",
        "description": "Throughput, latency, scheduler and errors of nanoserve replicas (docs/operations.md)",
        "tags": ["nanoserve", "llm"],
        "timezone": "browser",
        "editable": True,
        "graphTooltip": 1,
        "refresh": "10s",
        "schemaVersion": 39,
        "version": 1,
        "time": {"from": "now-1h", "to": "now"},
        "templating": {"list": [
            {"type": "datasource", "name": "datasource", "label": "Data source", "query": "prometheus",
             "current": {}, "hide": 0, "refresh": 1},
            {"type": "query", "name": "instance", "label": "Replica", "datasource": DS,
             "query": {"query": instance_query, "refId": "instance"}, "definition": instance_query,
             "multi": True, "includeAll": True, "allValue": ".*", "current": {}, "refresh": 2, "sort": 1,
             "hide": 0},
        ]},
        "annotations": {"list": []},
        "panels": d.panels,
    }


def render() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"


if __name__ == "__main__":
    OUT.write_text(render())
    sys.stdout.write(f"wrote {OUT}\n")
