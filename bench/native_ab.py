"""Two builds of the native step, alternating in one process: is a change to decode.c faster?

    python -m bench.native_ab --base 8c7ce8a [--head WORKTREE] [--shape 10.7M] [--dtype bfloat16]
                              [--rows 1,8,32,64,32x16] [--position 40] [--rounds 8] [--steps 40]

Builds nanoserve/engine/native/ (decode.c with its fragments, abi.c) at two git revisions (--head
WORKTREE: the files as they are on disk) with gcc -O3, loads each into its own NativeStep over the
same random weights and the same KV cache contents, checks that both give the same logits (the
native step's changes are meant to keep every bit), then times them in turns: each round runs
`--steps` forwards of each, one after the other, and the next round the other way round. Each
build runs as two instances, made in the order base, head, head, base: with one of each, the
build made second came out 1-6% faster when both were the same code (`--base HEAD --head HEAD`),
whichever ran first in a round; made in that order, the place in the
making order is the same on average for both. Reports the median over rounds of the ratio base /
head of each round's summed median forward times (above 1: head is faster), and each round's.
`--rows`: decode rows (each in its own slot, at --position), or SxL for S prompts of L tokens
prefilled from position 0 (the benchmark's prefill: 32x16). Needs gcc and git. Not a test:
nothing here asserts a speed.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from bench.record import cpu_label, machine
from bench.shapes import DTYPES, SHAPES
from bench.timing import round_medians_s
from nanoserve.engine import native_step
from nanoserve.engine.kv_slots import SpanKVCache
from nanoserve.engine.native_step import NativeStep
from nanoserve.model.config import GPTConfig
from nanoserve.model.gpt import GPT

REPO = Path(__file__).resolve().parents[1]
NATIVE = "nanoserve/engine/native"
NATIVE_BEFORE_THE_PACKAGE = "service/engine/native"  # where revisions before nanoserve/ keep it


def native_dir(revision: str) -> str:
    """The native sources' folder at `revision` (WORKTREE: on disk)."""
    if revision == "WORKTREE":
        return NATIVE
    found = subprocess.run(["git", "cat-file", "-e", f"{revision}:{NATIVE}"], cwd=REPO, capture_output=True)
    return NATIVE if found.returncode == 0 else NATIVE_BEFORE_THE_PACKAGE


def build(revision: str, out: Path) -> Path:
    """decode.c at `revision` (WORKTREE: as on disk) compiled into out/<revision>.so."""
    src = Path(tempfile.mkdtemp(prefix=f"src-{revision}-", dir=out))  # a revision may come twice
    if revision == "WORKTREE":
        for f in (REPO / NATIVE).iterdir():
            if f.suffix in (".c", ".h", ".inc"):
                (src / f.name).write_bytes(f.read_bytes())
    else:
        native = native_dir(revision)
        names = subprocess.run(["git", "ls-tree", "--name-only", f"{revision}:{native}"], cwd=REPO,
                               check=True, capture_output=True, text=True).stdout.split()
        for name in (n for n in names if n.endswith((".c", ".h", ".inc"))):
            blob = subprocess.run(["git", "show", f"{revision}:{native}/{name}"], cwd=REPO, check=True,
                                  capture_output=True).stdout
            (src / name).write_bytes(blob)
    lib = src / f"{revision}.so"
    sources = sorted(str(c) for c in src.glob("*.c"))  # decode.c, and abi.c where the revision has it
    cc = ["gcc", "-O3", "-std=c11", "-fPIC", "-shared", *sources, "-o", str(lib), "-lm"]
    subprocess.run(cc, check=True)
    return lib


def label(revision: str) -> str:
    """A revision as its short commit hash (HEAD moves on), or WORKTREE."""
    if revision == "WORKTREE":
        return revision
    rev = subprocess.run(["git", "rev-parse", "--short", revision], cwd=REPO, check=True, capture_output=True,
                         text=True)
    return rev.stdout.strip()


