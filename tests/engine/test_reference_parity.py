"""The engine's greedy output equals the slow reference generator token for token."""

from __future__ import annotations

import asyncio
import random

import pytest

from nanoserve.engine.types import FinishReason
from nanoserve.model.checkpoint import Checkpoint
from nanoserve.model.reference import reference_generate
from tests.engine.conftest import EngineFactory, collect, token_ids

PROMPTS = ["H", "Hello", "The quick brown fox", "a" * 31, "To be, or not to be: that is the question" * 2]


def reference(lively: Checkpoint, prompt: str, n: int, policy: str, keep: int | None = None) -> list[int]:
    model = lively.build_model("cpu")
    ids = lively.tokenizer.encode(prompt)
    return reference_generate(model, ids, n, policy=policy, keep=keep)


@pytest.mark.parametrize("policy", ["shift", "sliding"])
async def test_greedy_matches_reference_past_the_window(
    make_engine: EngineFactory, lively: Checkpoint, policy: str
) -> None:
    # block_size 32, prompts of 1..82 tokens, 70 new tokens: every prompt runs past the window,
    # the longest is cropped first.
    engine = make_engine(crop_policy=policy, max_seqs=2, prefill_budget=16)
    for prompt in PROMPTS:
        events = await collect(engine, prompt, max_new_tokens=70, temperature=0.0, stop_on_eos=False)
        assert token_ids(events) == reference(lively, prompt, 70, policy), (policy, prompt)
        last = events[-1]
        assert last.finish_reason is FinishReason.LENGTH and last.usage is not None
        n_ids = len(lively.tokenizer.encode(prompt))
        assert last.usage.cropped_tokens == max(0, n_ids - 32)
        assert last.usage.prompt_tokens == min(n_ids, 32)


async def test_shift_keep_setting(make_engine: EngineFactory, lively: Checkpoint) -> None:
    engine = make_engine(crop_policy="shift", shift_keep=5)
    events = await collect(engine, "Hello", max_new_tokens=60, temperature=0.0, stop_on_eos=False)
    assert token_ids(events) == reference(lively, "Hello", 60, "shift", keep=5)
    assert engine.stats().extra["context_shifts_total"] >= 2


@pytest.mark.parametrize("slots", [4, 12])
async def test_many_concurrent_requests_join_and_leave(
    make_engine: EngineFactory, lively: Checkpoint, slots: int
) -> None:
    """More requests than slots, different lengths and limits, staggered arrivals: requests join
    a running batch and leave it mid-way, and each still equals its reference. With 12 slots
    decode batches reach the large-batch attention path (model.gpt.DECODE_MATMUL_ROWS)."""
    engine = make_engine(max_seqs=slots, prefill_budget=8, max_queue=64)
    rng = random.Random(1)
    jobs = []
    for i in range(10 + slots):
        prompt = "".join(rng.choice("abcdefgh ,.XYZ") for _ in range(rng.randint(1, 40)))
        jobs.append((prompt, rng.randint(1, 45), i * 0.01))

    async def one(prompt: str, n: int, delay: float) -> list[int]:
        await asyncio.sleep(delay)
        return token_ids(await collect(engine, prompt, max_new_tokens=n, temperature=0.0, stop_on_eos=False))

    results = await asyncio.gather(*(one(*job) for job in jobs))
    for (prompt, n, _), got in zip(jobs, results, strict=True):
        assert got == reference(lively, prompt, n, "shift"), prompt
    assert engine.stats().slots_used == 0


async def test_mixed_params_in_one_batch_keep_greedy_rows_exact(
    make_engine: EngineFactory, lively: Checkpoint
) -> None:
    """Sampled rows with every processor enabled share the batch with greedy rows."""
    engine = make_engine(max_seqs=6)
    sampled = dict(temperature=0.9, top_k=20, top_p=0.9, min_p=0.05, typical_p=0.95,
                   repetition_penalty=1.2, frequency_penalty=0.5, presence_penalty=0.3, seed=3)
    greedy = dict(temperature=0.0)
    greedy_jobs = [collect(engine, p, max_new_tokens=40, stop_on_eos=False, **greedy) for p in PROMPTS[:3]]
    noisy_jobs = [collect(engine, p, max_new_tokens=40, stop_on_eos=False, **sampled) for p in PROMPTS[:3]]
    results = await asyncio.gather(*greedy_jobs, *noisy_jobs)
    for prompt, events in zip(PROMPTS[:3], results[:3], strict=True):
        assert token_ids(events) == reference(lively, prompt, 40, "shift")
