"""Several choices of one prompt (n > 1, best_of): one prefill shared, each choice its own seed."""

from __future__ import annotations

import asyncio

import pytest

from nanoserve.engine.stream import GenerationStream
from nanoserve.engine.types import FinishReason, InvalidRequest, SamplingParams, TokenEvent
from tests.engine.conftest import EngineFactory, collect, token_ids
from tests.engine.test_scheduling import wait_for
from tests.faults import injected_faults

PROMPT = "the quick brown fox jumps over"


async def _events(streams: list[GenerationStream]) -> list[list[TokenEvent]]:
    async def one(stream: GenerationStream) -> list[TokenEvent]:
        return [event async for event in stream]

    return list(await asyncio.gather(*(one(s) for s in streams)))


async def _drain(streams: list[GenerationStream]) -> list[list[int]]:
    return [token_ids(events) for events in await _events(streams)]


async def test_choice_i_draws_what_seed_plus_i_draws_alone(make_engine: EngineFactory) -> None:
    engine = make_engine(max_seqs=4)
    params = SamplingParams(max_new_tokens=12, temperature=1.0, seed=1234, stop_on_eos=False)
    choices = await _drain(await engine.generate_choices(PROMPT, params, 3))
    alone = [token_ids(await collect(engine, PROMPT, max_new_tokens=12, temperature=1.0, seed=1234 + i,
                                     stop_on_eos=False)) for i in range(3)]
    assert choices == alone
    assert len({tuple(c) for c in choices}) > 1  # different seeds: the choices differ


async def test_the_prompt_is_prefilled_once(make_engine: EngineFactory) -> None:
    engine = make_engine(max_seqs=4)
    prompt = engine.encode(PROMPT)
    before = engine.stats().extra
    params = SamplingParams(max_new_tokens=3, temperature=0.7, seed=5)
    await _drain(await engine.generate_choices(prompt, params, 4))
    after = engine.stats().extra
    # The leader feeds the prompt; each of the other three feeds only its last token.
    prefilled = after["prefill_tokens_total"] - before["prefill_tokens_total"]
    assert prefilled == len(prompt) + 3
    shared = after["prefill_tokens_shared_total"] - before["prefill_tokens_shared_total"]
    assert shared == 3 * (len(prompt) - 1)


async def test_cancelling_every_choice_frees_every_slot(make_engine: EngineFactory) -> None:
    engine = make_engine(max_seqs=3)
    params = SamplingParams(max_new_tokens=10_000, temperature=1.0, seed=1)
    streams = await engine.generate_choices(PROMPT, params, 3)
    for stream in streams:
        assert (await stream.__anext__()).token_id is not None
    assert engine.stats().slots_used == 3
    for stream in streams:
        await stream.aclose()
    await wait_for(lambda: engine.stats().slots_used == 0)
    events = await collect(engine, "abc", max_new_tokens=2, temperature=0.0)
    assert events[-1].finish_reason is FinishReason.LENGTH


async def test_a_group_waits_for_all_its_slots_and_a_cancelled_leader_is_replaced(
    make_engine: EngineFactory,
) -> None:
    engine = make_engine(max_seqs=3)
    blocker = await engine.generate("abc", SamplingParams(max_new_tokens=10_000, temperature=0.0))
    await blocker.__anext__()
    params = SamplingParams(max_new_tokens=5, temperature=1.0, seed=77, stop_on_eos=False)
    leader, *rest = await engine.generate_choices(PROMPT, params, 3)
    await asyncio.sleep(0.05)
    assert engine.stats().waiting == 1 and engine.stats().slots_used == 1  # 2 free slots < 3
    await leader.aclose()  # the first follower leads the rest; the group now fits
    got = await _drain(rest)
    alone = [token_ids(await collect(engine, PROMPT, max_new_tokens=5, temperature=1.0, seed=77 + i,
                                     stop_on_eos=False)) for i in (1, 2)]
    assert got == alone
    await blocker.aclose()
    await wait_for(lambda: engine.stats().slots_used == 0)


async def test_a_follower_prefills_alone_when_its_leader_ends_first(make_engine: EngineFactory) -> None:
    engine = make_engine(max_seqs=2)
    params = SamplingParams(max_new_tokens=4, temperature=1.0, seed=9, stop_on_eos=False)
    shared_before = engine.stats().extra["prefill_tokens_shared_total"]
    with engine._cond:  # the engine thread waits: admit the group, then end its leader before its prefill
        leader, follower = await engine.generate_choices(PROMPT, params, 2)
        engine.scheduler.admit(engine._waiting.pop_fair([]), 0.0)
        leader._request.cancelled = True
    assert [e async for e in leader][-1].finish_reason is FinishReason.CANCELLED
    events = [e async for e in follower]
    alone = await collect(engine, PROMPT, max_new_tokens=4, temperature=1.0, seed=10, stop_on_eos=False)
    assert token_ids(events) == token_ids(alone)
    assert engine.stats().extra["prefill_tokens_shared_total"] == shared_before  # nothing was shared
    await wait_for(lambda: engine.stats().slots_used == 0)


async def test_a_failing_prompt_fails_every_choice_and_frees_every_slot(
    make_engine: EngineFactory,
) -> None:
    with injected_faults("raise:POISON"):
        engine = make_engine(max_seqs=3)
    params = SamplingParams(max_new_tokens=4, temperature=1.0)
    finals = [events[-1] for events in await _events(await engine.generate_choices("POISON abc", params, 3))]
    assert all(f.finish_reason is FinishReason.ERROR and "injected fault" in (f.error or "") for f in finals)
    await wait_for(lambda: engine.stats().slots_used == 0)
    events = await collect(engine, "abc", max_new_tokens=2, temperature=0.0)
    assert events[-1].finish_reason is FinishReason.LENGTH


async def test_more_choices_than_slots_is_refused(make_engine: EngineFactory) -> None:
    engine = make_engine(max_seqs=2)
    with pytest.raises(InvalidRequest) as info:
        await engine.generate_choices(PROMPT, SamplingParams(max_new_tokens=2), 3)
    assert info.value.param == "n"
