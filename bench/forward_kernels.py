"""The forward alone: the native step (nanoserve/engine/native/decode.c) vs torch's kernels.

    python -m bench.forward_kernels [--shapes 10.7M,124M] [--rows 1,4,16,64] [--prefill 16,64,256]

Decode: for each random-weight model shape and batch size, the same cache, prefilled to position 40
for every row, and the same one-token batch, through the torch decode step (oneDNN packed linears,
as the engine runs it) and the native step. Prefill: one prompt of that many tokens from position
0, through `GPT.forward` (packed linears, last position's logits) and the native step (last row's
logits). Variants alternate in one process; each runs `--steps` forwards per round, `--rounds`
rounds, median per round, best round kept. Also prints the GB/s of weights a batch-1 step implies,
and where the CPU has AVX-512, the native step's time on its AVX2 kernels over its time on the
AVX-512 ones (the same bits; alternating with the others).
Writes bench/results/decode-step-<microarchitecture>.md. With --dtypes instead: the native step
with float32 or bfloat16 weights and KV cache, decode rows at --positions
(bench/results/decode-step-dtypes-*.md); where a
bf16 model runs on a tile level (AVX512-BF16 or AMX), also on the widening kernels. With --tiles: a
bf16 model's decode rows and prompt chunks on each tile level the CPU runs and on the widening
kernels (bench/results/decode-step-tiles-*.md); with --tiles --int8: the same model with int8
weights on AMX-INT8 and on AVX512-VNNI (the same bits; bench/results/decode-step-int8-tiles-*.md).
Not a test: nothing here asserts a speed.
"""

from __future__ import annotations

import argparse
import copy
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

from bench.record import RESULTS, cpu_label, machine
from bench.shapes import SHAPES
from bench.timing import best_median_s
from nanoserve.engine.config import TILE_ISAS
from nanoserve.engine.kv_slots import SpanKVCache
from nanoserve.engine.native_step import NativeStep
from nanoserve.engine.packed_linear import pack_linears
from nanoserve.engine.torch_decode import TorchDecodeStep
from nanoserve.model.gpt import GPT

POSITION = 40


