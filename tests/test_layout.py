"""The package's layers show in its folders and hold in its imports: `nanoserve/` holds model, engine
and server; imports run server -> engine -> model and never back; a wheel installs one top-level
package, `nanoserve`, with the console script, the chat page's files and the native step."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.bench.test_package import imported_modules

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "nanoserve"
# Each layer and the layers above it, which it must never import.
ABOVE = {
    "model": ("nanoserve.engine", "nanoserve.server", "nanoserve.cli"),
    "engine": ("nanoserve.server", "nanoserve.cli"),
}


def _layer_imports(layer: str) -> dict[str, set[str]]:
    """Each module of the layer -> the nanoserve modules it imports (at its top or in a function)."""
    return {
        str(path.relative_to(ROOT)): {m for m in imported_modules(path) if m.startswith("nanoserve.")}
        for path in (PACKAGE / layer).rglob("*.py")
    }


def test_the_package_holds_the_three_layers() -> None:
    layers = sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists())
    assert layers == ["engine", "model", "server"]


@pytest.mark.parametrize("layer", sorted(ABOVE))
def test_a_layer_never_imports_the_layers_above_it(layer: str) -> None:
    graph = _layer_imports(layer)
    upward = {module: sorted(m for m in names if m.startswith(ABOVE[layer]))
              for module, names in graph.items()}
    assert {module: names for module, names in upward.items() if names} == {}


def test_the_import_reader_sees_the_imports_that_go_down() -> None:
    """The check above reads real imports: the server imports the engine and the model, the engine
    the model (a reader that saw nothing would pass it)."""
    server = set().union(*_layer_imports("server").values())
    engine = set().union(*_layer_imports("engine").values())
    assert any(m.startswith("nanoserve.engine") for m in server)
    assert any(m.startswith("nanoserve.model") for m in server | engine)


def test_python_dash_m_nanoserve_is_the_command() -> None:
    done = subprocess.run([sys.executable, "-m", "nanoserve", "serve", "--help"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: nanoserve serve")


@pytest.mark.slow
def test_the_wheel_installs_one_top_level_package(tmp_path: Path) -> None:
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
         "--wheel-dir", str(tmp_path / "dist"), str(ROOT)],
        capture_output=True, text=True, timeout=600,
    )
    assert built.returncode == 0, built.stderr
    (wheel,) = (tmp_path / "dist").glob("nanoserve-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")} == {"nanoserve"}
    assert "nanoserve/server/static/chat.html" in names
    assert any(n.startswith("nanoserve/engine/native/_decode") and n.endswith(".so") for n in names)
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "nanoserve = nanoserve.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()
    # Installed on its own (the dependencies are this environment's), away from the source tree.
    target = tmp_path / "site"
    installed = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
                                "--target", str(target), str(wheel)], capture_output=True, text=True,
                               timeout=300)
    assert installed.returncode == 0, installed.stderr
    probe = (
        "import importlib.util, nanoserve.cli, nanoserve.server.app;"
        "print(nanoserve.__file__);"
        "print(importlib.util.find_spec('model'), importlib.util.find_spec('service'))"
    )
    env = {**os.environ, "PYTHONPATH": str(target)}
    ran = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=120)
    assert ran.returncode == 0, ran.stderr
    where, specs = ran.stdout.splitlines()
    assert where.startswith(str(target))
    assert specs == "None None"
