"""The connection limits' arithmetic and logging (nanoserve/server/http/connection_guard.py) and the log
escaping (nanoserve/server/http/access_log.py), without a server; the attacks on a real one are in
tests/reliability/."""

from __future__ import annotations

import asyncio
import logging
import resource
import subprocess
import sys

import pytest
from prometheus_client import CollectorRegistry
from pydantic import ValidationError

from nanoserve.server.http import connection_guard
from nanoserve.server.http.access_log import escape, logfmt_line
from nanoserve.server.http.connection_guard import (
    FD_RESERVE,
    LINGER_MAX,
    ConnectionGuard,
    ConnectionLimits,
    connection_capacity,
)
from nanoserve.server.metrics.instruments import Instruments
from nanoserve.server.settings import Settings


def test_capacity_leaves_room_for_the_server_and_lingering_sockets() -> None:
    assert connection_capacity(1024, 1 << 20) == 1024
    assert connection_capacity(1024, 1024) == 1024 - FD_RESERVE - LINGER_MAX
    assert connection_capacity(1024, 100) == 50  # a tiny limit: half of it, never all
    assert connection_capacity(5, 1) == 1


def test_the_soft_file_limit_is_raised_to_the_hard_one() -> None:
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard <= 256:
        pytest.skip(f"needs a finite hard file limit above 256 (have {hard})")
    code = ("import resource; from nanoserve.server.http.connection_guard import raise_open_file_limit; "
            "print(raise_open_file_limit(), resource.getrlimit(resource.RLIMIT_NOFILE)[0])")

    def lowered() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))

    out = subprocess.run([sys.executable, "-c", code], preexec_fn=lowered, capture_output=True, text=True,
                         check=True, timeout=60).stdout.split()
    assert out == [str(hard), str(hard)]


def test_guard_admits_up_to_the_limit_and_counts_hits() -> None:
    instruments = Instruments(CollectorRegistry())
    guard = ConnectionGuard(ConnectionLimits(max_connections=3, max_connections_per_client=2), instruments)
    assert [guard.admit("10.0.0.1") for _ in range(3)] == [None, None, "max_connections_per_client"]
    assert guard.admit("10.0.0.2") is None
    assert guard.admit("10.0.0.3") == "max_connections"
    assert instruments.connections_open._value.get() == 3
    guard.closed("10.0.0.1")
    assert guard.admit("10.0.0.1") is None
    guard.closed("10.0.0.2")
    assert guard._by_client == {"10.0.0.1": 2}
    assert instruments.connections_capacity._value.get() == 3


async def test_limit_logs_are_rate_limited_with_a_count(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(connection_guard, "LOG_INTERVAL_S", 0.2)
    instruments = Instruments(CollectorRegistry())
    guard = ConnectionGuard(ConnectionLimits(), instruments)
    with caplog.at_level(logging.INFO, logger="nanoserve.connections"):
        for i in range(100):
            guard.hit("max_connections", f"refused {i}")
        await asyncio.sleep(0.4)
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["refused 0", "99 more connections hit the max_connections limit in the last 0.2s "
                     "(not logged one by one)"]
    hits = instruments.connection_limit_hits.labels(limit="max_connections")._value.get()
    assert hits == 100


@pytest.mark.parametrize("field", ["max_connections", "max_connections_per_client", "header_timeout",
                                   "idle_timeout"])
def test_connection_settings_refuse_nonsense(field: str) -> None:
    for bad in (-1, "nan") if field == "max_connections_per_client" else (0, -1, "nan"):
        with pytest.raises(ValidationError):
            Settings(**{field: bad})


def test_escape_leaves_printable_text_and_escapes_the_rest() -> None:
    assert escape("/v1/chat/completions é 漢") == "/v1/chat/completions é 漢"
    assert escape("a\nb\r\x1b[2J\x00\x7f\u2028\u202e\\") == "a\\x0ab\\x0d\\x1b[2J\\x00\\x7f\\u2028\\u202e\\\\"
    assert escape("Traceback\n  line\x1b", keep_newlines=True) == "Traceback\n  line\\x1b"
    assert logfmt_line({"route": '/x status=200 "', "status": 404, "id": ""}) == \
        'route="/x status=200 \\x22" status=404 id=""'
