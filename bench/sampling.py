"""Sampling a step's tokens at GPT-2's vocabulary: the engine's candidates path vs the whole
vocabulary, and Hugging Face's logits warpers, on the same logits in one process.

    python -m bench.sampling [--rows 1,8,32] [--vocab 50257] [--out bench/results/sampling]
    python -m bench.sampling --engine [--out bench/results/sampling-engine]

The logits are synthetic, N(0, scale^2) per token, at scales from flat (a randomly initialised
model's: nearly uniform over 50k tokens) to peaked; each table row gives the distribution's mean
entropy and how much of its mass its 64 likeliest tokens hold, because the candidates path
(nanoserve/model/sampling.py `sample_tokens`) pays off exactly when a row's nucleus lies in its head.
Variants, alternating, median of `--steps` calls per round, best round kept:
  - candidates: `sample_tokens` as the engine runs it (`candidate_width` from the parameters);
  - whole vocabulary: `sample_tokens` with candidates off (every filter over all tokens);
  - HF: `transformers` processors and warpers (RepetitionPenaltyLogitsProcessor, then
    TemperatureLogitsWarper, TopK/TopP/MinP/TypicalLogitsWarper), softmax and
    `torch.multinomial`, as `generate(do_sample=True)` samples;
  - native: the engine's native sampler (nanoserve/engine/native/sampler.inc), which the runner uses
    for every sampled row on CPU (so it is what the engine runs); its picks are compared with the
    whole vocabulary's and the differences counted.
Settings include typical_p (every token, always) and a repetition penalty over 256 random tokens
of context per row.
With --engine instead: the engine itself at GPT-2's shape (124M random weights, the tied embedding
scaled x`--scale` so the next-token distributions are peaked: ~1.7 nats and 0.87 of the mass in
the top 64 at the first step at x4; x1 is nearly uniform), 32 sequences of 16 + 16 tokens, greedy
and each sampling setting, best of 2 runs each: what sampling costs a whole step.
Writes bench/results/sampling.json and sampling.md (or sampling-engine.*). Not a test: nothing
here asserts a speed.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

import torch

from bench.record import RESULTS, cpu_label, load_avg, machine, write_results
from bench.timing import best_median_s
from nanoserve.model.sampling import CANDIDATES, SamplingBatch, candidate_width, sample_tokens, seeded_uniform

SCALES = {"flat (random weights)": 0.05, "scale 3": 3.0, "scale 6": 6.0, "scale 10": 10.0}
SETTINGS: dict[str, dict[str, float]] = {
    "top_p 0.9": {"top_p": 0.9},
    "top_p 0.95": {"top_p": 0.95},
    "min_p 0.05": {"min_p": 0.05},
    "top_k 40, top_p 0.95": {"top_k": 40, "top_p": 0.95},
    "typical_p 0.9": {"typical_p": 0.9},
    "top_k 40, repetition 1.1": {"top_k": 40, "repetition_penalty": 1.1},
    "temperature only": {},
}
CONTEXT = 256  # tokens each row has seen, for the repetition penalty


def batch_for(rows: int, vocab: int, params: dict[str, float], candidates: bool) -> SamplingBatch:
    def col(value: float) -> torch.Tensor:
        return torch.full((rows, 1), value)

    k, p, m = int(params.get("top_k", vocab)), params.get("top_p", 1.0), params.get("min_p", 0.0)
    batch = SamplingBatch(
        temperature=col(1.0),
        greedy=torch.zeros(rows, dtype=torch.bool),
        uniform=torch.tensor([seeded_uniform(1, i) for i in range(rows)], dtype=torch.float64),
    )
    if k < vocab:
        batch.top_k, batch.top_k_max = torch.full((rows, 1), k), k
    if p < 1:
        batch.top_p = col(p)
    if m > 0:
        batch.min_p = col(m)
    if "typical_p" in params:
        batch.typical_p = col(params["typical_p"])
    if "repetition_penalty" in params:
        batch.repetition_penalty = col(params["repetition_penalty"])
    if candidates:
        batch.candidates = candidate_width(vocab, [k] * rows, [p] * rows, [m] * rows,
                                           typical=batch.typical_p is not None)
    return batch


def hf_sampler(params: dict[str, float], context: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    from transformers import (
        LogitsProcessorList,
        MinPLogitsWarper,
        RepetitionPenaltyLogitsProcessor,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
        TypicalLogitsWarper,
    )

    warpers: list[Any] = []  # generate()'s order: processors (the penalty), then warpers
    if "repetition_penalty" in params:
        warpers.append(RepetitionPenaltyLogitsProcessor(params["repetition_penalty"]))
    warpers.append(TemperatureLogitsWarper(1.0))
    if "top_k" in params:
        warpers.append(TopKLogitsWarper(int(params["top_k"])))
    if "top_p" in params:
        warpers.append(TopPLogitsWarper(params["top_p"]))
    if "min_p" in params:
        warpers.append(MinPLogitsWarper(params["min_p"]))
    if "typical_p" in params:
        warpers.append(TypicalLogitsWarper(params["typical_p"]))
    chain = LogitsProcessorList(warpers)

    def sample(logits: torch.Tensor) -> torch.Tensor:
        scores = chain(context, logits)  # type: ignore[arg-type]  # int64: a LongTensor at run time
        return torch.multinomial(scores.softmax(dim=-1), 1).view(-1)

    return sample


def native_sampler() -> Callable[[torch.Tensor, SamplingBatch, torch.Tensor], torch.Tensor] | None:
    """The engine's native sampler (nanoserve/engine/native/sampler.inc) as the runner calls it, or
    None where the library is not built."""
    from nanoserve.engine.kv_slots import SpanKVCache
    from nanoserve.engine.native_step import NativeStep, SamplePenalties, library_path
    from nanoserve.model.config import GPTConfig
    from nanoserve.model.gpt import GPT

    if library_path() is None:
        return None
    cfg = GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=32)  # any model: a handle
    cache = SpanKVCache(cfg.n_layer, 1, cfg.n_head, cfg.block_size, cfg.head_dim, torch.float32, "cpu")
    step = NativeStep(GPT(cfg).eval(), cache, max_threads=torch.get_num_threads())

    def sample(logits: torch.Tensor, batch: SamplingBatch, seen: torch.Tensor) -> torch.Tensor:
        rows = len(logits)

        def column(t: torch.Tensor | None, off: float) -> list[float]:
            return t.view(-1).tolist() if t is not None else [off] * rows

        out = torch.zeros(rows, dtype=torch.int64)
        top_k = [int(k) for k in column(batch.top_k, 0)]
        penalties = None
        if batch.repetition_penalty is not None:  # one slot a row, as the runner's per-slot state
            zero = [0.0] * rows
            penalties = SamplePenalties(seen.contiguous(), torch.zeros(seen.shape, dtype=torch.int32),
                                        list(range(rows)), column(batch.repetition_penalty, 1.0), zero, zero)
        step.sample(logits, column(batch.temperature, 1.0), top_k, column(batch.top_p, 1.0),
                    column(batch.min_p, 0.0), batch.uniform.tolist(), out, penalties,
                    typical_p=column(batch.typical_p, 1.0))
        return out

    return sample


def describe(logits: torch.Tensor) -> tuple[float, float]:
    """Mean entropy (nats) of the rows' distributions and mean mass of their CANDIDATES likeliest."""
    logp = logits.log_softmax(dim=-1)
    entropy = -(logp.exp() * logp).sum(dim=-1).mean().item()
    head = logp.topk(CANDIDATES, dim=-1).values.exp().sum(dim=-1).mean().item()
    return entropy, head


