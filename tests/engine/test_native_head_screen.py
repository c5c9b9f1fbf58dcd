"""The screened output layer (nanoserve/engine/native/head_screen.inc): a float32 model's rows that
read only their k largest logits get exactly the unscreened k largest, in the same order and bit
for bit, and every other logit below them; through the engine, the same tokens."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch
from torch import nn

from nanoserve.engine.engine import Engine
from nanoserve.engine.kv_slots import SpanKVCache
from nanoserve.engine.native_step import NativeStep
from nanoserve.engine.types import TokenEvent
from nanoserve.model.checkpoint import Checkpoint
from nanoserve.model.config import GPTConfig
from nanoserve.model.gpt import GPT
from tests.engine.conftest import EngineFactory, collect, token_ids

pytestmark = [pytest.mark.usefixtures("native_library"), pytest.mark.backends("native")]

SLOTS = 6


def _model(vocab: int, n_embd: int, scale: float, head_bias: bool = False, seed: int = 0) -> GPT:
    """A float32 model whose logits are sharp (scale 4: clear tops) or nearly flat (scale 1, GPT-2's
    init: many logits within the bf16 error bound of the k-th largest)."""
    torch.manual_seed(seed)
    model = GPT(GPTConfig(vocab_size=vocab, block_size=32, n_layer=2, n_head=4, n_embd=n_embd)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(scale)
        if head_bias:  # an untied output layer with a bias: the bias term of the bound, and its add
            model.lm_head = nn.Linear(n_embd, vocab, bias=True)
            model.lm_head.weight.normal_(0, 0.02 * scale)
            model.lm_head.bias.normal_(0, 0.5)
    return model


def _steps(model: GPT, usable: int = 0) -> tuple[NativeStep, NativeStep]:
    """The unscreened step and the screened one, each on its own cache."""
    cfg = model.config

    def step(screen: int) -> NativeStep:
        cache = SpanKVCache(cfg.n_layer, SLOTS, cfg.kv_heads, cfg.block_size, cfg.head_dim, torch.float32,
                            "cpu")
        return NativeStep(model, cache, max_threads=2, max_rows=32, screen_usable=screen)

    plain, screened = step(0), step(usable or cfg.vocab_size)
    if not screened.screening:
        pytest.skip("this CPU has no AVX512-BF16: the output layer is never screened here")
    return plain, screened


def _rows(vocab: int, n: int = SLOTS, seed: int = 3) -> tuple[list[int], list[int], list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=gen).tolist(), [0] * n, list(range(n))


def _check_top(plain: torch.Tensor, screened: torch.Tensor, k: int, usable: int) -> None:
    """Row by row: the k largest usable logits are the same ids, the same order, the same bits;
    every other usable screened logit is below the k-th largest."""
    for r in range(plain.shape[0]):
        want_v, want_i = plain[r, :usable].topk(k)
        got_v, got_i = screened[r, :usable].topk(k)
        assert torch.equal(got_i, want_i), r
        assert torch.equal(got_v.view(torch.int32), want_v.view(torch.int32)), r
        rest = torch.ones(usable, dtype=torch.bool)
        rest[want_i] = False
        assert bool((screened[r, :usable][rest] < want_v[-1]).all()), r


@pytest.mark.parametrize(("vocab", "n_embd", "scale"), [(1000, 64, 1.0), (1000, 64, 4.0), (517, 40, 1.0)])
@pytest.mark.parametrize("k", [1, 2, 40, 256])
@torch.no_grad()
def test_the_k_largest_logits_are_the_unscreened_ones_bit_for_bit(vocab: int, n_embd: int, scale: float,
                                                                   k: int) -> None:
    model = _model(vocab, n_embd, scale)
    plain, screened = _steps(model)
    for position in range(3):  # decode steps: each row one more token of its own sequence
        tokens, _, slots = _rows(vocab, seed=position)
        positions = [position] * SLOTS
        want = plain(tokens, positions, slots)
        got = screened(tokens, positions, slots, screen=[k] * SLOTS)
        _check_top(want, got, k, vocab)
        # Screening is real: the other logits are the bf16 product, not the float32 one.
        assert not torch.equal(got, want)


@torch.no_grad()
def test_a_biased_untied_output_layer_and_unusable_ids() -> None:
    model = _model(700, 64, 1.0, head_bias=True)
    usable = 650  # ids from 650 on (nanoGPT's padding) are never screened in
    plain, screened = _steps(model, usable=usable)
    tokens, positions, slots = _rows(700)
    for k in (1, 40):
        _check_top(plain(tokens, positions, slots), screened(tokens, positions, slots, screen=[k] * SLOTS), k,
                   usable)


@torch.no_grad()
def test_rows_that_read_every_logit_or_too_many_are_not_screened() -> None:
    """A step with any row of k 0 (logprobs, a draw without top_k), or k over the library's 256, is
    computed whole for every row; so is a row whose logits are all equal (every one a candidate)."""
    model = _model(5000, 32, 1.0)
    plain, screened = _steps(model)
    tokens, positions, slots = _rows(5000)
    want = plain(tokens, positions, slots)
    for screen in ([40, 0, 40, 40, 40, 40], [257] * SLOTS):
        got = screened(tokens, positions, slots, screen=screen)
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), screen
    with torch.no_grad():
        model.lm_head.weight.copy_(model.lm_head.weight[:1].expand_as(model.lm_head.weight))  # tied: also wte
    flat_plain, flat_screened = _steps(model)
    want = flat_plain(tokens, positions, slots)
    got = flat_screened(tokens, positions, slots, screen=[5] * SLOTS)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


@torch.no_grad()
def test_a_row_of_non_finite_logits_is_computed_whole() -> None:
    model = _model(1000, 64, 1.0)
    with torch.no_grad():
        model.wte.weight[7] = float("nan")
    plain, screened = _steps(model)
    tokens, positions, slots = [7, 8], [0, 0], [0, 1]
    want = plain(tokens, positions, slots)
    got = screened(tokens, positions, slots, screen=[40, 40])
    assert bool(want[0].isnan().all()) and bool(got[0].isnan().all())
    _check_top(want[1:], got[1:], 40, 1000)


@pytest.mark.parametrize("isa", ["avx2", "c"])
@torch.no_grad()
def test_below_the_avx512_level_nothing_is_screened(isa: str) -> None:
    """head_screen.inc reproduces the AVX-512 level's float32 sums: at other levels the screen is
    ignored and the logits are that level's own."""
    model = _model(1000, 64, 1.0)
    plain, screened = _steps(model)
    if plain.use_isa(isa) != isa or screened.use_isa(isa) != isa:
        pytest.skip(f"this CPU has no {isa} level")
    tokens, positions, slots = _rows(1000)
    want = plain(tokens, positions, slots)
    got = screened(tokens, positions, slots, screen=[40] * SLOTS)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


