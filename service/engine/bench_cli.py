"""`nanoserve bench`: runs bench/engine.py (engine vs naive loop vs HF vs llama.cpp vs limits)."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench" / "engine.py"


def add_bench_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "bench",
        help="benchmark the engine against its peers (bench/engine.py; --help after -- for options)",
        description="Run bench/engine.py; arguments after `bench` are passed through.",
    )
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments for bench/engine.py")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    if not BENCH.is_file():
        print(f"nanoserve bench: {BENCH} not found (the benchmark ships with the source tree)",
              file=sys.stderr)
        return 2
    spec = importlib.util.spec_from_file_location("nanoserve_bench_engine", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while it executes
    spec.loader.exec_module(module)
    passthrough = [a for a in args.args if a != "--"]
    return int(module.main(passthrough))
