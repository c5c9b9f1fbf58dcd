"""HTTP vs in-process: is the server itself a bottleneck?

    python -m bench.serving [--checkpoint checkpoints/shakespeare-char | --shape 10.7M|124M] [--dtype float32]
                            [-c 32] [-n 128] [--max-new-tokens 64] [--stream-intervals 1,4] [--device cuda]

The same engine settings and the same closed-loop load (c clients, n requests, the same prompt,
sampled at temperature 1 with a seed per request) run twice, alternating, `--repeats` times:
  - in-process: `Engine.generate` from c asyncio tasks in this process;
  - HTTP: a real `nanoserve serve` on 127.0.0.1 (uvicorn, SSE on /generate_stream), driven by
    bench/load.py from this process.
Reports generated tokens/s both ways and the ratio (best against best, and run by run), time
to first token p50/p99 both ways (from the request's submission: queueing and prefill count),
and the CPU per generated token of the HTTP server's event loop (its main thread, from /proc)
and of the load generator: both share the machine's two cores with the engine's threads, so
they are what HTTP costs here. Each client keeps its connection open across its requests, as
HTTP clients' pools do (`bench/load.py --new-connections` measures one per request).
`--stream-intervals 1,4` measures both ways at each stream interval in every repeat (the server's
`--stream-interval`; in-process, `Engine.generate(stream_interval=...)`), so each interval's
ratio compares like with like.
`--shape` serves one of #8's model shapes instead of a checkpoint: bench/shapes.py's random
weights, saved as a checkpoint in a temporary directory, with a prompt of 16 random tokens of its
vocabulary (the engine bench's prompt length). The shipped checkpoint (4.8M parameters) is the
smallest model, so HTTP's cost per token weighs most there.
Writes bench/results/serving.json and serving.md. Not a test: nothing here asserts a speed.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.load import LoadConfig, run_load, run_loop
from bench.load_config import new_tokens
from bench.load_report import percentiles
from bench.record import RESULTS, cpu_label, load_avg, machine, write_results
from bench.shapes import SHAPES, random_model, random_prompts
from nanoserve.engine.threads import single_threaded_elsewhere
from nanoserve.server.runtime.heap import freeze_startup_heap

REPO = Path(__file__).resolve().parents[1]


def in_process(checkpoint: Path, conc: int, requests: int, new: int, prompt: str, dtype: str, spread: int,
               interval: int = 1, device: str = "cpu", gil_switch_interval: float = 0.0) -> dict[str, Any]:
    from nanoserve.engine.config import EngineConfig
    from nanoserve.engine.engine import Engine
    from nanoserve.engine.types import SamplingParams
    from nanoserve.model.checkpoint import load_checkpoint

    if gil_switch_interval > 0:  # an embedding application's choice; the server's own is by device
        sys.setswitchinterval(gil_switch_interval)
    engine = Engine(load_checkpoint(checkpoint), EngineConfig(max_seqs=conc, max_queue=requests,
                                                                  dtype=dtype, device=device))
    engine.start()
    ttfts: list[float] = []
    tokens = 0

    async def one(index: int) -> None:
        nonlocal tokens
        params = SamplingParams(max_new_tokens=new_tokens(new, spread, index), temperature=1.0, seed=index)
        sent = time.perf_counter()
        first = None
        async for event in await engine.generate(prompt, params, stream_interval=interval):
            if event.token_id is not None:
                tokens += 1
                if first is None:
                    first = time.perf_counter() - sent
        if first is not None:
            ttfts.append(first)

    async def go() -> float:
        await engine.warmup()
        counter = iter(range(conc))  # warm every batch size's shapes and the thread tuner
        await asyncio.gather(*(worker(counter) for _ in range(conc)))
        ttfts.clear()
        nonlocal tokens
        tokens = 0
        counter = iter(range(requests))
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(counter) for _ in range(conc)))
        elapsed = time.perf_counter() - t0
        await engine.shutdown(0.0)
        return elapsed

    async def worker(counter: Any) -> None:
        for index in counter:
            await one(index)

    wall = run_loop(go())  # uvloop, as the server's loop
    return {"tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall, "ttft_s": percentiles(ttfts),
            "threads_by_size": engine.info()["cpu_threads_by_forward_size"]}


def over_http(checkpoint: Path, conc: int, requests: int, new: int, prompt: str, dtype: str, spread: int,
              interval: int = 1, device: str = "cpu", gil_switch_interval: float = 0.0) -> dict[str, Any]:
    import httpx

    from tests.server.server import running_server

    env = {"NANOSERVE_MAX_SEQS": str(conc), "NANOSERVE_MAX_QUEUE": str(requests),
           "NANOSERVE_LOG_LEVEL": "warning", "NANOSERVE_STREAM_INTERVAL": str(interval),
           "NANOSERVE_DTYPE": dtype, "NANOSERVE_GIL_SWITCH_INTERVAL": str(gil_switch_interval)}
    with running_server(checkpoint, env=env, args=("--device", device)) as server:
        def load(n: int) -> Any:
            config = LoadConfig(url=server.base_url, concurrency=conc, requests=n, max_new_tokens=new,
                                spread=spread, temperature=1.0, seed=0, prompt=prompt)
            return run_loop(run_load(config))

        load(conc)  # warm-up, as in-process
        cpu0, loop0 = time.process_time(), thread_cpu_s(server.process.pid)
        report = load(requests)
        client_cpu = time.process_time() - cpu0
        loop_cpu = thread_cpu_s(server.process.pid) - loop0
        threads = httpx.get(f"{server.base_url}/info", timeout=10).json()["engine"]
    threads_by_size = threads.get("cpu_threads_by_forward_size")
    summary = report.summary()
    if summary["outcomes"] != {"ok": requests}:
        raise RuntimeError(f"not every request completed: {summary['outcomes']}")
    return {"tokens": summary["tokens_generated"], "wall_s": summary["wall_s"],
            "tokens_per_s": summary["tokens_per_s"], "ttft_s": summary["ttft_s"],
            "client_cpu_share": client_cpu / summary["wall_s"], "threads_by_size": threads_by_size,
            "client_us_per_token": 1e6 * client_cpu / summary["tokens_generated"],
            "loop_us_per_token": 1e6 * loop_cpu / summary["tokens_generated"]}


def thread_cpu_s(pid: int, tid: int | None = None) -> float:
    """CPU seconds (user + system) thread `tid` of process `pid` has used: its main thread, which
    runs a server's event loop, by default. Linux (/proc)."""
    stat = Path(f"/proc/{pid}/task/{tid or pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2:].split()  # after the name, which may hold spaces
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.serving", description=__doc__.split("\n")[0])
    ap.add_argument("--checkpoint", default=str(REPO / "checkpoints" / "shakespeare-char"))
    ap.add_argument("--shape", choices=sorted(SHAPES), help="random weights of this shape instead")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N: both ways serve on it")
    ap.add_argument("-c", "--concurrency", type=int, default=32)
    ap.add_argument("-n", "--requests", type=int, default=128)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--spread", type=int, default=0,
                    help="request i asks for max-new-tokens +- up to this many (bench/load.py)")
    ap.add_argument("--prompt", default="ROMEO:", help="with --shape: 16 random tokens instead")
    ap.add_argument("--repeats", type=int, default=2, help="alternating runs each way, best kept")
    ap.add_argument("--out", default=str(RESULTS / "serving"))
    ap.add_argument("--stream-intervals", default="1",
                    help="comma-separated stream intervals, each measured both ways in every repeat")
    args = ap.parse_args(argv)
    single_threaded_elsewhere()  # the in-process engine's thread is the only one with a pool
    # This process is the load generator both ways and the server in-process: keep full garbage
    # collections off its start-up heap as `nanoserve serve` does (nanoserve/server/app.py).
    freeze_startup_heap()
    started = {"load_before": load_avg()}
    with tempfile.TemporaryDirectory(prefix="nanoserve-bench-") as tmp:
        if args.shape:
            ckpt, args.prompt = random_checkpoint(args.shape, Path(tmp))
            name = f"random weights of the {args.shape} shape ({args.dtype})"
        else:
            ckpt = Path(args.checkpoint)
            name = f"{ckpt.name} ({args.dtype})"
        return _run(args, ckpt, name, started)


