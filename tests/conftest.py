"""Shared test fixtures and the rule for system tools: skip locally, fail in CI."""

from __future__ import annotations

import os
import shutil

import pytest

IN_CI = os.environ.get("CI", "").lower() in {"1", "true", "yes"}


def require_tool(name: str, why: str = "") -> str:
    """Path of a system tool; skips the test when it is missing (fails instead under CI=true)."""
    path = shutil.which(name)
    if path is None:
        message = f"system tool {name!r} not found{': ' + why if why else ''}"
        if IN_CI:
            pytest.fail(message + " (CI installs it via .ci/apt-packages.txt)")
        pytest.skip(message)
    return path


def require_module(name: str) -> None:
    """Skip (fail in CI) when an optional Python module is missing."""
    try:
        __import__(name)
    except ImportError:
        if IN_CI:
            pytest.fail(f"Python module {name!r} is missing in CI")
        pytest.skip(f"Python module {name!r} not installed")
