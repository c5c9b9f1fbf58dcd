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
from tests.service.doc_text import blocks
from tests.service.server import free_port, poll_ready

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
                                   stdin=subprocess.DEVNULL, start_new_session=True)
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
        os.killpg(process.pid, signal.SIGTERM)  # make and the server it started
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=10)
