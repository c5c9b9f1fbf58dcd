"""A request answered before its body is all here (413 by Content-Length, 401 before the body) does
not get the rest read: the server closes the connection after a short linger, instead of parsing
and dropping on the event loop whatever length the client announced."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from nanoserve.server.http.connection_guard import LINGER_MAX_BYTES
from tests.reliability.raw_http import connect, error_code, split_responses
from tests.server.server import ServerProcess, running_server

MAX_BODY = 4096
ANNOUNCED = 1 << 30
SOCKET_BUFFERS = 16 << 20  # what the kernel's buffers on both sides may take, generously


@pytest.fixture(scope="module")
def server(tiny_checkpoint: Path) -> Iterator[ServerProcess]:
    env = {"OMP_NUM_THREADS": "1", "NANOSERVE_MAX_BODY_BYTES": str(MAX_BODY)}
    with running_server(tiny_checkpoint, env=env, ready_timeout=240) as srv:
        yield srv


def send_until_refused(sock: socket.socket) -> int:
    """Send zeros until the server stops taking them (closed, reset, or 5 s without room)."""
    block, sent = bytes(256 << 10), 0
    sock.settimeout(5)
    try:
        while sent < ANNOUNCED:
            sent += sock.send(block)
    except OSError:  # reset, broken pipe, or a full window the server no longer reads
        pass
    return sent


def test_an_oversized_body_is_answered_413_and_not_read(server: ServerProcess) -> None:
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {ANNOUNCED}\r\n\r\n")
    with connect(server.port) as sock:
        sock.sendall(head.encode())
        answer = b""
        while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
            answer += sock.recv(65536)
        [(status, _, body)] = split_responses(answer)
        assert status == 413 and error_code(body) == "body_too_large", answer
        t0 = time.monotonic()
        sent = send_until_refused(sock)
    print(f"the server took {sent >> 20} MiB of the refused body in {time.monotonic() - t0:.2f} s")
    # The linger's bound and the kernel's socket buffers, not the announced gigabyte.
    assert sent < LINGER_MAX_BYTES + SOCKET_BUFFERS


def test_the_server_still_serves_after_closing_such_connections(server: ServerProcess) -> None:
    with connect(server.port) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
        assert sock.recv(65536).startswith(b"HTTP/1.1 200")
