"""The server's GIL switch interval by device (nanoserve/server/runtime/gil.py)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from pydantic import ValidationError

from nanoserve.server.runtime.gil import GPU_SWITCH_INTERVAL_S, apply_switch_interval
from nanoserve.server.settings import Settings
from tests.server.server import running_server


@pytest.fixture
def restored() -> Iterator[float]:
    """The process's interval before the test, put back after it (it is process-wide)."""
    before = sys.getswitchinterval()
    yield before
    sys.setswitchinterval(before)


def test_by_device_python_default_on_cpu_and_shorter_on_a_gpu(restored: float) -> None:
    assert apply_switch_interval(0.0, "cpu") == restored  # CPU: left as Python has it
    assert apply_switch_interval(0.0, "cuda:0") == pytest.approx(GPU_SWITCH_INTERVAL_S)
    assert restored > GPU_SWITCH_INTERVAL_S


def test_an_explicit_interval_wins_on_any_device(restored: float) -> None:
    assert apply_switch_interval(0.002, "cpu") == pytest.approx(0.002)
    assert apply_switch_interval(0.003, "cuda") == pytest.approx(0.003)


def test_a_negative_interval_is_refused() -> None:
    with pytest.raises(ValidationError, match="gil_switch_interval"):
        Settings(gil_switch_interval=-1.0)


def test_the_server_sets_its_own_process_interval(tiny_checkpoint: Path) -> None:
    """On CPU the server keeps Python's interval unless told; told, /info reports the one set."""
    with running_server(tiny_checkpoint) as server:
        default = httpx.get(f"{server.base_url}/info", timeout=10).json()["engine"]["gil_switch_interval_s"]
    with running_server(tiny_checkpoint, args=["--gil-switch-interval", "0.002"]) as server:
        told = httpx.get(f"{server.base_url}/info", timeout=10).json()["engine"]["gil_switch_interval_s"]
    assert default == pytest.approx(0.005) and told == pytest.approx(0.002)
