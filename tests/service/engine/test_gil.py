"""The GIL switch interval by device (service/engine/gil.py)."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest

from service.engine.config import EngineConfig
from service.engine.gil import GPU_SWITCH_INTERVAL_S, apply_switch_interval


@pytest.fixture
def restored() -> Iterator[float]:
    """The process's interval before the test, put back after it (it is process-wide)."""
    before = sys.getswitchinterval()
    yield before
    sys.setswitchinterval(before)


def test_by_device_python_default_on_cpu_and_shorter_on_a_gpu(restored: float) -> None:
    assert apply_switch_interval(0.0, "cpu") == restored  # CPU: left as Python has it
    assert apply_switch_interval(0.0, "cuda:0") == pytest.approx(GPU_SWITCH_INTERVAL_S)
    assert GPU_SWITCH_INTERVAL_S < restored


def test_an_explicit_interval_wins_on_any_device(restored: float) -> None:
    assert apply_switch_interval(0.002, "cpu") == pytest.approx(0.002)
    assert apply_switch_interval(0.003, "cuda") == pytest.approx(0.003)


def test_a_negative_interval_is_refused_in_one_line() -> None:
    with pytest.raises(ValueError, match="gil_switch_interval must be 0 .* or positive"):
        EngineConfig(gil_switch_interval=-1.0)
