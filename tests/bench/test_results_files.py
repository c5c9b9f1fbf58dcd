"""bench/record.py's write_results: where a benchmark's tables land; and the committed results
files: no run dates, and each renders from its JSON as committed."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from bench.engine_throughput_report import load_results
from bench.engine_throughput_report import render as render_engine
from bench.record import write_results
from bench.server_vs_llama_report import render as render_vs_llama


def test_a_name_with_a_dot_keeps_it(tmp_path: Path) -> None:
    # Path.with_suffix would turn results/engine-10.7M into results/engine-10.json.
    write_results(tmp_path / "engine-10.7M", {"a": 1}, "| table |\n")
    assert json.loads((tmp_path / "engine-10.7M.json").read_text()) == {"a": 1}
    assert (tmp_path / "engine-10.7M.md").read_text() == "| table |\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["engine-10.7M.json", "engine-10.7M.md"]


def test_a_name_given_with_its_suffix_writes_both_files(tmp_path: Path) -> None:
    write_results(tmp_path / "sub" / "run.md", {"b": 2}, "md")
    assert sorted(p.name for p in (tmp_path / "sub").iterdir()) == ["run.json", "run.md"]


RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"
DATE = re.compile(r"20\d\d-[01]\d-[0-3]\d")


def test_no_results_file_names_the_date_of_its_run() -> None:
    files = sorted(RESULTS.iterdir())
    assert files
    for path in files:
        assert not DATE.search(path.read_text()), path.name
        if path.suffix == ".json":
            assert "utc" not in json.loads(path.read_text())["meta"], path.name


@pytest.mark.parametrize("name", sorted(p.stem for p in RESULTS.glob("engine-*.json")))
def test_an_engine_run_rerenders_to_its_committed_table(name: str) -> None:
    # `bench.engine_throughput --render`: an older machine dict (no microarch) renders as it was.
    saved = json.loads((RESULTS / f"{name}.json").read_text())
    _, md = render_engine(saved["meta"], load_results(saved))
    assert md == (RESULTS / f"{name}.md").read_text()
    saved["meta"]["machine"]["microarch"] = "zen9"
    header = render_engine(saved["meta"], load_results(saved))[1].splitlines()[0]
    assert header.startswith(f"Machine: {saved['meta']['machine']['cpu']} (zen9), ")


@pytest.mark.parametrize("name", sorted(p.stem for p in RESULTS.glob("server-vs-llama-*.json")))
def test_a_server_vs_llama_run_rerenders_to_its_committed_table(name: str) -> None:
    saved = json.loads((RESULTS / f"{name}.json").read_text())
    runs: dict[str, dict[int, Any]] = {}
    for key, cell in saved["cells"].items():
        dtype, conc = key.split("/")
        runs.setdefault(dtype, {})[int(conc)] = cell["runs"]
    payload, md = render_vs_llama(saved["meta"], runs, saved["unavailable"])
    assert md == (RESULTS / f"{name}.md").read_text()
    assert json.loads(json.dumps(payload)) == saved
