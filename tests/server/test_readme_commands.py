"""The README's `make serve`, run as a newcomer would, and its Python examples (the openai SDK and
huggingface_hub) against that server. Its curl examples: test_readme_examples.py; `make test` and
`make lint` are what CI (`.ci/run`) runs."""

from __future__ import annotations

import contextlib
import io
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import require_tool
from tests.server.doc_text import blocks
from tests.server.server import free_port, poll_ready

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text(encoding="utf-8")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_make_serve_answers_the_readme_python_examples(tmp_path: Path) -> None:
    make = require_tool("make")
    venv = Path(sys.prefix)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    env = {**os.environ, "NANOSERVE_PORT": str(port), "NANOSERVE_DEVICE": "cpu", "PYTHONUNBUFFERED": "1"}
    log = tmp_path / "serve.log"
    # `-o`: take the environment these tests run in as installed, never reinstall into it.
    command = [make, "-s", "-o", f"{venv}/.installed", "serve", f"VENV={venv}"]
    with log.open("wb") as out:
        process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL)
    try:
        poll_ready(base, 240, alive=lambda: process.poll() is None, logs=log.read_text)
        examples = blocks(README, "python")
        assert len(examples) == 2 and "openai" in examples[0] and "huggingface_hub" in examples[1]
        for code in examples:
            assert "http://127.0.0.1:8000" in code  # the README still reads as this test expects
            printed = io.StringIO()
            with contextlib.redirect_stdout(printed):
                exec(compile(code.replace("http://127.0.0.1:8000", base), "README.md", "exec"), {})
            assert printed.getvalue().strip(), code  # each prints generated text
    finally:
        stop(process)


def children(pid: int) -> list[int]:
    """The processes `pid` started (Linux)."""
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(c) for c in path.read_text().split()] if path.exists() else []


def stop(make: subprocess.Popen[bytes]) -> None:
    """SIGTERM the server make started (make does not pass signals on), then wait for make."""
    for signum in (signal.SIGTERM, signal.SIGKILL):
        for pid in children(make.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)
        try:
            make.wait(timeout=60)
            return
        except subprocess.TimeoutExpired:
            continue
    make.kill()
    make.wait(timeout=10)