def random_checkpoint(shape: str, out: Path) -> tuple[Path, str]:
    """A server's checkpoint of `shape` with bench/shapes.py's random weights, and a prompt."""
    from nanoserve.model.checkpoint import save_checkpoint

    model, tokenizer = random_model(shape)
    prompt = tokenizer.decode(random_prompts(tokenizer.vocab_size, 1, 16)[0])
    return save_checkpoint(out / shape, model, tokenizer, name=f"random-{shape}"), prompt


def _run(args: argparse.Namespace, ckpt: Path, name: str, started: dict[str, Any]) -> int:
    intervals = [int(i) for i in args.stream_intervals.split(",")]
    # runs[interval][way]: one entry per repeat.
    runs: dict[int, dict[str, list[dict[str, Any]]]] = {i: {"in_process": [], "http": []} for i in intervals}
    for _ in range(args.repeats):
        load = (ckpt, args.concurrency, args.requests, args.max_new_tokens, args.prompt, args.dtype,
                args.spread)
        for interval in intervals:
            by_way = runs[interval]
            by_way["in_process"].append(in_process(*load, interval, device=args.device))
            by_way["http"].append(over_http(*load, interval, device=args.device))
            for way, rs in by_way.items():
                r = rs[-1]
                print(f"  interval {interval} {way:10s} {r['tokens_per_s']:8.1f} tok/s  TTFT p50 "
                      f"{r['ttft_s']['p50']:.3f}s p99 {r['ttft_s']['p99']:.3f}s", flush=True)
    meta = {**started, "load_after": load_avg(), "machine": machine(), "args": vars(args)}
    md = (
        f"Machine: {cpu_label(meta['machine'])}, {meta['machine']['cores']} cores; load "
        f"before/after {meta['load_before']} / {meta['load_after']}. Model: {name}, "
        f"{args.concurrency} concurrent clients, {args.requests} requests x {args.max_new_tokens} "
        f"new tokens{f' +- up to {args.spread}' if args.spread else ''}, temperature 1, best of "
        f"{args.repeats} alternating runs.\n"
    )
    results: dict[str, Any] = {"meta": meta, "by_interval": {}}
    for interval, by_way in runs.items():
        summary, text = _summarize(by_way)
        results["by_interval"][str(interval)] = {"runs": by_way, **summary}
        md += f"\n**Stream interval {interval}**\n\n" + text if len(intervals) > 1 else "\n" + text
    if len(intervals) == 1:  # the shape earlier results have
        results.update(results.pop("by_interval")[str(intervals[0])])
    print(md)
    write_results(args.out, results, md)
    return 0


