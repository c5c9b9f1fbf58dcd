"""deploy/prometheus and deploy/grafana: promtool checks, alert unit tests, and a cross-check that the
alerts and the dashboard only query metrics nanoserve actually exports (a renamed metric must fail here,
not silently blank a panel or disarm an alert)."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from nanoserve.engine.types import EngineStats
from nanoserve.server.metrics import Metrics
from tests.conftest import require_tool
from tests.server.test_metrics import FakeEngine

ROOT = Path(__file__).resolve().parents[2]
PROMETHEUS_DIR = ROOT / "deploy" / "prometheus"
DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "nanoserve.json"
PROVISIONING = ROOT / "deploy" / "grafana" / "provisioning"

# Series Prometheus itself adds to every scrape target.
PROMETHEUS_SERIES = {"up", "scrape_duration_seconds", "scrape_samples_scraped"}


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    tool = require_tool("promtool", "Debian package prometheus")
    return subprocess.run([tool, *args], cwd=PROMETHEUS_DIR, capture_output=True, text=True, timeout=60)


@pytest.mark.system_tool
def test_prometheus_config_and_its_rule_files_are_valid() -> None:
    result = promtool("check", "config", "prometheus.yml")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 rule files found" in result.stdout + result.stderr


@pytest.mark.system_tool
def test_alert_rules_pass_their_unit_tests() -> None:
    result = promtool("test", "rules", "alerts_test.yml")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def exported_series_names() -> set[str]:
    """Every sample name a nanoserve /metrics can carry, from the registry's metric families."""
    metrics = Metrics()
    extra = {"context_shifts_total": 0.0, "preemptions_total": 0.0, "prefill_tokens_shared_total": 0.0,
             "prefix_cache_lookups_total": 0.0, "prefix_cache_hits_total": 0.0,
             "prefix_cache_reused_tokens_total": 0.0}
    metrics.bind_engine(FakeEngine(EngineStats(0, 0, 0, 4, 0, extra=extra)))
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
    names: set[str] = set()
    for family in metrics.registry.collect():
        names.update(family.name + s for s in suffixes.get(family.type, ("",)))
    return names


def alert_rules() -> list[dict[str, Any]]:
    groups = yaml.safe_load((PROMETHEUS_DIR / "alerts.yml").read_text())["groups"]
    return [rule for group in groups for rule in group["rules"]]


def dashboard_exprs() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]


def metric_names_in(expr: str) -> set[str]:
    return set(re.findall(r"\b(?:nanoserve|process)_[a-z_]+\b", expr)) | (
        {"up"} if re.search(r"\bup\{", expr) else set()
    )


@pytest.mark.parametrize("source", ["alerts", "dashboard"])
def test_alerts_and_dashboard_query_only_exported_metrics(source: str) -> None:
    exprs = [r["expr"] for r in alert_rules()] if source == "alerts" else dashboard_exprs()
    assert len(exprs) >= 8
    known = exported_series_names() | PROMETHEUS_SERIES
    unknown = {name for expr in exprs for name in metric_names_in(expr)} - known
    assert not unknown, f"{source} query metrics that /metrics does not export: {sorted(unknown)}"


def test_alerts_cover_what_operators_page_on() -> None:
    rules = {r["alert"]: r for r in alert_rules()}
    for name in ("NanoserveTargetDown", "NanoserveNotReady", "NanoserveHighTimeToFirstToken",
                 "NanoserveQueueSaturated", "NanoserveHighErrorRate"):
        assert name in rules
        assert rules[name]["labels"]["severity"] in {"warning", "critical"}
        assert rules[name]["annotations"]["summary"] and rules[name]["annotations"]["description"]
    tested = set(re.findall(r"alertname: (\w+)", (PROMETHEUS_DIR / "alerts_test.yml").read_text()))
    assert tested == set(rules), "every alert needs a promtool unit test"


def test_dashboard_json_is_what_its_generator_writes() -> None:
    spec = importlib.util.spec_from_file_location("dashboard", ROOT / "deploy" / "grafana" / "dashboard.py")
    assert spec is not None and spec.loader is not None
    generator = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generator)
    assert DASHBOARD.read_text() == generator.render(), "run: python deploy/grafana/dashboard.py"


def test_dashboard_is_well_formed_and_provisioned() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    panels = dashboard["panels"]
    assert dashboard["uid"] == "nanoserve"
    assert len({p["id"] for p in panels}) == len(panels), "panel ids must be unique"
    titles = " ".join(p["title"] for p in panels).lower()
    for topic in ("requests / s", "tokens / s", "time to first token", "inter-token", "waiting", "kv slots",
                  "errors"):
        assert topic in titles, f"no panel about {topic!r}"
    for panel in panels:
        assert panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24
        for target in panel.get("targets", []):
            assert target["datasource"]["uid"] == "${datasource}"
    provider = yaml.safe_load((PROVISIONING / "dashboards" / "nanoserve.yml").read_text())["providers"][0]
    assert provider["type"] == "file" and provider["options"]["path"]
    datasources = yaml.safe_load((PROVISIONING / "datasources" / "prometheus.yml").read_text())
    datasource = datasources["datasources"][0]
    assert datasource["type"] == "prometheus" and datasource["url"].startswith("http://")


def test_every_exported_metric_is_documented() -> None:
    doc = "docs/operations.md"
    docs = (ROOT / doc).read_text()
    documented = set(re.findall(r"`(nanoserve_[a-z_]+)[`{]", docs))
    exported = {n for n in exported_series_names() if n.startswith("nanoserve_")}
    # Histograms are documented by their family name, counters with their _total suffix.
    families = {re.sub(r"_(bucket|sum|count)$", "", n) for n in exported}
    assert families - documented == set(), f"metrics missing from {doc}"
    assert documented - families == set(), f"{doc} lists metrics that are not exported"
