"""Fixtures shared by the service tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.server.server import ServerProcess, running_server

# The OpenAI API and chat page tests share one real server (a start costs seconds on 2 busy cores).
OPENAI_API_KEY = "openai-and-chat-page-tests"
OPENAI_MAX_NEW_TOKENS = 4096
OPENAI_MAX_STOP_SEQUENCES = 4
# Test-build fault: a prompt containing this gets NaN logits, so its generation fails in the engine.
FAULT_MARKER = "FAULT-MARKER"


@pytest.fixture(scope="session")
def openai_server(tiny_checkpoint: Path) -> Iterator[ServerProcess]:
    """`nanoserve serve` on the tiny checkpoint, with an API key, for tests/server/test_openai*.py
    and test_chat_page.py."""
    env = {
        "NANOSERVE_API_KEYS": OPENAI_API_KEY,
        "NANOSERVE_MAX_NEW_TOKENS": str(OPENAI_MAX_NEW_TOKENS),
        "NANOSERVE_DEFAULT_MAX_NEW_TOKENS": "16",
        "NANOSERVE_MAX_STOP_SEQUENCES": str(OPENAI_MAX_STOP_SEQUENCES),
        "NANOSERVE_MAX_SEQS": "4",
        "NANOSERVE_DRAIN_TIMEOUT": "2",
    }
    with running_server(tiny_checkpoint, env=env, fault=f"nan:{FAULT_MARKER}") as server:
        yield server


@pytest.fixture(scope="module")
def openai_client(openai_server: ServerProcess) -> Iterator[Any]:
    """The official `openai` client on openai_server: its API key, no retries."""
    import openai

    with openai.OpenAI(base_url=openai_server.base_url + "/v1", api_key=OPENAI_API_KEY, max_retries=0,
                       timeout=60) as c:
        yield c


def metric_value(exposition: str, series: str) -> float:
    """The value of one series (`name{labels}` exactly as exposed) in a Prometheus scrape; 0 if absent."""
    for line in exposition.splitlines():
        if line.startswith(series + " "):
            return float(line.split()[-1])
    return 0.0
