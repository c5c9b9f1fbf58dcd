"""OpenAI's logit_bias, on every backend (make_engine runs each test once per backend: the native
step's sampler, nanoserve/model/sampling.py's torch sampler, and torch on CUDA where present); greedy and
sampled rows; and its validation."""

from __future__ import annotations

import pytest

from nanoserve.engine.types import InvalidRequest, SamplingParams
from nanoserve.engine.validation import validate_params
from tests.engine.conftest import EngineFactory, collect, token_ids


async def test_a_bias_bans_or_forces_tokens(make_engine: EngineFactory) -> None:
    engine = make_engine()
    free = token_ids(await collect(engine, "Hello", max_new_tokens=8, temperature=0.0, stop_on_eos=False))
    # Greedy: banning the first pick changes it; the rest of the vocabulary is untouched.
    banned = token_ids(await collect(engine, "Hello", max_new_tokens=8, temperature=0.0, stop_on_eos=False,
                                     logit_bias=((free[0], -100.0),)))
    assert banned[0] != free[0] and free[0] not in banned
    # Sampled (the native sampler's rows, where there is one): +100 leaves nothing else to draw.
    forced = 7 if free[0] != 7 else 8
    for seed in range(3):
        out = token_ids(await collect(engine, "Hello", max_new_tokens=6, temperature=1.0, seed=seed,
                                      top_p=0.9, stop_on_eos=False, logit_bias=((forced, 100.0),)))
        assert out == [forced] * 6
    # A sampled row beside an unbiased one in the same steps: each keeps its own logits.
    biased, plain = await collect_both(engine, free[0])
    assert free[0] not in biased and plain == free


async def collect_both(engine, token: int) -> tuple[list[int], list[int]]:  # type: ignore[no-untyped-def]
    import asyncio

    a, b = await asyncio.gather(
        collect(engine, "Hello", max_new_tokens=8, temperature=0.8, seed=1, stop_on_eos=False,
                logit_bias=((token, -100.0),)),
        collect(engine, "Hello", max_new_tokens=8, temperature=0.0, stop_on_eos=False),
    )
    return token_ids(a), token_ids(b)


@pytest.mark.parametrize(("bias", "says"), [
    (((70000, 1.0),), "not in this model's vocabulary"),
    (((-1, 1.0),), "not in this model's vocabulary"),
    (((3, 101.0),), "logit_bias must be in"),
    (((3, float("nan")),), "finite"),
])
def test_bad_biases_are_refused_naming_the_field(bias: tuple[tuple[int, float], ...], says: str) -> None:
    with pytest.raises(InvalidRequest, match=says) as info:
        validate_params(SamplingParams(logit_bias=bias), vocab_size=96)
    assert info.value.param == "logit_bias"
