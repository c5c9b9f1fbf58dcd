"""A real Prometheus scraping a real nanoserve every second.

The test sends a small, known load, then asks Prometheus (its HTTP API) for the counters and checks
they equal what was sent; a TTFT quantile must be computable with histogram_quantile; every query of
the Grafana dashboard and every alert rule must evaluate without error against the real data; and the
server's own /metrics must pass `promtool check metrics` after the traffic.

Prometheus runs with its own config, data directory and a free port on 127.0.0.1, so it never touches
a Prometheus the system package may have started; it is stopped by its PID.
"""

from __future__ import annotations

import contextlib
import json
import math
import subprocess
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import require_tool
from tests.server.server import ServerProcess, free_port, start_server, wait_ready

ROOT = Path(__file__).resolve().parents[2]
ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "nanoserve.json"

pytestmark = [pytest.mark.system_tool, pytest.mark.slow]

MAX_NEW_TOKENS = 8
N_PLAIN, N_STREAM = 3, 3


class PrometheusAPI:
    def __init__(self, base_url: str) -> None:
        self.base_url = base_url

    def query(self, expr: str) -> list[dict[str, Any]]:
        """Instant query; raises with Prometheus's error text when the expression fails."""
        response = httpx.get(self.base_url + "/api/v1/query", params={"query": expr}, timeout=10)
        body = response.json()
        if body.get("status") != "success":
            raise AssertionError(f"query {expr!r} failed: {body.get('error', response.text)}")
        return list(body["data"]["result"])

    def scalar(self, expr: str) -> float | None:
        """The single value of a one-series query, None when it has no series (yet)."""
        result = self.query(expr)
        assert len(result) <= 1, f"{expr!r} returned {len(result)} series"
        return float(result[0]["value"][1]) if result else None


def wait_for(what: str, check: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.25)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


@contextmanager
def running_prometheus(tmp_path: Path, target_port: int) -> Iterator[PrometheusAPI]:
    binary = require_tool("prometheus", "Debian package prometheus")
    config = {
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(ALERTS)],
        "scrape_configs": [
            {"job_name": "nanoserve", "static_configs": [{"targets": [f"127.0.0.1:{target_port}"]}]}
        ],
    }
    config_path = tmp_path / "prometheus.yml"
    config_path.write_text(json.dumps(config))  # JSON is YAML
    port = free_port()
    log_path = tmp_path / "prometheus.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [binary, f"--config.file={config_path}", f"--storage.tsdb.path={tmp_path / 'data'}",
             f"--web.listen-address=127.0.0.1:{port}"],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        )
    api = PrometheusAPI(f"http://127.0.0.1:{port}")
    try:
        def ready() -> bool:
            assert process.poll() is None, f"prometheus exited:\n{log_path.read_text()}"
            try:
                return httpx.get(api.base_url + "/-/ready", timeout=2).status_code == 200
            except httpx.TransportError:
                return False

        wait_for("Prometheus to be ready", ready, timeout=30)
        yield api
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)


def generate(server: ServerProcess, i: int) -> int:
    """One non-streaming request; the number of tokens the server says it generated."""
    response = httpx.post(server.base_url + "/generate", timeout=60, json={
        "inputs": f"Request {i}: ", "parameters": {"max_new_tokens": MAX_NEW_TOKENS, "details": True,
                                                   "seed": i}})
    assert response.status_code == 200, response.text
    return int(response.json()["details"]["generated_tokens"])


def generate_stream(server: ServerProcess, i: int) -> int:
    """One SSE request read to its end; the generated-token count from its last event."""
    body = {"inputs": f"Stream {i}: ", "parameters": {"max_new_tokens": MAX_NEW_TOKENS, "seed": i}}
    last: dict[str, Any] = {}
    with httpx.stream("POST", server.base_url + "/generate_stream", json=body, timeout=60) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: "):
                last = json.loads(line[len("data: "):])
    return int(last["details"]["generated_tokens"])


@contextmanager
def server_and_prometheus(checkpoint: Path, tmp_path: Path) -> Iterator[tuple[ServerProcess, PrometheusAPI]]:
    """Both started at once (the server's start-up is the slow part), both always stopped."""
    server = start_server(checkpoint)
    try:
        with running_prometheus(tmp_path, server.port) as prom:
            wait_ready(server)
            yield server, prom
    finally:
        server.stop()
        server.log_path.unlink(missing_ok=True)


