"""bench/gpu: the prepared GPU check cannot rot where no GPU runs it. Its plan parses with each
step's own parser and measures what the issue's targets name, its filter selects enough engine
tests, its wheels meet every requirement, its verdicts never call anything unmeasured a pass, and
(slow) its dry run goes through the driver end to end on the CPU."""

from __future__ import annotations

import importlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bench.gpu import wheels
from bench.gpu.check import main, make_plan
from bench.gpu.report import render
from bench.gpu.targets import all_pass, judge
from bench.gpu.wheels import problems, subset_imports

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("dry_run", [False, True])
def test_every_step_of_the_plan_parses_with_its_modules_parser(dry_run: bool) -> None:
    plan = make_plan(dry_run)
    assert list(plan.steps) == ["probe", "tests", "stream", "engine", "serving", "engine-135M",
                                "hf-static", "hf-135M", "hf-static-135M"]
    for name, (argv, timeout_s) in plan.steps.items():
        assert 0 < timeout_s <= plan.budget_s, name
        if argv[0] == "pytest":
            assert all((ROOT / path).exists() for path in plan.test_paths)
            continue
        parser = importlib.import_module(argv[0]).build_parser()
        args = parser.parse_args([*argv[1:], "--json", "out.json"])
        assert args.device == plan.device, name


def _args(plan_step: tuple[list[str], float]) -> Any:
    argv = plan_step[0]
    return importlib.import_module(argv[0]).build_parser().parse_args([*argv[1:], "--json", "x"])


def test_the_gpu_plan_measures_what_the_targets_name() -> None:
    plan = make_plan(dry_run=False)
    assert (plan.device, plan.shape, plan.dtype, plan.new_tokens) == ("cuda", "124M", "bfloat16", 128)
    assert plan.batches == (1, 64) and plan.streams[-1] == 64 and plan.many_streams == 256
    assert plan.more_shapes == ("135M",)  # SmolLM2-135M's shape, the Llama family
    assert "torch-cuda" in plan.test_filter
    engine = _args(plan.steps["engine"])
    assert engine.batches == "1,64,256" and engine.without_graphs == "1,64"
    static = _args(plan.steps["hf-static"])
    assert (static.peer, static.shape) == ("hf-static", "124M")
    # GPT-2 against the static cache alone; the Llama shape against both of generate's caches.
    assert "hf" not in plan.steps
    assert {_args(plan.steps[s]).peer for s in ("hf-135M", "hf-static-135M")} == {"hf", "hf-static"}


def test_the_run_fits_one_device_call_as_the_readme_gives_it() -> None:
    # The driver's budget inside run.sh's backstop, inside the README's timeout_s, at most 8 minutes:
    # the wheels' install and the report get the difference.
    plan = make_plan(dry_run=False)
    backstop = int(re.search(r"GPU_CHECK_BACKSTOP_S:-(\d+)", (ROOT / "bench/gpu/run.sh").read_text())[1])
    readme = (ROOT / "bench/gpu/README.md").read_text()
    first_call = readme[readme.index("## The device call"):]
    timeout_s = int(re.search(r"timeout_s: `(\d+)`", first_call)[1])
    assert "bash bench/gpu/run.sh 2>&1" in first_call and '`[".whl"]`' in first_call
    assert plan.budget_s + 15 <= backstop and backstop + 15 <= timeout_s <= 480
    # The README's step table gives each step's limit as the plan has it.
    rows = {m[1]: m[2] for m in re.finditer(r"^\| (`[^|]+) \|[^|]+\| ([\d, ]+) \|", readme, re.M)}
    limits = {step.strip("`"): int(limit) for names, limits in rows.items()
              for step, limit in zip(names.split(", "), limits.split(", "), strict=True)}
    assert limits == {name: timeout for name, (_, timeout) in plan.steps.items()}


COLLECT_AS_ON_A_GPU = """
import sys, torch, pytest
torch.cuda.is_available = lambda: True  # collection only: nothing runs on a device
sys.exit(pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", *sys.argv[1:]]))
"""


def test_the_gpu_filter_selects_the_cuda_tests_and_min_tests_of_them() -> None:
    # Collected as on a GPU: tests/engine/conftest.py then adds the "torch-cuda" parameter.
    plan = make_plan(dry_run=False)
    argv = [sys.executable, "-c", COLLECT_AS_ON_A_GPU, *plan.test_paths, "-k", plan.test_filter]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120)
    selected = [line for line in done.stdout.splitlines() if "::" in line]
    assert len(selected) >= plan.min_tests, done.stdout[-2000:]
    assert all("torch-cuda" in t or "cuda_index" in t for t in selected)
    assert any("test_greedy_matches_reference" in t for t in selected)  # parity
    assert any("alone_and_batched" in t for t in selected)  # batch invariance


def test_the_carried_wheels_and_the_image_meet_every_requirement() -> None:
    assert problems() == []


