"""bench/ is a package: its modules import each other one way, `python -m bench.<name>` runs from
the repository root as is, and nothing in the `nanoserve` package imports it."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"


def imported_modules(path: Path) -> set[str]:
    """Every module `path` imports, at its top or inside a function."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            # `from bench import limits` imports the module bench.limits
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def bench_graph() -> dict[str, set[str]]:
    modules = {f"bench.{p.stem}" for p in BENCH.glob("*.py") if p.stem != "__init__"}
    return {f"bench.{p.stem}": imported_modules(p) & modules
            for p in BENCH.glob("*.py") if p.stem != "__init__"}


def tangled(graph: dict[str, set[str]]) -> set[str]:
    """The modules left after removing, again and again, every module that imports none of the
    modules left: empty when imports run one way, else the modules in or above an import cycle."""
    left = dict(graph)
    while left:
        leaves = {m for m, deps in left.items() if not deps & left.keys()}
        if not leaves:
            break
        for m in leaves:
            del left[m]
    return set(left)


def test_tangled_finds_a_cycle_and_only_a_cycle() -> None:
    assert tangled({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}) == {"a", "b", "c", "d"}
    assert tangled({"a": {"b", "c"}, "b": {"c"}, "c": set()}) == set()


def test_bench_modules_import_each_other_one_way() -> None:
    graph = bench_graph()
    assert graph.get("bench.engine_throughput")  # the graph is read: the driver imports its parts
    assert tangled(graph) == set()


def test_no_bench_module_edits_the_import_path() -> None:
    edits = [p.name for p in BENCH.glob("*.py") if "sys.path" in p.read_text(encoding="utf-8")]
    assert edits == []


def test_the_nanoserve_package_never_imports_bench() -> None:
    files = list((ROOT / "nanoserve").rglob("*.py"))
    assert len(files) > 50  # the package's files are read
    importers = [str(p.relative_to(ROOT)) for p in files
                 if any(m == "bench" or m.startswith("bench.") for m in imported_modules(p))]
    assert importers == []


def test_a_benchmark_runs_as_a_module_from_the_repository_root() -> None:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the root comes from -m alone
    out = subprocess.run([sys.executable, "-m", "bench.engine_throughput", "--help"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage: python -m bench.engine_throughput") and "--render" in out.stdout
