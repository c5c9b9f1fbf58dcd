"""A bounded schemathesis run against /openapi.json of a real server.

It generates requests from the documented schema (valid and invalid) for every operation and checks
that no response is a 5xx, every status code and content type is documented, every response body
(and every SSE event) matches its schema, and invalid requests are rejected. Valid-by-schema
requests may still be refused by server limits (caps, characters outside the model's vocabulary),
so `positive_data_acceptance` is not checked.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import require_module
from tests.server.server import ServerProcess, running_server


@pytest.fixture(scope="module")
def server(tiny_checkpoint) -> Iterator[ServerProcess]:  # type: ignore[no-untyped-def]
    # Small caps keep each accepted generation short, so the run is bounded by examples, not tokens.
    env = {"NANOSERVE_MAX_NEW_TOKENS": "8", "NANOSERVE_MAX_PROMPT_TOKENS": "128"}
    with running_server(tiny_checkpoint, env=env) as srv:
        yield srv


@pytest.mark.slow
def test_schemathesis_finds_no_server_error_or_schema_violation(
    server: ServerProcess, tmp_path: Path
) -> None:
    require_module("schemathesis")
    st = shutil.which("st", path=str(Path(sys.executable).parent)) or shutil.which("st")
    assert st is not None, "schemathesis is installed but its `st` command is not on the venv's PATH"
    command = [
        st, "run", f"{server.base_url}/openapi.json",
        "--phases", "examples,coverage,fuzzing",
        "--max-examples", "8",
        "--checks", "all",
        "--exclude-checks", "positive_data_acceptance",
        "--generation-deterministic",  # the same cases every run: a failure reproduces
        "--request-timeout", "30",
        "--max-failures", "20",
        "--no-color",
    ]
    result = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=400)
    report = result.stdout[-12000:] + result.stderr[-2000:]
    assert result.returncode == 0, report
    assert "No issues found" in result.stdout or " passed" in result.stdout, report
    assert (server.process.poll() is None), "the server died during the run:\n" + server.logs()
