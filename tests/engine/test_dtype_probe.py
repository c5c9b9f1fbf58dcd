"""A dtype this CPU only emulates is measured at start-up and named in a warning and in info()."""

from __future__ import annotations

import logging
import math

import pytest
import torch

import nanoserve.engine.engine as engine_module
from nanoserve.engine.config import EngineConfig
from nanoserve.engine.dtype_probe import cpu_matmul_slowdown
from nanoserve.engine.engine import Engine
from nanoserve.engine.native_step import unavailable_reason as native_unavailable
from nanoserve.model.checkpoint import Checkpoint


def test_float32_is_the_reference_and_bfloat16_gets_a_measured_ratio() -> None:
    assert cpu_matmul_slowdown(torch.float32) == 1.0
    ratio = cpu_matmul_slowdown(torch.bfloat16)
    assert math.isfinite(ratio) and ratio > 0


# The native step computes bfloat16 models in float32, so a slow torch bf16 only matters without it.
@pytest.mark.parametrize(("slowdown", "native_step", "warned"),
                         [(50.0, False, True), (1.2, False, False), (50.0, True, False)])
def test_engine_warns_when_its_dtype_is_slow_here(
    lively: Checkpoint, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
    slowdown: float, native_step: bool, warned: bool,
) -> None:
    if native_step and native_unavailable(torch.device("cpu"), torch.bfloat16):
        pytest.skip(f"native step unavailable: {native_unavailable(torch.device('cpu'), torch.bfloat16)}")
    asked: list[torch.dtype] = []

    def probe(dtype: torch.dtype) -> float:
        asked.append(dtype)
        return slowdown

    monkeypatch.setattr(engine_module, "cpu_matmul_slowdown", probe)
    with caplog.at_level(logging.WARNING, logger="nanoserve.engine.engine"):
        config = EngineConfig(device="cpu", dtype="bfloat16", max_seqs=2,
                              backend="native" if native_step else "torch")
        engine = Engine(lively, config)
    assert asked == [torch.bfloat16]
    assert (engine.info()["backend"]["name"] == "native") is native_step
    assert engine.info()["dtype_matmul_slowdown_vs_float32"] == slowdown
    messages = [r.getMessage() for r in caplog.records]
    assert any("50x slower than float32" in m and "serve with dtype float32" in m
               for m in messages) is warned


def test_float32_engine_does_not_probe(lively: Checkpoint, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine_module, "cpu_matmul_slowdown", lambda dtype: pytest.fail("probed"))
    engine = Engine(lively, EngineConfig(device="cpu", dtype="float32", max_seqs=2))
    assert engine.info()["dtype_matmul_slowdown_vs_float32"] == 1.0