def _summarize(runs: dict[str, list[dict[str, Any]]]) -> tuple[dict[str, Any], str]:
    best = {way: max(rs, key=lambda r: r["tokens_per_s"]) for way, rs in runs.items()}
    ratio = best["http"]["tokens_per_s"] / best["in_process"]["tokens_per_s"]
    # Each HTTP run against the in-process run just before it: the host's other tenants change
    # its speed by a third from one minute to the next, and a pair shares the same minute.
    pairs = [h["tokens_per_s"] / i["tokens_per_s"]
             for i, h in zip(runs["in_process"], runs["http"], strict=True)]
    text = (
        "| path | tokens/s | TTFT p50 | TTFT p99 |\n|---|---|---|---|\n"
        + "\n".join(
            f"| {way} | {r['tokens_per_s']:.0f} | {1e3 * r['ttft_s']['p50']:.0f} ms | "
            f"{1e3 * r['ttft_s']['p99']:.0f} ms |" for way, r in best.items()
        )
        + f"\n\nHTTP / in-process throughput: {ratio:.2f} (best against best); run by run "
        f"(each HTTP run over the in-process run just before it): "
        f"{', '.join(f'{p:.2f}' for p in pairs)}, median {statistics.median(pairs):.2f}.\n\n"
        f"CPU per generated token through HTTP (median of the runs): the server's event loop "
        f"{statistics.median(r['loop_us_per_token'] for r in runs['http']):.0f} us, the load generator "
        f"(same machine) {statistics.median(r['client_us_per_token'] for r in runs['http']):.0f} us "
        f"({best['http']['client_cpu_share']:.0%} of one core in the best run). Both run beside the "
        f"engine's threads on the same cores.\n"
    )
    return {"ratio": ratio, "run_ratios": pairs}, text


if __name__ == "__main__":
    sys.exit(main())
