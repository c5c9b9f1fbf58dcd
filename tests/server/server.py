"""A real `nanoserve serve` process on 127.0.0.1, for tests that need real sockets.

    from tests.server.server import running_server

    with running_server(tiny_checkpoint, env={"NANOSERVE_MAX_SEQS": "2"}) as server:
        httpx.get(server.base_url + "/ready")
        server.process.send_signal(signal.SIGTERM); server.wait(10)

The server runs the installed console script (the same code path as `make serve`) on a free
ephemeral port, with its output captured in a log file (`server.logs()`); the context manager
waits for GET /ready (bounded) and always stops the process on exit (SIGTERM, then SIGKILL).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclass
class ServerProcess:
    base_url: str
    port: int
    process: subprocess.Popen[bytes]
    log_path: Path

    def logs(self) -> str:
        """Everything the server printed so far (stdout and stderr)."""
        return self.log_path.read_text(encoding="utf-8", errors="replace")

    def wait(self, timeout: float) -> int:
        """The exit status, waiting at most `timeout` seconds (raises TimeoutExpired)."""
        return self.process.wait(timeout=timeout)

    def stop(self, timeout: float = 15.0) -> int | None:
        """SIGTERM, then SIGKILL if it has not exited within `timeout` seconds."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        return self.process.returncode


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def serve_command(checkpoint: Path | str, port: int, args: Sequence[str] = (), fault: str | None = None
                  ) -> list[str]:
    """The command line: the venv's `nanoserve` script when installed, else `python -m nanoserve.cli`;
    with a `fault`, `python -m tests.faults` (the same command line, the fault injected)."""
    script = Path(sys.executable).parent / "nanoserve"
    base = [str(script)] if script.exists() else [sys.executable, "-m", "nanoserve.cli"]
    if fault is not None:
        base = [sys.executable, "-m", "tests.faults"]
    return [*base, "serve", "--checkpoint", str(checkpoint), "--host", "127.0.0.1", "--port", str(port),
            "--device", "cpu", *args]


def start_server(
    checkpoint: Path | str, *, env: Mapping[str, str] | None = None, args: Sequence[str] = (),
    fault: str | None = None,
) -> ServerProcess:
    """Start (without waiting for readiness) a server process; the caller must stop it. `fault`:
    a fault the backend injects (tests/faults.py), e.g. "nan:POISON"."""
    port = free_port()
    log_file = tempfile.NamedTemporaryFile(prefix="nanoserve-", suffix=".log", delete=False)  # noqa: SIM115
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    if fault is not None:
        full_env["NANOSERVE_TEST_FAULT"] = fault
    process = subprocess.Popen(
        serve_command(checkpoint, port, args, fault), cwd=REPO_ROOT, env=full_env,
        stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
    )
    log_file.close()
    return ServerProcess(f"http://127.0.0.1:{port}", port, process, Path(log_file.name))


def poll_ready(
    base_url: str,
    timeout: float,
    *,
    alive: Callable[[], bool],
    logs: Callable[[], str],
    interval: float = 0.1,
) -> None:
    """Poll GET {base_url}/ready until 200. Raises RuntimeError (with `logs()`) once `alive()` is
    false, TimeoutError when `timeout` passes. For anything that runs a server: a process, a container."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not alive():
            raise RuntimeError(f"server exited before it was ready:\n{logs()}")
        try:
            if httpx.get(base_url + "/ready", timeout=2.0).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(interval)
    raise TimeoutError(f"server not ready after {timeout:.0f}s:\n{logs()}")


def wait_ready(server: ServerProcess, timeout: float = 90.0) -> None:
    """Poll GET /ready until 200; raise with the server's log if it exits or the time runs out."""
    poll_ready(server.base_url, timeout, alive=lambda: server.process.poll() is None, logs=server.logs)


@contextmanager
def running_server(
    checkpoint: Path | str,
    *,
    env: Mapping[str, str] | None = None,
    args: Sequence[str] = (),
    ready_timeout: float = 90.0,
    fault: str | None = None,
) -> Iterator[ServerProcess]:
    """A ready server for the duration of the block; always stopped (and its log removed) after.

    `env` adds NANOSERVE_* (or any) variables; `args` are extra `nanoserve serve` flags; `fault`
    a fault its backend injects (tests/faults.py).
    A port taken between choosing and binding it is retried on another port (twice).
    """
    server = None
    for attempt in range(3):
        server = start_server(checkpoint, env=env, args=args, fault=fault)
        try:
            wait_ready(server, ready_timeout)
            break
        except RuntimeError:
            if attempt == 2 or "address already in use" not in server.logs().lower():
                server.stop()
                server.log_path.unlink(missing_ok=True)
                raise
            server.log_path.unlink(missing_ok=True)
        except BaseException:
            server.stop()
            server.log_path.unlink(missing_ok=True)
            raise
    assert server is not None
    try:
        yield server
    finally:
        server.stop()
        server.log_path.unlink(missing_ok=True)
