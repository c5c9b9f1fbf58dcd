"""Two checkouts of the engine, in alternating processes: does a change to the engine cost anything?

    python -m bench.engine_ab --base e7f8d78 [--head HEAD] [--batches 1,32] [--rounds 4]
                              [--tokens 64] [--threads 2]

Checks out both revisions into temporary worktrees, each with its native library built from its
own sources the same way (bench.native_ab.build: gcc -O3), and runs the same measurement in a fresh
process on each tree in turns, base and head, head and base the next round: a random model of the
benchmark's 10.7M shape (6 layers, width 384, window 256) on the engine with each tree's defaults,
`batch` concurrent sampled requests (temperature 1, top-k 40, a seed each) of `--tokens` new
tokens, tokens a second from submission to the last event. Reports each tree's median over rounds,
the ratio head / base (above 1: head is faster) and whether both trees drew the same tokens (a
refactor keeps every bit). The measurement uses only the engine's public API (Engine, EngineConfig,
SamplingParams, save/load_checkpoint), so it runs on old and new trees alike. Not a test: nothing
here asserts a speed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from importlib.machinery import EXTENSION_SUFFIXES
from pathlib import Path

from bench.native_ab import build
from bench.record import machine

REPO = Path(__file__).resolve().parents[1]

# Runs inside the tree under test (PYTHONPATH puts its code first): prints one JSON line.
CHILD = r"""
import asyncio, importlib, importlib.util, json, sys, tempfile, time, pathlib, torch
# Trees before the nanoserve package kept the same modules under model/ and service/engine/.
new = importlib.util.find_spec("nanoserve") is not None
M, E = ("nanoserve.model", "nanoserve.engine") if new else ("model", "service.engine")
def mod(name): return importlib.import_module(name)
checkpoint = mod(M + ".checkpoint")
load_checkpoint, save_checkpoint = checkpoint.load_checkpoint, checkpoint.save_checkpoint
GPTConfig, GPT = mod(M + ".config").GPTConfig, mod(M + ".gpt").GPT
CharTokenizer = mod(M + ".tokenizer").CharTokenizer
EngineConfig, Engine = mod(E + ".config").EngineConfig, mod(E + ".engine").Engine
SamplingParams = mod(E + ".types").SamplingParams
batches, tokens, threads = json.loads(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
torch.manual_seed(0)
tok = CharTokenizer.train("".join(chr(c) for c in range(32, 127)))
cfg = GPTConfig(vocab_size=tok.vocab_size, block_size=256, n_layer=6, n_head=6, n_embd=384)
path = pathlib.Path(tempfile.mkdtemp()) / "m"
save_checkpoint(path, GPT(cfg), tok, name="ab")
ckpt = load_checkpoint(path)
async def run(batch):
    engine = Engine(ckpt, EngineConfig(max_seqs=batch, max_queue=batch, cpu_threads=threads))
    engine.start()
    await engine.warmup()
    async def one(i):
        params = SamplingParams(max_new_tokens=tokens, temperature=1.0, top_k=40, seed=i, stop_on_eos=False)
        return [e.token_id async for e in await engine.generate("Hello " + str(i), params)]
    t0 = time.perf_counter()
    outs = await asyncio.gather(*(one(i) for i in range(batch)))
    elapsed = time.perf_counter() - t0
    await engine.shutdown(0)
    return batch * tokens / elapsed, outs
result = {}
for b in batches:
    tps, outs = asyncio.run(run(b))
    result[str(b)] = {"tokens_per_s": tps, "tokens": outs}
print(json.dumps(result))
"""


def checkout(revision: str, scratch: Path) -> Path:
    """A worktree of `revision` with its own native library built in place."""
    tree = scratch / f"tree-{revision}"
    subprocess.run(["git", "worktree", "add", "--detach", "--quiet", str(tree), revision], cwd=REPO,
                   check=True)
    library = build(revision, scratch)
    # The second: revisions before the nanoserve package.
    homes = (tree / "nanoserve" / "engine" / "native", tree / "service" / "engine" / "native")
    native = next(d for d in homes if d.is_dir())
    shutil.copy(library, native / f"_decode{EXTENSION_SUFFIXES[0]}")
    return tree


def measure(tree: Path, batches: list[int], tokens: int, threads: int) -> dict[str, dict]:  # type: ignore[type-arg]
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": str(threads)}
    done = subprocess.run([sys.executable, "-c", CHILD, json.dumps(batches), str(tokens), str(threads)],
                          cwd=tree, env=env, check=True, capture_output=True, text=True, timeout=900)
    return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def summary(rounds: list[dict[str, dict[str, dict]]], batches: list[int]) -> list[str]:  # type: ignore[type-arg]
    """One line per batch size: each tree's median tokens/s, head / base, and same tokens or not."""
    lines = []
    for b in map(str, batches):
        base = [r["base"][b]["tokens_per_s"] for r in rounds]
        head = [r["head"][b]["tokens_per_s"] for r in rounds]
        same = all(r["base"][b]["tokens"] == r["head"][b]["tokens"] for r in rounds)
        lines.append(f"batch {b}: base {statistics.median(base):,.0f} tok/s, head "
                     f"{statistics.median(head):,.0f} tok/s, head / base "
                     f"{statistics.median(head) / statistics.median(base):.2f} "
                     f"(rounds: {', '.join(f'{h / x:.2f}' for h, x in zip(head, base, strict=True))}); "
                     f"{'the same tokens' if same else 'DIFFERENT TOKENS'}")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.engine_ab", description=__doc__.split("\n\n")[0])
    p.add_argument("--base", required=True, help="git revision to compare against")
    p.add_argument("--head", default="HEAD", help="git revision (commit a change to measure it)")
    p.add_argument("--batches", default="1,32")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    scratch = Path(tempfile.mkdtemp(prefix="engine-ab-"))
    trees = {"base": checkout(args.base, scratch), "head": checkout(args.head, scratch)}
    rounds = []
    try:
        for i in range(args.rounds):
            order = ("base", "head") if i % 2 == 0 else ("head", "base")
            rounds.append({role: measure(trees[role], batches, args.tokens, args.threads) for role in order})
    finally:
        for tree in trees.values():
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=REPO, check=False)
        shutil.rmtree(scratch, ignore_errors=True)
    print(f"{machine()}; base {args.base}, head {args.head}; {args.rounds} rounds, {args.tokens} new tokens")
    print("\n".join(summary(rounds, batches)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
