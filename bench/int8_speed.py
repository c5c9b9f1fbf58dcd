"""Decode steps of the native step with int8 weights against bfloat16 and float32 ones.

    python -m bench.int8_speed [--shape 124M] [--rows 1,32] [--steps 20] [--rounds 5]

For each batch size, the same random-weight model as float32, bfloat16 and int8 (linear layers,
output layer included, per output feature; embeddings and KV cache bfloat16: `--dtype bfloat16
--quantize int8`), every row at position 40 of its own cache slot, one decode step of all rows;
the variants alternate in one process (bench/timing.py), best round's median kept. Prints tokens/s
and each variant's ratio to bfloat16, with the kernel level each ran. Not a test: nothing asserts.
"""

from __future__ import annotations

import argparse
from functools import partial

import torch

from bench.shapes import SHAPES
from bench.timing import best_median_s
from nanoserve.engine.kv_slots import SpanKVCache
from nanoserve.engine.native_step import NativeStep
from nanoserve.model.gpt import GPT

POSITION = 40

# name: (weights' and cache's dtype, quantize)
VARIANTS = {"float32": (torch.float32, "none"), "bfloat16": (torch.bfloat16, "none"),
            "int8": (torch.bfloat16, "int8")}


def prefilled_step(model: GPT, dtype: torch.dtype, quantize: str, slots: int) -> NativeStep:
    """A native step over `model` in `dtype` with every slot's cache filled to POSITION."""
    cfg = model.config
    low = GPT(cfg).eval()
    low.load_state_dict(model.state_dict())
    low.to(dtype)
    cache = SpanKVCache(cfg.n_layer, slots, cfg.n_head, POSITION + 8, cfg.head_dim, dtype, "cpu")
    step = NativeStep(low, cache, max_threads=torch.get_num_threads(), max_rows=max(POSITION, slots),
                      hold_once=True, quantize=quantize)
    gen = torch.Generator().manual_seed(0)
    for s in range(slots):
        prompt = torch.randint(0, cfg.vocab_size, (POSITION,), generator=gen).tolist()
        step(prompt, list(range(POSITION)), [s] * POSITION, [POSITION - 1])
    return step


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shape", default="124M", choices=sorted(SHAPES))
    parser.add_argument("--rows", default="1,32")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    rows_list = [int(r) for r in args.rows.split(",")]
    torch.manual_seed(0)
    model = GPT(SHAPES[args.shape]).eval()
    slots = max(rows_list)
    steps = {name: prefilled_step(model, d, q, slots) for name, (d, q) in VARIANTS.items()}
    vocab = model.config.vocab_size
    print(f"{args.shape}, {torch.get_num_threads()} threads; kernels: "
          + ", ".join(f"{n} {s.isa}" for n, s in steps.items()) + "\n")
    print("| rows | " + " | ".join(f"{n} tokens/s" for n in steps) + " | int8 / bfloat16 |")
    print("|---" * (len(steps) + 2) + "|")
    for rows in rows_list:
        tokens = [(7 * r + 3) % vocab for r in range(rows)]
        positions, slots_used = [POSITION] * rows, list(range(rows))
        fns = {n: partial(s, tokens, positions, slots_used) for n, s in steps.items()}
        secs = best_median_s(fns, args.steps, args.rounds)
        rates = {n: rows / t for n, t in secs.items()}
        print(f"| {rows} | " + " | ".join(f"{r:,.0f}" for r in rates.values())
              + f" | {rates['int8'] / rates['bfloat16']:.2f}x |")


if __name__ == "__main__":
    main()
