"""How each peer generates a batch, timed: this engine in-process, a naive recompute loop, and Hugging
Face `generate()`. (llama.cpp: bench/llama_peer.py.) Every peer decodes greedily unless given
sampling parameters, every sequence generating the same number of tokens."""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bench.shapes import DTYPES
from bench.throughput_runs import Run
from nanoserve.engine.config import EngineConfig
from nanoserve.engine.engine import Engine
from nanoserve.engine.types import FinishReason, SamplingParams, Usage
from nanoserve.model.checkpoint import Checkpoint
from nanoserve.model.gpt import GPT


# ------------------------------------------------------------------------------------ engine
class StepTimes:
    """The engine's observer: every decode-only step's duration."""

    def __init__(self) -> None:
        self.decode: list[float] = []

    def on_step(self, duration_s: float, batch_size: int, prefill_tokens: int) -> None:
        if prefill_tokens == 0:
            self.decode.append(duration_s)

    def on_finish(self, reason: FinishReason, usage: Usage) -> None:
        pass

    def on_rejected(self, reason: str) -> None:
        pass


async def generate_batch(
    engine: Engine, prompts: list[list[int]], new: int, extra: dict[str, Any] | None = None
) -> float:
    """Seconds for `engine` to generate `new` tokens for every prompt at once (greedy unless
    `extra` sets sampling parameters)."""
    base: dict[str, Any] = {"temperature": 0.0, "seed": 0, **(extra or {})}
    params = SamplingParams(max_new_tokens=new, stop_on_eos=False, **base)

    async def one(p: list[int]) -> int:
        return len([e async for e in await engine.generate(p, params) if e.token_id is not None])

    t0 = time.perf_counter()
    counts = await asyncio.gather(*(one(p) for p in prompts))
    elapsed = time.perf_counter() - t0
    assert all(c == new for c in counts), counts
    return elapsed


def bench_engine(
    ckpt: Checkpoint, conc: int, prompts: list[list[int]], new: int, cfg: dict[str, Any] | None = None,
    params: dict[str, Any] | None = None, name: str = "engine",
) -> Run:
    times = StepTimes()
    window = min(ckpt.config.block_size, 256)  # bounds KV memory; prompts + new tokens fit
    # No prefix reuse: the timed run sends the warm-up's prompts again, which the peers recompute.
    cfg = {"max_context": window, "prefix_cache": False, **(cfg or {})}
    config = EngineConfig(max_seqs=conc, max_queue=conc, dtype=ckpt.dtype, **cfg)
    engine = Engine(ckpt, config, observer=times)
    engine.start()

    async def go() -> float:
        await engine.warmup()
        # Warm this batch size's shapes, and give the thread tuner (nanoserve/engine/threads.py)
        # its first measurements: a long-running server has them after its first few steps.
        await generate_batch(engine, prompts[:conc], 16, params)
        times.decode.clear()
        elapsed = await generate_batch(engine, prompts[:conc], new, params)
        await engine.shutdown(0.0)
        return elapsed

    elapsed = asyncio.run(go())
    step = 1e3 * statistics.median(times.decode) if times.decode else float("nan")
    return Run(name, conc, conc * new, elapsed, step)


# -------------------------------------------------------------------------------- naive loop
@torch.inference_mode()
def bench_naive(model: GPT, conc: int, prompts: list[list[int]], new: int) -> Run:
    """nanoGPT sample.py: crop to block_size, full forward, take the last logits, append."""
    block = model.config.block_size
    idx = torch.tensor(prompts[:conc], dtype=torch.long)
    model(idx[:, -block:])  # warm-up
    t0 = time.perf_counter()
    for _ in range(new):
        logits = model(idx[:, -block:])[:, -1, :]
        idx = torch.cat((idx, logits.argmax(dim=-1, keepdim=True)), dim=1)
    elapsed = time.perf_counter() - t0
    return Run("naive", conc, conc * new, elapsed, 1e3 * elapsed / new)


# ------------------------------------------------------------------------------------- HF
def hf_model(ckpt: Checkpoint) -> Any:
    """transformers' model of `ckpt` (GPT-2 or Llama, as exported) and its exported directory."""
    from transformers import AutoModelForCausalLM

    from nanoserve.model.hf import export_hf

    out = Path(tempfile.mkdtemp(prefix="nanoserve-bench-hf-"))
    export_hf(ckpt, out)
    return AutoModelForCausalLM.from_pretrained(out, dtype=DTYPES[ckpt.dtype]).eval(), out


@torch.inference_mode()
def bench_hf(
    model: Any, conc: int, prompts: list[list[int]], new: int, params: dict[str, Any] | None = None
) -> Run:
    """HF generate: greedy, or sampled with `params` (temperature, top_k, top_p, min_p: the
    engine's names; top_k 0 when not given, since generate() would otherwise add its default 50)."""
    ids = torch.tensor(prompts[:conc], dtype=torch.long)
    sampling: dict[str, Any] = {"do_sample": False}
    if params and params.get("temperature", 0) > 0:
        sampling = {"do_sample": True, "top_k": 0, **params}
    kwargs = dict(
        attention_mask=torch.ones_like(ids), pad_token_id=0, eos_token_id=None, use_cache=True, **sampling
    )
    model.generate(ids, max_new_tokens=2, min_new_tokens=2, **kwargs)  # warm-up
    t0 = time.perf_counter()
    out = model.generate(ids, max_new_tokens=new, min_new_tokens=new, **kwargs)
    elapsed = time.perf_counter() - t0
    assert out.shape[1] == ids.shape[1] + new
    return Run("hf", conc, conc * new, elapsed, 1e3 * elapsed / new)
