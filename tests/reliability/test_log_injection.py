"""Log injection on a real server, in both log formats: what a client sends (a path with encoded
newlines, terminal escapes or line separators, a path that imitates access-line fields, a request
id) never forges a line, a field or an escape sequence in the server's log (docs/limits.md,
"Logs")."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.reliability.conftest import ONE_THREAD
from tests.reliability.raw_http import connect, read_until_close, split_responses
from tests.server.server import ServerProcess, running_server

FORGING_PATH = "/a%0aFORGED%20line%1b[31mred%e2%80%a8sep%5cx0a"
SEEN_PATH = "/a\\x0aFORGED line\\x1b[31mred\\u2028sep\\\\x0a"  # as the log must show it
FIELDS_PATH = "/x%20status=200%20route=/generate%22"
SEEN_FIELDS = "/x status=200 route=/generate\\x22"
BAD_IDS = ["has space", 'quote"d', "a" * 129, "semi;colon", "\u00e9t\u00e9"]


@pytest.fixture(scope="module", params=["text", "json"])
def served(request: pytest.FixtureRequest, tiny_checkpoint: Path) -> Iterator[tuple[ServerProcess, str]]:
    env = {**ONE_THREAD, "NANOSERVE_LOG_FORMAT": request.param}
    with running_server(tiny_checkpoint, env=env, ready_timeout=240) as s:
        yield s, request.param


def raw_get(server: ServerProcess, target: bytes, extra: bytes = b"") -> int:
    s = connect(server.port)
    s.sendall(b"GET " + target + b" HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n" + extra + b"\r\n")
    responses = split_responses(read_until_close(s))
    s.close()
    return responses[0][0]


def access_routes(server: ServerProcess, fmt: str) -> list[str]:
    """The `route` of every access-log line, as a reader of the log sees it."""
    lines = server.logs().splitlines()
    if fmt == "json":
        records = [json.loads(line) for line in lines if line.startswith("{")]
        return [r["route"] for r in records if r.get("logger") == "nanoserve.access"]
    out = []
    for line in lines:
        if " nanoserve.access: " in line:
            m = re.search(r' route=("[^"]*"|\S+)', line)
            assert m is not None, line
            value = m.group(1)
            out.append(value[1:-1] if value.startswith('"') else value)
    return out


def test_client_text_never_forges_a_line_a_field_or_an_escape(served: tuple[ServerProcess, str]) -> None:
    server, fmt = served
    assert raw_get(server, FORGING_PATH.encode()) == 404
    assert raw_get(server, FIELDS_PATH.encode()) == 404
    assert raw_get(server, b"/\xffraw") == 400  # a raw non-ASCII byte: not HTTP, no traceback
    logs = server.logs()
    assert "\x1b" not in logs and "\u2028" not in logs, "a terminal escape or separator reached the log"
    assert not any(line.startswith("FORGED") for line in logs.splitlines()), logs[-2000:]
    routes = access_routes(server, fmt)
    assert SEEN_PATH in routes, routes
    # One field, not three (in text, quoted, its quote written \x22; JSON quotes on its own).
    assert (SEEN_FIELDS if fmt == "text" else SEEN_FIELDS.replace("\\x22", '"')) in routes, routes
    if fmt == "text":
        assert f'route="{SEEN_FIELDS}" status=404' in logs
    else:
        for line in logs.splitlines():  # every line is one JSON object
            if line.strip():
                json.loads(line)
    assert "Traceback" not in logs


def test_a_request_id_is_echoed_only_when_it_is_a_sane_token(served: tuple[ServerProcess, str]) -> None:
    server, _ = served
    good = "client-id.42:7_x"
    r = httpx.get(server.base_url + "/health", headers={"X-Request-Id": good}, timeout=5)
    assert r.headers["x-request-id"] == good
    for bad in BAD_IDS:
        assert raw_get(server, b"/nope", b"X-Request-Id: " + bad.encode("utf-8") + b"\r\n") == 404
        r = httpx.get(server.base_url + "/health", headers={"X-Request-Id": bad.encode("utf-8")}, timeout=5)
        echoed = r.headers["x-request-id"]
        assert echoed != bad and re.fullmatch(r"[A-Za-z0-9._:\-]{1,128}", echoed), echoed
    logs = server.logs()
    for bad in BAD_IDS:
        assert bad not in logs
