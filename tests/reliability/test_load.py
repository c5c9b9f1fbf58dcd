"""64 concurrent streams against 8 KV slots and a short queue: nothing is lost, nothing leaks.

Every request either completes with a well-formed stream whose token count matches its final
`details`, or is refused with 429 + Retry-After; the server's counters equal what the clients saw;
afterwards the scheduler is idle; and a second identical run does not grow the server's memory
beyond RSS_GROWTH_BOUND.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter

import pytest

from bench.load import LoadConfig, LoadReport, main, run_load
from tests.reliability.conftest import SHARED_MAX_QUEUE
from tests.reliability.observe import Sample, rss_bytes, scrape, total, wait_until
from tests.server.server import ServerProcess

STREAMS = 64
MAX_NEW_TOKENS = 32
ROUTE = "/generate_stream"
# Growth allowed between the end of run 1 and the end of run 2 (same load, warm server). A leak of
# one KV cache or one request's state per stream would show as MBs per run; allocator noise is
# well below this (a few MiB between runs).
RSS_GROWTH_BOUND = 24 << 20

COUNTERS = {
    "ok": ("nanoserve_http_requests_total", {"route": ROUTE, "code": "200"}),
    "rejected_http": ("nanoserve_http_requests_total", {"route": ROUTE, "code": "429"}),
    "rejected_engine": ("nanoserve_requests_rejected_total", {}),
    "finished_length": ("nanoserve_requests_finished_total", {"route": ROUTE, "finish_reason": "length"}),
    "generated_tokens": ("nanoserve_generated_tokens_total", {}),
}


def counters(samples: list[Sample]) -> dict[str, float]:
    return {key: total(samples, name, **labels) for key, (name, labels) in COUNTERS.items()}


def idle(url: str) -> bool:
    s = scrape(url)
    busy = [
        total(s, "nanoserve_running_sequences"),
        total(s, "nanoserve_waiting_requests"),
        total(s, "nanoserve_kv_slots_in_use"),
        total(s, "nanoserve_http_requests_in_flight", route=ROUTE),
    ]
    return not any(busy)


def one_run(url: str) -> LoadReport:
    config = LoadConfig(url=url, concurrency=STREAMS, requests=STREAMS, prompt="Hello there",
                        max_new_tokens=MAX_NEW_TOKENS, temperature=1.0, seed=1000, timeout_s=60)
    return asyncio.run(run_load(config))


def check_run(report: LoadReport) -> dict[str, int]:
    """Assert the run's invariants; returns its outcome counts."""
    outcomes = Counter(r.kind for r in report.results)
    assert set(outcomes) <= {"ok", "http_429"}, report.by_kind()
    assert len(report.results) == STREAMS
    for r in report.results:
        assert not r.malformed, (r.index, r.malformed)
        if r.kind == "ok":
            # The tiny model has no end-of-text token and no stop strings were set: every stream
            # runs to its length, and the deltas add up to the final text.
            assert r.tokens == r.details_tokens == MAX_NEW_TOKENS, r
            assert r.finish_reason == "length"
            assert r.final_text == r.text
        else:
            assert r.retry_after is not None and int(r.retry_after) >= 1, r
    return dict(outcomes)


def test_64_streams_nothing_lost_and_no_leak(shared_server: ServerProcess) -> None:
    url = shared_server.base_url
    rss = []
    for _ in range(2):
        before = counters(scrape(url))
        report = one_run(url)
        outcomes = check_run(report)
        # Counters are updated as streams close; wait for the server to be idle, then compare.
        wait_until(lambda: idle(url), timeout_s=10)
        after = counters(scrape(url))
        delta = {k: after[k] - before[k] for k in after}
        ok, rejected = outcomes.get("ok", 0), outcomes.get("http_429", 0)
        # The first SHARED_MAX_QUEUE arrivals always find room; 64 at once overflow slots + queue.
        assert ok >= SHARED_MAX_QUEUE and rejected >= 1, outcomes
        assert delta["ok"] == ok and delta["finished_length"] == ok, (delta, outcomes)
        assert delta["rejected_http"] == rejected and delta["rejected_engine"] == rejected, (delta, outcomes)
        assert delta["generated_tokens"] == sum(r.tokens for r in report.results), delta
        rss.append(rss_bytes(shared_server.process.pid))
        print(f"run: {outcomes}, RSS {rss[-1] / 2**20:.1f} MiB, {report.summary()}")
    growth = rss[1] - rss[0]
    assert growth < RSS_GROWTH_BOUND, f"RSS grew {growth / 2**20:.1f} MiB between identical runs"


def test_chat_route_streams_complete(shared_server: ServerProcess) -> None:
    """The load tool's OpenAI route against the real server: every stream ends with [DONE]."""
    config = LoadConfig(url=shared_server.base_url, route="chat", concurrency=4, requests=8,
                        prompt="Hello there", max_new_tokens=16, seed=5, timeout_s=60)
    report = asyncio.run(run_load(config))
    for r in report.results:
        assert r.kind == "ok" and not r.malformed, r
        # usage.completion_tokens; a delta can carry two tokens when one was held back.
        assert r.details_tokens == 16 and 0 < r.tokens <= 16 and r.finish_reason == "length", r


def test_cli_against_the_real_server(
    shared_server: ServerProcess, capsys: pytest.CaptureFixture[str]
) -> None:
    """What a user runs: `python -m bench.load --json` exits 0 and its figures add up."""
    code = main(["--url", shared_server.base_url, "-c", "4", "-n", "8", "--max-new-tokens", "8",
                 "--seed", "1", "--json", "--per-request"])
    summary = json.loads(capsys.readouterr().out)
    assert code == 0 and summary["outcomes"] == {"ok": 8}
    assert summary["tokens_generated"] == 64 and summary["tokens_per_s"] > 0
    assert all(summary[k]["p50"] is not None for k in ("ttft_s", "itl_s", "e2e_s"))
    assert [r["details_tokens"] for r in summary["results"]] == [8] * 8
