"""The issue's targets for the GPU path, judged from one run's measurements.

At the 124M shape in bf16 on one GPU: the engine at batch 64 at least 3x Hugging Face `generate`,
at batch 1 at least 2x `generate` and at least 25% of the HBM bound, and HTTP at 64 streams at
least 80% of in-process. `generate` counts at its fastest measured cache (dynamic or static). The
HBM bound is one decode step per weight read: measured copy bandwidth (bytes read + written) over
the weights' bytes; the engine's batch-1 rate for it is its median decode step, as the bound has
no prefill in it. Anything not measured is NOT MEASURED, never a pass; a run off a GPU is a dry run
whose figures only show the script works. The engine's targets are judged again at each further
shape measured (the SmolLM2-135M one), against `generate` as measured there.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

BATCH_X_HF = 3.0
SINGLE_X_HF = 2.0
SINGLE_OF_HBM = 0.25
HTTP_OF_IN_PROCESS = 0.80


@dataclass
class Verdict:
    target: str
    ratio: float | None
    needed: float
    status: str  # PASS, FAIL, NOT MEASURED, or DRY RUN (off a GPU)
    detail: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _run(peer: dict[str, Any] | None, batch: int) -> dict[str, Any] | None:
    if not peer or "runs" not in peer:
        return None
    return next((r for r in peer["runs"] if r["batch"] == batch), None)


def best_hf(results: dict[str, Any], batch: int, suffix: str = "") -> tuple[dict[str, Any] | None, str]:
    """The fastest `generate` run at `batch` and which cache it used (steps "hf" and "hf-static",
    or with a shape's `suffix`, "hf-135M", ...)."""
    found = [(run, name) for name in (f"hf{suffix}", f"hf-static{suffix}")
             if (run := _run(results.get(name), batch))]
    if not found:
        return None, ""
    return max(found, key=lambda f: f[0]["tokens_per_s"])


def _verdict(target: str, ratio: float | None, needed: float, on_gpu: bool, detail: str) -> Verdict:
    if ratio is None:
        status = "NOT MEASURED"
    elif not on_gpu:
        status = "DRY RUN"
    else:
        status = "PASS" if ratio >= needed else "FAIL"
    return Verdict(target, ratio, needed, status, detail)


def engine_targets(results: dict[str, Any], small: int, large: int, on_gpu: bool, suffix: str = "",
                   label: str = "") -> list[Verdict]:
    """Against `generate` at both batch sizes, and against the HBM bound at the small one."""
    verdicts = []
    engine = results.get(f"engine{suffix}")
    for batch, needed in ((large, BATCH_X_HF), (small, SINGLE_X_HF)):
        mine, (theirs, cache) = _run(engine, batch), best_hf(results, batch, suffix)
        ratio = mine["tokens_per_s"] / theirs["tokens_per_s"] if mine and theirs else None
        detail = "engine or generate not measured"
        if mine and theirs:
            detail = (f"engine {mine['tokens_per_s']:.0f} tok/s, generate ({cache}) "
                      f"{theirs['tokens_per_s']:.0f} tok/s")
        target = f"{label}batch {batch}: engine / HF generate"
        verdicts.append(_verdict(target, ratio, needed, on_gpu, detail))
    mine = _run(engine, small)
    bandwidth = (results.get("probe") or {}).get("copy_bandwidth_GBps")
    weights = (engine or {}).get("weight_bytes")
    ratio, detail = None, "engine batch 1 or bandwidth not measured"
    if mine and bandwidth and weights and mine["decode_step_ms"] == mine["decode_step_ms"]:  # not NaN
        rate, bound = 1e3 / mine["decode_step_ms"], bandwidth * 1e9 / weights
        ratio = rate / bound
        detail = (f"decode {rate:.0f} tok/s; bound {bound:.0f} tok/s = {bandwidth:.0f} GB/s copy over "
                  f"{weights / 1e6:.0f} MB of weights")
    target = f"{label}batch {small}: engine / HBM bound"
    verdicts.append(_verdict(target, ratio, SINGLE_OF_HBM, on_gpu, detail))
    return verdicts


def judge(results: dict[str, Any], small: int, large: int, streams: int,
          more_shapes: tuple[str, ...] = ()) -> list[Verdict]:
    """The targets from `results` (check.py's steps by name): batch sizes `small` and `large`,
    HTTP at `streams` streams; then the engine's targets again at each of `more_shapes`."""
    on_gpu = str((results.get("probe") or {}).get("device", "")).startswith("cuda")
    verdicts = engine_targets(results, small, large, on_gpu)
    serving = results.get("serving") or {}
    at = next((s for s in serving.get("by_streams", []) if s["streams"] == streams), None)
    ratio = at["ratio"] if at else None
    detail = (f"HTTP {at['http']['tokens_per_s']:.0f} tok/s, in-process "
              f"{at['in_process']['tokens_per_s']:.0f} tok/s" if at else "serving not measured")
    target = f"{streams} streams: HTTP / in-process"
    verdicts.append(_verdict(target, ratio, HTTP_OF_IN_PROCESS, on_gpu, detail))
    for shape in more_shapes:
        verdicts += engine_targets(results, small, large, on_gpu, f"-{shape}", f"{shape} ")
    return verdicts