def test_what_the_gpu_test_subset_imports_is_a_requirement_too(monkeypatch: pytest.MonkeyPatch) -> None:
    # The subset's own imports as pytest collects it: a module-level import the image lacks stops
    # the whole collection, so each must be carried; a fixture's lazy import (openai) is not.
    imports = subset_imports(make_plan(dry_run=False).test_paths)
    assert imports["jsonschema"] == "tests/engine/test_grammar.py"
    assert {"torch", "pytest", "numpy"} <= imports.keys()
    assert "openai" not in imports and not set(wheels.LOCAL) & imports.keys()
    without = {k: v for k, v in wheels.carried().items() if k != "jsonschema"}
    monkeypatch.setattr(wheels, "carried", lambda: without)
    monkeypatch.setattr(wheels, "subset_imports", lambda paths: {**imports, "no_such_module_x": "u.py"})
    assert problems() == ["u.py imports no_such_module_x, which no installed distribution provides",
                          "jsonschema: neither in the image nor in wheels.txt"]


def _peer(batches: dict[int, tuple[float, float]]) -> dict[str, Any]:
    return {"weight_bytes": 250e6, "runs": [{"batch": b, "tokens_per_s": tps, "decode_step_ms": ms}
                                            for b, (tps, ms) in batches.items()]}


def _results(device: str = "cuda:0") -> dict[str, Any]:
    serving = {"by_streams": [{"streams": 64, "ratio": 0.9,
                               "http": {"tokens_per_s": 900.0, "ttft_s": {"p50": 0.15}},
                               "in_process": {"tokens_per_s": 1000.0, "ttft_s": {"p50": 0.03}}}]}
    return {"probe": {"device": device, "copy_bandwidth_GBps": 3000.0},
            "engine": _peer({1: (400.0, 2.0), 64: (9000.0, 7.0), 256: (20000.0, 12.0)}),
            # Faster than the static cache here, yet not GPT-2's peer: the issue names the static cache.
            "hf": _peer({1: (300.0, 3.0), 64: (5000.0, 12.0)}),
            "hf-static": _peer({1: (250.0, 4.0), 64: (4000.0, 16.0)}),
            "serving": serving}


def _llama(results: dict[str, Any], static_at_64: float = 2000.0) -> dict[str, Any]:
    return {**results, "engine-135M": _peer({1: (300.0, 3.0), 64: (6000.0, 10.0)}),
            "hf-135M": _peer({1: (100.0, 10.0), 64: (2500.0, 20.0)}),
            "hf-static-135M": _peer({1: (200.0, 5.0), 64: (static_at_64, 25.0)})}


def test_gpt2_against_generates_static_cache_at_2x_and_the_figures_beside() -> None:
    v = {x.target: x for x in judge(_results(), 1, 64, 64, (), 256)}
    big, one = v["batch 64: engine / HF generate"], v["batch 1: engine / HF generate"]
    assert (big.value, big.needed, big.status) == (2.25, 2.0, "PASS")  # the older 3x is no bar
    assert "(hf-static) 4000" in big.detail
    assert (one.value, one.status) == (1.6, "FAIL")  # 400 / 250
    hbm = v["batch 1: engine / HBM bound"]  # 500 tok/s decoding against 3000e9 / 250e6 = 12000
    assert hbm.value == pytest.approx(500 / 12000) and (hbm.needed, hbm.status) == (None, "REPORTED")
    http = v["64 streams: HTTP / in-process"]
    assert (http.value, http.needed, http.status) == (0.9, 0.8, "PASS")
    ttft = v["64 streams: TTFT p50 through HTTP, ms"]
    assert (ttft.value, ttft.status, ttft.detail) == (150.0, "REPORTED", "in-process 30.0 ms")
    many = v["256 streams: engine tok/s"]
    assert (many.value, many.status) == (20000.0, "REPORTED") and "batch 64: 9000 tok/s" in many.detail
    assert len(v) == 6


def test_the_llama_shape_against_the_faster_of_both_caches_measured() -> None:
    v = {x.target: x for x in judge(_llama(_results()), 1, 64, 64, ("135M",), 256)}
    big, one = v["135M batch 64: engine / HF generate"], v["135M batch 1: engine / HF generate"]
    assert (big.value, big.status) == (2.4, "PASS") and "(hf-135M)" in big.detail  # dynamic 2500 > 2000
    assert (one.value, one.status) == (1.5, "FAIL") and "(hf-static-135M)" in one.detail  # 300 / 200
    assert len(v) == 9
    v = {x.target: x for x in judge(_llama(_results(), static_at_64=4000.0), 1, 64, 64, ("135M",))}
    assert v["135M batch 64: engine / HF generate"].value == 1.5  # 6000 / 4000, now the static cache's
    # One cache alone does not say which is faster: not measured, however the engine compares.
    results = _llama(_results())
    del results["hf-static-135M"]
    v = {x.target: x for x in judge(results, 1, 64, 64, ("135M",))}
    for batch in (64, 1):
        verdict = v[f"135M batch {batch}: engine / HF generate"]
        assert (verdict.status, verdict.detail) == ("NOT MEASURED", "hf-static-135M not measured")


