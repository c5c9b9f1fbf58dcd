"""The GPU check's results as markdown: the whole summary, and the short table printed last."""

from __future__ import annotations

from typing import Any

from bench.gpu.targets import Verdict, all_pass


def _fmt(value: float | None, spec: str = ".0f") -> str:
    return "-" if value is None or value != value else format(value, spec)  # None or NaN: "-"


def _header(payload: dict[str, Any]) -> str:
    probe = payload["steps"].get("probe", {}).get("result") or {}
    plan = payload["meta"]["plan"]
    machine = probe.get("machine", {})
    kind = "DRY RUN on the CPU (no GPU result)" if payload["meta"]["dry_run"] else "GPU run"
    return (f"**{kind}**: {probe.get('name', 'device not probed')} ({plan['device']}"
            f"{', compute capability ' + probe['capability'] if 'capability' in probe else ''}), "
            f"torch {machine.get('torch', '?')}, CUDA {probe.get('cuda')}, "
            f"{machine.get('cores', '?')} CPU cores; "
            f"copy bandwidth {_fmt(probe.get('copy_bandwidth_GBps'))} GB/s (read + written); "
            f"{payload['meta']['utc']}. Models: random weights of the "
            f"{' and '.join([plan['shape'], *plan.get('more_shapes', ())])} shapes in {plan['dtype']}, "
            f"{plan['new_tokens']} new tokens per sequence after 16-token prompts, greedy.\n")


def _steps(payload: dict[str, Any]) -> str:
    rows = []
    for name, step in payload["steps"].items():
        result = step.get("result") or {}
        note = step.get("note", "")
        if name == "tests" and result:
            note = ", ".join(f"{v} {k}" for k, v in result.items() if k != "tests" and v)
        elif name == "stream" and result:
            note = (f"{result['streams']} streams, {result['tokens']} tokens, "
                    f"{len(result['mismatches'])} mismatched")
        rows.append(f"| {name} | {step['status']} | {step.get('seconds', '-')} | {note} |")
    return "| step | status | seconds | note |\n|---|---|---|---|\n" + "\n".join(rows) + "\n"


def _cell(peer: dict[str, Any], batch: int, key: str, spec: str = ".0f", runs: str = "runs") -> str:
    run = next((r for r in peer.get(runs, []) if r["batch"] == batch), None)
    return _fmt(run[key] if run else None, spec)


def _graphs_gain(engine: dict[str, Any], batch: int) -> str:
    """The engine's tokens/s with CUDA graphs over without, at `batch` (the same step measures both)."""
    on = next((r for r in engine.get("runs", []) if r["batch"] == batch), None)
    off = next((r for r in engine.get("runs_no_graphs", []) if r["batch"] == batch), None)
    return _fmt(on["tokens_per_s"] / off["tokens_per_s"] if on and off else None, ".2f")


def _engine(payload: dict[str, Any]) -> str:
    plan = payload["meta"]["plan"]
    rows = []
    for shape, suffix in [(plan["shape"], ""), *((s, f"-{s}") for s in plan.get("more_shapes", ()))]:
        engine, hf, static = (payload["steps"].get(f"{peer}{suffix}", {}).get("result") or {}
                              for peer in ("engine", "hf", "hf-static"))
        for b in sorted({r["batch"] for peer in (engine, hf, static) for r in peer.get("runs", [])}):
            rows.append(f"| {shape} | {b} | {_cell(engine, b, 'tokens_per_s')} | "
                        f"{_cell(engine, b, 'decode_step_ms', '.2f')} | "
                        f"{_cell(engine, b, 'decode_step_ms', '.2f', 'runs_no_graphs')} | "
                        f"{_graphs_gain(engine, b)} | {_cell(hf, b, 'tokens_per_s')} | "
                        f"{_cell(static, b, 'tokens_per_s')} |")
    if not rows:
        return ""
    head = ("| shape | batch | engine tok/s | engine decode step ms | without CUDA graphs, step ms "
            "| graphs on / off, tok/s | HF generate tok/s | HF generate, static cache tok/s |\n"
            "|---|---|---|---|---|---|---|---|\n")
    return head + "\n".join(rows) + "\n"


def _serving(payload: dict[str, Any]) -> str:
    result = payload["steps"].get("serving", {}).get("result") or {}
    rows = [f"| {s['streams']} | {_fmt(s['in_process']['tokens_per_s'])} | "
            f"{_fmt(s['http']['tokens_per_s'])} | "
            f"{s['ratio']:.2f} | {_fmt(1e3 * (s['in_process']['ttft_s']['p50'] or 0))} / "
            f"{_fmt(1e3 * (s['http']['ttft_s']['p50'] or 0))} ms |" for s in result.get("by_streams", [])]
    if not rows:
        return ""
    return ("| streams | in-process tok/s | HTTP tok/s | HTTP / in-process | TTFT p50 in-process / HTTP |\n"
            "|---|---|---|---|---|\n" + "\n".join(rows) + "\n")


def _targets(payload: dict[str, Any]) -> str:
    """The targets (a ratio and its bar) and the figures (a value, no bar), and whether all passed."""
    verdicts = [Verdict(**t) for t in payload["targets"]]
    rows = [f"| {v.target} | {_fmt(v.value, '.2f' if v.value is None or abs(v.value) < 10 else '.0f')} | "
            f"{'-' if v.needed is None else format(v.needed, 'g')} | {v.status} | {v.detail} |"
            for v in verdicts]
    head = "| target or figure | value | needed | verdict | measured |\n|---|---|---|---|---|\n"
    done = ("A dry run: nothing judged." if payload["meta"]["dry_run"] else
            "Every target PASS, every figure measured." if all_pass(verdicts) else
            "Not every target passed, or something was not measured.")
    return head + "\n".join(rows) + "\n\n" + done + "\n"


def render(payload: dict[str, Any]) -> tuple[str, str]:
    """(summary.md, the short table to print last)."""
    parts = [_header(payload), _steps(payload), _engine(payload), _serving(payload), _targets(payload)]
    summary = "\n".join(p for p in parts if p)
    return summary, _steps(payload) + "\n" + _targets(payload)
