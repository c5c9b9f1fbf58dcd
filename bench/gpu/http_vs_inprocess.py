"""HTTP against in-process on one device, at each stream count: what the server costs there.

    python -m bench.gpu.http_vs_inprocess --device cuda --shape 124M --dtype bfloat16 --streams 1,64 \
        --json serving.json

bench/serving.py's two ways, on `--device`: the same closed-loop load (`streams` clients, each on
one kept-alive connection, `--requests-per-stream` requests each of `--max-new-tokens` tokens at
temperature 1, seeded) through a real `nanoserve serve` (uvicorn, SSE) and through
`Engine.generate` in this process, in turns, `--repeats` times; the best of each kept.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

from bench.serving import in_process, over_http, random_checkpoint
from bench.shapes import SHAPES
from nanoserve.engine.threads import single_threaded_elsewhere
from nanoserve.server.runtime.heap import freeze_startup_heap


def measure(ckpt: Path, prompt: str, streams: int, args: argparse.Namespace) -> dict[str, Any]:
    requests = streams * args.requests_per_stream
    load = (ckpt, streams, requests, args.max_new_tokens, prompt, args.dtype, 0)
    ways: dict[str, list[dict[str, Any]]] = {"in_process": [], "http": []}
    for _ in range(args.repeats):
        gil = args.gil_switch_interval
        ways["in_process"].append(in_process(*load, device=args.device, gil_switch_interval=gil))
        ways["http"].append(over_http(*load, device=args.device, gil_switch_interval=gil))
    best = {way: max(runs, key=lambda r: r["tokens_per_s"]) for way, runs in ways.items()}
    ratio = best["http"]["tokens_per_s"] / best["in_process"]["tokens_per_s"]
    print(f"{streams} streams: in-process {best['in_process']['tokens_per_s']:.1f} tok/s, "
          f"HTTP {best['http']['tokens_per_s']:.1f} tok/s, HTTP / in-process {ratio:.2f}", flush=True)
    return {"streams": streams, "requests": requests, "in_process": best["in_process"], "http": best["http"],
            "ratio": ratio, "runs": ways}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu.http_vs_inprocess",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--shape", default="124M", choices=sorted(SHAPES))
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--streams", default="1,64")
    ap.add_argument("--requests-per-stream", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=1, help="runs each way, in turns, best kept")
    ap.add_argument("--gil-switch-interval", type=float, default=0.0,
                    help="the GIL switch interval in seconds, both ways (0: the server's choice by device, "
                         "and Python's own in-process; 0.005: Python's own)")
    ap.add_argument("--json", required=True, help="where to write the result")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    single_threaded_elsewhere()  # as bench/serving.py: the in-process engine's thread has the pool
    freeze_startup_heap()
    with tempfile.TemporaryDirectory(prefix="nanoserve-gpu-") as tmp:
        ckpt, prompt = random_checkpoint(args.shape, Path(tmp))
        results = [measure(ckpt, prompt, int(s), args) for s in args.streams.split(",")]
    out = {"device": args.device, "shape": args.shape, "dtype": args.dtype,
           "max_new_tokens": args.max_new_tokens, "by_streams": results}
    Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
