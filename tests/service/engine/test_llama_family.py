"""The engine serves a Llama-family model (RMSNorm, SwiGLU, rotary positions, grouped-query
attention, untied output) as it serves GPT-2: greedy equal to the reference, batched and alone,
past the window (a context shift re-prefills the kept tokens at positions from 0, as the reference
recomputes them)."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest
import torch

from model.checkpoint import Checkpoint, load_checkpoint, save_checkpoint
from model.config import GPTConfig
from model.gpt import GPT
from model.reference import reference_generate
from model.tokenizer import CharTokenizer
from service.engine.config import EngineConfig
from service.engine.engine import Engine
from tests.conftest import TINY_VOCAB_TEXT
from tests.service.engine.conftest import EngineFactory, collect, token_ids

# The native step's kernels are GPT-2's: this family runs on the torch backend (and CUDA's).
pytestmark = pytest.mark.backends("torch", "torch-cuda")


@pytest.fixture(scope="module")
def lively_llama(tmp_path_factory: pytest.TempPathFactory) -> Checkpoint:
    tok = CharTokenizer.train(TINY_VOCAB_TEXT)
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=tok.vocab_size, block_size=32, n_layer=2, n_head=4, n_embd=32, n_kv_head=2,
                       norm="rmsnorm", mlp="swiglu", positions="rope", bias=False, tie_embeddings=False)
    model = GPT(config)
    with torch.no_grad():  # sharp, context-dependent predictions (tests/service/engine/conftest.py)
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(6.0)
    path = tmp_path_factory.mktemp("llama") / "ckpt"
    return load_checkpoint(save_checkpoint(path, model, tok, name="lively-llama"))


def reference(ckpt: Checkpoint, prompt: str, n: int, policy: str) -> list[int]:
    return reference_generate(ckpt.build_model("cpu"), ckpt.tokenizer.encode(prompt), n, policy=policy)


@pytest.mark.parametrize("policy", ["shift", "sliding"])
async def test_greedy_matches_reference_past_the_window(
    make_engine: EngineFactory, lively_llama: Checkpoint, policy: str
) -> None:
    engine = make_engine(lively_llama, crop_policy=policy, max_seqs=2, prefill_budget=16)
    for prompt in ("H", "The quick brown fox", "To be, or not to be: that is the question" * 2):
        events = await collect(engine, prompt, max_new_tokens=70, temperature=0.0, stop_on_eos=False)
        assert token_ids(events) == reference(lively_llama, prompt, 70, policy), (policy, prompt)
    assert engine.stats().extra["context_shifts_total"] >= 3


async def test_concurrent_requests_each_equal_their_reference(
    make_engine: EngineFactory, lively_llama: Checkpoint
) -> None:
    engine = make_engine(lively_llama, max_seqs=6, prefill_budget=8, max_queue=32)
    rng = random.Random(3)
    jobs = [("".join(rng.choice("abcdefgh ,.XYZ") for _ in range(rng.randint(1, 40))), rng.randint(1, 45))
            for _ in range(12)]
    results = await asyncio.gather(*(collect(engine, p, max_new_tokens=n, temperature=0.0, stop_on_eos=False)
                                     for p, n in jobs))
    for (prompt, n), events in zip(jobs, results, strict=True):
        assert token_ids(events) == reference(lively_llama, prompt, n, "shift"), prompt


async def test_sampled_tokens_are_the_same_alone_and_batched(
    make_engine: EngineFactory, lively_llama: Checkpoint
) -> None:
    engine = make_engine(lively_llama, max_seqs=4)
    params = dict(max_new_tokens=40, temperature=1.1, top_k=20, top_p=0.9, seed=5, stop_on_eos=False)
    alone = token_ids(await collect(engine, "Hello there", **params))
    together = await asyncio.gather(collect(engine, "Hello there", **params),
                                    *(collect(engine, p, max_new_tokens=40, seed=i, stop_on_eos=False)
                                      for i, p in enumerate(["abc", "xyz", "q"])))
    assert token_ids(together[0]) == alone and len(set(alone)) > 5


async def test_the_cache_is_sized_by_key_value_heads_and_the_backend_says_why(
    lively_llama: Checkpoint, tmp_path: Path
) -> None:
    engine = Engine(lively_llama, EngineConfig(device="cpu", max_seqs=3))
    info = engine.info()
    assert info["backend"]["name"] == "torch" and "GPT-2 family only" in info["backend"]["reason"]
    assert engine.runner.cache.layers[0].k.shape == (3, 2, 32, 8)  # 2 key/value heads, not 4
    with pytest.raises(ValueError, match="backend native cannot run here: its kernels cover the GPT-2"):
        Engine(lively_llama, EngineConfig(device="cpu", backend="native"))
