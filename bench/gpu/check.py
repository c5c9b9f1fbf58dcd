"""The GPU check's plan and its driver: every step a process of its own, under one time budget.

    python -m bench.gpu.check --out DIR [--dry-run] [--only probe,tests,...] [--plan]

Steps, in order (each writes its JSON; the driver gathers them):
  probe      the device, its software, measured copy bandwidth (bench/gpu/probe.py)
  tests      the engine suites on the torch backend on the device (the "torch-cuda" parameter of
             tests/engine, CUDA graphs on, the graphs' own capture and replay tests among them)
             and the CUDA device-index check of tests/reliability
  stream     greedy streams through a real uvicorn on the device against the reference
  engine     this engine at batch 1, 64 and 256 (bench/gpu/peers.py) with CUDA graphs, and at 1
             and 64 without them
  serving    HTTP against in-process at 64 streams (bench/gpu/http_vs_inprocess.py), TTFT included
  engine-135M          the engine at the SmolLM2-135M shape (the Llama family), batch 1 and 64
  hf-static            Hugging Face generate with its static cache (compiled, CUDA graphs), 124M
  hf-135M, hf-static-135M   generate at the 135M shape, dynamic and static cache
The peers' compiles come last, as they are the steps most likely to run long: a step is skipped
when the budget is spent, and a rerun (`--only`) measures it. Then the targets (targets.py) are
judged and results.json, summary.md and steps.log written to --out; the summary's table is printed
last. A step that fails or runs past its time is recorded as such and the rest still run.
`--dry-run` runs the same steps on the CPU at small shapes; `--merge` judges a run and its rerun
together.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.gpu.report import render
from bench.gpu.targets import judge

REPO = Path(__file__).resolve().parents[2]


@dataclass
class Plan:
    device: str
    shape: str  # the targets' shape
    more_shapes: tuple[str, ...]  # engine and generate (dynamic cache) also measured at these
    dtype: str
    batches: tuple[int, int]  # (small, large)
    many_streams: int  # the engine's batch (and KV slots) for the many-streams figure
    new_tokens: int
    streams: tuple[int, ...]  # HTTP against in-process at these; the last is judged
    requests_per_stream: int
    repeats: int
    test_paths: tuple[str, ...]
    test_filter: str
    min_tests: int  # passed tests below which the tests step failed (a filter that selected too few)
    budget_s: float
    steps: dict[str, tuple[list[str], float]] = field(default_factory=dict)  # name -> (argv, timeout)


# Each step's limit on a GPU, in seconds. On an H200, before the CUDA graphs, the steps took probe
# 7, tests 36, stream 15, engine 25, serving 48 (with one stream more), engine-135M 37, hf-135M 60
# (with one warm-up more), hf-static 68: 296 s, leaving hf-static-135M (its compile at 30 layers,
# never timed) 144 s of the budget. The limits (565 in all) stop a step that hangs; the budget
# (BUDGET_S) ends the run inside one device call of 480 s with the wheels' install; what it skips,
# a rerun measures.
LIMITS_S = {"probe": 20, "tests": 75, "stream": 30, "engine": 50, "serving": 50, "engine-135M": 40,
            "hf-static": 90, "hf-135M": 60, "hf-static-135M": 150}
BUDGET_S = 440
DRY_RUN_SLOWER = 2.5  # the dry run's limits and budget: a small model, but on a few shared CPU cores


def make_plan(dry_run: bool, budget_s: float | None = None) -> Plan:
    if dry_run:  # the CPU, small shapes: every step end to end in a few minutes
        plan = Plan("cpu", "10.7M", ("135M",), "float32", (1, 4), 8, 8, (4,), 2, 1,
                    ("tests/engine/test_reference_parity.py",
                     "tests/engine/test_sampling.py"),
                    "torch and (greedy_matches_reference or seeded_sampling_same_alone)", 3,
                    budget_s or BUDGET_S * DRY_RUN_SLOWER)
    else:
        plan = Plan("cuda", "124M", ("135M",), "bfloat16", (1, 64), 256, 128, (64,), 4, 2,
                    ("tests/engine", "tests/reliability/test_startup_faults.py"),
                    "torch-cuda or cuda_index", 40, budget_s or BUDGET_S)
    scale = DRY_RUN_SLOWER if dry_run else 1.0
    batches = ",".join(map(str, plan.batches))

    def on(shape: str) -> list[str]:
        return ["--device", plan.device, "--shape", shape, "--dtype", plan.dtype]

    def peer(name: str, shape: str, *extra: str) -> list[str]:
        return ["bench.gpu.peers", "--peer", name, *on(shape), "--new-tokens", str(plan.new_tokens),
                "--repeats", str(plan.repeats), *(extra or ("--batches", batches))]

    argv: dict[str, list[str]] = {
        "probe": ["bench.gpu.probe", "--device", plan.device],
        # Only the plugins the suites use (run_step turns autoloading off): the GPU image's own
        # (xdist, cov, benchmark, hypothesis, ...) stay out of the tests' way.
        "tests": ["pytest", "-q", "-p", "no:cacheprovider", "-p", "pytest_asyncio.plugin",
                  "-p", "pytest_timeout", "-rfE", *plan.test_paths, "-k", plan.test_filter],
        "stream": ["bench.gpu.stream_check", "--device", plan.device],
        # The many-streams figure rides on the engine's step; the graphs' gain at the main shape only.
        "engine": peer("engine", plan.shape, "--batches", f"{batches},{plan.many_streams}",
                       "--without-graphs", batches),
        "serving": ["bench.gpu.http_vs_inprocess", *on(plan.shape),
                    "--streams", ",".join(map(str, plan.streams)),
                    "--requests-per-stream", str(plan.requests_per_stream)],
    }
    for shape in plan.more_shapes:
        argv[f"engine-{shape}"] = peer("engine", shape)
    argv["hf-static"] = peer("hf-static", plan.shape)
    for shape in plan.more_shapes:
        argv[f"hf-{shape}"] = peer("hf", shape)
        argv[f"hf-static-{shape}"] = peer("hf-static", shape)
    plan.steps = {name: (args, LIMITS_S[name] * scale) for name, args in argv.items()}
    return plan


def run_step(name: str, argv: list[str], timeout_s: float, scratch: Path, log: Path) -> dict[str, Any]:
    """Run one step (`python -m argv...`) in its own process group, stopped after `timeout_s`."""
    out = scratch / f"{name}.json"
    extra = [f"--junitxml={out.with_suffix('.xml')}"] if argv[0] == "pytest" else ["--json", str(out)]
    cmd = [sys.executable, "-m", *argv, *extra]
    t0 = time.monotonic()
    with log.open("a") as f:
        f.write(f"\n===== {name}: {' '.join(cmd)}\n")
        f.flush()
        env = {**os.environ, **({"PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"} if argv[0] == "pytest" else {})}
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            rc: int | None = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the step and anything it started (a server)
            proc.wait()
            rc = None
    step: dict[str, Any] = {"seconds": round(time.monotonic() - t0, 1), "rc": rc,
                            "status": "timeout" if rc is None else "ok" if rc == 0 else "failed"}
    if argv[0] == "pytest" and out.with_suffix(".xml").exists():
        step["result"] = junit_counts(out.with_suffix(".xml"))
    elif out.exists():
        step["result"] = json.loads(out.read_text())
    return step


def junit_counts(path: Path) -> dict[str, int]:
    suite = ET.parse(path).getroot()
    suite = suite if suite.tag == "testsuite" else suite[0]
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    return counts


def run_plan(plan: Plan, only: list[str] | None, out_dir: Path) -> dict[str, Any]:
    deadline = time.monotonic() + plan.budget_s
    log = out_dir / "steps.log"
    log.write_text("")
    steps: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="nanoserve-gpu-check-") as tmp:
        for name, (argv, timeout_s) in plan.steps.items():
            if only and name not in only and name != "probe":  # a rerun names its device too
                continue
            left = deadline - time.monotonic() - 5  # the report's own few seconds
            if left < min(30.0, timeout_s):
                steps[name] = {"status": "skipped", "note": f"budget spent ({left:.0f} s left)"}
            else:
                steps[name] = run_step(name, argv, min(timeout_s, left), Path(tmp), log)
                if name == "tests" and steps[name].get("result", {}).get("passed", 0) < plan.min_tests:
                    steps[name].update(status="failed", note=f"fewer than {plan.min_tests} tests passed")
            print(f"[{name}] {steps[name]['status']} in {steps[name].get('seconds', 0)} s", flush=True)
            if steps[name]["status"] in ("failed", "timeout"):
                print(tail(log, 25), flush=True)
    return steps


def tail(path: Path, lines: int) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def merge(paths: list[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The meta and steps of several runs' results.json, later runs' steps replacing earlier ones
    where they have a result (a rerun of the steps that did not finish). Runs on different devices
    are refused: their timings are not compared."""
    payloads = [json.loads(Path(p).read_text()) for p in paths]
    probes = [p["steps"].get("probe", {}).get("result") or {} for p in payloads]
    names = {str(probe["name"]) for probe in probes if probe.get("name")}
    if len(names) > 1:
        raise SystemExit(f"--merge: runs on different devices ({', '.join(sorted(names))}) are not compared")
    steps: dict[str, Any] = {}
    for payload in payloads:
        for name, step in payload["steps"].items():
            if "result" in step or "result" not in steps.get(name, {}):
                steps[name] = step
    meta = {**payloads[-1]["meta"], "merged_from": [p["meta"]["utc"] for p in payloads]}
    return meta, steps


