"""Sampled decoding end to end: the engine against Hugging Face generate(do_sample=True).

    python -m bench.sampled [--shape 124M] [--dtypes bfloat16,float32] [--concurrency 1,32]
                            [--out bench/results/sampled]

bench/engine_throughput.py measures greedy decoding; users mostly sample. Here both peers generate with the
same settings: greedy for reference, temperature 1 alone, top_p 0.95, and top_k 50 + top_p 0.95
(generate()'s default top_k with top_p). Each peer runs in a process of its own (bench/peers.py),
taking turns `--repeats` times, the best run of each kept. The model is bench/shapes.py's random
GPT-2-shape one: its next-token distributions are nearly uniform over 50,257 tokens, the costliest
case for the engine's sampler (a nucleus of ~95% of the vocabulary) and any case for HF's, which
sorts the whole vocabulary under top_p whatever the distribution. The same prompts and token
counts as bench/engine_throughput.py (`--prompt-tokens`; `--new-tokens` 32 for every shape).
Writes bench/results/sampled.json and sampled.md. Not a test: nothing here asserts a speed.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from bench.peers import PeerProcess
from bench.record import RESULTS, cpu_label, load_avg, machine, write_results

SETTINGS: dict[str, dict[str, float]] = {
    "greedy": {"temperature": 0.0},
    "temperature 1": {"temperature": 1.0},
    "top_p 0.95": {"temperature": 1.0, "top_p": 0.95},
    "top_k 50, top_p 0.95": {"temperature": 1.0, "top_k": 50, "top_p": 0.95},
}


def run(shape: str, dtype: str, concs: list[int], args: argparse.Namespace) -> list[dict[str, Any]]:
    peers = {p: PeerProcess(p, shape, dtype, args.threads, args.prompt_tokens, max(concs))
             for p in ("engine", "hf")}
    out = []
    try:
        for peer in peers.values():
            peer.call("ready")
        for conc in concs:
            for setting, params in SETTINGS.items():
                engine, hf = [], []
                for _ in range(args.repeats):
                    engine.append(peers["engine"].call("run", conc, args.new_tokens, {}, params, "engine"))
                    hf.append(peers["hf"].call("run", conc, args.new_tokens, params))
                e, h = max(engine, key=lambda r: r.tps), max(hf, key=lambda r: r.tps)
                out.append({"shape": shape, "dtype": dtype, "concurrency": conc, "setting": setting,
                            "engine_tps": e.tps, "engine_step_ms": e.step_ms, "hf_tps": h.tps,
                            "hf_step_ms": h.step_ms})
                print(f"[{shape} {dtype}] c{conc:<3d} {setting:22s} engine {e.tps:8.1f} tok/s  "
                      f"HF {h.tps:8.1f} tok/s  engine/HF {e.tps / h.tps:5.2f}", flush=True)
    finally:
        for peer in peers.values():
            peer.close()
    return out


def table(results: list[dict[str, Any]]) -> str:
    lines = ["| model | dtype | sequences | setting | engine tok/s | HF tok/s | engine / HF | engine step ms "
             "| HF step ms |", "|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['shape']} | {r['dtype']} | {r['concurrency']} | {r['setting']} | {r['engine_tps']:.0f} "
              f"| {r['hf_tps']:.0f} | {r['engine_tps'] / r['hf_tps']:.2f} | {r['engine_step_ms']:.1f} "
              f"| {r['hf_step_ms']:.1f} |" for r in results]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.sampled", description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="124M")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--concurrency", default="1,32")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--out", default=str(RESULTS / "sampled"))
    args = ap.parse_args(argv)
    started: dict[str, Any] = {"load_before": load_avg()}
    concs = [int(c) for c in args.concurrency.split(",")]
    results = [r for dtype in args.dtypes.split(",") for r in run(args.shape, dtype, concs, args)]
    meta = {**started, "load_after": load_avg(), "machine": machine(), "args": vars(args)}
    md = (f"Machine: {cpu_label(meta['machine'])}, {meta['machine']['cores']} cores, torch "
          f"{meta['machine']['torch']}; load before/after {meta['load_before']} / "
          f"{meta['load_after']}. {args.shape} random weights (near-uniform next-token "
          f"distributions), {args.prompt_tokens}-token prompts, {args.new_tokens} new tokens a "
          f"sequence, best of {args.repeats} alternating runs a peer.\n\n" + table(results) + "\n")
    print(md)
    write_results(args.out, {"meta": meta, "results": results}, md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
