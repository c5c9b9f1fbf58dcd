"""This engine and Hugging Face `generate` on one device, timed alike; one peer per process.

    python -m bench.gpu.peers --peer engine|hf|hf-static --device cuda --shape 124M --dtype bfloat16 \
        --batches 1,64 [--without-graphs 1,64] --new-tokens 128 --json engine.json

Every peer gets the same random-weight model (bench/shapes.py) and the same prompts, decodes
greedily, and generates exactly `--new-tokens` for every prompt; a run's time includes its
prefill. `hf` is `generate` with its dynamic KV cache; `hf-static` with its static cache
(`cache_implementation="static"`), which on a GPU also compiles the decode step and replays it
as CUDA graphs: its warm-up runs the timed shape twice, so compiling and capturing stay out of
the time (the dynamic cache's once).
The engine runs through the torch backend, the one a GPU runs; its decode-step median comes from
the engine's own step timer (bench/peer_runs.py), with max_seqs the batch (so 256 rows are 256 KV
slots). It runs with its decode step replayed as CUDA graphs (the default), then once more without
them at the batches `--without-graphs` names (`runs_no_graphs`), so the graphs' gain is a ratio
within one run.
Each peer runs in a process of its own (bench/gpu/check.py starts them): one peer's compile, CUDA
graphs or allocator cache never touches another's time, and a peer that hangs is stopped alone.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

from bench.limits import model_costs
from bench.peer_runs import bench_engine, hf_model
from bench.shapes import DTYPES, SHAPES, make_checkpoint, prompts_for
from nanoserve.model.checkpoint import Checkpoint

PEERS = ("engine", "hf", "hf-static")


def engine_runs(ckpt: Checkpoint, device: str, batches: list[int], prompts: list[list[int]], new: int,
                repeats: int, graphs: bool = True) -> list[dict[str, Any]]:
    out = []
    cfg = {"device": device, "backend": "torch", "cuda_graphs": graphs}
    for batch in batches:
        runs = [bench_engine(ckpt, batch, prompts, new, cfg) for _ in range(repeats)]
        best = max(runs, key=lambda r: r.tps)
        out.append({"batch": batch, "tokens_per_s": best.tps, "decode_step_ms": best.step_ms,
                    "seconds": [r.seconds for r in runs]})
        print(f"engine batch {batch}{'' if graphs else ' without CUDA graphs'}: {best.tps:.1f} tok/s, "
              f"decode step {best.step_ms:.3f} ms", flush=True)
    return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def hf_runs(ckpt: Checkpoint, device_name: str, batches: list[int], prompts: list[list[int]], new: int,
            repeats: int, static: bool) -> list[dict[str, Any]]:
    device = torch.device(device_name)
    model = hf_model(ckpt)[0].to(device)
    out = []
    for batch in batches:
        ids = torch.tensor(prompts[:batch], dtype=torch.long, device=device)
        kwargs: dict[str, Any] = dict(attention_mask=torch.ones_like(ids), pad_token_id=0, eos_token_id=None,
                                      do_sample=False, max_new_tokens=new, min_new_tokens=new)
        if static:
            kwargs["cache_implementation"] = "static"
        for _ in range(2 if static else 1):  # the timed shape itself: compiles, captures, allocates
            model.generate(ids, **kwargs)
        seconds = []
        for _ in range(repeats):
            _sync(device)
            t0 = time.perf_counter()
            tokens = model.generate(ids, **kwargs)
            _sync(device)
            seconds.append(time.perf_counter() - t0)
            if tokens.shape != (batch, ids.shape[1] + new):
                want = (batch, ids.shape[1] + new)
                raise RuntimeError(f"generate returned {tuple(tokens.shape)}, not {want}")
        best = min(seconds)
        out.append({"batch": batch, "tokens_per_s": batch * new / best, "decode_step_ms": 1e3 * best / new,
                    "seconds": seconds})
        print(f"{'hf-static' if static else 'hf'} batch {batch}: {batch * new / best:.1f} tok/s", flush=True)
    return out


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu.peers", description=__doc__.split("\n")[0])
    ap.add_argument("--peer", required=True, choices=PEERS)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--shape", default="124M", choices=sorted(SHAPES))
    ap.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--without-graphs", default="", metavar="BATCHES",
                    help="engine: these batches again without CUDA graphs, one run each (default none)")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prompt-tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=2, help="timed runs per batch, best kept")
    ap.add_argument("--json", required=True, help="where to write the result")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    ckpt = make_checkpoint(args.shape, args.dtype)
    prompts = prompts_for(ckpt, max(batches), args.prompt_tokens)
    extra: dict[str, Any] = {}
    if args.peer == "engine":
        runs = engine_runs(ckpt, args.device, batches, prompts, args.new_tokens, args.repeats)
        if args.without_graphs:
            eager = [int(b) for b in args.without_graphs.split(",")]
            extra["runs_no_graphs"] = engine_runs(ckpt, args.device, eager, prompts, args.new_tokens, 1,
                                                  graphs=False)
    else:
        runs = hf_runs(ckpt, args.device, batches, prompts, args.new_tokens, args.repeats,
                       static=args.peer == "hf-static")
    result = {"peer": args.peer, "device": args.device, "shape": args.shape, "dtype": args.dtype,
              "weight_bytes": model_costs(ckpt.config, DTYPES[args.dtype])[0],
              "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens, "runs": runs, **extra}
    Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
