"""bench/server_vs_llama.py's figures: what each load run's summary (bench/load.py) yields, and the
tables comparing the two servers round by round. No server or model here, so tests read it directly."""

from __future__ import annotations

import statistics
from typing import Any

from bench.record import cpu_label

WAYS = ("nanoserve", "llama-server")
# (key, label, unit, scale, higher is better)
FIGURES = (
    ("tokens_per_s", "tokens/s", "", 1.0, True),
    ("ttft_p50", "TTFT p50", " ms", 1e3, False),
    ("ttft_p99", "TTFT p99", " ms", 1e3, False),
    ("itl_p50", "inter-token p50", " ms", 1e3, False),
    ("itl_p99", "inter-token p99", " ms", 1e3, False),
)


def figures(summary: dict[str, Any]) -> dict[str, float | None]:
    """One load run's figures from `LoadReport.summary()`: throughput and latency percentiles (s).
    Raises when a request did not complete: a run that lost requests measures something else."""
    outcomes = summary["outcomes"]
    if set(outcomes) != {"ok"}:
        raise RuntimeError(f"not every request completed: {outcomes}")
    if summary.get("malformed_streams"):
        raise RuntimeError(f"{summary['malformed_streams']} malformed streams")
    return {"tokens_per_s": summary["tokens_per_s"], "tokens": summary["tokens_generated"],
            "requests": summary["requests"],
            "ttft_p50": summary["ttft_s"]["p50"], "ttft_p99": summary["ttft_s"]["p99"],
            "itl_p50": summary["itl_s"]["p50"], "itl_p99": summary["itl_s"]["p99"]}


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def compare(rounds: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Both servers' runs of one (dtype, concurrency) cell -> each figure's median and range per
    server, the ratio nanoserve / llama-server of the medians, and the ratio round by round (each
    nanoserve run against the llama-server run of the same round: the host's load drifts)."""
    out: dict[str, Any] = {}
    for key, *_ in FIGURES:
        by_way = {w: [r[key] for r in rounds.get(w, []) if r.get(key) is not None] for w in WAYS}
        cell: dict[str, Any] = {w: spread(v) for w, v in by_way.items() if v}
        if len(cell) == len(WAYS):
            cell["ratio"] = cell["nanoserve"]["median"] / cell["llama-server"]["median"]
            cell["round_ratios"] = [a / b for a, b in zip(by_way["nanoserve"], by_way["llama-server"],
                                                          strict=False)]
        if cell:
            out[key] = cell
    return out


def _cell(s: dict[str, float], unit: str, scale: float) -> str:
    lo, mid, hi = (scale * s[k] for k in ("min", "median", "max"))
    digits = 0 if scale == 1.0 or mid >= 10 else 1
    return f"{mid:,.{digits}f}{unit} ({lo:,.{digits}f}-{hi:,.{digits}f})"


def table(cells: dict[str, Any]) -> str:
    rows = ["| figure | nanoserve | llama-server | nanoserve / llama-server |", "|---|---|---|---|"]
    for key, label, unit, scale, higher in FIGURES:
        c = cells.get(key)
        if c is None:
            continue
        better = "higher" if higher else "lower"
        ours, theirs = (_cell(c[w], unit, scale) if w in c else "not available" for w in WAYS)
        ratio = f"{c['ratio']:.2f} ({better} is better)" if "ratio" in c else "-"
        rows.append(f"| {label} | {ours} | {theirs} | {ratio} |")
    return "\n".join(rows) + "\n"


def render(meta: dict[str, Any], runs: dict[str, dict[int, dict[str, list[dict[str, Any]]]]],
           unavailable: dict[str, str]) -> tuple[dict[str, Any], str]:
    """runs[dtype][conc][way]: one figures dict per round. Returns (JSON payload, markdown)."""
    a = meta["args"]
    m = meta["machine"]
    md = (f"Machine: {cpu_label(m)}, {m['cores']} cores; load before/after "
          f"{meta['load_before']} / {meta['load_after']}. llama.cpp b{meta['llama_cpp']} "
          f"(llama-server: --parallel {a['slots']}, -c {a['slots']}x{a['slot_context']}, -t {a['threads']}; "
          f"nanoserve: max_seqs {a['slots']}, max_context {a['slot_context']}, {a['threads']} threads). "
          f"Model: random weights of the {a['shape']} shape, the same weights in both servers. Load: "
          f"streaming /v1/completions, {a['prompt_tokens']}-token prompts (token ids, a different "
          f"prompt per request), {a['max_new_tokens']} new tokens, temperature 1, top_k 40 "
          f"(top_p 1, min_p 0); "
          f"{a['rounds']} round{'s' if a['rounds'] > 1 else ''}, the servers alternating. Each cell: "
          f"median (min-max over rounds).\n")
    payload: dict[str, Any] = {"meta": meta, "unavailable": unavailable, "cells": {}}
    for dtype, by_conc in runs.items():
        for conc, rounds in by_conc.items():
            cells = compare(rounds)
            payload["cells"][f"{dtype}/{conc}"] = {"runs": rounds, **cells}
            llama_type = meta["gguf_types"][dtype]
            if dtype == "int8" and dtype not in unavailable:
                llama_type += f"; nanoserve `{a['nanoserve_int8_args']}` in {a['int8_dtype']}"
            md += (f"\n**{dtype} (llama.cpp {llama_type}), {conc} concurrent stream"
                   f"{'s' if conc > 1 else ''}**\n\n" + table(cells))
    for dtype, why in unavailable.items():
        md += f"\n{dtype}: nanoserve not measured ({why}).\n"
    return payload, md
