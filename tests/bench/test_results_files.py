"""bench/record.py's write_results: where a benchmark's tables land."""

from __future__ import annotations

import json
from pathlib import Path

from bench.record import write_results


def test_a_name_with_a_dot_keeps_it(tmp_path: Path) -> None:
    # Path.with_suffix would turn results/engine-10.7M into results/engine-10.json.
    write_results(tmp_path / "engine-10.7M", {"a": 1}, "| table |\n")
    assert json.loads((tmp_path / "engine-10.7M.json").read_text()) == {"a": 1}
    assert (tmp_path / "engine-10.7M.md").read_text() == "| table |\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["engine-10.7M.json", "engine-10.7M.md"]


def test_a_name_given_with_its_suffix_writes_both_files(tmp_path: Path) -> None:
    write_results(tmp_path / "sub" / "run.md", {"b": 2}, "md")
    assert sorted(p.name for p in (tmp_path / "sub").iterdir()) == ["run.json", "run.md"]
