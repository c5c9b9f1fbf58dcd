"""How much does other CPU work on the same cores cost the engine? (Why HTTP trails in-process.)

    python -m bench.interference [--share 0.15] [--repeats 2]

Runs bench/serving.py's in-process load (shipped checkpoint, 32 clients, 256 requests x 64 new
tokens) three ways, alternating, `--repeats` times:
  - alone;
  - beside another process that is busy `--share` of one core, in 4 ms periods (what a load
    generator on the same machine does);
  - beside a Python thread of the same process busy the same share (what the server's event loop
    does: it also holds the GIL while it runs).
A server on a 2-core machine is always in the third situation, and a same-machine benchmark also
in the second. Writes bench/results/interference.json and .md. Not a test: nothing asserts a speed.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
import threading
import time
from pathlib import Path
from typing import Any

from bench.record import RESULTS, cpu_label, load_avg, machine, write_results
from bench.serving import in_process
from nanoserve.engine.threads import single_threaded_elsewhere

REPO = Path(__file__).resolve().parents[1]
PERIOD_S = 0.004


def busy_loop(share: float, stop: threading.Event | None = None) -> None:
    """Spin for `share` of every period and sleep the rest, until `stop` is set (or forever)."""
    while stop is None or not stop.is_set():
        start = time.perf_counter()
        while time.perf_counter() - start < share * PERIOD_S:
            pass
        time.sleep((1 - share) * PERIOD_S)


def run(way: str, share: float, checkpoint: Path) -> dict[str, Any]:
    stop = threading.Event()
    other: mp.process.BaseProcess | None = None
    if way == "process":
        other = mp.get_context("spawn").Process(target=busy_loop, args=(share,), daemon=True)
        other.start()
    elif way == "thread":
        threading.Thread(target=busy_loop, args=(share, stop), daemon=True).start()
    try:
        return in_process(checkpoint, 32, 256, 64, "ROMEO:", "float32", 0)
    finally:
        stop.set()
        if other is not None:
            other.kill()
            other.join()


def each(runs: list[dict[str, Any]]) -> str:
    return ", ".join(f"{r['tokens_per_s']:.0f}" for r in runs)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.interference", description=__doc__.split("\n")[0])
    ap.add_argument("--checkpoint", default=str(REPO / "checkpoints" / "shakespeare-char"))
    ap.add_argument("--share", type=float, default=0.15, help="fraction of one core the other work uses")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default=str(RESULTS / "interference"))
    args = ap.parse_args(argv)
    single_threaded_elsewhere()
    meta: dict[str, Any] = {"load_before": load_avg()}
    ways = ("alone", "process", "thread")
    runs: dict[str, list[dict[str, Any]]] = {way: [] for way in ways}
    for _ in range(args.repeats):
        for way in ways:
            r = run(way, args.share, Path(args.checkpoint))
            runs[way].append(r)
            print(f"  {way:8s} {r['tokens_per_s']:7.0f} tok/s  threads by size {r['threads_by_size']}",
                  flush=True)
    meta.update(load_after=load_avg(), machine=machine(), args=vars(args))
    best = {way: max(r["tokens_per_s"] for r in rs) for way, rs in runs.items()}
    md = (
        f"Machine: {cpu_label(meta['machine'])}, {meta['machine']['cores']} cores; load "
        f"before/after {meta['load_before']} / {meta['load_after']}. In-process engine, "
        f"{Path(args.checkpoint).name}, 32 clients, 256 requests x 64 new tokens; the other work is "
        f"busy {args.share:.0%} of one core; every run listed, alternating.\n\n"
        "| beside the engine | tokens/s (each run) | best / alone |\n|---|---|---|\n"
        + "\n".join(
            f"| {way} | {each(runs[way])} | {best[way] / best['alone']:.2f} |" for way in ways
        )
        + "\n"
    )
    print(md)
    write_results(args.out, {"meta": meta, "runs": runs}, md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
