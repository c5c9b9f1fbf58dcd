"""The API key is checked before the body's size: a caller without a valid key learns nothing about
the limits (401, as documented), and the body it announces is never read; with a key, an
oversized body is still 413."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.reliability.conftest import ONE_THREAD
from tests.reliability.raw_http import connect, error_code, read_until_close, split_responses
from tests.server.server import ServerProcess, running_server

KEY = "size-test-key-0123456789"
MAX_BODY = 4096


@pytest.fixture(scope="module")
def server(tiny_checkpoint: Path) -> Iterator[ServerProcess]:
    env = {**ONE_THREAD, "NANOSERVE_API_KEYS": KEY, "NANOSERVE_MAX_BODY_BYTES": str(MAX_BODY)}
    with running_server(tiny_checkpoint, env=env, ready_timeout=240) as srv:
        yield srv


def _announce(server: ServerProcess, path: str, authorization: str | None) -> tuple[int, bytes]:
    """POST announcing a 1 GB body, none of which is sent; the status and body of the answer."""
    head = f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    if authorization is not None:
        head += f"Authorization: {authorization}\r\n"
    head += "Content-Length: 1000000000\r\nConnection: close\r\n\r\n"
    with connect(server.port) as sock:
        sock.sendall(head.encode())
        [(status, _, body)] = split_responses(read_until_close(sock, timeout=30))
    return status, body


@pytest.mark.parametrize("path", ["/generate", "/v1/completions", "/v1/chat/completions", "/no/such/route"])
def test_without_a_valid_key_an_oversized_body_is_401(server: ServerProcess, path: str) -> None:
    for authorization, code in ((None, "missing_api_key"), ("Bearer wrong-key", "invalid_api_key")):
        status, body = _announce(server, path, authorization)
        assert status == 401 and error_code(body) == code, (path, authorization, body)


def test_with_a_key_an_oversized_body_is_still_413(server: ServerProcess) -> None:
    status, body = _announce(server, "/v1/completions", f"Bearer {KEY}")
    assert status == 413 and error_code(body) == "body_too_large", body
