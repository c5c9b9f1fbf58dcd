"""bench/engine_throughput.py's tables: a run's markdown and JSON from its results, or again from a
saved run (`python -m bench.engine_throughput --render <run>.json`, the limits recomputed from its
measurements)."""

from __future__ import annotations

from typing import Any

from bench.levers import lever_table
from bench.limits import model_costs
from bench.record import cpu_label
from bench.shapes import DTYPES, SHAPES
from bench.throughput_runs import Run, ShapeResult


def table(results: list[ShapeResult]) -> str:
    lines = [
        "| model | dtype | conc | engine tok/s | engine step ms | naive / engine | HF / engine | "
        "llama.cpp / engine | engine / limit | HF / limit |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for res in results:
        for conc in sorted({r.concurrency for r in res.runs}):
            by = {r.peer: r for r in res.runs if r.concurrency == conc}
            eng, bound = by["engine"], res.bound_tps(conc)
            peers = ("naive", "hf", "llama.cpp")
            ratios = [f"{by[p].tps / eng.tps:.2f}" if p in by else "n/a" for p in peers]
            hf = f"{by['hf'].tps / bound:.0%}" if "hf" in by else "n/a"
            lines.append(
                f"| {res.shape} | {res.dtype} | {conc} | {eng.tps:.0f} | {eng.step_ms:.1f} | "
                f"{' | '.join(ratios)} | {eng.tps / bound:.0%} | {hf} |"
            )
    return "\n".join(lines)


def _rates(limits: dict[str, float]) -> str:
    return ", ".join(f"{k.removeprefix('matmul_GFLOPs_')} {v:.1f}" for k, v in limits.items()
                     if k.startswith("matmul_GFLOPs_"))


def _reads(limits: dict[str, float]) -> str:
    """Which read set the bandwidth: memory (512 MiB) and a buffer the weights' size (older saved
    runs have the first only)."""
    if "bandwidth_weights_GBps" not in limits:
        return ""
    return (f" (512 MiB {limits['bandwidth_memory_GBps']:.1f}, weights-sized buffer "
            f"{limits['bandwidth_weights_GBps']:.1f})")


def load_results(saved: dict[str, Any]) -> list[ShapeResult]:
    """A saved run's results, its limits' model costs recomputed (older runs lack some)."""
    results = []
    for r in saved["results"]:
        args = saved["meta"]["args"]
        res = ShapeResult(r["shape"], r["dtype"], r["params"],
                          r.get("prompt_tokens", args["prompt_tokens"]),
                          r.get("new_tokens", args["new_tokens"] if r["shape"] == "10.7M"
                                else max(4, args["new_tokens"] // 2)))
        res.limits = dict(r["limits"])
        costs = model_costs(SHAPES[r["shape"]], DTYPES[r["dtype"]])
        names = ("weight_bytes", "flops_per_token", "head_flops_per_token")
        res.limits.update(zip(names, costs, strict=True))
        res.runs = [Run(**{k: v for k, v in x.items() if k != "tps"}) for x in r["runs"]]
        results.append(res)
    return results


def render(meta: dict[str, Any], results: list[ShapeResult], extra: str = "") -> tuple[dict[str, Any], str]:
    """A run's JSON payload and its markdown: the table, the levers if run, `extra`, the limits."""
    args = meta["args"]
    md = table(results)
    if args.get("levers"):
        md += "\n\nLevers (same run; ratio to the default engine at the same concurrency):\n\n"
        md += lever_table(results)
    md += extra
    payload = {"meta": meta, "results": [
        {"shape": r.shape, "dtype": r.dtype, "params": r.params, "limits": r.limits,
         "prompt_tokens": r.prompt_tokens, "new_tokens": r.new_tokens,
         "run_bound_tps": {c: r.bound_tps(c) for c in sorted({x.concurrency for x in r.runs})},
         "runs": [{**vars(x), "tps": x.tps} for x in r.runs]} for r in results]}
    header = (f"Machine: {cpu_label(meta['machine'])}, {meta['machine']['cores']} cores, torch "
              f"{meta['machine']['torch']}, {args['threads']} threads; load before/after "
              f"{meta['load_before']} / {meta['load_after']}.\n\n")
    limits = "\n".join(
        f"- {r.shape} {r.dtype}: {r.limits['bandwidth_GBps']:.1f} GB/s read{_reads(r.limits)} -> "
        f"batch-1 bound {r.limits['bound_tps_batch1']:.0f} tok/s; "
        f"{r.limits['matmul_GFLOPs']:.0f} GFLOP/s matmul "
        f"({_rates(r.limits)}) -> compute bound {r.limits['bound_tps_compute']:.0f} tok/s (decode alone); "
        f"runs of {r.prompt_tokens}-token prompts and {r.new_tokens} new tokens, prefill counted: "
        + ", ".join(f"batch {c} {r.bound_tps(c):.0f}" for c in sorted({x.concurrency for x in r.runs}))
        + " tok/s" for r in results)
    explain = ("x / limit: the shortest time the run could take on these limits (the prompts' forward, "
               "its output layer for each sequence's last token only, then one forward per further token, "
               "each the longer of reading the weights and computing its tokens) over x's measured time.\n")
    return payload, header + md + "\n\nMeasured limits (same run):\n" + limits + "\n\n" + explain