def send_load(server: ServerProcess) -> int:
    """A small known load (plain + streamed, concurrently, plus one invalid request); tokens generated."""
    with ThreadPoolExecutor(max_workers=4) as pool:
        plain = pool.map(lambda i: generate(server, i), range(N_PLAIN))
        streamed = pool.map(lambda i: generate_stream(server, i), range(N_STREAM))
        tokens = sum(plain) + sum(streamed)
    invalid = {"inputs": "x", "parameters": {"temperature": -1}}
    assert httpx.post(server.base_url + "/generate", json=invalid, timeout=30).status_code == 422
    assert tokens > 0
    return tokens


def test_prometheus_scrapes_exact_counts_and_computes_ttft_quantile(
    tiny_checkpoint: Path, tmp_path: Path
) -> None:
    promtool = require_tool("promtool", "Debian package prometheus")
    with server_and_prometheus(tiny_checkpoint, tmp_path) as (server, prom):
        wait_for("the nanoserve target to be up", lambda: prom.scalar('up{job="nanoserve"}') == 1.0, 20)
        tokens = send_load(server)
        expected = {
            'sum(nanoserve_http_requests_total{route="/generate", code="200"})': N_PLAIN,
            'sum(nanoserve_http_requests_total{route="/generate_stream", code="200"})': N_STREAM,
            'sum(nanoserve_http_requests_total{route="/generate", code="422"})': 1,
            "sum(nanoserve_requests_finished_total)": N_PLAIN + N_STREAM,
            "sum(nanoserve_time_to_first_token_seconds_count)": N_PLAIN + N_STREAM,
            "sum(nanoserve_generated_tokens_total)": tokens,
        }

        def scraped() -> dict[str, float | None]:
            return {expr: prom.scalar(expr) for expr in expected}

        try:
            wait_for("the load to be scraped", lambda: scraped() == expected, timeout=20)
        finally:
            got = scraped()
        assert got == expected

        ttft_p50 = prom.scalar(
            "histogram_quantile(0.5, sum by (le) (rate(nanoserve_time_to_first_token_seconds_bucket[1m])))"
        )
        assert ttft_p50 is not None and math.isfinite(ttft_p50) and 0 < ttft_p50 < 100
        assert prom.scalar("nanoserve_ready") == 1.0
        wait_for("idle gauges", lambda: prom.scalar("nanoserve_running_sequences") == 0.0, timeout=10)
        check_dashboard_queries(prom)
        check_rules_evaluate(prom)

        exposition = httpx.get(server.base_url + "/metrics", timeout=10).content
        check = subprocess.run([promtool, "check", "metrics"], input=exposition, capture_output=True,
                               timeout=30)
        assert check.returncode == 0, (check.stdout + check.stderr).decode()


def check_dashboard_queries(prom: PrometheusAPI) -> None:
    """Every Grafana panel query, with Grafana's variables filled in, runs against the real data."""
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    assert exprs

    def empty_queries() -> list[str]:
        empty = []
        for expr in exprs:
            concrete = expr.replace("$__rate_interval", "1m").replace("$instance", ".*")
            if not prom.query(concrete):  # raises on a PromQL error
                empty.append(expr)
        return empty

    def only_expected_empty() -> bool:
        return all("rejected" in e or "cancelled" in e or "cropped" in e for e in empty_queries())

    # rate() needs two samples of a series inside its window: on a fast machine the test can get
    # here before the second scrape of series the load created, so give the scrapes a moment.
    with contextlib.suppress(AssertionError):  # the assertion below names the empty queries
        wait_for("dashboard queries to have data", only_expected_empty, timeout=15)
    empty = empty_queries()
    assert all("rejected" in e or "cancelled" in e or "cropped" in e for e in empty), empty


def check_rules_evaluate(prom: PrometheusAPI) -> None:
    """The alert rules loaded, evaluate without error, and none fires on a healthy server."""
    def evaluated() -> bool:
        groups = httpx.get(prom.base_url + "/api/v1/rules", timeout=10).json()["data"]["groups"]
        rules = [r for g in groups for r in g["rules"]]
        return bool(rules) and all(r.get("lastEvaluation", "").startswith("20") for r in rules)

    wait_for("the alert rules to be evaluated", evaluated, timeout=10)
    groups = httpx.get(prom.base_url + "/api/v1/rules", timeout=10).json()["data"]["groups"]
    rules = [r for g in groups for r in g["rules"]]
    assert len(rules) >= 5
    assert all(r["health"] == "ok" for r in rules), [(r["name"], r.get("lastError")) for r in rules]
    assert [r["name"] for r in rules if r["state"] == "firing"] == []
