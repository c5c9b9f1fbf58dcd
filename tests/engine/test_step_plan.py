"""The scheduler alone, without a runner: schedule() plans a step as plain data and
update_from_output() applies what a backend made of it."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest

from nanoserve.engine.config import EngineConfig
from nanoserve.engine.inbox import Inbox
from nanoserve.engine.request import Request
from nanoserve.engine.scheduler import Scheduler
from nanoserve.engine.step_plan import CopyPrefix, ResetSlot, RowError, StepOutput
from nanoserve.engine.types import FinishReason, SamplingParams, TokenEvent
from nanoserve.engine.work import SampleResult
from nanoserve.model.tokenizer import CharTokenizer

TOKENIZER = CharTokenizer.train("abcdefghijklmnopqrstuvwxyz ")


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def _request(loop: asyncio.AbstractEventLoop, prompt: list[int], max_new_tokens: int = 4) -> Request:
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, stop_on_eos=False)
    return Request("r", prompt, params, 0, 0, TOKENIZER, loop, Inbox(loop, 1, lambda e: False))


def _scheduler(**config: Any) -> Scheduler:
    return Scheduler(TOKENIZER, EngineConfig(**config), window=256, batch_invariant=True)


def _planner(loop: asyncio.AbstractEventLoop, prefill_budget: int, idle_prefill_budget: int,
             pending: list[int], ratio: float = 1.2) -> list[tuple[int, int]]:
    """Plan one step for requests with these pending token counts; (request index, chunk) pairs."""
    scheduler = _scheduler(prefill_budget=prefill_budget, idle_prefill_budget=idle_prefill_budget,
                           waiting_served_ratio=ratio)
    reqs = []
    for i, n in enumerate(pending):
        req = _request(loop, [(i + k) % TOKENIZER.vocab_size for k in range(100 + n)])
        scheduler.admit(req, 0.0)
        req.n_cached = 100  # as if the first 100 tokens were prefilled
        reqs.append(req)
    return [(reqs.index(item.req), len(item.tokens)) for item in scheduler.plan()]


def test_prefill_budget_per_step_and_the_larger_idle_budget(loop: asyncio.AbstractEventLoop) -> None:
    # Someone decodes (and prompts are not a wave: ratio 10): one budget's worth of prompt chunks
    # joins the decode row.
    assert _planner(loop, 8, 32, [1, 8, 8, 8], ratio=10) == [(0, 1), (1, 8)]
    # Nobody decodes: up to the idle budget, still in prefill_budget-sized chunks per request.
    assert _planner(loop, 8, 32, [8, 8, 8, 8, 8]) == [(0, 8), (1, 8), (2, 8), (3, 8)]
    assert _planner(loop, 8, 32, [100, 3, 20]) == [(0, 8), (1, 3), (2, 8)]
    # The first chunk of a step always fits, even if the idle budget is smaller.
    assert _planner(loop, 8, 4, [8, 8]) == [(0, 8)]


def test_a_wave_of_prompts_gets_the_idle_budget_while_it_outnumbers_the_decoding_rows(
    loop: asyncio.AbstractEventLoop,
) -> None:
    # One row decodes, two prompts wait: 2 >= 1.2 x 1, so the wave is prefilled in this step.
    assert _planner(loop, 8, 32, [1, 8, 8]) == [(0, 1), (1, 8), (2, 8)]
    # Three rows decode, two prompts: 2 < 3.6, the normal budget (one chunk).
    assert _planner(loop, 8, 32, [1, 1, 1, 8, 8]) == [(0, 1), (1, 1), (2, 1), (3, 8)]
    # The ratio is the threshold: at 2.5, two prompts beside one decoding row are not a wave.
    assert _planner(loop, 8, 32, [1, 8, 8], ratio=2.5) == [(0, 1), (1, 8)]


def test_a_plan_carries_the_slot_operations_admission_recorded(loop: asyncio.AbstractEventLoop) -> None:
    scheduler = _scheduler(max_seqs=2)
    first = _request(loop, [1, 2, 3, 4, 5, 6])
    scheduler.admit(first, 0.0)
    plan = scheduler.schedule(0.0)
    assert plan.step == 1 and plan.slot_ops == [ResetSlot(first, 0)] and not plan.ended
    assert [(item.req, item.tokens, item.start, item.completes) for item in plan.items] == [
        (first, [1, 2, 3, 4, 5, 6], 0, True)]
    assert plan.tokens == 6
    # The backend fed the prompt and drew token 7; then the request is cancelled and ends.
    sampled = SampleResult([first], [7], [True], None, None, None)
    result = scheduler.update_from_output(plan, StepOutput(1.0, rows=[0], samples=[sampled]))
    assert [(r, e.token_id) for r, e in result.events] == [(first, 7)]
    assert result.batch_size == 1 and result.prefill_tokens == 6 and first.n_cached == 6
    first.cancelled = True
    ended = scheduler.schedule(2.0)
    assert ended.step == 0 and not ended.items and not ended.slot_ops
    assert [(r, e.finish_reason) for r, e in ended.ended] == [(first, FinishReason.CANCELLED)]
    # A prompt starting with what slot 0 still holds is seated there, its prefix in place: no copy.
    again = _request(loop, [1, 2, 3, 4, 5, 6, 7, 9])
    scheduler.admit(again, 3.0)
    plan = scheduler.schedule(3.0)
    assert plan.slot_ops == [ResetSlot(again, 0)] and again.n_cached == 6
    assert [item.tokens for item in plan.items] == [[7, 9]]
    # Another prompt with that prefix, while slot 0 is taken: the prefix is copied to slot 1.
    other = _request(loop, [1, 2, 3, 4, 8])
    scheduler.admit(other, 4.0)
    assert scheduler.schedule(4.0).slot_ops == [CopyPrefix(0, 1, 4), ResetSlot(other, 1)]


def test_update_ends_the_rows_the_backend_failed_and_frees_their_slots(
    loop: asyncio.AbstractEventLoop,
) -> None:
    scheduler = _scheduler(max_seqs=3)
    broken, unlucky, fine = (_request(loop, [1, 2, 3]) for _ in range(3))
    for req in (broken, unlucky, fine):
        scheduler.admit(req, 0.0)
    plan = scheduler.schedule(0.0)
    output = StepOutput(1.0, errors={0: "forward pass failed: boom"}, rows=[1, 2],
                        samples=[RowError(unlucky, "sampling failed: bad"),
                                 SampleResult([fine], [5], [True], None, None, None)])
    result = scheduler.update_from_output(plan, output)

    def seen(event: TokenEvent) -> tuple[FinishReason | None, str | None, int | None]:
        return event.finish_reason, event.error, event.token_id

    assert [(r, seen(e)) for r, e in result.events] == [
        (broken, (FinishReason.ERROR, "forward pass failed: boom", None)),
        (unlucky, (FinishReason.ERROR, "sampling failed: bad", None)),
        (fine, (None, None, 5)),
    ]
    assert scheduler.running == [fine] and scheduler.free_slots == [0, 1]
    assert broken.n_cached == 0 and unlucky.n_cached == 3  # a failed forward cached nothing


def test_a_request_that_only_scores_its_prompt_ends_when_its_prefill_does(
    loop: asyncio.AbstractEventLoop,
) -> None:
    scheduler = _scheduler()
    scoring = _request(loop, [1, 2, 3], max_new_tokens=0)
    scheduler.admit(scoring, 0.0)
    plan = scheduler.schedule(0.0)
    result = scheduler.update_from_output(plan, StepOutput(1.0, rows=[0]))
    assert [(r, e.finish_reason, e.token_id) for r, e in result.events] == [
        (scoring, FinishReason.LENGTH, None)]
    assert not scheduler.running and scoring.prefill_done_at == 1.0
