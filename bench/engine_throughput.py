"""Engine benchmark: this engine vs its peers and vs the machine's measured limits, in one run.

    python -m bench.engine_throughput [--shapes 10.7M,124M] [--dtypes float32] [--concurrency 1,8,32,64]

For each model shape (random GPT-2-architecture weights) and dtype, on the same prompts:
  (a) this engine (in-process, greedy, every sequence generating the same number of tokens),
  (b) a naive recompute loop like nanoGPT's sample.py (no KV cache, whole context every token),
  (c) Hugging Face transformers `generate()` with its KV cache on the exported GPT-2 weights,
  (d) llama.cpp through llama-cpp-python on a GGUF conversion, or without it llama.cpp's own
      llama-batched-bench (bench/llama_batched.py; built by `make llama-cpp`; skipped when neither),
plus the machine's limits measured in the same run: memory read bandwidth (a forward reads every
weight once) and matmul throughput (a forward costs 2 FLOPs per weight per token it feeds): the
fastest of torch's matmul in the dtype, in float32 (bf16 weights can be widened), and the vector
units' measured multiply-add peak (bench/peak.py; torch's matmul can fall far short of it). From
them, the shortest time a run could take (`run_bound_s`): the prompts' forward, then one forward
per further generated token, each taking the longer of reading the weights and computing its
tokens. Every peer does that same work, so "x / limit" is the run's bound over its measured time:
the share of the machine it used.
Prints ratios to this engine and writes bench/results/engine.json and engine.md. Not a test:
nothing here asserts a speed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

from bench.engine_throughput_report import load_results, render
from bench.levers import LEVERS, crop_runs, crop_table
from bench.limits import model_costs
from bench.peers import PEERS, PeerProcess
from bench.record import RESULTS, load_avg, machine, write_results
from bench.shapes import DTYPES, SHAPES
from bench.throughput_runs import ShapeResult
from nanoserve.engine.threads import single_threaded_elsewhere
from nanoserve.model.gpt import GPT


def run_shape(shape: str, dtype: str, concs: list[int], args: argparse.Namespace) -> ShapeResult:
    cfg = SHAPES[shape]
    with torch.device("meta"):
        params = GPT(cfg).num_params(non_embedding=False)
    new = args.new_tokens if shape == "10.7M" else max(4, args.new_tokens // 2)
    res = ShapeResult(shape, dtype, params, args.prompt_tokens, new)
    peers = {p: PeerProcess(p, shape, dtype, args.threads, args.prompt_tokens, max(concs)) for p in PEERS}
    try:
        # Every peer builds its model when it starts (124M: seconds of CPU and memory traffic):
        # the limits are measured once they all have, not beside them (beside a start-up, a read
        # measured a third of the bandwidth).
        for peer in peers.values():
            peer.call("ready")
        first = peers["naive"].call("limits")
        for conc in concs:
            print(f"[{shape} {dtype}] concurrency {conc}  (load {load_avg()})", flush=True)
            # Shared, noisy machines: the engine, HF and llama.cpp take turns `repeats` times, each
            # one's best run kept, so no ratio rides on one draw.
            eng_runs, hf_runs, llama_runs = [], [], []
            for i in range(args.repeats):
                eng_runs.append(peers["engine"].call("run", conc, new))
                if i < (args.hf_repeats or args.repeats):
                    hf_runs.append(peers["hf"].call("run", conc, new))
                llama_runs.append(peers["llama.cpp"].call("run", conc, new))  # None: not installed
            res.runs.append(max(eng_runs, key=lambda r: r.tps))
            naive_new = new if shape == "10.7M" or conc <= 8 else max(2, new // 4)
            if not args.no_naive:
                res.runs.append(peers["naive"].call("run", conc, naive_new))
            res.runs.append(max(hf_runs, key=lambda r: r.tps))
            if llama_runs[0] is not None:
                res.runs.append(max(llama_runs, key=lambda r: r.tps))
            if args.levers and conc in (1, 32):
                res.runs.extend(peers["engine"].call("run", conc, new, c, p, n) for n, c, p in LEVERS)
            for r in res.runs:
                if r.concurrency == conc:
                    line = f"    {r.peer:22s} {r.tps:9.1f} tok/s  step {r.step_ms:8.2f} ms {r.note}"
                    print(line, flush=True)
        # Measured again after the runs, each figure's best kept: on a shared host one reading
        # can land beside another tenant and read low by half or more.
        again = peers["naive"].call("limits")
        res.limits = {k: max(v, again[k]) for k, v in first.items()}
        weight_bytes, flops_per_token, head_flops = model_costs(cfg, DTYPES[dtype])
        res.limits.update(weight_bytes=weight_bytes, flops_per_token=flops_per_token,
                          head_flops_per_token=head_flops)
        res.limits["bound_tps_batch1"] = res.limits["bandwidth_GBps"] * 1e9 / weight_bytes
        res.limits["bound_tps_compute"] = res.limits["matmul_GFLOPs"] * 1e9 / flops_per_token
    finally:
        for peer in peers.values():
            peer.close()
    return res


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m bench.engine_throughput", description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="10.7M,124M")
    ap.add_argument("--dtypes", default="float32")
    ap.add_argument("--concurrency", default="1,8,32,64")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--out", default=str(RESULTS / "engine"))
    ap.add_argument("--repeats", type=int, default=2, help="alternating engine/HF runs, best kept")
    ap.add_argument("--hf-repeats", type=int, default=0,
                    help="HF runs per cell if fewer than --repeats (bf16 HF on AVX2: minutes per run)")
    ap.add_argument("--no-naive", action="store_true",
                    help="skip the naive loop (bf16 on a CPU without bf16 arithmetic: minutes per cell)")
    ap.add_argument("--levers", action="store_true", help="also measure each engine lever off/on")
    ap.add_argument("--crop", action="store_true", help="also measure shift vs sliding past the window")
    ap.add_argument("--render", metavar="JSON",
                    help="write a saved run's tables again (limits recomputed from its measurements)")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.render:
        saved = json.loads(Path(args.render).read_text())
        write_results(Path(args.render).with_suffix(""), *render(saved["meta"], load_results(saved)))
        return 0
    # Every peer runs in a process of its own (bench/peers.py); this one only drives them.
    single_threaded_elsewhere()
    concs = [int(c) for c in args.concurrency.split(",")]
    started = {"load_before": load_avg()}
    results = [
        run_shape(shape, dtype, concs, args)
        for shape in args.shapes.split(",") for dtype in args.dtypes.split(",")
    ]
    meta = {**started, "load_after": load_avg(), "machine": machine(), "args": vars(args)}
    crop = ""
    if args.crop:
        crop = "\n\nCropping past the window (10.7M, float32):\n\n" + crop_table(crop_runs())
    payload, md = render(meta, results, crop)
    print(md)
    write_results(args.out, payload, md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
