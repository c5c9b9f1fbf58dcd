"""`make serve` passes options through: PORT= for the port, ARGS= for any `nanoserve serve` flag."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.conftest import require_tool
from tests.server.server import free_port, poll_ready
from tests.server.test_readme_commands import stop

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_make_serve_takes_a_port_and_flags(tmp_path: Path, tiny_checkpoint) -> None:  # type: ignore[no-untyped-def]
    make = require_tool("make")
    venv = Path(sys.prefix)
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("NANOSERVE_") and k != "PORT"}
    args = f"--checkpoint {tiny_checkpoint} --device cpu --max-seqs 3"
    # `-o`: take the environment these tests run in as installed, never reinstall into it.
    command = [make, "-s", "-o", f"{venv}/.installed", "serve", f"VENV={venv}", f"PORT={port}",
               f"ARGS={args}"]
    log = tmp_path / "serve.log"
    with log.open("wb") as out:
        process = subprocess.Popen(command, cwd=ROOT, env={**env, "PYTHONUNBUFFERED": "1"}, stdout=out,
                                   stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        poll_ready(f"http://127.0.0.1:{port}", 240, alive=lambda: process.poll() is None, logs=log.read_text)
        info = httpx.get(f"http://127.0.0.1:{port}/info", timeout=10).json()
    finally:
        stop(process)
    assert info["max_concurrent_requests"] == 3  # --max-seqs 3 reached the server
    assert info["model_id"] == "tiny-test"  # --checkpoint too