@torch.inference_mode()
def bench_shape(shape: str, rows_list: list[int], prefills: list[int], steps: int, rounds: int) -> list[str]:
    cfg = SHAPES[shape]
    torch.manual_seed(0)
    model = GPT(cfg).eval()
    slots = max(rows_list)
    cache = SpanKVCache(cfg.n_layer, slots, cfg.n_head, cfg.block_size, cfg.head_dim, torch.float32, "cpu")
    # Weight bytes a batch-1 step reads: every layer's parameters and the output projection
    # (counted before packing: packed weights are buffers, not parameters).
    layer_bytes = sum(p.numel() for n, p in model.named_parameters() if ".h." in f".{n}") * 4
    weight_bytes = layer_bytes + cfg.vocab_size * cfg.n_embd * 4
    native = NativeStep(model, cache, max_threads=torch.get_num_threads(),
                        max_rows=max([*prefills, 1]))
    pack_linears(model, batch_hint=slots)
    reference = TorchDecodeStep(model, cache)
    for slot in range(slots):  # every row at POSITION, its own prompt
        cache.prepare([slot], [POSITION])
        prompt = torch.randint(0, cfg.vocab_size, (1, POSITION))
        model(prompt, input_pos=torch.arange(POSITION).view(1, -1), cache=cache, slots=torch.tensor([slot]))
    lines = []
    for rows in rows_list:
        tokens = torch.randint(0, cfg.vocab_size, (rows,))
        pos, slot_t = torch.full((rows,), POSITION), torch.arange(rows)
        tok_list, pos_list, slot_list = tokens.tolist(), pos.tolist(), slot_t.tolist()

        def run_torch() -> None:
            cache.prepare(slot_list, [POSITION + 1] * rows)  # noqa: B023
            reference(tokens, pos, slot_t)  # noqa: B023

        def run_native() -> None:
            native(tok_list, pos_list, slot_list)  # noqa: B023

        best = best_median_s({"torch": run_torch, "native": run_native,
                              **_on_avx2(native, run_native)}, steps, rounds)
        best_t, best_n = best["torch"], best["native"]
        gbps = f"{weight_bytes / best_n / 1e9:.1f}" if rows == 1 else "-"
        lines.append(f"| {shape} | decode, {rows} rows | {best_t * 1e3:.2f} | {best_n * 1e3:.2f} | "
                     f"{best_t / best_n:.2f} | {rows / best_n:.0f} | {gbps} | {_avx2_ratio(best)} |")
        print(lines[-1], flush=True)
    for n in prefills:
        prompt = torch.randint(0, cfg.vocab_size, (1, n))
        pos_t, prompt_list, slot_n = torch.arange(n).view(1, -1), prompt[0].tolist(), [0] * n

        def prefill_torch() -> None:
            cache.prepare([0], [n])  # noqa: B023
            model(prompt, input_pos=pos_t, cache=cache, slots=torch.tensor([0]), last_only=True)  # noqa: B023

        def prefill_native() -> None:
            native(prompt_list, list(range(n)), slot_n, [n - 1])  # noqa: B023

        best = best_median_s({"torch": prefill_torch, "native": prefill_native,
                              **_on_avx2(native, prefill_native)}, max(3, steps // 4), rounds)
        best_t, best_n = best["torch"], best["native"]
        lines.append(f"| {shape} | prefill, {n} tokens | {best_t * 1e3:.2f} | {best_n * 1e3:.2f} | "
                     f"{best_t / best_n:.2f} | {n / best_n:.0f} | - | {_avx2_ratio(best)} |")
        print(lines[-1], flush=True)
    return lines


def _on_avx2(native: NativeStep, run: Callable[[], object]) -> dict[str, Callable[[], object]]:
    """Where the CPU has AVX-512, the native step again with its AVX2 kernels (same bits)."""
    return {"native avx2": _at_level(native, "avx2", run)} if native.isa == "avx512" else {}


def _at_level(native: NativeStep, level: str, run: Callable[[], object]) -> Callable[[], object]:
    """`run` with the native step's kernels at `level` (then back to the best)."""
    best = native.isa

    def at_level() -> None:
        native.use_isa(level)
        try:
            run()
        finally:
            native.use_isa(best)

    return at_level


def _avx2_ratio(best: dict[str, float]) -> str:
    return f"{best['native avx2'] / best['native']:.2f}" if "native avx2" in best else "-"


VARIANTS = {  # (weights, KV cache) dtypes of the native step
    "float32 / float32": (torch.float32, torch.float32),
    "float32 / bfloat16 KV": (torch.float32, torch.bfloat16),
    "bfloat16 / bfloat16": (torch.bfloat16, torch.bfloat16),
}


@torch.inference_mode()
def bench_dtypes(
    shape: str, rows_list: list[int], positions: list[int], steps: int, rounds: int
) -> list[str]:
    """The native step with float32 or bfloat16 weights and KV cache, decode rows at each position."""
    cfg = SHAPES[shape]
    torch.manual_seed(0)
    base = GPT(cfg).eval()
    slots = max(rows_list)
    steppers: dict[str, NativeStep] = {}
    for name, (wdtype, kvdtype) in VARIANTS.items():
        cache = SpanKVCache(cfg.n_layer, slots, cfg.n_head, cfg.block_size, cfg.head_dim, kvdtype, "cpu")
        for layer in cache.layers:  # any values: only the bytes read matter here
            for buf in (layer.k, layer.v):
                assert isinstance(buf, torch.Tensor)
                buf.normal_()
        model = copy.deepcopy(base).to(wdtype)
        steppers[name] = NativeStep(model, cache, max_threads=torch.get_num_threads())
    lines = []
    for rows in rows_list:
        for position in positions:
            toks, pos, slot = [1] * rows, [position] * rows, list(range(rows))
            fns: dict[str, Callable[[], object]] = {
                name: partial(st, toks, pos, slot) for name, st in steppers.items()}
            bf16 = steppers["bfloat16 / bfloat16"]
            if bf16.isa in TILE_ISAS:  # the same step on the widening kernels: float32 inputs
                fns["bfloat16 / bfloat16, AVX-512 widening"] = _at_level(
                    bf16, "avx512", fns["bfloat16 / bfloat16"])
            best = best_median_s(fns, steps, rounds)
            first = best[next(iter(VARIANTS))]
            for name, t in best.items():
                lines.append(f"| {shape} | {rows} | {position} | {name} | {t * 1e3:.2f} | {first / t:.2f} |")
                print(lines[-1], flush=True)
    return lines


@torch.inference_mode()
def bench_tiles(shape: str, rows_list: list[int], prefills: list[int], steps: int, rounds: int,
                int8: bool = False) -> list[str]:
    """A bfloat16 model's step on each tile level this CPU runs (AMX, AVX512-BF16) and on the
    widening AVX-512 kernels: decode rows at POSITION and prompt chunks from position 0, by size.
    `int8`: its linear layers in int8, on AMX-INT8 and on VNNI (the avx512 level)."""
    cfg = SHAPES[shape]
    torch.manual_seed(0)
    model = GPT(cfg).eval().to(torch.bfloat16)
    slots = max(rows_list)
    cache = SpanKVCache(cfg.n_layer, slots, cfg.n_head, cfg.block_size, cfg.head_dim, torch.bfloat16, "cpu")
    for layer in cache.layers:  # any values: only the bytes read matter here
        for buf in (layer.k, layer.v):
            assert isinstance(buf, torch.Tensor)
            buf.normal_()
    native = NativeStep(model, cache, max_threads=torch.get_num_threads(), max_rows=max([*prefills, slots]),
                        quantize="int8" if int8 else "none")
    levels: list[str] = [lv for lv in ("amx", "avx512bf16", "avx512") if native.use_isa(lv) == lv]
    base_level = "avx512" if int8 else "avx512bf16"
    lines = []
    work = [(f"decode, {r} rows", [1] * r, [POSITION] * r, list(range(r))) for r in rows_list]
    work += [(f"prefill, {n} tokens", [1] * n, list(range(n)), [0] * n) for n in prefills]
    for what, toks, pos, slot in work:
        fns = {lv: _at_level(native, lv, partial(native, toks, pos, slot)) for lv in levels}
        best = best_median_s(fns, steps, rounds)
        base = best.get(base_level)
        for lv, t in best.items():
            ratio = f"{base / t:.2f}" if base else "-"
            lines.append(f"| {shape} | {what} | {lv} | {t * 1e3:.2f} | {ratio} |")
            print(lines[-1], flush=True)
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.forward_kernels", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="10.7M,124M")
    ap.add_argument("--rows", default="1,4,16,64")
    ap.add_argument("--prefill", default="16,64,256,1024", help="prompt lengths (tokens) to prefill")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None, help="default: bench/results/decode-step[-dtypes].md")
    ap.add_argument("--dtypes", action="store_true",
                    help="instead: the native step with float32/bfloat16 weights and KV cache")
    ap.add_argument("--positions", default="40,200", help="with --dtypes: decode positions")
    ap.add_argument("--tiles", action="store_true",
                    help="instead: a bf16 model's step on each tile level (AMX, AVX512-BF16) and AVX-512")
    ap.add_argument("--int8", action="store_true", help="with --tiles: int8 weights, AMX-INT8 against VNNI")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.tiles and args.int8:
        what = (f"A model with int8 weights (bf16 embeddings and KV cache) on AMX-INT8 (amx) and VNNI "
                f"(avx512); decode rows at position {POSITION}")
        columns = ["| model | forward | level | ms | speed vs avx512 (VNNI) |", "|---|---|---|---|---|"]
    elif args.tiles:
        what = f"A bfloat16 model (bf16 KV cache) by kernel level; decode rows at position {POSITION}"
        columns = ["| model | forward | level | ms | speed vs avx512bf16 |", "|---|---|---|---|---|"]
    elif args.dtypes:
        what = "The native step's decode forward by weight / KV cache dtype"
        columns = ["| model | rows | position | weights / cache | ms | speed vs float32 / float32 |",
                   "|---|---|---|---|---|---|"]
    else:
        what = f"Every row at position {POSITION}"
        columns = ["| model | forward | torch ms | native ms | torch / native | native tok/s "
                   "| native GB/s (batch 1) | native on AVX2 kernels / native |", "|---" * 8 + "|"]
    m = machine()
    header = [
        f"Machine: {cpu_label(m)}, {m['cores']} cores, torch {torch.__version__}, {args.threads} threads. "
        f"{what}; median of {args.steps} forwards per round, best of {args.rounds} alternating rounds.",
        "",
        *columns,
    ]
    print("\n".join(header), flush=True)
    lines = []
    rows = [int(r) for r in args.rows.split(",")]
    for shape in args.shapes.split(","):
        steps = args.steps if shape == "10.7M" else max(5, args.steps // 4)
        window = SHAPES[shape].block_size
        if args.tiles:
            prefills = [int(n) for n in args.prefill.split(",") if n and int(n) <= window]
            lines += bench_tiles(shape, rows, prefills, steps, args.rounds, int8=args.int8)
        elif args.dtypes:
            positions = [p for p in (int(x) for x in args.positions.split(",")) if p < window]
            lines += bench_dtypes(shape, rows, positions, steps, args.rounds)
        else:
            prefills = [int(n) for n in args.prefill.split(",") if n and int(n) <= window]
            lines += bench_shape(shape, rows, prefills, steps, args.rounds)
    name = ("decode-step-dtypes" if args.dtypes else "decode-step-int8-tiles" if args.tiles and args.int8
            else "decode-step-tiles" if args.tiles else "decode-step")
    out = args.out or str(RESULTS / f"{name}-{m['microarch']}.md")
    Path(out).write_text("\n".join(header + lines) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