@torch.inference_mode()
def run(rows_list: list[int], vocab: int, steps: int, rounds: int) -> list[dict[str, Any]]:
    out = []
    g = torch.Generator().manual_seed(0)
    native = native_sampler()
    for rows in rows_list:
        for dist, scale in SCALES.items():
            logits = torch.randn(rows, vocab, generator=g) * scale
            entropy, head = describe(logits)
            context = torch.randint(0, vocab, (rows, CONTEXT), generator=g)
            seen = torch.zeros(rows, vocab, dtype=torch.bool).scatter_(1, context, True)
            for setting, params in SETTINGS.items():
                fast, full = batch_for(rows, vocab, params, True), batch_for(rows, vocab, params, False)
                assert torch.equal(sample_tokens(logits, fast, seen), sample_tokens(logits, full, seen))
                hf = hf_sampler(params, context)
                variants: dict[str, Callable[[], object]] = {
                    "candidates": lambda: sample_tokens(logits, fast, seen),  # noqa: B023
                    "whole vocabulary": lambda: sample_tokens(logits, full, seen),  # noqa: B023
                    "HF": lambda: hf(logits),  # noqa: B023
                }
                differ = None
                if native is not None:
                    variants["native"] = lambda: native(logits, full, seen)  # noqa: B023
                    differ = int((native(logits, full, seen) != sample_tokens(logits, full, seen)).sum())
                seconds = best_median_s(variants, steps, rounds)
                ms = {name: 1e3 * s for name, s in seconds.items()}
                out.append({"rows": rows, "distribution": dist, "entropy": entropy, "head_mass": head,
                            "setting": setting, "width": fast.candidates, "ms": ms,
                            "native_picks_differing": differ})
                print(f"{rows:3d} rows  {dist:22s} {setting:22s} " + "  ".join(
                    f"{k} {v:7.2f} ms" for k, v in ms.items()), flush=True)
    return out


