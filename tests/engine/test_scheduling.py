"""Admission, cancellation, overload, deadlines, shutdown, observer hooks, engine introspection,
and how many prompt rows a step carries beside decoding rows."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from nanoserve.engine.config import EngineConfig
from nanoserve.engine.inbox import Inbox
from nanoserve.engine.request import Request
from nanoserve.engine.scheduler import Scheduler
from nanoserve.engine.step_cost import DECODE_SHARE, StepCost
from nanoserve.engine.step_plan import StepOutput
from nanoserve.engine.types import (
    FinishReason,
    InvalidRequest,
    NotReady,
    Overloaded,
    PromptTooLong,
    SamplingParams,
    Usage,
)
from nanoserve.model.checkpoint import Checkpoint
from nanoserve.model.reference import reference_generate
from nanoserve.model.tokenizer import CharTokenizer
from tests.engine.conftest import EngineFactory, collect


async def wait_for(predicate, timeout: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    end = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < end, "condition not reached in time"
        await asyncio.sleep(0.005)


async def test_cancel_frees_the_slot_within_a_step(make_engine: EngineFactory) -> None:
    engine = make_engine(max_seqs=1)
    stream = await engine.generate("Hello", SamplingParams(max_new_tokens=10_000, temperature=0.0))
    first = await stream.__anext__()
    assert first.token_id is not None
    assert engine.stats().slots_used == 1
    steps_at_cancel = engine.stats().steps
    await stream.aclose()
    await wait_for(lambda: engine.stats().slots_used == 0)
    # Freed at the start of the next step at the latest (one step may have been in flight).
    assert engine.stats().steps <= steps_at_cancel + 2
    # The freed slot is immediately usable.
    events = await collect(engine, "abc", max_new_tokens=3, temperature=0.0)
    assert events[-1].finish_reason is FinishReason.LENGTH


async def test_cancelling_the_consumer_task_cancels_the_request(make_engine: EngineFactory) -> None:
    engine = make_engine(max_seqs=1)
    stream = await engine.generate("Hello", SamplingParams(max_new_tokens=10_000, temperature=0.0))

    async def consume() -> None:
        async for _ in stream:
            pass

    task = asyncio.create_task(consume())
    await wait_for(lambda: engine.stats().running == 1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await wait_for(lambda: engine.stats().slots_used == 0)


async def test_queue_overflow_raises_overloaded_before_returning(make_engine: EngineFactory) -> None:
    rejected: list[str] = []

    class Obs:
        def on_step(self, duration_s: float, batch_size: int, prefill_tokens: int) -> None: ...
        def on_finish(self, reason: FinishReason, usage: Usage) -> None: ...
        def on_rejected(self, reason: str) -> None:
            rejected.append(reason)

    engine = make_engine(max_seqs=1, max_queue=2, observer=Obs())
    long = SamplingParams(max_new_tokens=10_000, temperature=0.0)
    running = await engine.generate("a", long)
    await wait_for(lambda: engine.stats().running == 1)
    queued = [await engine.generate("b", long), await engine.generate("c", long)]
    assert engine.stats().waiting == 2
    with pytest.raises(Overloaded) as err:
        await engine.generate("d", long)
    assert err.value.retry_after_s > 0
    assert rejected == ["overloaded"]
    for s in (running, *queued):
        await s.aclose()
    await wait_for(lambda: engine.stats().running == 0 and engine.stats().waiting == 0)


async def test_long_prompt_cropped_or_rejected(make_engine: EngineFactory) -> None:
    engine = make_engine()
    stream = await engine.generate("x" * 50, SamplingParams(max_new_tokens=1, temperature=0.0))
    assert (stream.prompt_tokens, stream.cropped_tokens) == (32, 18)
    await stream.aclose()
    strict = make_engine(reject_long_prompts=True)
    with pytest.raises(PromptTooLong) as err:
        await strict.generate("x" * 50, SamplingParams(max_new_tokens=1))
    assert (err.value.prompt_tokens, err.value.max_tokens) == (50, 32)
    # `truncate` is the request's own, explicit crop: allowed even when long prompts are rejected.
    events = await collect(strict, "x" * 50, max_new_tokens=1, truncate=10, temperature=0.0)
    assert events[-1].usage is not None and events[-1].usage.cropped_tokens == 40


@pytest.mark.parametrize(
    ("params", "param"),
    [
        (dict(temperature=-1.0), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(top_n_tokens=1000), "top_n_tokens"),
        (dict(stop=("",)), "stop"),
        (dict(seed=-5), "seed"),
    ],
)
async def test_invalid_params_name_the_parameter(
    make_engine: EngineFactory, params: dict[str, object], param: str
) -> None:
    engine = make_engine()
    with pytest.raises(InvalidRequest) as err:
        await engine.generate("a", SamplingParams(**params))  # type: ignore[arg-type]
    assert err.value.param == param and param in str(err.value)


async def test_unrepresentable_text_is_an_invalid_request(make_engine: EngineFactory) -> None:
    engine = make_engine()
    with pytest.raises(InvalidRequest, match="U\\+00E9"):
        await engine.generate("caf\u00e9", SamplingParams())
    with pytest.raises(InvalidRequest, match="token id"):
        await engine.generate([1, 999], SamplingParams())


async def test_deadline_ends_a_running_request(make_engine: EngineFactory) -> None:
    engine = make_engine()
    events = await collect(engine, "a", max_new_tokens=100_000, temperature=0.0, deadline_s=0.3)
    assert events[-1].finish_reason is FinishReason.LENGTH
    assert 0 < len(events) < 100_000


async def test_shutdown_drains_then_fails_the_rest(make_engine: EngineFactory) -> None:
    engine = make_engine(max_seqs=2)
    short = await engine.generate("a", SamplingParams(max_new_tokens=5, temperature=0.0))
    endless = await engine.generate("b", SamplingParams(max_new_tokens=1_000_000, temperature=0.0))
    await engine.shutdown(drain_timeout=0.5)
    short_events = [e async for e in short]
    endless_events = [e async for e in endless]
    assert short_events[-1].finish_reason is FinishReason.LENGTH
    assert endless_events[-1].finish_reason is FinishReason.ERROR and endless_events[-1].error
    assert not engine.health() and not engine.ready
    with pytest.raises(NotReady):
        await engine.generate("c", SamplingParams())


async def test_warmup_ready_stats_info_and_observer(make_engine: EngineFactory, lively: Checkpoint) -> None:
    steps: list[tuple[float, int, int]] = []
    finished: list[FinishReason] = []

    class Obs:
        def on_step(self, duration_s: float, batch_size: int, prefill_tokens: int) -> None:
            steps.append((duration_s, batch_size, prefill_tokens))

        def on_finish(self, reason: FinishReason, usage: Usage) -> None:
            finished.append(reason)

        def on_rejected(self, reason: str) -> None: ...

    engine = make_engine(observer=Obs(), max_seqs=3)
    assert engine.health() and not engine.ready
    await engine.warmup()
    assert engine.ready
    steps.clear()
    finished.clear()
    events = await collect(engine, "Hello", max_new_tokens=4, temperature=0.0)
    assert events[-1].usage is not None and events[-1].usage.generated_tokens == 4
    assert finished == [FinishReason.LENGTH]
    assert steps[0][1:] == (1, 5)  # the first step prefilled the 5 prompt tokens
    assert all(d > 0 and b == 1 and p == 0 for d, b, p in steps[1:])
    stats = engine.stats()
    assert (stats.slots_total, stats.running, stats.waiting) == (3, 0, 0)
    assert stats.kv_cache_bytes == engine.runner.cache.nbytes > 0
    info = engine.info()
    assert info["window"] == 32 and info["max_seqs"] == 3 and info["crop_policy"] == "shift"


async def test_dropping_a_stream_without_closing_it_frees_the_slot(make_engine: EngineFactory) -> None:
    engine = make_engine(max_seqs=1)
    stream = await engine.generate("Hello", SamplingParams(max_new_tokens=10_000, temperature=0.0))
    async for _ in stream:
        break
    del stream
    await wait_for(lambda: engine.stats().slots_used == 0)


async def test_admission_is_fair_between_clients(make_engine: EngineFactory) -> None:
    # One slot. Client a has one request running and three waiting, then b queues one: b's is
    # admitted second, right after the request that was running, not behind all of a's.
    engine = make_engine(max_seqs=1, max_queue=8)
    order: list[str] = []

    async def run(name: str, client: str) -> None:
        stream = await engine.generate("Hello", SamplingParams(max_new_tokens=200, temperature=0.0,
                                                               stop_on_eos=False), client=client)
        async for event in stream:
            if event.finish_reason is not None:
                order.append(name)

    tasks = [asyncio.ensure_future(run(f"a{i}", "a")) for i in range(4)]
    while engine.stats().running < 1 or engine.stats().waiting < 3:
        await asyncio.sleep(0.001)
    tasks.append(asyncio.ensure_future(run("b", "b")))
    await asyncio.gather(*tasks)
    assert order == ["a0", "b", "a1", "a2", "a3"]  # FIFO would make b last


async def test_one_client_gets_at_most_its_share_of_the_queue(make_engine: EngineFactory) -> None:
    engine = make_engine(max_seqs=1, max_queue=4, max_waiting_per_client=2)
    params = SamplingParams(max_new_tokens=10_000, temperature=0.0, stop_on_eos=False)
    streams = [await engine.generate("Hello", params, client="a")]
    while engine.stats().running < 1:  # the first is admitted
        await asyncio.sleep(0.01)
    streams += [await engine.generate("Hello", params, client="a") for _ in range(2)]  # these wait
    with pytest.raises(Overloaded, match="this client already has 2 requests waiting") as refused:
        await engine.generate("Hello", params, client="a")
    assert refused.value.retry_after_s >= 1.0
    other = await engine.generate("Hello", params, client="b")  # another client still gets in
    anonymous = await engine.generate("Hello", params)  # library callers (no client) share no cap
    for s in [*streams, other, anonymous]:
        await s.aclose()


async def test_a_client_holding_every_slot_gives_one_up_and_keeps_its_tokens(
    make_engine: EngineFactory, lively: Checkpoint
) -> None:
    # Client a holds both slots with long greedy streams; b arrives: one of a's requests is
    # preempted, b runs and ends first, and a's streams (the preempted one re-prefilled) are
    # still token for token the recompute-everything reference.
    engine = make_engine(max_seqs=2, max_queue=8)
    order: list[str] = []
    results: dict[str, list[int]] = {}
    params = {"temperature": 0.0, "stop_on_eos": False}

    async def run(name: str, client: str, prompt: str, n: int) -> None:
        stream = await engine.generate(prompt, SamplingParams(max_new_tokens=n, **params), client=client)
        events = [e async for e in stream]
        assert events[-1].finish_reason is FinishReason.LENGTH
        results[name] = [e.token_id for e in events if e.token_id is not None]
        order.append(name)

    a = [asyncio.ensure_future(run(f"a{i}", "a", p, 400)) for i, p in enumerate(["Hello", "The end"])]
    while engine.stats().running < 2 or engine.scheduler.generated_tokens < 20:
        await asyncio.sleep(0.005)
    await run("b", "b", "xyz", 5)
    assert order == ["b"]  # a's 400-token streams are still going
    await asyncio.gather(*a)
    assert engine.stats().extra["preemptions_total"] >= 1
    model = lively.build_model("cpu")
    for name, prompt in (("a0", "Hello"), ("a1", "The end"), ("b", "xyz")):
        n = 5 if name == "b" else 400
        assert results[name] == reference_generate(model, lively.tokenizer.encode(prompt), n, policy="shift")


async def test_a_preempted_sampled_request_with_penalties_draws_what_it_draws_alone(
    make_engine: EngineFactory,
) -> None:
    # The penalties' counts are rebuilt from the tokens generated before the preemption.
    params = SamplingParams(max_new_tokens=300, temperature=1.0, seed=11, repetition_penalty=1.3,
                            frequency_penalty=0.5, stop_on_eos=False)
    alone = make_engine(max_seqs=2)
    expected = [e.token_id async for e in await alone.generate("Hello", params)]
    engine = make_engine(max_seqs=2, max_queue=8)
    streams = [await engine.generate("Hello", params, client="a") for _ in range(2)]
    while engine.stats().running < 2 or engine.scheduler.generated_tokens < 20:
        await asyncio.sleep(0.005)
    other = await engine.generate("xyz", SamplingParams(max_new_tokens=5), client="b")
    async for _ in other:
        pass
    assert engine.stats().extra["preemptions_total"] >= 1
    for stream in streams:
        assert [e.token_id async for e in stream] == expected


CHARS = CharTokenizer.train("abcdefghijklmnopqrstuvwxyz ")


def _request(loop: asyncio.AbstractEventLoop, index: int, tokens: int) -> Request:
    params = SamplingParams(max_new_tokens=1000, temperature=0.0, stop_on_eos=False)
    req = Request(f"r{index}", [1] * tokens, params, 0, 0, CHARS, loop, Inbox(loop, 1, lambda e: False))
    req.client = f"client-{index}"
    return req


def _stepped(pending: list[int], steps: int, rows_per_step: float | None = None,
             **config: Any) -> list[list[tuple[int, int]]]:
    """Plan `steps` steps, each as if run, for requests (one client each) with these pending
    token counts (1: it decodes), DECODE_SHARE of a decode-only step costing `rows_per_step`
    prompt rows (None: not measured yet): each step's (request index, rows) pairs."""
    loop = asyncio.new_event_loop()
    try:
        scheduler = Scheduler(CHARS, EngineConfig(**config), window=512, batch_invariant=True)
        if rows_per_step is not None:
            scheduler.step_cost = StepCost(decode_s=0.01 * rows_per_step / DECODE_SHARE, row_s=0.01)
        reqs = []
        for i, n in enumerate(pending):
            req = _request(loop, i, 10 + n)
            scheduler.admit(req, 0.0)
            req.n_cached = 10  # as if its first 10 tokens were prefilled
            reqs.append(req)
        out = []
        for _ in range(steps):
            items = scheduler.plan()
            out.append([(reqs.index(item.req), len(item.tokens)) for item in items])
            for item in items:  # fed; a row that completes its context draws a token
                item.req.n_cached += len(item.tokens)
                if item.completes:
                    item.req.ctx.append(2)
        return out
    finally:
        loop.close()


