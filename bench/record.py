"""What every benchmark records beside its figures: where its results go, the machine it ran on,
and the load around it."""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path
from typing import Any

import torch

RESULTS = Path(__file__).resolve().parent / "results"


def write_results(out: str | Path, payload: dict[str, Any], md: str) -> None:
    """A benchmark's results: `out`.json (everything measured) and `out`.md (its table)."""
    path = Path(out)
    if path.suffix in (".json", ".md"):
        path = path.with_suffix("")
    path.parent.mkdir(parents=True, exist_ok=True)
    # Suffixes appended, not swapped: a name like results/engine-10.7M would otherwise lose ".7M".
    path.with_name(path.name + ".json").write_text(json.dumps(payload, indent=2) + "\n")
    path.with_name(path.name + ".md").write_text(md)


def machine() -> dict[str, Any]:
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(),
            "torch": torch.__version__, "python": platform.python_version()}


def load_avg() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"