def run_engine(scale: float, conc: int) -> list[dict[str, Any]]:
    from bench.peer_runs import bench_engine
    from bench.shapes import make_checkpoint, prompts_for

    ckpt = make_checkpoint("124M", "float32")
    ckpt.state_dict["wte.weight"] = ckpt.state_dict["wte.weight"] * scale
    with torch.inference_mode():
        logits = ckpt.build_model()(torch.tensor(prompts_for(ckpt, 8, 16)))[:, -1]
    entropy, head = describe(logits)
    prompts, out = prompts_for(ckpt, conc, 16), []
    for setting, params in {"greedy": {"temperature": 0.0}, **SETTINGS}.items():
        sampling = params if setting == "greedy" else {"temperature": 1.0, **params}
        best = max((bench_engine(ckpt, conc, prompts, 16, params=sampling) for _ in range(2)),
                   key=lambda r: r.tps)
        out.append({"setting": setting, "tps": best.tps, "step_ms": best.step_ms, "entropy": entropy,
                    "head_mass": head})
        print(f"{setting:22s} {best.tps:7.1f} tok/s  step {best.step_ms:6.1f} ms", flush=True)
    return out


def engine_table(results: list[dict[str, Any]]) -> str:
    greedy = results[0]["tps"]
    lines = ["| setting | tok/s | step ms | / greedy |", "|---|---|---|---|"]
    lines += [f"| {r['setting']} | {r['tps']:.0f} | {r['step_ms']:.1f} | {r['tps'] / greedy:.2f} |"
              for r in results]
    return "\n".join(lines)


def table(results: list[dict[str, Any]]) -> str:
    lines = [
        "| rows | logits | entropy (nats) | mass of top 64 | setting | candidates ms | "
        "whole vocabulary / candidates | HF / candidates | native ms | HF / native |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        ms = r["ms"]
        native = (f"{ms['native']:.2f} | {ms['HF'] / ms['native']:.2f}" if "native" in ms else "- | -")
        lines.append(
            f"| {r['rows']} | {r['distribution']} | {r['entropy']:.1f} | {r['head_mass']:.2f} | "
            f"{r['setting']} | {ms['candidates']:.2f} | {ms['whole vocabulary'] / ms['candidates']:.2f} | "
            f"{ms['HF'] / ms['candidates']:.2f} | {native} |"
        )
    return "\n".join(lines)


def differing(results: list[dict[str, Any]]) -> str:
    counts = [r["native_picks_differing"] for r in results if r["native_picks_differing"] is not None]
    return f"{sum(counts)} of {sum(r['rows'] for r in results if r['native_picks_differing'] is not None)}" \
        if counts else "not run (the native library is not built)"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.sampling", description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="1,8,32")
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--steps", type=int, default=7)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--out", default=None)
    ap.add_argument("--engine", action="store_true", help="the engine at 124M, greedy vs each setting")
    ap.add_argument("--scale", type=float, default=4.0, help="--engine: the tied embedding's factor")
    ap.add_argument("--concurrency", type=int, default=32)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    started: dict[str, Any] = {"load_before": load_avg()}
    if args.engine:
        runs = run_engine(args.scale, args.concurrency)
        meta = {**started, "load_after": load_avg(), "machine": machine(), "args": vars(args)}
        md = (f"Machine: {cpu_label(meta['machine'])}, {meta['machine']['cores']} cores, torch "
              f"{meta['machine']['torch']}; load before/after {meta['load_before']} / "
              f"{meta['load_after']}. The engine, 124M random weights, embedding x{args.scale} (first-step "
              f"entropy {runs[0]['entropy']:.1f} nats, top-64 mass {runs[0]['head_mass']:.2f}), "
              f"{args.concurrency} x (16 + 16 tokens), temperature 1 unless greedy, best of 2.\n\n"
              + engine_table(runs) + "\n")
        print(md)
        write_results(args.out or RESULTS / "sampling-engine", {"meta": meta, "results": runs}, md)
        return 0
    results = run([int(r) for r in args.rows.split(",")], args.vocab, args.steps, args.rounds)
    meta = {**started, "load_after": load_avg(), "machine": machine(), "args": vars(args)}
    md = (f"Machine: {cpu_label(meta['machine'])}, {meta['machine']['cores']} cores, torch "
          f"{meta['machine']['torch']}, {args.threads} threads; vocabulary {args.vocab}; "
          f"load before/after {meta['load_before']} / {meta['load_after']}. Milliseconds per call "
          f"(best of {args.rounds} rounds' medians); every candidates pick equalled the whole "
          f"vocabulary's; native: the engine's sampler (typical_p's distances are float64 there, "
          f"float32 in torch), picks differing from the whole vocabulary's: "
          f"{differing(results)}.\n\n"
          + table(results) + "\n")
    print(md)
    write_results(args.out or RESULTS / "sampling", {"meta": meta, "results": results}, md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