async def test_the_engine_draws_the_same_tokens_screened_or_not(make_engine: EngineFactory,
                                                                lively: Checkpoint) -> None:
    """Greedy and top-k draws, alone and beside rows that are not screenable (top_p alone,
    logprobs), give the same tokens with the screen on and off."""
    screened = make_engine(max_seqs=4, screen_head=True)
    plain = make_engine(max_seqs=4, screen_head=False)
    if not screened.info()["backend"].get("screened_head"):
        pytest.skip("this CPU has no AVX512-BF16: the output layer is never screened here")
    assert plain.info()["backend"]["screened_head"] is False
    asks = [
        {"temperature": 0.0},
        {"temperature": 1.0, "top_k": 5, "seed": 11},
        {"temperature": 0.7, "top_k": 2, "top_p": 0.9, "seed": 12},
        {"temperature": 1.0, "top_p": 0.8, "seed": 13},
        {"temperature": 1.0, "top_k": 3, "logprobs": True, "seed": 14},
    ]
    for batch in (asks[:3], asks):  # all screenable; then mixed with rows that are not
        runs = []
        for engine in (screened, plain):
            events = await _together(engine, batch)
            runs.append([token_ids(e) for e in events])
        assert runs[0] == runs[1]
        assert all(len(ids) == 12 for ids in runs[0])


async def _together(engine: Engine, asks: list[dict[str, Any]]) -> list[list[TokenEvent]]:
    prompt = [1, 2, 3, 4, 5]
    return list(await asyncio.gather(*(collect(engine, prompt, max_new_tokens=12, stop_on_eos=False, **a)
                                       for a in asks)))


@torch.no_grad()
def test_a_logit_that_bf16_ranks_second_is_still_found() -> None:
    """The error bound at its worst: x and token A's weights all round down to bf16 by ~2^-8 (the
    products lose ~2 x 2^-8 together), token B's are exact in bf16 and smaller in float32. bf16 ranks
    B first; float32 ranks A first, and so must the screened row. (A is found when its bound and
    B's together cover the gap, so this case misses A once the bound is below ~22% of the right one.)"""
    model = _model(64, 64, 1.0)
    a = 1 + 2**-8 - 2**-12  # just below the midpoint between 1 and 1 + 2^-7: rounds to 1
    model.ln_f.weight.zero_()  # the final norm gives its bias, whatever the input: x = a everywhere
    model.ln_f.bias.fill_(a)
    model.wte.weight[3] = a  # tied: the output layer's row of token A
    model.wte.weight[5, :29], model.wte.weight[5, 29:] = 1 + 2**-7, 1.0  # token B, exact in bf16
    x, w = model.ln_f.bias, model.lm_head.weight
    assert int((w.bfloat16().float() @ x.bfloat16().float()).argmax()) == 5  # bf16's pick: B
    assert int((w.double() @ x.double()).argmax()) == 3  # the true one: A
    plain, screened = _steps(model)
    tokens, positions, slots = _rows(64)
    want = plain(tokens, positions, slots)
    got = screened(tokens, positions, slots, screen=[1] * SLOTS)
    assert want.argmax(dim=1).tolist() == [3] * SLOTS
    _check_top(want, got, 1, 64)


@torch.no_grad()
def test_more_logit_rows_than_slots_are_computed_whole() -> None:
    """A screened step's logit rows are one per sequence; a call asking for more (every row of two
    prompt chunks) than the cache has slots is computed whole."""
    model = _model(1000, 64, 1.0)
    plain, screened = _steps(model)
    tokens = _rows(1000, n=8)[0]
    positions, slots = [0, 1, 2, 3] * 2, [0] * 4 + [1] * 4
    want = plain(tokens, positions, slots)
    got = screened(tokens, positions, slots, screen=[40] * 8)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
