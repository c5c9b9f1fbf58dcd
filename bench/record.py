"""What every benchmark records beside its figures: where its results go, the machine it ran on,
and the load around it."""

from __future__ import annotations

import json
import os
import platform
import re
from pathlib import Path
from typing import Any

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


def cpuinfo_fields(text: str) -> dict[str, str]:
    """The first processor's fields in /proc/cpuinfo's text: every core is the same part."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            if fields:
                break
            continue
        key, sep, value = line.partition(":")
        if sep:
            fields.setdefault(key.strip(), value.strip())
    return fields


def _int(value: str | None) -> int | None:
    try:  # /proc/cpuinfo writes family and model in decimal
        return int(value) if value is not None else None
    except ValueError:
        return None


def slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")[:32] or "cpu"


# AMD family 0x19's model ranges: Zen 3 (Milan, Vermeer, Cezanne, ...) and Zen 4 (Genoa, Raphael,
# Phoenix, Bergamo, ...). Cloud VMs name them all "AMD EPYC", so the model number tells them apart.
_ZEN3 = ((0x00, 0x0F), (0x20, 0x5F))
_ZEN4 = ((0x10, 0x1F), (0x60, 0x7F), (0xA0, 0xAF))


# Intel family 6's server parts with AMX by model number (a cloud VM names them all "Intel(R)
# Xeon(R) Processor", so the model number tells them apart).
_INTEL_XEON = {0x8F: "sapphire-rapids", 0xCF: "emerald-rapids", 0xAD: "granite-rapids"}


def microarch(vendor: str, family: int | None, model: int | None, name: str) -> str:
    """A short name for the CPU's microarchitecture ("zen3", "zen4", "zen5", "sapphire-rapids",
    "emerald-rapids", "granite-rapids"), else a slug of its model name: the tag results files are
    named by."""
    if vendor == "GenuineIntel" and family == 6 and model in _INTEL_XEON:
        return _INTEL_XEON[model]
    if vendor == "AuthenticAMD" and family == 0x19 and model is not None:
        for arch, ranges in (("zen3", _ZEN3), ("zen4", _ZEN4)):
            if any(lo <= model <= hi for lo, hi in ranges):
                return arch
    if vendor == "AuthenticAMD" and family == 0x1A:
        return "zen5"
    return slug(name)


def machine() -> dict[str, Any]:
    import torch  # here, not above: the report modules that only render results stay torch-free

    try:
        info = cpuinfo_fields(Path("/proc/cpuinfo").read_text())
    except OSError:
        info = {}
    cpu = info.get("model name", "unknown")
    vendor = info.get("vendor_id", "unknown")
    family, model = _int(info.get("cpu family")), _int(info.get("model"))
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {"cpu": cpu, "vendor_id": vendor, "cpu_family": family, "cpu_model": model,
            "microarch": microarch(vendor, family, model, cpu if cpu != "unknown" else ""),
            "cores": os.cpu_count(), "gpu": gpu,
            "torch": torch.__version__, "python": platform.python_version()}


def cpu_label(m: dict[str, Any]) -> str:
    """The CPU as a report's Machine line names it: "AMD EPYC (zen4)". Just the name where the
    microarchitecture is only the name's slug, or was not recorded (older results files)."""
    arch = m.get("microarch")
    return f"{m['cpu']} ({arch})" if arch and arch != slug(str(m["cpu"])) else str(m["cpu"])


def load_avg() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"
