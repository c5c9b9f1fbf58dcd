"""Time to first token of a chat's follow-up turn, its history's KV cache reused, against a cold
prompt of the same length, in one engine in one process:

    python -m bench.prefix_reuse [--shape 124M|10.7M|shipped] [--history 100] [--new 8]
                                 [--answer 16] [--rounds 5] [--threads N]

Each round generates a first turn (`history - answer` random prompt tokens and `answer` greedy
ones), then times the follow-up (that history and `new` more tokens: only the new ones and the
answer's last token are prefilled) and a cold prompt of random tokens of the same length (nothing
to reuse), alternating which goes first. TTFT is measured from the `generate` call to the first
token event. Reports every round, the medians and their ratio, and the engine's prefix cache
counters. Not a test: nothing here asserts a speed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path

import torch

from bench.shapes import make_checkpoint
from nanoserve.engine.config import EngineConfig
from nanoserve.engine.engine import Engine
from nanoserve.engine.types import SamplingParams
from nanoserve.model.checkpoint import Checkpoint, load_checkpoint

SHIPPED = Path(__file__).resolve().parents[1] / "checkpoints" / "shakespeare-char"


async def ttft(engine: Engine, prompt: list[int], new_tokens: int) -> tuple[float, list[int]]:
    """Seconds from the call to the first token, and the greedy tokens generated."""
    start = time.perf_counter()
    stream = await engine.generate(prompt, SamplingParams(max_new_tokens=new_tokens, temperature=0.0,
                                                          stop_on_eos=False))
    first, tokens = None, []
    async for event in stream:
        if first is None:
            first = time.perf_counter() - start
        if event.token_id is not None:
            tokens.append(event.token_id)
    assert first is not None
    return first, tokens


async def measure(ckpt: Checkpoint, args: argparse.Namespace) -> dict[str, object]:
    config = EngineConfig(device="cpu", max_seqs=4, cpu_threads=args.threads)
    engine = Engine(ckpt, config)
    engine.start()
    await engine.warmup()
    vocab = ckpt.tokenizer.vocab_size
    g = torch.Generator().manual_seed(0)

    def random(n: int) -> list[int]:
        return torch.randint(0, vocab, (n,), generator=g).tolist()

    follow, cold = [], []
    try:
        for r in range(args.rounds):
            first_turn = random(args.history - args.answer)
            _, answer = await ttft(engine, first_turn, args.answer)
            prompt = first_turn + answer + random(args.new)
            other = random(len(prompt))
            for which in ((0, 1) if r % 2 else (1, 0)):
                if which:
                    follow.append((await ttft(engine, prompt, 1))[0])
                else:
                    cold.append((await ttft(engine, other, 1))[0])
        stats = engine.stats().extra
    finally:
        await engine.shutdown(0.0)
    return {
        "backend": engine.backend.name, "kernels": engine.backend.kernels(),
        "prompt_tokens": args.history + args.new,
        "follow_up_ttft_ms": [round(t * 1e3, 1) for t in follow],
        "cold_ttft_ms": [round(t * 1e3, 1) for t in cold],
        "median_follow_up_ms": round(statistics.median(follow) * 1e3, 1),
        "median_cold_ms": round(statistics.median(cold) * 1e3, 1),
        "cold_over_follow_up": round(statistics.median(cold) / statistics.median(follow), 2),
        "prefix_cache": {k: stats[k] for k in stats if k.startswith("prefix_cache")},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="124M", choices=["124M", "10.7M", "shipped"])
    parser.add_argument("--history", type=int, default=100)
    parser.add_argument("--new", type=int, default=8)
    parser.add_argument("--answer", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    ckpt = load_checkpoint(SHIPPED) if args.shape == "shipped" else make_checkpoint(args.shape, "float32")
    print(json.dumps({"shape": args.shape, **asyncio.run(measure(ckpt, args))}, indent=1))


if __name__ == "__main__":
    main()
