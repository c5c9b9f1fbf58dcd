"""The README's performance table is the committed run it names, and its command is that run's."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

from bench.engine_throughput import build_parser

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text(encoding="utf-8")
SECTION = README.split("## Performance", 1)[1].split("\n## ", 1)[0]


def table_rows(text: str, first_cell: str) -> list[list[str]]:
    """The cells of a markdown table's rows, found by its header's first cell."""
    lines = text[text.index(f"| {first_cell} |"):].splitlines()
    return [[c.strip() for c in line.strip("|").split("|")] for line in lines[2:] if line.startswith("|")]


def run_file() -> Path:
    link = re.search(r"\[bench/results/([\w.-]+\.md)\]", SECTION)
    assert link, "the README names no results file"
    return ROOT / "bench" / "results" / link.group(1)


def test_every_readme_row_is_the_results_file_row_it_summarises() -> None:
    measured = {(r[0], r[1], r[2]): r for r in table_rows(run_file().read_text(), "model")}
    rows = table_rows(SECTION, "model")
    assert len(rows) >= 4
    for model, dtype, conc, tps, llama, hf, naive, limit in rows:
        # results columns: model, dtype, conc, tok/s, step ms, naive / engine, HF / engine,
        # llama.cpp / engine, engine / limit, HF / limit (peer / engine; the README inverts them)
        m = measured[(model.split(" ")[0], dtype, conc)]
        assert tps.replace(",", "") == m[3], (model, dtype, conc)
        assert llama == f"{1 / float(m[7]):.1f}x" and hf == f"{1 / float(m[6]):.1f}x", (model, dtype, conc)
        assert naive == f"{1 / float(m[5]):.0f}x" and limit == m[8], (model, dtype, conc)


def test_the_readme_command_is_the_one_that_made_the_run() -> None:
    command = re.search(r"`python -m bench\.engine_throughput ([^`]*)`", SECTION)
    assert command, "the README gives no command for its table"
    # The command parsed as the benchmark parses it today: its options and today's defaults
    # together must be the run's.
    given = vars(build_parser().parse_args(shlex.split(command.group(1))))
    args = json.loads(run_file().with_suffix(".json").read_text())["meta"]["args"]
    compared = ("shapes", "dtypes", "concurrency", "new_tokens", "prompt_tokens", "repeats")
    assert {k: given[k] for k in compared} == {k: args[k] for k in compared}