def test_nothing_unmeasured_passes_and_nothing_off_a_gpu_is_a_gpu_result() -> None:
    results = _results()
    del results["hf-static"], results["serving"]
    results["engine"]["runs"][0]["decode_step_ms"] = float("nan")
    verdicts = judge(results, 1, 64, 64, ("135M",), 512)
    assert [v.status for v in verdicts] == ["NOT MEASURED"] * len(verdicts)
    assert {v.status for v in judge(_llama(_results("cpu")), 1, 64, 64, ("135M",), 256)} == {"DRY RUN"}


def test_done_only_when_every_target_passes_and_every_figure_is_measured() -> None:
    results = _llama(_results())
    results["engine"]["runs"][0]["tokens_per_s"] = 600.0  # batch 1: 600 / 250 = 2.4
    results["engine-135M"]["runs"][0]["tokens_per_s"] = 500.0  # 500 / 200 = 2.5
    assert all_pass(judge(results, 1, 64, 64, ("135M",), 256))
    assert not all_pass(judge(results, 1, 64, 64, ("135M",), 512))  # no run at 512: a figure missing
    payload = _payload("t", "NVIDIA H100", {})
    payload["targets"] = [v.to_dict() for v in judge(results, 1, 64, 64, ("135M",), 256)]
    assert render(payload)[1].rstrip().endswith("\n\nEvery target PASS, every figure measured.")
    results["serving"]["by_streams"][0]["ratio"] = 0.79
    assert not all_pass(judge(results, 1, 64, 64, ("135M",), 256))
    payload["targets"] = [v.to_dict() for v in judge(results, 1, 64, 64, ("135M",), 256)]
    assert render(payload)[1].rstrip().endswith("Not every target passed, or something was not measured.")


def test_the_report_says_a_dry_run_is_one_and_tables_every_target() -> None:
    payload = {"meta": {"utc": "t", "dry_run": True, "plan": make_plan(True).__dict__},
               "steps": {"probe": {"status": "ok", "seconds": 1, "result": {"device": "cpu", "name": "x"}},
                         "hf-static": {"status": "skipped", "note": "budget spent (3 s left)"}},
               "targets": [v.to_dict() for v in judge(_llama(_results("cpu")), 1, 64, 64, ("135M",), 256)]}
    summary, table = render(payload)
    assert summary.startswith("**DRY RUN on the CPU (no GPU result)**")
    assert "| hf-static | skipped | - | budget spent (3 s left) |" in table
    assert table.count("| DRY RUN |") == 9 and table.rstrip().endswith("A dry run: nothing judged.")
    assert "| 64 streams: TTFT p50 through HTTP, ms | 150 | - | DRY RUN | in-process 30.0 ms |" in table


def _payload(utc: str, gpu: str, steps: dict[str, Any]) -> dict[str, Any]:
    probe = {"status": "ok", "result": {"device": "cuda", "name": gpu, "copy_bandwidth_GBps": 3000.0}}
    return {"meta": {"utc": utc, "dry_run": False, "plan": make_plan(False).__dict__},
            "steps": {"probe": probe, **steps}, "targets": []}


def test_a_rerun_merges_with_its_run_and_runs_on_two_gpus_do_not(tmp_path: Path) -> None:
    first = _payload("t1", "NVIDIA H100", {"engine": {"status": "ok", "result": _results()["engine"]},
                                            "hf-static": {"status": "timeout", "rc": None}})
    rerun = _payload("t2", "NVIDIA H100", {"engine": {"status": "skipped"},
                                            "hf-static": {"status": "ok", "result": _results()["hf-static"]}})
    paths = []
    for name, payload in (("a.json", first), ("b.json", rerun)):
        (tmp_path / name).write_text(json.dumps(payload))
        paths.append(str(tmp_path / name))
    assert main(["--merge", *paths, "--out", str(tmp_path / "out")]) == 0
    merged = json.loads((tmp_path / "out" / "results.json").read_text())
    assert merged["meta"]["merged_from"] == ["t1", "t2"]
    assert merged["steps"]["engine"]["status"] == "ok" and merged["steps"]["hf-static"]["status"] == "ok"
    big = merged["targets"][0]  # engine 9000 against generate (static cache) 4000 at batch 64
    assert big["value"] == 2.25 and big["status"] == "PASS"
    (tmp_path / "c.json").write_text(json.dumps(_payload("t3", "NVIDIA H200", {})))
    with pytest.raises(SystemExit, match="different devices"):
        main(["--merge", paths[0], str(tmp_path / "c.json"), "--out", str(tmp_path / "out")])


@pytest.mark.slow
def test_the_dry_run_goes_through_the_driver(tmp_path: Path) -> None:
    # The cheapest steps through run.sh and the driver: a step's process, its JSON, the report.
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable}
    done = subprocess.run(["bash", "bench/gpu/run.sh", "--dry-run", "--only", "probe,tests"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    payload = json.loads((tmp_path / "results.json").read_text())
    assert payload["steps"]["probe"]["result"]["copy_bandwidth_GBps"] > 0
    assert payload["steps"]["tests"]["result"]["passed"] >= 3
    assert done.stdout.rstrip().endswith("|\n\nA dry run: nothing judged.")  # the tables, then the verdict
    assert (tmp_path / "summary.md").read_text().startswith("**DRY RUN")
