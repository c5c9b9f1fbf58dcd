"""A step's draw at GPT-2's vocabulary: the reference sampler against the device sampler, same
logits, same requests, one process.

    python -m bench.device_sampling [--rows 1,32,64] [--device cpu|cuda] [--threads N]
                                    [--steps 5] [--rounds 3]

  - reference: torch_backend.torch_draw (sampling_batch, then sampling.sample_tokens with its
    candidates head), what the torch backend runs today;
  - device: device_draw.DeviceDraw (one packed parameter copy, every processor over the whole
    vocabulary with fixed shapes, nanoserve/model/device_sampling.py).
Each call ends with the tokens on the host (`.tolist()`), as the runner reads them. The logits are
N(0, 6^2) per token: peaked, as a trained model's. The ratio is reference time over device time
(above 1: the device sampler is faster). On a CPU expect below 1: the device sampler sorts every
row's whole vocabulary where the reference works on a 64-token head, and on a CPU a host read
costs nothing; it exists for a GPU, where it runs inside a captured step with no host read.
Median of `--steps` calls per round, rounds alternating, best round kept (bench/timing.py). Not a
test: nothing here asserts a speed.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys

import torch

from bench.record import cpu_label, load_avg, machine
from bench.timing import best_median_s
from nanoserve.engine.backends.torch_backend import torch_draw
from nanoserve.engine.device_draw import DeviceDraw
from nanoserve.engine.inbox import Inbox
from nanoserve.engine.penalties import PenaltyState
from nanoserve.engine.request import Request
from nanoserve.engine.types import SamplingParams
from nanoserve.model.sampling import row_max
from nanoserve.model.tokenizer import CharTokenizer

VOCAB = 50257
SETTINGS: dict[str, dict[str, float]] = {
    "temperature 0.8, top_p 0.95": {"temperature": 0.8, "top_p": 0.95},
    "top_k 40, top_p 0.95, repetition 1.1": {"top_k": 40, "top_p": 0.95, "repetition_penalty": 1.1},
    "typical_p 0.9": {"typical_p": 0.9},
    "greedy": {"temperature": 0.0, "repetition_penalty": 1.1},
}


def requests(rows: int, params: dict[str, float], loop: asyncio.AbstractEventLoop) -> list[Request]:
    tok, rng = CharTokenizer.train("ab"), random.Random(rows)
    reqs = []
    for slot in range(rows):
        prompt = [rng.randrange(VOCAB) for _ in range(256)]  # the repetition penalty's context
        req = Request("r", prompt, SamplingParams(**params), slot, 0, tok, loop, Inbox(loop))  # type: ignore[arg-type]
        req.slot = slot
        reqs.append(req)
    return reqs


def measure(rows: int, params: dict[str, float], device: torch.device, steps: int,
            rounds: int) -> dict[str, float]:
    loop = asyncio.new_event_loop()
    reqs = requests(rows, params, loop)
    state = PenaltyState(rows, VOCAB, device)
    for r in reqs:
        state.reset_slot(r)
    logits = (torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(rows)) * 6).to(device)
    greedy = row_max(logits)[1]
    sampler = DeviceDraw()
    # Each call draws from fresh copies of the logits (the runner hands its own over).
    times = best_median_s({
        "reference": lambda: torch_draw(reqs, logits.clone(), greedy, state, VOCAB).tolist(),
        "device": lambda: sampler(reqs, logits.clone(), greedy, state, VOCAB).tolist(),
    }, steps, rounds)
    loop.close()
    return times


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,32,64")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=0, help="torch's CPU threads (0: its default)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_label(machine())
    print(f"{where}, torch {torch.__version__}, {torch.get_num_threads()} threads, load {load_avg()}")
    print("| setting | rows | reference ms | device ms | reference / device |")
    print("|---|---|---|---|---|")
    with torch.inference_mode():
        for name, params in SETTINGS.items():
            for rows in (int(r) for r in args.rows.split(",")):
                t = measure(rows, params, device, args.steps, args.rounds)
                print(f"| {name} | {rows} | {t['reference'] * 1e3:.2f} | {t['device'] * 1e3:.2f} "
                      f"| {t['reference'] / t['device']:.2f}x |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
