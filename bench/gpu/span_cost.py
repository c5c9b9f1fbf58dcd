"""What attending over the whole window costs against the span buckets, for the static decode step
(nanoserve/engine/graph_step.py): its FLOPs and bytes counted, and its time measured in one run.

    python -m bench.gpu.span_cost --shape 124M --device cpu --batch 4 --context 144

A graph replays fixed shapes, so attention reads a fixed number of cache positions. Reading the
whole window costs the same at every context length; span buckets (powers of two) read at most
twice what a batch's longest row needs, for a few more graphs. Both run the same step here, the
span its bucket (`bucket_for(context)`) or the window, at the shape's window.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

from bench.shapes import DTYPES, SHAPES, random_model
from nanoserve.engine.graph_step import GraphDecodeStep, bucket_for, span_buckets
from nanoserve.engine.kv_slots import SpanKVCache
from nanoserve.model.config import GPTConfig


def step_costs(cfg: GPTConfig, batch: int, span: int, elem: int) -> dict[str, float]:
    """One decode step's multiply-adds x 2 (FLOPs) and bytes: the linear layers' weights read once,
    attention's QK^T and PV over `span` positions, and its keys and values gathered (read and written
    once, then read by the matmuls) per row and layer."""
    c, hs, nkv, layers = cfg.n_embd, cfg.head_dim, cfg.kv_heads, cfg.n_layer
    attn_proj = c * (c + 2 * nkv * hs) + c * c
    mlp = c * cfg.hidden * (3 if cfg.mlp == "swiglu" else 2)
    linear = layers * (attn_proj + mlp) + c * cfg.vocab_size
    attention_flops = layers * batch * 2 * 2 * cfg.n_head * hs * span  # QK^T and PV
    kv_bytes = layers * batch * 2 * nkv * span * hs * elem * 3  # gathered: read, written, read again
    return {"linear_flops": 2.0 * batch * linear, "attention_flops": float(attention_flops),
            "weight_bytes": float(linear * elem), "kv_bytes": float(kv_bytes)}


@torch.no_grad()
def time_spans(step: GraphDecodeStep, batch: int, spans: list[int], repeats: int) -> list[float]:
    """The fastest of `repeats` eager steps at each of `spans`, taken in turn (a busy host slows
    them alike); synchronized on a GPU."""
    sync = torch.cuda.synchronize if step.device.type == "cuda" else (lambda: None)
    best = [float("inf")] * len(spans)
    for i in range(repeats + 1):
        for j, span in enumerate(spans):
            sync()
            t0 = time.perf_counter()
            step.compute(batch, span)
            sync()
            if i:  # the first round warms the allocator and kernels
                best[j] = min(best[j], time.perf_counter() - t0)
    return best


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu.span_cost", description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="124M", choices=sorted(SHAPES))
    ap.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--context", type=int, default=144, help="the longest row's length (16 + 128)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--json", help="where to write the result")
    args = ap.parse_args(argv)
    model, _ = random_model(args.shape, args.dtype)
    model = model.to(args.device).eval()
    cfg = model.config
    window = cfg.block_size
    cache = SpanKVCache(cfg.n_layer, args.batch + 1, cfg.kv_heads, window, cfg.head_dim,
                        DTYPES[args.dtype], args.device)
    step = GraphDecodeStep(model, cache, args.batch)
    bucket = bucket_for(args.context, span_buckets(window))
    elem = torch.empty((), dtype=DTYPES[args.dtype]).element_size()
    rows: dict[str, Any] = {}
    named = {"span bucket": bucket, "whole window": window}
    times = time_spans(step, args.batch, list(named.values()), args.repeats)
    for (name, span), seconds in zip(named.items(), times, strict=True):
        rows[name] = {"span": span, "step_ms": 1e3 * seconds, **step_costs(cfg, args.batch, span, elem)}
        r = rows[name]
        total = (r["attention_flops"] + r["linear_flops"]) / 1e9
        print(f"{name:12s} span {span:5d}: step {r['step_ms']:8.2f} ms, attention "
              f"{r['attention_flops'] / 1e9:.3f} GFLOP of {total:.3f}, KV bytes {r['kv_bytes'] / 1e6:.1f} MB "
              f"against {r['weight_bytes'] / 1e6:.1f} MB of weights", flush=True)
    ratio = rows["whole window"]["step_ms"] / rows["span bucket"]["step_ms"]
    print(f"whole window / span bucket, step time: {ratio:.2f}x "
          f"({args.shape} {args.dtype} on {args.device}, batch {args.batch}, context {args.context})")
    result = {"shape": args.shape, "dtype": args.dtype, "device": args.device, "batch": args.batch,
              "context": args.context, "rows": rows, "window_over_bucket": ratio}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