def test_prompt_rows_beside_a_decoding_row_cost_at_most_a_share_of_a_decode_step() -> None:
    # The share of a decode-only step prompt rows may add costs what 4 prompt rows cost: a chunk
    # of 8 joins every other step of the decoding row, whose steps take 1 + DECODE_SHARE times
    # their time alone on average.
    steps = _stepped([1, 100], 6, rows_per_step=4, prefill_budget=8, waiting_served_ratio=10)
    assert steps == [[(0, 1)], [(0, 1), (1, 8)]] * 3
    # Until both costs are measured, the budget alone (a chunk every step).
    steps = _stepped([1, 100], 2, prefill_budget=8, waiting_served_ratio=10)
    assert steps == [[(0, 1), (1, 8)]] * 2
    # Nobody decodes, but a request that arrives waits for the step in flight: long prompts'
    # chunks take what the share of a decode step's time buys (20 rows: two chunks), at least prefill_budget;
    # prompts that complete in the step take the idle budget.
    steps = _stepped([100, 100, 100, 8], 1, rows_per_step=20, prefill_budget=8, idle_prefill_budget=32)
    assert steps == [[(0, 8), (1, 8), (3, 8)]]
    steps = _stepped([100, 100], 1, rows_per_step=1, prefill_budget=8, idle_prefill_budget=32)
    assert steps == [[(0, 8)]]


