"""Pipelined requests followed by a malformed one, on one connection of a real server: the
responses to the valid requests go out whole and in order, then a 400, then the server closes;
nothing logs a traceback and the metrics count what was really answered (docs/limits.md,
"Pipelining")."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.reliability.conftest import ONE_THREAD
from tests.reliability.observe import rss_bytes, scrape, total
from tests.reliability.raw_http import Baseline, connect, error_code, read_until_close, split_responses
from tests.server.server import ServerProcess, running_server

GARBAGE = b"THIS IS NOT HTTP\r\n\r\n"


@pytest.fixture(scope="module")
def server(tiny_checkpoint: Path) -> Iterator[ServerProcess]:
    with running_server(tiny_checkpoint, env=ONE_THREAD, ready_timeout=240) as s:
        yield s


def post(path: str, body: dict[str, object]) -> bytes:
    data = json.dumps(body).encode()
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n").encode() + data


def generate(tokens: int) -> dict[str, object]:
    return {"inputs": "Hello there", "parameters": {"max_new_tokens": tokens, "seed": 1, "details": True}}


def exchange(server: ServerProcess, payload: bytes) -> list[tuple[int, dict[str, str], bytes]]:
    """Send `payload` in one write; every response until the server closes."""
    s = connect(server.port, timeout=30)
    s.sendall(payload)
    data = read_until_close(s, timeout=30)
    s.close()
    return split_responses(data)


def counted(server: ServerProcess, route: str, code: str) -> float:
    return total(scrape(server.base_url), "nanoserve_http_requests_total", route=route, code=code)


def test_a_response_in_progress_finishes_before_the_400(server: ServerProcess) -> None:
    before = counted(server, "/generate", "200")
    [(s1, _, b1), (s2, h2, b2)] = exchange(server, post("/generate", generate(12)) + GARBAGE)
    assert s1 == 200 and json.loads(b1)["details"]["generated_tokens"] == 12
    assert s2 == 400 and error_code(b2) == "bad_request" and h2["connection"] == "close"
    assert counted(server, "/generate", "200") - before == 1


def test_a_stream_finishes_whole_before_the_400(server: ServerProcess) -> None:
    [(s1, h1, b1), (s2, _, b2)] = exchange(server, post("/generate_stream", generate(30)) + GARBAGE)
    assert s1 == 200 and h1["content-type"].startswith("text/event-stream")
    events = [line for line in b1.decode().split("\n") if line.startswith("data:")]
    assert len(events) == 30 and json.loads(events[-1][5:])["details"]["generated_tokens"] == 30
    assert s2 == 400 and error_code(b2) == "bad_request"


def test_every_pipelined_request_before_the_bad_one_is_answered_in_order(server: ServerProcess) -> None:
    payload = (b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n" + post("/generate", generate(5))
               + post("/generate_stream", generate(5)) + GARBAGE + b"GET /health HTTP/1.1\r\n\r\n")
    responses = exchange(server, payload)
    assert [status for status, _, _ in responses] == [200, 200, 200, 400]  # nothing after the bad one
    assert json.loads(responses[1][2])["details"]["generated_tokens"] == 5


def test_a_malformed_body_ends_its_own_request_with_400(server: ServerProcess) -> None:
    bad_chunk = (b"POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Transfer-Encoding: chunked\r\n\r\n5\r\n{\"inp\r\nZZ-not-a-size\r\n")
    [(status, _, body)] = exchange(server, bad_chunk)
    assert status == 400 and error_code(body) == "bad_request"
    [(status, _, body)] = exchange(server, GARBAGE)
    assert status == 400


def test_no_traceback_and_the_server_is_well(server: ServerProcess) -> None:
    assert httpx.get(server.base_url + "/health", timeout=5).status_code == 200
    samples = scrape(server.base_url)
    assert total(samples, "nanoserve_connection_limit_hits_total", limit="parse_error") >= 5
    assert total(samples, "nanoserve_http_requests_in_flight") <= 1  # the scrape itself
    logs = server.logs()
    assert "Traceback" not in logs and "Exception in ASGI" not in logs, logs[-3000:]
    assert "malformed request" in logs


def test_a_pipelined_flood_is_parsed_only_a_little_ahead(server: ServerProcess) -> None:
    # 20,000 requests in 660 kB, written as fast as the socket takes them while their answers are
    # read: parsed all at once they held ~3 kB of request state each (+60 MB here).
    base = Baseline(server.process.pid)
    n, batch = 20_000, 1_000
    s = connect(server.port, timeout=60)
    answered = [0]

    def read_all() -> None:
        tail = b""
        while answered[0] < n:
            chunk = s.recv(1 << 20)
            if not chunk:
                return
            answered[0] += (tail + chunk).count(b"HTTP/1.1 200")
            tail = chunk[-16:]

    reader = threading.Thread(target=read_all, daemon=True)
    reader.start()
    peak = 0
    for _ in range(n // batch):
        s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n" * batch)
        peak = max(peak, rss_bytes(server.process.pid))
    deadline = time.monotonic() + 60
    while reader.is_alive() and time.monotonic() < deadline:
        reader.join(0.2)
        peak = max(peak, rss_bytes(server.process.pid))
    s.close()
    assert answered[0] == n
    grown = (peak - base.rss) / 2**20
    assert grown < 30, f"RSS grew {grown:.0f} MB during the flood"
    base.back_within(fds=10, rss_mb=30)
    print(f"pipelined flood: {n} answered, RSS peak {grown:+.1f} MB")
