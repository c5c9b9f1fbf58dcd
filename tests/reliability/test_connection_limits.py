"""Attacks below HTTP on a real server: idle and slowloris sockets, a connection flood, an endless
header, a blank-line trickle and idle keep-alive connections (docs/limits.md, "Connections").

The server runs scaled-down limits (64 connections, 1 s header and idle timeouts, 4 KiB of
headers) so each attack takes seconds. Each test asserts that the attack is cut off with the
documented answer, that an ordinary client is unharmed (a stream started beside the attack
completes, /health answers), and that the server's descriptors come back within +10 and its
resident memory within +50 MB of what they were before the attack.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import select
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.reliability.conftest import ONE_THREAD
from tests.reliability.observe import scrape, total
from tests.reliability.raw_http import (
    STREAM_TOKENS,
    Baseline,
    BystanderStream,
    closed_by_server,
    connect,
    error_code,
    read_until_close,
    split_responses,
)
from tests.server.server import ServerProcess, free_port, running_server, serve_command, wait_ready

MAX_CONNECTIONS = 64
HEADER_TIMEOUT_S = 1.0
IDLE_TIMEOUT_S = 1.0
MAX_HEADER_BYTES = 4096
HEAD_LIMIT = MAX_HEADER_BYTES + 8192  # the request line's allowance (connection_guard.REQUEST_LINE_BYTES)
FDS_BOUND, RSS_BOUND_MB = 10, 50
LONG_STREAM = 3000  # tokens: still streaming while the flood is opened
HEALTH = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"


@pytest.fixture(scope="module")
def server(tiny_checkpoint: Path) -> Iterator[ServerProcess]:
    env = {**ONE_THREAD, "NANOSERVE_MAX_CONNECTIONS": str(MAX_CONNECTIONS),
           "NANOSERVE_HEADER_TIMEOUT": str(HEADER_TIMEOUT_S), "NANOSERVE_IDLE_TIMEOUT": str(IDLE_TIMEOUT_S),
           "NANOSERVE_MAX_HEADER_BYTES": str(MAX_HEADER_BYTES)}
    with running_server(tiny_checkpoint, env=env, ready_timeout=240) as s:
        yield s


def hits(server: ServerProcess, limit: str) -> float:
    return total(scrape(server.base_url), "nanoserve_connection_limit_hits_total", limit=limit)


def assert_stream_complete(events: list[str], tokens: int = STREAM_TOKENS) -> None:
    last = json.loads(events[-1].removeprefix("data:"))
    assert last["details"]["generated_tokens"] == tokens, last


def test_idle_and_slowloris_sockets_are_closed_by_the_header_timeout(server: ServerProcess) -> None:
    base = Baseline(server.process.pid)
    before = hits(server, "header_timeout")
    bystander = BystanderStream(server.base_url)
    idle = [connect(server.port) for _ in range(20)]
    slow = [connect(server.port) for _ in range(20)]
    for s in slow:
        s.sendall(b"POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\n")
    start = time.monotonic()
    for _ in range(10):  # one header line every 0.2 s each: the head would never end
        for s in slow:
            with contextlib.suppress(OSError):
                s.sendall(b"X-Slow: 1\r\n")
        time.sleep(0.2)
    assert httpx.get(server.base_url + "/health", timeout=5).status_code == 200
    for s in idle:
        closed, data = closed_by_server(s, timeout=5)
        assert closed and data == b"", data[:200]  # nothing was asked: a plain close
    for s in slow:
        closed, data = closed_by_server(s, timeout=5)
        assert closed, "a slowloris connection is still open"
        [(status, headers, body)] = split_responses(data)
        assert status == 408 and error_code(body) == "header_timeout" and headers["connection"] == "close"
    took = time.monotonic() - start
    assert took < HEADER_TIMEOUT_S + 4, f"the attack sockets were closed only after {took:.1f}s"
    for s in idle + slow:
        s.close()
    assert_stream_complete(bystander.result())
    assert hits(server, "header_timeout") - before >= 40
    extra, grown = base.back_within(FDS_BOUND, RSS_BOUND_MB)
    print(f"40 idle/slowloris sockets closed within {took:.1f}s; fds +{extra}, RSS {grown:+.1f} MB")


def test_a_connection_flood_gets_fast_503s_and_spares_open_connections(server: ServerProcess) -> None:
    base = Baseline(server.process.pid)
    before = hits(server, "max_connections")
    bystander = BystanderStream(server.base_url, tokens=LONG_STREAM)
    assert bystander.started.wait(30) and bystander.error is None
    flood = []
    for _ in range(200):
        s = connect(server.port)
        s.sendall(HEALTH[:10])  # a request head begun, never finished
        flood.append(s)
    bystander.done_before_flood = bystander.done()
    refused = timed_out = 0
    for s in flood:  # each is answered: 503 at once, or 408 once its head times out
        closed, data = closed_by_server(s, timeout=HEADER_TIMEOUT_S + 4)
        assert closed, "a flood connection is still open"
        [(status, headers, body)] = split_responses(data)
        if status == 503:
            assert headers["retry-after"] == "1" and error_code(body) == "too_many_connections"
            refused += 1
        else:
            assert status == 408 and error_code(body) == "header_timeout", data[:300]
            timed_out += 1
    # The stream held one of the 64 connections all along; a probe or scrape may have held another.
    assert not bystander.done_before_flood
    assert 200 - MAX_CONNECTIONS + 1 <= refused <= 200 - MAX_CONNECTIONS + 3, refused
    for s in flood:
        s.close()
    assert_stream_complete(bystander.result(), LONG_STREAM)
    assert httpx.get(server.base_url + "/health", timeout=5).status_code == 200
    assert hits(server, "max_connections") - before == refused
    # Rate-limited: the refusals are one line and a count, not one line each.
    assert server.logs().count("(max_connections)") <= 3, server.logs()[-3000:]
    extra, grown = base.back_within(FDS_BOUND, RSS_BOUND_MB)
    assert total(scrape(server.base_url), "nanoserve_connections_open") <= 2  # the scrape's own
    print(f"flood of 200: {refused} refused with 503, {timed_out} admitted then 408; fds +{extra}, "
          f"RSS {grown:+.1f} MB")


def test_a_header_that_never_ends_gets_431_before_it_grows(server: ServerProcess) -> None:
    base = Baseline(server.process.pid)
    bystander = BystanderStream(server.base_url)
    s = connect(server.port)
    s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Endless: ")
    chunk, sent = b"a" * 65536, 0
    while sent < 64 << 20:  # 64 MB at most; the server must answer long before
        readable, _, _ = select.select([s], [], [], 0)
        if readable:
            break
        try:
            s.sendall(chunk)
        except OSError:
            break
        sent += len(chunk)
    data = read_until_close(s, timeout=5)
    s.close()
    [(status, _, body)] = split_responses(data)
    assert status == 431 and error_code(body) == "headers_too_large", data[:300]
    # What the kernels' socket buffers take before the answer is read; unbounded it ran to 64 MB.
    assert sent < 16 << 20, f"{sent} bytes were taken before the 431"
    assert_stream_complete(bystander.result())
    assert httpx.get(server.base_url + "/health", timeout=5).status_code == 200
    extra, grown = base.back_within(FDS_BOUND, RSS_BOUND_MB)
    print(f"endless header: 431 after {sent} bytes sent (limit {HEAD_LIMIT}); fds +{extra}, "
          f"RSS {grown:+.1f} MB")


def test_a_head_just_under_the_limit_is_served(server: ServerProcess) -> None:
    filler = "a" * (MAX_HEADER_BYTES - 200)
    r = httpx.get(server.base_url + "/health", headers={"X-Filler": filler}, timeout=5)
    assert r.status_code == 200
    r = httpx.get(server.base_url + "/health", headers={"X-Filler": filler * 4}, timeout=5)
    assert r.status_code == 431 and r.json()["error"]["code"] == "headers_too_large"


def test_blank_lines_trickled_between_requests_do_not_hold_a_connection(server: ServerProcess) -> None:
    s = connect(server.port)
    s.sendall(HEALTH)
    start = time.monotonic()
    closed, data = False, b""
    for _ in range(40):  # "\r\n" every 0.1 s: idle bytes, but no request ever begins
        try:
            s.sendall(b"\r\n")
        except OSError:
            closed = True
            break
        done, more = closed_by_server(s, timeout=0.1)
        data += more
        if done:
            closed = True
            break
    took = time.monotonic() - start
    s.close()
    assert closed, "the connection was held open by blank lines"
    assert took < HEADER_TIMEOUT_S + 2
    assert split_responses(data)[0][0] == 200


def test_an_idle_kept_alive_connection_is_closed(server: ServerProcess) -> None:
    before = hits(server, "idle_timeout")
    s = connect(server.port)
    s.sendall(HEALTH)
    start = time.monotonic()
    closed, data = closed_by_server(s, timeout=IDLE_TIMEOUT_S + 3)
    took = time.monotonic() - start
    s.close()
    assert closed and split_responses(data)[0][0] == 200
    assert IDLE_TIMEOUT_S * 0.8 <= took < IDLE_TIMEOUT_S + 3, took
    assert hits(server, "idle_timeout") - before >= 1


@pytest.mark.parametrize("opening", [b"2\r\n{}\r\n0\r\nX-Trailer: ", b"2;ext="], ids=["trailer", "chunk-ext"])
def test_endless_trailers_or_chunk_extensions_get_431(server: ServerProcess, opening: bytes) -> None:
    # Trailers are headers too: the parser buffered them (+65 MB in 20 s, at a quadratic CPU cost).
    base = Baseline(server.process.pid)
    s = connect(server.port)
    s.sendall(b"POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
              b"Transfer-Encoding: chunked\r\n\r\n" + opening)
    sent = 0
    while sent < 64 << 20:
        if select.select([s], [], [], 0)[0]:
            break
        try:
            s.sendall(b"a" * 65536)
        except OSError:
            break
        sent += 65536
    data = read_until_close(s, timeout=5)
    s.close()
    [(status, _, body)] = split_responses(data)
    assert status == 431 and error_code(body) == "headers_too_large"
    assert sent < 16 << 20
    base.back_within(FDS_BOUND, RSS_BOUND_MB)


def test_one_client_address_cannot_take_every_connection(tiny_checkpoint: Path) -> None:
    # Another loopback address plays the attacker: 127.0.0.2 takes its 16, the rest of its 100 get
    # 503 at once, and 127.0.0.1 still connects, streams and probes.
    env = {**ONE_THREAD, "NANOSERVE_MAX_CONNECTIONS": str(MAX_CONNECTIONS),
           "NANOSERVE_MAX_CONNECTIONS_PER_CLIENT": "16", "NANOSERVE_HEADER_TIMEOUT": "60"}
    with running_server(tiny_checkpoint, env=env, ready_timeout=240) as server:
        attack = []
        for _ in range(100):
            s = socket.create_connection(("127.0.0.1", server.port), timeout=10,
                                         source_address=("127.0.0.2", 0))
            attack.append(s)
        bystander = BystanderStream(server.base_url)
        assert httpx.get(server.base_url + "/health", timeout=5).status_code == 200
        answers = [closed_by_server(s, timeout=0.2) for s in attack]
        refused = [split_responses(data) for closed, data in answers if closed]
        assert len(refused) == 100 - 16
        for [(status, _, body)] in refused:
            assert status == 503 and error_code(body) == "too_many_connections"
            assert "this client address" in json.loads(body)["error"]["message"]
        assert_stream_complete(bystander.result())
        for s in attack:
            s.close()
        assert hits(server, "max_connections_per_client") == 100 - 16


def test_the_connection_cap_stays_below_a_low_file_limit(tiny_checkpoint: Path, tmp_path: Path) -> None:
    # Soft and hard file limits of 400: the server lowers max_connections to fit (400 - 128 - 64),
    # so a flood of 300 sockets gets answered 503s instead of accept() failing for want of a
    # descriptor (every client then reset or left hanging, nothing logged).
    files = 400
    cap = files - 128 - 64

    def low_file_limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (files, files))

    port = free_port()
    log_path = tmp_path / "server.log"
    with log_path.open("wb") as log_file:
        process = subprocess.Popen(serve_command(tiny_checkpoint, port), env={**os.environ, **ONE_THREAD},
                                   stdout=log_file, stderr=subprocess.STDOUT, preexec_fn=low_file_limit)
    server = ServerProcess(f"http://127.0.0.1:{port}", port, process, log_path)
    try:
        wait_ready(server, timeout=240)
        assert f"max_connections lowered from 1024 to {cap} to fit the open-file limit of {files}" \
            in server.logs()
        flood = [connect(port) for _ in range(300)]
        time.sleep(0.5)
        answered, _, _ = select.select(flood, [], [], 0)  # the refused: each has its 503 waiting
        assert 300 - cap <= len(answered) <= 300 - cap + 2, len(answered)
        assert all(split_responses(read_until_close(s, timeout=5))[0][0] == 503 for s in answered)
        for s in flood:
            s.close()
        assert httpx.get(server.base_url + "/health", timeout=5).status_code == 200
        assert "Too many open files" not in server.logs()
    finally:
        server.stop()
