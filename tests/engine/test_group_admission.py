"""Groups of choices (n, best_of) and the queue: no head-of-line blocking, no starvation, no ping-pong.

Three clients each time: one holding slots with long streams, one asking for a group of choices,
one more. A group that does not fit is passed by requests that do; past max_group_wait_s it takes
its slots by preemption; a client waiting with no slot gets as many as its group needs.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace

from nanoserve.engine import admission
from nanoserve.engine.engine import Engine
from nanoserve.engine.stream import GenerationStream
from nanoserve.engine.types import FinishReason, SamplingParams, TokenEvent
from tests.engine.conftest import EngineFactory, token_ids
from tests.engine.test_choices import PROMPT, _drain
from tests.engine.test_scheduling import wait_for

ENDLESS = SamplingParams(max_new_tokens=10_000, temperature=1.0, seed=3, stop_on_eos=False)
CHECKED = 300  # tokens of a preempted stream compared with the same stream alone
SHORT = SamplingParams(max_new_tokens=4, temperature=1.0, seed=5, stop_on_eos=False)
SERVED_S = 20.0  # on a free host each is served in well under a second


async def _started(engine: Engine, client: str, count: int) -> list[GenerationStream]:
    """`count` endless streams of `client`, each past its first token."""
    streams = [await engine.generate("Hello", ENDLESS, client=client) for _ in range(count)]
    for stream in streams:
        await stream.__anext__()
    return streams


async def _alone(engine: Engine) -> list[int]:
    """The tokens after the first that an endless stream draws alone, CHECKED of them."""
    params = replace(ENDLESS, max_new_tokens=CHECKED + 1)
    return token_ids([e async for e in await engine.generate("Hello", params)])[1:]


async def _next_tokens(stream: GenerationStream, count: int) -> list[int]:
    tokens = [(await stream.__anext__()).token_id for _ in range(count)]
    await stream.aclose()
    return [t for t in tokens if t is not None]


async def test_a_group_that_does_not_fit_is_passed_by_a_request_that_does(make_engine: EngineFactory) -> None:
    engine = make_engine(max_seqs=3)  # max_group_wait_s at its default: no ageing within this test
    (held,) = await _started(engine, "a", 1)
    group = await engine.generate_choices(PROMPT, SHORT, 3, client="b")  # 2 slots free of 3
    await asyncio.sleep(0.05)
    # c's request takes a free slot and ends while b's group still waits for a's stream.
    other = await engine.generate("abc", SHORT, client="c")
    events = await asyncio.wait_for(_events_of(other), SERVED_S)
    assert events[-1].finish_reason is FinishReason.LENGTH
    assert engine.stats().waiting == 1 and engine.scheduler.preemptions == 0
    await held.aclose()  # then the group fits
    assert all(len(tokens) == 4 for tokens in await asyncio.wait_for(_drain(group), SERVED_S))


async def test_a_group_past_its_wait_takes_its_slots_and_its_victim_keeps_its_tokens(
    make_engine: EngineFactory,
) -> None:
    alone = await _alone(make_engine(max_seqs=1))
    engine = make_engine(max_seqs=3, max_group_wait_s=0.3)
    (held,) = await _started(engine, "a", 1)
    group = await engine.generate_choices(PROMPT, SHORT, 3, client="b")
    # a's endless stream steps aside for the group after 0.3 s.
    got = await asyncio.wait_for(_drain(group), SERVED_S)
    assert [len(tokens) for tokens in got] == [4, 4, 4]
    # Once the group's prompt is shared, a (waiting with no slot) takes one of its choices' slots
    # back: two preemptions, then a stable state.
    assert engine.scheduler.preemptions == 2
    # The preempted stream went on drawing the same tokens.
    assert await asyncio.wait_for(_next_tokens(held, CHECKED), SERVED_S) == alone


async def test_an_aged_group_is_not_overtaken(make_engine: EngineFactory) -> None:
    # The group cannot fit even by preemption while a's group has not shared its prompt (its
    # choices then do not yield): a request of c arriving behind it waits too.
    engine = make_engine(max_seqs=3, max_group_wait_s=0.0)
    with engine._cond:  # the engine thread waits: a's group is seated, its prefill not yet run
        first = await engine.generate_choices(PROMPT, ENDLESS, 2, client="a")
        engine.scheduler.admit(engine._waiting.pop_fair([]), 0.0)
        group = await engine.generate_choices(PROMPT, SHORT, 3, client="b")
        other = await engine.generate("abc", SHORT, client="c")
        admission.admit(engine._waiting, engine.scheduler, 1e9, engine.config.max_group_wait_s)
        assert engine.stats().waiting == 2 and len(engine.scheduler.free_slots) == 1  # kept for b
    # Once a's prompt is shared, a's choices yield to b's group, then c is served.
    assert all(len(t) == 4 for t in await asyncio.wait_for(_drain(group), SERVED_S))
    assert (await asyncio.wait_for(_events_of(other), SERVED_S))[-1].finish_reason is FinishReason.LENGTH
    for stream in first:
        await stream.aclose()


async def test_a_client_with_no_slot_gets_every_slot_its_group_needs(make_engine: EngineFactory) -> None:
    # a fills every slot; b asks for two choices and c for one: b is served at once (two of a's
    # newest streams step aside together), then c (one more, of whoever holds the most then):
    # three preemptions and no more, however long a's streams run.
    alone = await _alone(make_engine(max_seqs=1))
    engine = make_engine(max_seqs=4)
    held = await _started(engine, "a", 4)
    # b's choices run 64 tokens: still running when c comes (else c would find their slots free).
    group = await engine.generate_choices(PROMPT, replace(SHORT, max_new_tokens=64), 2, client="b")
    await wait_for(lambda: engine.scheduler.preemptions == 2)
    other = await engine.generate("abc", SHORT, client="c")
    got = await asyncio.wait_for(_drain(group), SERVED_S)
    assert [len(tokens) for tokens in got] == [64, 64]
    assert (await asyncio.wait_for(_events_of(other), SERVED_S))[-1].finish_reason is FinishReason.LENGTH
    assert engine.scheduler.preemptions == 3
    for stream in held:
        assert await asyncio.wait_for(_next_tokens(stream, CHECKED), SERVED_S) == alone
    assert engine.scheduler.preemptions == 3  # no ping-pong: a's streams were not preempted again


async def _events_of(stream: GenerationStream) -> list[TokenEvent]:
    return [e async for e in stream]