def step_for(lib: Path, model: GPT, cfg: GPTConfig, slots: int, dtype: torch.dtype) -> NativeStep:
    """A NativeStep on library `lib` (as the engine holds one: weights once), over a cache whose
    contents are the same for every build (seeded)."""
    real = native_step.library_path
    native_step.library_path = lambda: lib  # type: ignore[assignment]
    try:
        cache = SpanKVCache(cfg.n_layer, slots, cfg.n_head, cfg.block_size, cfg.head_dim, dtype, "cpu")
        gen = torch.Generator().manual_seed(1)
        for layer in cache.layers:
            for t in (layer.k, layer.v):
                assert isinstance(t, torch.Tensor)
                t.copy_(torch.randn(t.shape, generator=gen))
        return NativeStep(copy.deepcopy(model), cache, max_threads=torch.get_num_threads(), max_rows=2048,
                          hold_once=True)
    finally:
        native_step.library_path = real  # type: ignore[assignment]


def forward_args(spec: str, position: int) -> tuple[list[int], list[int], list[int], list[int] | None]:
    if "x" in spec:  # S prompts of L tokens from position 0, the last row of each wanted
        seqs, length = (int(v) for v in spec.split("x"))
        pos = [p for _ in range(seqs) for p in range(length)]
        slot = [s for s in range(seqs) for _ in range(length)]
        return [5] * len(pos), pos, slot, [s * length + length - 1 for s in range(seqs)]
    rows = int(spec)
    return [5] * rows, [position] * rows, list(range(rows)), None


MADE = ("base", "head", "head", "base")  # the order the instances are made in (see the docstring)


def abba_ratios(medians: list[list[float]]) -> tuple[list[float], list[float], list[float]]:
    """Per-round medians of the instances made in MADE's order -> (each round's base / head ratio
    of summed times, each round's base time and head time per forward, the two instances' mean)."""
    base = [(a + d) / 2 for a, d in zip(medians[0], medians[3], strict=True)]
    head = [(b + c) / 2 for b, c in zip(medians[1], medians[2], strict=True)]
    return [b / h for b, h in zip(base, head, strict=True)], base, head


def compare(steps: list[NativeStep], spec: str, position: int, n: int, rounds: int) -> str:
    args = forward_args(spec, position)
    first, *others = (st(*args) for st in steps)
    same = all(torch.equal(first, other) for other in others)
    made = enumerate(zip(MADE, steps, strict=True))
    fns = {f"{role}{i}": (lambda st=st: st(*args)) for i, (role, st) in made}
    ratios, base, head = abba_ratios(list(round_medians_s(fns, n, rounds).values()))
    label = f"{spec} rows" if "x" not in spec else f"prefill {spec}"
    return (f"| {label} | {min(base) * 1e3:.3f} | {min(head) * 1e3:.3f} | {statistics.median(ratios):.3f} | "
            f"{' '.join(f'{x:.2f}' for x in ratios)} | {'yes' if same else 'NO'} |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.native_ab", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, help="git revision (or WORKTREE)")
    ap.add_argument("--head", default="WORKTREE", help="git revision (or WORKTREE, the default)")
    ap.add_argument("--shape", default="10.7M", choices=sorted(SHAPES))
    ap.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    ap.add_argument("--rows", default="1,8,32,64,32x16")
    ap.add_argument("--position", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", help="also write the table to this file")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    cfg = SHAPES[args.shape]
    torch.manual_seed(0)
    model = GPT(cfg).to(DTYPES[args.dtype]).eval()
    specs = args.rows.split(",")
    slots = max(int(s.split("x")[0]) for s in specs)
    with tempfile.TemporaryDirectory(prefix="nanoserve-ab-") as tmp, torch.inference_mode():
        libs = {"base": build(args.base, Path(tmp)), "head": build(args.head, Path(tmp))}
        steps = [step_for(libs[role], model, cfg, slots, DTYPES[args.dtype]) for role in MADE]
        m = machine()
        base, head = label(args.base), label(args.head)
        lines = [
            f"Machine: {cpu_label(m)}, {m['cores']} cores. {args.shape} {args.dtype}, decode rows at "
            f"position {args.position}; {args.rounds} rounds of {args.steps} forwards, two instances of each "
            "build (made base, head, head, base), the order turned each round.",
            "",
            f"| forward | {base} ms (best round) | {head} ms (best round) | {base} / {head}, median of rounds"
            " | each round | same logits |",
            "|---|---|---|---|---|---|",
        ]
        print("\n".join(lines), flush=True)
        for spec in specs:
            lines.append(compare(steps, spec, args.position, args.steps, args.rounds))
            print(lines[-1], flush=True)
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
