"""The `nanoserve` command: one entry point, a subcommand per job."""

from __future__ import annotations

import argparse
import sys

from nanoserve.engine.omp_wait import bound_openmp_spinning


def build_parser() -> argparse.ArgumentParser:
    # Imported here, not above: they load torch, and main() sets libgomp's spinning first.
    from nanoserve.model.hf_cli import add_hf_parsers
    from nanoserve.model.training.cli import add_train_parser
    from nanoserve.server.serve_cli import add_serve_parser

    parser = argparse.ArgumentParser(prog="nanoserve", description="Serve and train small GPT models.")
    sub = parser.add_subparsers(dest="command", required=True)
    add_train_parser(sub)
    add_serve_parser(sub)
    add_hf_parsers(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    bound_openmp_spinning()  # before torch loads libgomp (omp_wait.py)
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
