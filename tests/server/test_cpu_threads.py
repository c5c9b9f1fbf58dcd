"""A server started under `taskset -c 0` runs its engine on one thread and says so, in its start-up
log and in GET /info; and it names its weights' format at start-up."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import httpx
import pytest

from tests.server.server import REPO_ROOT, ServerProcess, free_port, serve_command, wait_ready

pytestmark = pytest.mark.skipif(shutil.which("taskset") is None, reason="needs taskset (util-linux)")


def test_a_server_pinned_to_one_cpu_runs_one_thread_and_says_so(tiny_checkpoint) -> None:  # type: ignore[no-untyped-def]
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    with tempfile.NamedTemporaryFile(prefix="nanoserve-", suffix=".log", delete=False) as log_file:
        command = ["taskset", "-c", "0", *serve_command(tiny_checkpoint, port)]
        process = subprocess.Popen(command, cwd=REPO_ROOT, env={**env, "PYTHONUNBUFFERED": "1"},
                                   stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    server = ServerProcess(f"http://127.0.0.1:{port}", port, process, Path(log_file.name))
    try:
        wait_ready(server)
        info = httpx.get(server.base_url + "/info", timeout=10).json()["engine"]
        logs = server.logs()
    finally:
        server.stop()
        server.log_path.unlink(missing_ok=True)
    assert info["cpu_threads"] == 1
    assert info["cpu_threads_from"]["source"] in {"affinity", "cgroup quota"}
    assert "affinity 1 CPU" in info["cpu_threads_from"]["detail"]
    assert "engine: 1 CPU thread, from the affinity mask (affinity 1 CPU" in logs
    assert "weights float32" in logs  # the tiny checkpoint served as loaded
