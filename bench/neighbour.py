"""The server beside a CPU-bound neighbour: does the default thread count keep its speed?

    python -m bench.neighbour [--rounds 4] [--tokens 600]

Three `nanoserve serve` processes on the shipped checkpoint, started once: the default thread count
(the CPUs the process may use: affinity and cgroup quota, engine/threads.py), `--cpu-threads 1`
and `--cpu-threads 2`. Each round times one greedy stream of `--tokens` tokens through each server,
alone and then beside a neighbour process that spins on one core for the whole stream (what a
batch job, a compile or another container on the same host does), the servers in turn. Medians
over the rounds; the default's ratio to the best of the three in each condition (issue: within
10% beside the neighbour, and no worse alone). Writes bench/results/neighbour-<machine>.{json,md}.
Needs an otherwise idle machine. Not a test: nothing asserts a speed.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx

from bench.record import RESULTS, cpu_label, load_avg, machine, write_results

REPO = Path(__file__).resolve().parents[1]
CHECKPOINT = REPO / "checkpoints" / "shakespeare-char"
WAYS = {"default": [], "1 thread": ["--cpu-threads", "1"], "2 threads": ["--cpu-threads", "2"]}


def spin(stop: Any) -> None:
    """A neighbour: one core busy until `stop` is set."""
    while not stop.is_set():
        for _ in range(100_000):
            pass


def stream_s(base_url: str, tokens: int) -> float:
    """Seconds for one greedy stream of `tokens` tokens (TGI's /generate_stream), end to end."""
    body = {"inputs": "ROMEO:", "parameters": {"max_new_tokens": tokens, "do_sample": False,
                                              "stop": [], "details": False}}
    t0 = time.perf_counter()
    with httpx.stream("POST", f"{base_url}/generate_stream", json=body, timeout=600) as r:
        r.raise_for_status()
        for _ in r.iter_bytes():
            pass
    return time.perf_counter() - t0


def measure(rounds: int, tokens: int) -> dict[str, dict[str, list[float]]]:
    from tests.server.server import running_server  # the test harness's start, ready and stop

    times: dict[str, dict[str, list[float]]] = {c: {w: [] for w in WAYS} for c in ("alone", "neighbour")}
    with ExitStack() as stack:
        quiet = {"NANOSERVE_LOG_LEVEL": "warning"}
        servers = {w: stack.enter_context(running_server(CHECKPOINT, args=a, env=quiet))
                   for w, a in WAYS.items()}
        for server in servers.values():  # warm-up: first requests, caches
            stream_s(server.base_url, 64)
        for r in range(rounds):
            for condition in ("alone", "neighbour"):
                for way, server in servers.items():
                    stop = mp.Event()
                    neighbour = mp.Process(target=spin, args=(stop,)) if condition == "neighbour" else None
                    if neighbour is not None:
                        neighbour.start()
                        time.sleep(0.2)  # it has its core before the stream starts
                    try:
                        took = stream_s(server.base_url, tokens)
                    finally:
                        if neighbour is not None:
                            stop.set()
                            neighbour.join()
                    times[condition][way].append(took)
                    print(f"round {r + 1}/{rounds} {condition:9s} {way:9s} {took:7.3f} s", flush=True)
    return times


def report(times: dict[str, dict[str, list[float]]], tokens: int, rounds: int,
           loads: str) -> tuple[dict[str, Any], str]:
    m = machine()
    lines = [f"Machine: {cpu_label(m)}, {m['cores']} cores; load before/after {loads}. The shipped "
             f"checkpoint (checkpoints/shakespeare-char), one greedy stream of {tokens} tokens through "
             "`nanoserve serve` (TGI /generate_stream), three servers started once (default threads, "
             "`--cpu-threads 1`, `--cpu-threads 2`), each alone and beside a neighbour process spinning "
             f"on one core for the whole stream; {rounds} rounds, servers in turn. Median seconds "
             "(min-max); `python -m bench.neighbour`.", "",
             "| condition | default | 1 thread | 2 threads | default / best |", "|---|---|---|---|---|"]
    summary: dict[str, Any] = {}
    for condition, by_way in times.items():
        med = {w: statistics.median(v) for w, v in by_way.items()}
        ratio = med["default"] / min(med.values())
        summary[condition] = {"median_s": med, "default_over_best": ratio}
        cells = [f"{med[w]:.2f} ({min(v):.2f}-{max(v):.2f})" for w, v in by_way.items()]
        lines.append(f"| {condition} | {' | '.join(cells)} | {ratio:.2f} |")
    payload = {"meta": {"machine": m, "load": loads, "tokens": tokens, "rounds": rounds},
               "times_s": times, "summary": summary}
    return payload, "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=600)
    ap.add_argument("--out", default=None, help="results path without suffix")
    args = ap.parse_args(argv)
    before = load_avg()
    times = measure(args.rounds, args.tokens)
    payload, md = report(times, args.tokens, args.rounds, f"{before} / {load_avg()}")
    out = args.out or RESULTS / f"neighbour-{machine()['microarch']}"
    write_results(out, payload, md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