def finish(meta: dict[str, Any], steps: dict[str, Any], out_dir: Path) -> int:
    """Judge the targets, write results.json and summary.md, print the short table last."""
    plan = meta["plan"]
    results = {name: s["result"] for name, s in steps.items() if "result" in s}
    verdicts = judge(results, plan["batches"][0], plan["batches"][1], plan["streams"][-1],
                     tuple(plan.get("more_shapes", ())), plan.get("many_streams"))
    payload = {"meta": meta, "steps": steps, "targets": [v.to_dict() for v in verdicts]}
    (out_dir / "results.json").write_text(json.dumps(payload, indent=2) + "\n")
    summary, table = render(payload)
    (out_dir / "summary.md").write_text(summary)
    print("\n" + table, flush=True)
    return 1 if any(s["status"] != "ok" for s in steps.values()) else 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu.check", description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="folder for results.json, summary.md and steps.log")
    ap.add_argument("--dry-run", action="store_true",
                    help="on the CPU at small shapes: tries the script, measures nothing of a GPU")
    ap.add_argument("--only", help="comma-separated steps to run (a rerun of some); probe always runs")
    ap.add_argument("--budget-s", type=float, help=f"seconds for every step together (default {BUDGET_S})")
    ap.add_argument("--plan", action="store_true", help="print the plan as JSON and exit")
    ap.add_argument("--merge", nargs="+", metavar="RESULTS_JSON",
                    help="run nothing: judge and write these runs' steps together (a run and its rerun)")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    out_dir = Path(args.out)
    if args.merge:
        meta, steps = merge(args.merge)
        out_dir.mkdir(parents=True, exist_ok=True)
        return finish(meta, steps, out_dir)
    plan = make_plan(args.dry_run, args.budget_s)
    only = args.only.split(",") if args.only else None
    if only and (unknown := set(only) - set(plan.steps)):
        raise SystemExit(f"--only: no step named {', '.join(sorted(unknown))}; "
                         f"steps: {', '.join(plan.steps)}")
    if args.plan:
        print(json.dumps(plan.__dict__, indent=2))
        return 0
    out_dir.mkdir(parents=True, exist_ok=True)
    meta = {"utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "dry_run": args.dry_run,
            "plan": plan.__dict__}
    return finish(meta, run_plan(plan, only, out_dir), out_dir)


if __name__ == "__main__":
    raise SystemExit(main())
