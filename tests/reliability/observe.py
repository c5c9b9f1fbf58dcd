"""What the reliability tests read from a running server: /metrics samples and process memory."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

Sample = tuple[str, dict[str, str], float]


def scrape(base_url: str, headers: dict[str, str] | None = None) -> list[Sample]:
    """Every sample of GET /metrics as (name, labels, value)."""
    resp = httpx.get(f"{base_url}/metrics", headers=headers, timeout=10)
    resp.raise_for_status()
    return [
        (s.name, dict(s.labels), s.value)
        for family in text_string_to_metric_families(resp.text)
        for s in family.samples
    ]


def total(samples: list[Sample], name: str, **labels: str) -> float:
    """Sum of the samples called `name` whose labels include `labels` (0 when there are none)."""
    return sum(v for n, lab, v in samples if n == name and all(lab.get(k) == x for k, x in labels.items()))


def has(samples: list[Sample], name: str) -> bool:
    return any(n == name for n, _, _ in samples)


def rss_bytes(pid: int) -> int:
    """Resident set size of process `pid`, from /proc (Linux)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS line for pid {pid}")


def wait_until(predicate: Callable[[], bool], timeout_s: float, interval_s: float = 0.02) -> float:
    """Poll `predicate` until it holds; returns the seconds it took, raises on timeout."""
    start = time.monotonic()
    while True:
        if predicate():
            return time.monotonic() - start
        if time.monotonic() - start > timeout_s:
            raise AssertionError(f"condition still false after {timeout_s}s")
        time.sleep(interval_s)
