"""The servers the reliability tests share, started together so their start-ups overlap.

- `shared`: fewer KV slots than the load test's streams and a short queue, so load both queues and
  overflows; also takes the bad-input table, disconnects and the slow reader.
- `secure`: API keys, one CORS origin and debug logging (so a leaked key would show); its backend
  also injects the test fault "nan:" (prompts containing FAULT_MARKER get NaN logits; see
  tests/faults.py), which needs a server of its own and costs the security tests nothing.
- `raise`: the test fault "raise:" (the forward pass raises when such a prompt is in the batch).
  It and `secure` serve a 512-token window (LONG_WINDOW), the others the tiny 64-token one.
- `drain`: gets SIGTERM under load.

All run the real `nanoserve serve` through the HTTP tests' harness (tests/server/server.py).
"""

from __future__ import annotations

import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import make_tiny_checkpoint
from tests.server.server import ServerProcess, start_server, wait_ready

SHARED_MAX_SEQS = 8
SHARED_MAX_QUEUE = 16
FAULT_MARKER = "POISON"
API_KEYS = ("reliability-key-0123456789", "second-key-abcdefghij")
ALLOWED_ORIGIN = "https://chat.example.org"
# One intra-op thread: a tiny model gains nothing from two, and on a busy 2-core box two spinning
# OpenMP threads per server made engine steps ~40x slower (7 ms -> 300 ms, measured).
ONE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}

# The fault test's batch-mates ask for this many tokens, more than the engine makes within the
# test's timeouts, so only the test ends them (the fault servers allow it).
MATE_TOKENS = 1_000_000

# Start-up is a second or two on an idle machine and can take over a minute on a busy one.
READY_TIMEOUT_S = 240.0
FLEET = {
    "shared": {"NANOSERVE_MAX_SEQS": str(SHARED_MAX_SEQS), "NANOSERVE_MAX_QUEUE": str(SHARED_MAX_QUEUE),
               "NANOSERVE_DRAIN_TIMEOUT": "5"},
    "secure": {"NANOSERVE_API_KEYS": ",".join(API_KEYS), "NANOSERVE_CORS_ORIGINS": ALLOWED_ORIGIN,
               "NANOSERVE_LOG_LEVEL": "debug", "NANOSERVE_DETERMINISTIC": "1",
               "NANOSERVE_MAX_NEW_TOKENS": str(MATE_TOKENS)},
    "raise": {"NANOSERVE_BODY_TIMEOUT": "2",
              "NANOSERVE_MAX_NEW_TOKENS": str(MATE_TOKENS)},
    "drain": {"NANOSERVE_DRAIN_TIMEOUT": "60", "NANOSERVE_MAX_SEQS": "8"},
}
# Faults their backends inject (tests/faults.py): a prompt containing the marker gets NaN logits,
# or makes the forward pass it is in raise.
FAULTS = {"secure": f"nan:{FAULT_MARKER}", "raise": f"raise:{FAULT_MARKER}"}


# Servers whose tests generate long streams (the fault test's batch-mates): a 512-token window,
# not 64, so their tokens are compared with solo runs without a context shift in most runs.
LONG_WINDOW = {"secure", "raise"}
LONG_WINDOW_TOKENS = 512


@pytest.fixture(scope="session")
def fleet(
    tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, ServerProcess]]:
    long_dir = tmp_path_factory.mktemp("ckpt") / "tiny-long"
    long_window = make_tiny_checkpoint(long_dir, block_size=LONG_WINDOW_TOKENS)
    servers = {
        name: start_server(long_window if name in LONG_WINDOW else tiny_checkpoint, env={**ONE_THREAD, **env},
                           fault=FAULTS.get(name))
        for name, env in FLEET.items()
    }
    try:
        for server in servers.values():
            wait_ready(server, timeout=READY_TIMEOUT_S)
        yield servers
    finally:
        stop_all(list(servers.values()))


def stop_all(servers: list[ServerProcess]) -> None:
    """SIGTERM every server at once, then wait for each (SIGKILL after 20 s)."""
    running = [s for s in servers if s.process.poll() is None]
    for s in running:
        s.process.send_signal(signal.SIGTERM)
    for s in running:
        try:
            s.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            s.process.kill()
            s.process.wait(timeout=10)
    for s in servers:
        s.log_path.unlink(missing_ok=True)


@pytest.fixture(scope="session")
def shared_server(fleet: dict[str, ServerProcess]) -> ServerProcess:
    return fleet["shared"]


@pytest.fixture(scope="session")
def secure_server(fleet: dict[str, ServerProcess]) -> ServerProcess:
    return fleet["secure"]


@pytest.fixture
def client(shared_server: ServerProcess) -> Iterator[httpx.Client]:
    """A client of the shared server (no keys, no CORS)."""
    with httpx.Client(base_url=shared_server.base_url, timeout=60) as c:
        yield c


@pytest.fixture
def sclient(secure_server: ServerProcess) -> Iterator[httpx.Client]:
    """A client of the secure server (sends no key by itself)."""
    with httpx.Client(base_url=secure_server.base_url, timeout=60) as c:
        yield c
