"""Issue 44's targets for the GPU path, judged from one run's measurements, and the figures
reported beside them.

Targets (PASS or FAIL), bf16 on one GPU, 16-token prompts, 128 new tokens, greedy, every peer in
the same run:
- 124M (GPT-2 small): the engine at batch 64 and at batch 1 at least 2x Hugging Face `generate`
  with its static cache (compiled, replayed as CUDA graphs);
- 135M (SmolLM2-135M's shape, the Llama family): the same, against the faster of `generate`'s
  dynamic and static caches; both must be measured, since which is faster is only known then;
- HTTP at 64 streams at least 0.8 of in-process.
Figures (reported, no bar): the engine at 256 streams (256 KV slots), the time to first token
(p50) at 64 streams, and each batch-1 decode step against the HBM bound (measured copy bandwidth
over the weights' bytes: every weight read once a token), which an older issue asked 25% of.
Anything not measured is NOT MEASURED, never a pass; a run off a GPU is a dry run whose figures
only show the script works.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

ENGINE_X_GENERATE = 2.0  # at batch 64 and at batch 1
HTTP_OF_IN_PROCESS = 0.80


def generate_peers(suffix: str) -> tuple[str, ...]:
    """The steps whose fastest `generate` the engine is judged against: at the first shape (GPT-2)
    the static cache, as the issue names; at a further shape (Llama) both caches."""
    return ("hf-static",) if not suffix else (f"hf{suffix}", f"hf-static{suffix}")


@dataclass
class Verdict:
    target: str
    value: float | None  # a target's ratio, or a figure in the unit its name gives
    needed: float | None  # None: a figure, reported and never judged
    status: str  # PASS, FAIL, REPORTED (a figure), NOT MEASURED, or DRY RUN (off a GPU)
    detail: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _verdict(target: str, value: float | None, needed: float | None, on_gpu: bool, detail: str) -> Verdict:
    if value is None or value != value:  # None or NaN
        status, value = "NOT MEASURED", None
    elif not on_gpu:
        status = "DRY RUN"
    elif needed is None:
        status = "REPORTED"
    else:
        status = "PASS" if value >= needed else "FAIL"
    return Verdict(target, value, needed, status, detail)


def _run(peer: dict[str, Any] | None, batch: int) -> dict[str, Any] | None:
    if not peer or "runs" not in peer:
        return None
    return next((r for r in peer["runs"] if r["batch"] == batch), None)


def fastest_generate(results: dict[str, Any], batch: int,
                     suffix: str = "") -> tuple[dict[str, Any] | None, str]:
    """The fastest of `generate_peers(suffix)` at `batch` and its step's name, or None and the
    names of those not measured there."""
    runs = {name: _run(results.get(name), batch) for name in generate_peers(suffix)}
    missing = [name for name, run in runs.items() if run is None]
    if missing:
        return None, ", ".join(missing)
    name = max(runs, key=lambda n: runs[n]["tokens_per_s"])  # type: ignore[index]
    return runs[name], name


def engine_targets(results: dict[str, Any], small: int, large: int, on_gpu: bool, suffix: str = "",
                   label: str = "") -> list[Verdict]:
    """The engine against `generate` at both batch sizes, and its batch-1 step against the HBM bound."""
    verdicts = []
    engine = results.get(f"engine{suffix}")
    for batch in (large, small):
        mine, (theirs, peer) = _run(engine, batch), fastest_generate(results, batch, suffix)
        missing = [why for why, gone in ((f"engine{suffix}", mine is None), (peer, theirs is None)) if gone]
        ratio, detail = None, f"{', '.join(missing)} not measured"
        if mine and theirs:
            ratio = mine["tokens_per_s"] / theirs["tokens_per_s"]
            detail = (f"engine {mine['tokens_per_s']:.0f} tok/s, "
                      f"generate ({peer}) {theirs['tokens_per_s']:.0f} tok/s")
        verdicts.append(_verdict(f"{label}batch {batch}: engine / HF generate", ratio, ENGINE_X_GENERATE,
                                 on_gpu, detail))
    verdicts.append(_hbm_share(results, engine, small, on_gpu, label))
    return verdicts


def _hbm_share(results: dict[str, Any], engine: dict[str, Any] | None, small: int, on_gpu: bool,
               label: str) -> Verdict:
    mine = _run(engine, small)
    bandwidth = (results.get("probe") or {}).get("copy_bandwidth_GBps")
    weights = (engine or {}).get("weight_bytes")
    share, detail = None, "engine batch 1 or bandwidth not measured"
    if mine and bandwidth and weights and mine["decode_step_ms"] == mine["decode_step_ms"]:  # not NaN
        rate, bound = 1e3 / mine["decode_step_ms"], bandwidth * 1e9 / weights
        share = rate / bound
        detail = (f"decode {rate:.0f} tok/s; bound {bound:.0f} tok/s = {bandwidth:.0f} GB/s copy over "
                  f"{weights / 1e6:.0f} MB of weights")
    return _verdict(f"{label}batch {small}: engine / HBM bound", share, None, on_gpu, detail)


def serving_verdicts(results: dict[str, Any], streams: int, on_gpu: bool) -> list[Verdict]:
    """HTTP against in-process at `streams` streams (a target) and HTTP's TTFT p50 there (a figure)."""
    serving = results.get("serving") or {}
    at = next((s for s in serving.get("by_streams", []) if s["streams"] == streams), None)
    if at is None:
        return [_verdict(f"{streams} streams: HTTP / in-process", None, HTTP_OF_IN_PROCESS, on_gpu,
                         "serving not measured"),
                _verdict(f"{streams} streams: TTFT p50 through HTTP, ms", None, None, on_gpu,
                         "serving not measured")]
    http, local = at["http"], at["in_process"]
    ttft = {way: (r.get("ttft_s") or {}).get("p50") for way, r in (("http", http), ("local", local))}
    return [
        _verdict(f"{streams} streams: HTTP / in-process", at["ratio"], HTTP_OF_IN_PROCESS, on_gpu,
                 f"HTTP {http['tokens_per_s']:.0f} tok/s, in-process {local['tokens_per_s']:.0f} tok/s"),
        _verdict(f"{streams} streams: TTFT p50 through HTTP, ms",
                 None if ttft["http"] is None else 1e3 * ttft["http"], None, on_gpu,
                 "in-process " + ("-" if ttft["local"] is None else f"{1e3 * ttft['local']:.1f} ms")),
    ]


