"""SIGTERM while request bodies are half sent: those requests were not admitted, so they get the
drain's clean 503 (`draining`, `Retry-After`) at once, like any request refused while draining,
never a 500 with a CancelledError traceback when the server stops; streams already running still
complete and the process exits 0 (docs/limits.md, "Drain")."""

from __future__ import annotations

import signal
import socket
import time
from pathlib import Path

from tests.conftest import make_tiny_checkpoint
from tests.reliability.conftest import ONE_THREAD
from tests.reliability.raw_http import BystanderStream, connect, error_code, read_until_close, split_responses
from tests.server.server import ServerProcess, running_server

HEAD = (b"POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Content-Length: 100\r\n\r\n")
CHUNKED = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
           b"Transfer-Encoding: chunked\r\n\r\n8\r\n{\"prompt\r\n")
HALF_SENT = [HEAD, HEAD + b'{"inputs": "Hel', CHUNKED]


def half_sent_requests(server: ServerProcess) -> list[socket.socket]:
    socks = []
    for payload in HALF_SENT:
        s = connect(server.port, timeout=30)
        s.sendall(payload)
        socks.append(s)
    time.sleep(0.2)  # the server has read them and its routes wait for the rest of each body
    return socks


def assert_refused_cleanly(socks: list[socket.socket], signalled: float) -> None:
    for s in socks:
        data = read_until_close(s, timeout=30)
        s.close()
        [(status, headers, body)] = split_responses(data)
        assert status == 503, data[:300]
        assert error_code(body) == "draining" and headers["retry-after"] == "1"
        assert headers["connection"] == "close"
    # At once: not after the server's 5 s flush timeout, when the old code cancelled them.
    assert time.monotonic() - signalled < 4


def assert_clean_exit(server: ServerProcess) -> None:
    assert server.wait(30) == 0
    logs = server.logs()
    for bad in ("Traceback", "CancelledError", "Exception in ASGI", "Cancel "):
        assert bad not in logs, logs[-3000:]


def test_half_sent_bodies_get_the_drain_503_when_nothing_else_runs(tiny_checkpoint: Path) -> None:
    env = {**ONE_THREAD, "NANOSERVE_DRAIN_TIMEOUT": "20"}
    with running_server(tiny_checkpoint, env=env, ready_timeout=240) as server:
        socks = half_sent_requests(server)
        server.process.send_signal(signal.SIGTERM)
        assert_refused_cleanly(socks, time.monotonic())
        assert_clean_exit(server)


def test_half_sent_bodies_get_the_drain_503_while_a_stream_finishes(tmp_path: Path) -> None:
    # A model a little larger than the tiny one, so the stream is surely still running at SIGTERM.
    checkpoint = make_tiny_checkpoint(tmp_path / "small", n_layer=4, n_embd=128)
    env = {**ONE_THREAD, "NANOSERVE_DRAIN_TIMEOUT": "20"}
    with running_server(checkpoint, env=env, ready_timeout=240) as server:
        start = time.monotonic()
        bystander = BystanderStream(server.base_url, tokens=4000)
        assert bystander.started.wait(30) and bystander.error is None
        socks = half_sent_requests(server)
        assert not bystander.done()
        server.process.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        assert_refused_cleanly(socks, signalled)
        events = bystander.result()
        print(f"drain: the stream ran {time.monotonic() - start:.1f}s, SIGTERM after "
              f"{signalled - start:.1f}s")
        assert '"generated_tokens":4000' in events[-1].replace(" ", "")
        assert_clean_exit(server)
