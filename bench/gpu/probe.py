"""What the run is on: the device, its software, and its memory bandwidth, measured.

    python -m bench.gpu.probe --device cuda --json probe.json

The bandwidth is a large device-to-device copy, bytes read plus bytes written over its time (best
of several): the figure the HBM bound of a decode step uses, since a step streams every weight
once. On a CPU it is the same copy in host memory.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time
from pathlib import Path
from typing import Any

import torch

from bench.record import machine


def copy_bandwidth(device: torch.device, nbytes: int, repeats: int = 10) -> float:
    """Bytes per second moved (read + written) copying a buffer of `nbytes` on `device`, best of
    `repeats` after a warm-up. Random bytes, not zeros (zeros can run faster than real data)."""
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            seconds = start.elapsed_time(end) / 1e3
        else:
            t0 = time.perf_counter()
            dst.copy_(src)
            seconds = time.perf_counter() - t0
        best = min(best, seconds)
    if not torch.equal(dst[:4096], src[:4096]):
        raise RuntimeError("the copy did not copy")
    return 2 * nbytes / best


def nvidia_smi() -> str | None:
    """The driver's one-line description of each GPU, or None without nvidia-smi."""
    try:
        done = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
             "--format=csv,noheader"], capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() or None


def probe(device_name: str) -> dict[str, Any]:
    device = torch.device(device_name)
    info: dict[str, Any] = {"device": device_name, "machine": machine(), "cuda": torch.version.cuda,
                            "cuda_available": torch.cuda.is_available()}
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit(f"device {device_name}: torch {torch.__version__} sees no CUDA device")
        props = torch.cuda.get_device_properties(device)
        info.update(name=props.name, capability=f"{props.major}.{props.minor}",
                    memory_GiB=round(props.total_memory / 2**30, 1),
                    multiprocessors=props.multi_processor_count, nvidia_smi=nvidia_smi())
        nbytes = 2**30
    else:
        info.update(name=info["machine"]["cpu"])
        nbytes = 2**27
    info["copy_bandwidth_GBps"] = copy_bandwidth(device, nbytes) / 1e9
    return info


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu.probe", description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--json", required=True, help="where to write the result")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    info = probe(args.device)
    Path(args.json).write_text(json.dumps(info, indent=2) + "\n")
    print(json.dumps(info, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