def many_streams(results: dict[str, Any], many: int, large: int, on_gpu: bool) -> Verdict:
    """The engine's tokens/s with `many` streams at once (as many KV slots), against its `large` batch."""
    engine = results.get("engine")
    mine, base = _run(engine, many), _run(engine, large)
    detail = "engine not measured at this batch"
    if mine:
        detail = (f"decode step {mine['decode_step_ms']:.2f} ms"
                  + (f"; batch {large}: {base['tokens_per_s']:.0f} tok/s" if base else ""))
    return _verdict(f"{many} streams: engine tok/s", mine["tokens_per_s"] if mine else None, None, on_gpu,
                    detail)


def judge(results: dict[str, Any], small: int, large: int, streams: int,
          more_shapes: tuple[str, ...] = (), many: int | None = None) -> list[Verdict]:
    """The targets and figures from `results` (check.py's steps by name): batch sizes `small` and
    `large`, HTTP at `streams` streams, the engine at `many` streams; then the engine's targets
    again at each of `more_shapes`."""
    on_gpu = str((results.get("probe") or {}).get("device", "")).startswith("cuda")
    verdicts = engine_targets(results, small, large, on_gpu)
    verdicts += serving_verdicts(results, streams, on_gpu)
    if many is not None:
        verdicts.append(many_streams(results, many, large, on_gpu))
    for shape in more_shapes:
        verdicts += engine_targets(results, small, large, on_gpu, f"-{shape}", f"{shape} ")
    return verdicts


def all_pass(verdicts: list[Verdict]) -> bool:
    """Every target PASS and every figure measured: what the issue's "done" asks of one run."""
    return all(v.status == ("PASS" if v.needed is not None else "REPORTED") for v in verdicts)
