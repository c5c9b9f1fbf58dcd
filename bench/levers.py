"""Extra measurements for bench/engine_throughput.py: each engine lever off vs on, and the two cropping
policies past the window. Same process, same prompts, back to back with the default engine."""

from __future__ import annotations

from typing import Any

from bench.peer_runs import bench_engine
from bench.shapes import make_checkpoint, prompts_for
from bench.throughput_runs import Run, ShapeResult

LEVERS: list[tuple[str, dict[str, Any], dict[str, Any]]] = [
    # (name, EngineConfig overrides, SamplingParams overrides)
    ("no native step (oneDNN packed linears)", {"backend": "torch"}, {}),
    ("no native step, no oneDNN packing", {"backend": "torch", "packed_linear": False}, {}),
    ("KV cache bfloat16", {"kv_cache_dtype": "bfloat16"}, {}),
    # bf16 models: the widening kernels (float32 inputs) instead of a tile level (AVX512-BF16 or
    # AMX, inputs rounded to bf16); float32 models run avx512 anyway (the same as the default).
    ("native_isa=avx512 (no bf16 dot products)", {"native_isa": "avx512"}, {}),
    ("deterministic=True", {"deterministic": True}, {}),
    ("sample top_k=40 top_p=0.95", {}, {"temperature": 1.0, "top_k": 40, "top_p": 0.95}),
    ("sample top_p=0.95, no top_k", {}, {"temperature": 1.0, "top_p": 0.95}),
]


def lever_table(results: list[ShapeResult]) -> str:
    lines = [
        "| model | dtype | conc | variant | tok/s | step ms | ratio to default |",
        "|---|---|---|---|---|---|---|",
    ]
    names = {name for name, _, _ in LEVERS}
    for res in results:
        for r in res.runs:
            if r.peer not in names:
                continue
            base = next(x for x in res.runs if x.peer == "engine" and x.concurrency == r.concurrency)
            lines.append(f"| {res.shape} | {res.dtype} | {r.concurrency} | {r.peer} | {r.tps:.0f} | "
                         f"{r.step_ms:.1f} | {r.tps / base.tps:.2f} |")
    return "\n".join(lines)


def crop_runs(prompt_len: int = 236, new: int = 100) -> list[Run]:
    """10.7M model (window 256): generation runs `prompt_len + new - 256` tokens past the window."""
    ckpt = make_checkpoint("10.7M", "float32")
    prompts = prompts_for(ckpt, 4, prompt_len)
    runs = []
    for conc in (1, 4):
        for policy in ("shift", "sliding"):
            runs.append(bench_engine(ckpt, conc, prompts, new, {"crop_policy": policy}, name=policy))
            print(f"    crop {policy:8s} conc {conc}: {runs[-1].tps:.1f} tok/s", flush=True)
    return runs


def crop_table(runs: list[Run]) -> str:
    lines = ["| conc | policy | tok/s | ratio to shift |", "|---|---|---|---|"]
    for r in runs:
        shift = next(x for x in runs if x.peer == "shift" and x.concurrency == r.concurrency)
        lines.append(f"| {r.concurrency} | {r.peer} | {r.tps:.1f} | {r.tps / shift.tps:.2f} |")
    return "\n".join(lines)
