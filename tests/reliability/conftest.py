"""Servers the reliability tests share, so the suite pays for few start-ups.

`shared_server` is a plain server with fewer KV slots than the load test's streams and a short
queue, so load both queues and overflows. Tests that need other settings (API keys, fault
injection, a server to SIGTERM) start their own with the same harness (tests/service/server.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.service.server import ServerProcess, running_server

SHARED_MAX_SEQS = 8
SHARED_MAX_QUEUE = 16
# One intra-op thread: a tiny model gains nothing from two, and on a busy 2-core box two spinning
# OpenMP threads per server made engine steps ~40x slower (7 ms -> 300 ms, measured).
ONE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
SHARED_ENV = {
    **ONE_THREAD,
    "NANOSERVE_MAX_SEQS": str(SHARED_MAX_SEQS),
    "NANOSERVE_MAX_QUEUE": str(SHARED_MAX_QUEUE),
    "NANOSERVE_DRAIN_TIMEOUT": "5",
}


@pytest.fixture(scope="session")
def shared_server(tiny_checkpoint: Path) -> Iterator[ServerProcess]:
    with running_server(tiny_checkpoint, env=SHARED_ENV) as server:
        yield server


@pytest.fixture
def client(shared_server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=shared_server.base_url, timeout=60) as c:
        yield c
