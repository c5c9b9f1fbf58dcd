"""The engine serves a Llama-family model (RMSNorm, SwiGLU, rotary positions, grouped-query
attention, untied output) as it serves GPT-2, on every backend: greedy equal to the reference,
batched and alone, past the window (a context shift re-prefills the kept tokens at positions from
0, as the reference recomputes them)."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch

from nanoserve.engine import native_step
from nanoserve.engine.config import TILE_ISAS, EngineConfig
from nanoserve.engine.engine import Engine
from nanoserve.model.checkpoint import Checkpoint, load_checkpoint, save_checkpoint
from nanoserve.model.config import GPTConfig
from nanoserve.model.gpt import GPT
from nanoserve.model.reference import reference_generate
from nanoserve.model.tokenizer import CharTokenizer
from tests.conftest import TINY_VOCAB_TEXT
from tests.engine.conftest import EngineFactory, collect, token_ids
from tests.engine.test_native_step import _bf16_inputs, _rounded

# Key/value heads per model: grouped-query (two query heads each), multi-query (one for all four),
# multi-head; untied and tied output layers, with and without biases, an MLP width of 40 (not whole
# panels of the native step's kernels).
VARIANTS = {
    "gqa untied": dict(n_kv_head=2, bias=False, tie_embeddings=False),
    "mqa tied": dict(n_kv_head=1, bias=True, tie_embeddings=True, mlp_hidden=40),
    "mha tied": dict(n_kv_head=4, bias=False, tie_embeddings=True),
}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def lively_llama(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Checkpoint:
    tok = CharTokenizer.train(TINY_VOCAB_TEXT)
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=tok.vocab_size, block_size=32, n_layer=2, n_head=4, n_embd=32,
                       norm="rmsnorm", mlp="swiglu", positions="rope", **VARIANTS[request.param])
    model = GPT(config)
    with torch.no_grad():  # sharp, context-dependent predictions (tests/engine/conftest.py)
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(6.0)
    path = tmp_path_factory.mktemp("llama") / "ckpt"
    return load_checkpoint(save_checkpoint(path, model, tok, name="lively-llama"))


def reference(ckpt: Checkpoint, prompt: str, n: int, policy: str) -> list[int]:
    return reference_generate(ckpt.build_model("cpu"), ckpt.tokenizer.encode(prompt), n, policy=policy)


@pytest.mark.parametrize("policy", ["shift", "sliding"])
async def test_greedy_matches_reference_past_the_window(
    make_engine: EngineFactory, lively_llama: Checkpoint, policy: str, backend: str
) -> None:
    engine = make_engine(lively_llama, crop_policy=policy, max_seqs=2, prefill_budget=16)
    assert engine.info()["backend"]["name"] == backend.partition("-")[0]
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


# Each one and 40 tokens outgrow the window of 32: the context is shifted on the way.
PROMPTS = ("hello wor", "The quick brown", "~~ 42 ~~", "To be, or not to be: that is")
GREEDY = dict(max_new_tokens=40, temperature=0.0, stop_on_eos=False)


@pytest.mark.backends("native")
async def test_a_bfloat16_engine_decodes_natively_as_float32_does_with_its_weights(
    make_engine: EngineFactory, lively_llama: Checkpoint
) -> None:
    """dtype bfloat16 on the native step, kernels up to avx512 (linear inputs kept in float32):
    greedy as the float32 engine given the same bf16-rounded weights (the bf16 cache's rounding is
    the only difference, too small to move these sharp argmaxes), past the window too."""
    low = make_engine(lively_llama, max_seqs=4, dtype="bfloat16", native_isa="avx512")
    full = make_engine(_rounded(lively_llama), max_seqs=4, backend="torch")
    backend = low.info()["backend"]
    assert backend["name"] == "native" and backend["kernels"] in ("c", "avx2", "avx512")
    assert low.runner.cache.layers[0].k.dtype == torch.bfloat16  # type: ignore[union-attr]
    for prompt in PROMPTS:
        want = token_ids(await collect(full, prompt, **GREEDY))
        got = token_ids(await collect(low, prompt, **GREEDY))
        assert got == want, prompt


@pytest.mark.backends("native")
async def test_a_bfloat16_engine_on_bf16_dot_products_decodes_as_float32_does_with_its_inputs_rounded(
    make_engine: EngineFactory, lively_llama: Checkpoint
) -> None:
    """On a tile level (AVX512-BF16 or AMX) the linear layers' inputs are rounded to bf16 too: the
    float32 engine on the same rounded weights gives the same greedy tokens when its linear layers
    round their inputs (where no two tokens are nearer than bf16's error: the fourth prompt meets
    such a near tie, which either side may take)."""
    low = make_engine(lively_llama, max_seqs=4, dtype="bfloat16")
    if (runs := low.info()["backend"]["kernels"]) not in TILE_ISAS:
        pytest.skip(f"this CPU has no AVX512-BF16 nor AMX (the native step runs {runs})")
    full = make_engine(_rounded(lively_llama), max_seqs=4, backend="torch")
    with _bf16_inputs(full.model, True) as hooks:
        assert len(hooks) == 4 * lively_llama.config.n_layer + 1
        for prompt in PROMPTS[:3]:
            want = token_ids(await collect(full, prompt, **GREEDY))
            got = token_ids(await collect(low, prompt, **GREEDY))
            assert got == want, prompt


@pytest.mark.usefixtures("native_library")
def test_the_cache_is_sized_by_key_value_heads_and_the_native_backend_serves_the_family(
    lively_llama: Checkpoint,
) -> None:
    engine = Engine(lively_llama, EngineConfig(device="cpu", max_seqs=3))
    info = engine.info()
    assert info["backend"]["name"] == "native", info["backend"]
    kv = lively_llama.config.kv_heads
    assert engine.runner.cache.layers[0].k.shape == (3, kv, 32, 8)  # key/value heads, not query heads


@pytest.mark.usefixtures("native_library")
def test_a_family_choice_the_kernels_lack_falls_back_to_torch_and_says_which(
    lively_llama: Checkpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    # As a library without rotary positions would be: the factory asks family_unsupported.
    monkeypatch.setattr(native_step, "FAMILY_CHOICES", ("layernorm", "rmsnorm", "gelu", "swiglu", "learned"))
    backend = Engine(lively_llama, EngineConfig(device="cpu", max_seqs=2)).info()["backend"]
    why = "its kernels have no positions 'rope'"
    assert backend["name"] == "torch" and why in backend["reason"]
    with pytest.raises(ValueError, match=f"backend native cannot run here: {why}"):
        Engine(lively_llama, EngineConfig(device="cpu", backend="native"))
