"""Which backend computes is chosen once, at start-up, and said: in the log and in /info."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx

from nanoserve.engine.native_step import library_path
from tests.server.server import REPO_ROOT, running_server


def serve(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "nanoserve.cli", "serve", *args], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=120)


def test_a_backend_that_cannot_run_is_one_line_before_loading(tiny_checkpoint: Path) -> None:
    done = serve("--checkpoint", str(tiny_checkpoint), "--backend", "native", "--compile", "--port", "0")
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert lines == ["nanoserve serve: error: backend native cannot run here: the model is compiled "
                     "(the compiled graph runs every step)"]


def test_serve_has_no_test_only_flags() -> None:
    done = subprocess.run([sys.executable, "-m", "nanoserve.cli", "serve", "--help"], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "--backend" in done.stdout
    flags = {word.strip("[],") for word in done.stdout.split() if word.startswith(("--", "[--"))}
    assert "--backend" in flags and not any("inject" in flag or flag.startswith("--fault") for flag in flags)


def test_info_and_the_log_say_which_backend_runs_and_why(tiny_checkpoint: Path) -> None:
    expected = "native" if library_path() is not None else "torch"
    for asked, name in (("auto", expected), ("torch", "torch")):
        with running_server(tiny_checkpoint, args=["--backend", asked]) as server:
            backend = httpx.get(f"{server.base_url}/info", timeout=10).json()["engine"]["backend"]
            logs = server.logs()
        assert backend["name"] == name and backend["kernels"] and backend["reason"]
        assert f"engine: backend {name}, kernels {backend['kernels']} ({backend['reason']})" in logs
