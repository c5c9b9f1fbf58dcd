"""Are the carried wheels enough? Every requirement of what the GPU check imports, met by the image
or by bench/gpu/wheels.txt.

    python -m bench.gpu.wheels     (exit 1 naming what is missing)

The roots are pyproject's runtime dependencies (uvicorn without its `standard` extra: of it the
server needs httptools, its HTTP protocol, and uvloop, which the image has; watchfiles serves
--reload and websockets WebSocket routes, neither used) and the test subset's pytest plugins. A
requirement the image meets ends the walk there (the image's own packages bring theirs); a carried
one is followed through its own requirements, read from this environment's metadata, so each pin
must be the version installed here, the one the CPU suite runs.
"""

from __future__ import annotations

import re
import sys
from importlib import metadata
from pathlib import Path

import tomllib
from packaging.requirements import Requirement

HERE = Path(__file__).resolve().parent
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
    project = tomllib.loads((HERE.parents[1] / "pyproject.toml").read_text())["project"]
    reqs = [Requirement(spec) for spec in project["dependencies"]]
    for req in reqs:
        req.extras = set()  # uvicorn[standard]: see the module's docstring
    return [*reqs, *(Requirement(name) for name in EXTRA_ROOTS)]


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
    todo, seen = roots(), set()
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
