"""`nanoserve` bounds libgomp's idle spinning before torch loads libgomp (omp_wait.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from nanoserve.engine.omp_wait import SPIN_COUNT, bound_openmp_spinning

REPO = Path(__file__).resolve().parents[2]
PROBE = """
import os, sys
from nanoserve.cli import main
loaded_at_import = 'torch' in sys.modules
try:
    main(['serve', '--help'])
except SystemExit:
    pass
print(loaded_at_import, 'torch' in sys.modules, os.environ.get('GOMP_SPINCOUNT'))
"""


def probe(env: dict[str, str]) -> list[str]:
    clean = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    done = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO, env={**clean, **env}, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.split()[-3:]


def test_the_command_sets_the_spin_count_before_torch_loads() -> None:
    # The `nanoserve` module loads no torch; main() sets the count, then the subcommands load it.
    assert probe({}) == ["False", "True", str(SPIN_COUNT)]
    assert probe({"GOMP_SPINCOUNT": "5"})[2] == "5"  # the operator's own setting wins
    assert probe({"OMP_WAIT_POLICY": "active"})[2] == "None"  # so does a wait policy


def test_bound_openmp_spinning_only_fills_in_what_is_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    bound_openmp_spinning()
    assert os.environ["GOMP_SPINCOUNT"] == str(SPIN_COUNT)
    monkeypatch.setenv("GOMP_SPINCOUNT", "100")
    bound_openmp_spinning()
    assert os.environ["GOMP_SPINCOUNT"] == "100"
