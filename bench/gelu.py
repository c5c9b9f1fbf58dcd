"""GELU (tanh form) on this CPU: F.gelu, the sigmoid form (nanoserve/engine/packed_linear.py's
SigmoidGELU) and oneDNN's fused post-op, over the activation sizes a decode step and a prefill
produce. Picks the sizes where SigmoidGELU uses its sigmoid form; run it on a new kind of CPU.

    python -m bench.gelu [--threads 2] [--out bench/results/gelu]
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.record import RESULTS, cpu_label, load_avg, machine
from nanoserve.engine.packed_linear import SigmoidGELU, sigmoid_gelu

ROWS = [1, 8, 16, 32, 64, 128, 1024]
WIDTHS = [1536, 3072]  # the MLP widths of the 10.7M and 124M shapes


def median_us(fn: Callable[[], object], n: int = 200) -> float:
    for _ in range(10):
        fn()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e6 * sorted(times)[n // 2]


def row(rows: int, width: int) -> str:
    """One table row: the GELU alone three ways over rows x width values."""
    weight, bias = torch.randn(width, 384), torch.randn(width)
    x, inp = torch.randn(rows, width), torch.randn(rows, 384)
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, rows)
    linear = torch.ops.mkldnn._linear_pointwise
    plain = median_us(lambda: linear(inp, packed, bias, "none", [], ""))
    fused = median_us(lambda: linear(inp, packed, bias, "gelu", [], "tanh"))
    ref = median_us(lambda: F.gelu(x, approximate="tanh"))
    sig = median_us(lambda: sigmoid_gelu(x))
    uses = "sigmoid form" if x.numel() in SigmoidGELU.SIGMOID_FORM else "F.gelu"
    cells = [f"{rows} x {width}", x.numel(), f"{ref:.0f}", f"{sig:.0f}", f"{fused - plain:.0f}"]
    cells += [f"{sig / ref:.2f}", uses]
    return "| " + " | ".join(map(str, cells)) + " |"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gelu", description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--out", default=str(RESULTS / "gelu"))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    lines = [
        f"Machine: {cpu_label(machine())}, {os.cpu_count()} cores, torch {torch.__version__}, "
        f"{args.threads} threads; load {load_avg()}.",
        "",
        "Median microseconds for the GELU alone; fused = oneDNN linear (384 -> width) with the GELU "
        "post-op minus the same linear without it.",
        "",
        "| rows x width | values | F.gelu | sigmoid form | fused post-op | sigmoid / F.gelu "
        "| SigmoidGELU uses |",
        "|---|---|---|---|---|---|---|",
    ]
    for width in WIDTHS:
        for rows in ROWS:
            lines.append(row(rows, width))
    md = "\n".join(lines)
    print(md)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out + ".md").write_text(md + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