def test_a_chunk_the_credit_cannot_pay_is_not_passed_by_smaller_ones() -> None:
    # Client 1's chunk of 8 waits for credit (4 a step): client 2's 3-token prompt, behind it in
    # the round robin, does not take the credit from under it, then goes next.
    steps = _stepped([1, 100, 3], 3, rows_per_step=4, prefill_budget=8, waiting_served_ratio=10)
    assert steps == [[(0, 1)], [(0, 1), (1, 8)], [(0, 1), (2, 3)]]


def test_the_wave_budget_is_for_prompts_that_complete() -> None:
    # Two prompts beside one decoding row are a wave (2 >= 1.2 x 1): short prompts that complete
    # are prefilled together in one step, without waiting for credit.
    steps = _stepped([1, 8, 8], 1, rows_per_step=1, prefill_budget=8, idle_prefill_budget=32)
    assert steps == [[(0, 1), (1, 8), (2, 8)]]
    # Long prompts' middle chunks share prefill_budget and the credit: one chunk a step (the
    # two in turn) while the decode row runs, however many clients send long prompts.
    steps = _stepped([1, 100, 100], 2, prefill_budget=8, idle_prefill_budget=32)
    assert steps == [[(0, 1), (1, 8)], [(0, 1), (2, 8)]]


def test_step_costs_are_learnt_from_the_steps_that_run() -> None:
    loop = asyncio.new_event_loop()
    try:
        scheduler = Scheduler(CHARS, EngineConfig(prefill_budget=8, waiting_served_ratio=10), window=512,
                              batch_invariant=True)
        decoder, prompt = _request(loop, 0, 3), _request(loop, 1, 400)
        scheduler.admit(decoder, 0.0)
        decoder.n_cached = 2
        at = 100.0
        # A decode-only step takes 40 ms, a prompt row adds 5 ms.
        for step in range(20):
            if step == 10:
                assert scheduler.step_cost.prompt_rows_per_step() is None  # no prompt row ran yet
                scheduler.admit(prompt, at)
            plan = scheduler.schedule(at)
            at += 0.04 + 0.005 * sum(len(item.tokens) for item in plan.items if item.req is prompt)
            scheduler.update_from_output(plan, StepOutput(forward_done=at))
            decoder.ctx.append(2)  # as if it drew a token
            at += 0.001  # between steps: not the forward's
        assert scheduler.step_cost.decode_s == pytest.approx(0.04)
        assert scheduler.step_cost.row_s == pytest.approx(0.005)
    finally:
        loop.close()
