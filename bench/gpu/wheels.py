"""Are the carried wheels enough? Every requirement of what the GPU check imports, met by the image
or by bench/gpu/wheels.txt.

    python -m bench.gpu.wheels     (exit 1 naming what is missing)

The roots are pyproject's runtime dependencies (uvicorn without its `standard` extra: of it the
server needs httptools, its HTTP protocol, and uvloop, which the image has; watchfiles serves
--reload and websockets WebSocket routes, neither used), the test subset's pytest plugins and what
the test subset imports as pytest collects it (its modules, their conftests and the tests.* helpers
they import; a dev-only import such as jsonschema would otherwise stop the whole collection). A
requirement the image meets ends the walk there (the image's own packages bring theirs); a carried
one is followed through its own requirements, read from this environment's metadata, so each pin
must be the version installed here, the one the CPU suite runs.
"""

from __future__ import annotations

import ast
import re
import sys
from importlib import metadata
from pathlib import Path

import tomllib
from packaging.requirements import Requirement

from bench.gpu.check import make_plan

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
PROJECT = "nanoserve"
LOCAL = ("nanoserve", "bench", "tests")  # the repository's own packages
EXTRA_ROOTS = ("httptools", "pytest-asyncio", "pytest-timeout")
# The device's interpreter, for environment markers.
MARKERS = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
           "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
           "implementation_name": "cpython", "platform_python_implementation": "CPython", "extra": ""}


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _names(path: Path) -> list[str]:
    lines = (line.split("#")[0].strip() for line in path.read_text().splitlines())
    return [line for line in lines if line]


def carried() -> dict[str, str]:
    """wheels.txt: name -> pinned version."""
    pins = (line.split("==") for line in _names(HERE / "wheels.txt"))
    return {canonical(name): version for name, version in pins}


def image() -> set[str]:
    return {canonical(name) for name in _names(HERE / "image-packages.txt")}


def roots() -> list[Requirement]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    reqs = [Requirement(spec) for spec in project["dependencies"]]
    for req in reqs:
        req.extras = set()  # uvicorn[standard]: see the module's docstring
    return [*reqs, *(Requirement(name) for name in EXTRA_ROOTS)]


def _module_imports(path: Path) -> set[str]:
    """Modules a file imports when loaded: function bodies (lazy imports in fixtures) are left out."""
    found: set[str] = set()
    todo: list[ast.AST] = [ast.parse(path.read_text())]
    while todo:
        node = todo.pop()
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            todo.extend(ast.iter_child_nodes(node))
    return found


def _collected_files(test_paths: tuple[str, ...]) -> list[Path]:
    """The test subset's files and every conftest.py from the repository's root down to them."""
    files: list[Path] = []
    for rel in test_paths:
        path = REPO / rel
        files += sorted(path.rglob("*.py")) if path.is_dir() else [path]
        for folder in [path, *path.parents] if path.is_dir() else path.parents:
            if folder == REPO.parent:
                break
            files.append(folder / "conftest.py")
    return [f for f in dict.fromkeys(files) if f.exists()]


def subset_imports(test_paths: tuple[str, ...]) -> dict[str, str]:
    """Third-party top-level module -> a file that imports it: the subset's files and the
    repository's own modules they import, followed."""
    todo, seen = _collected_files(test_paths), set()
    found: dict[str, str] = {}
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        for module in _module_imports(path):
            top = module.split(".")[0]
            if top in LOCAL:
                local = REPO.joinpath(*module.split("."))
                todo += [p for p in (local.with_suffix(".py"), local / "__init__.py") if p.exists()]
            elif top not in sys.stdlib_module_names:
                found.setdefault(top, str(path.relative_to(REPO)))
    return found


def _import_roots(test_paths: tuple[str, ...]) -> tuple[list[Requirement], list[str]]:
    """The distributions the subset's imports need, and each import no installed distribution has."""
    dists, reqs, found = metadata.packages_distributions(), [], []
    for module, where in sorted(subset_imports(test_paths).items()):
        names = [canonical(name) for name in dists.get(module, [])]
        if not names:
            found.append(f"{where} imports {module}, which no installed distribution provides")
        reqs += [Requirement(name) for name in names if name != PROJECT]
    return reqs, found


def problems() -> list[str]:
    """Each requirement neither the image nor the wheels meet, each pin that is not the installed
    version, and each carried version a requirement rules out."""
    have, base, found = carried(), image(), []
    for name, version in have.items():
        try:
            installed = metadata.version(name)
        except metadata.PackageNotFoundError:
            found.append(f"{name} is pinned in wheels.txt but not installed here: its needs are unknown")
            continue
        if installed != version:
            found.append(f"wheels.txt pins {name}=={version}, this environment has {installed}")
    imported, found_imports = _import_roots(make_plan(dry_run=False).test_paths)
    found += found_imports
    todo, seen = [*roots(), *imported], set()
    while todo:
        req = todo.pop()
        name = canonical(req.name)
        if (req.marker and not req.marker.evaluate(MARKERS)) or (name in seen and name not in have):
            continue
        if name in have:
            if not req.specifier.contains(have[name], prereleases=True):
                found.append(f"{req} rules out the carried {name}=={have[name]}")
            if name in seen:
                continue
            seen.add(name)
            todo += [Requirement(r) for r in metadata.requires(name) or []]
        elif name not in base:
            found.append(f"{req}: neither in the image nor in wheels.txt")
        seen.add(name)
    return found


def main() -> int:
    found = problems()
    print("\n".join(found) or "every requirement is met by the image or the carried wheels")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
