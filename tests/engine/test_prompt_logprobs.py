"""Echo and prompt logprobs: the prompt scored in its own prefill, on every backend."""

from __future__ import annotations

import asyncio

import pytest
import torch

from nanoserve.engine.config import EngineConfig
from nanoserve.engine.inbox import Inbox
from nanoserve.engine.prompt_scores import PromptScores, ScoringCost, prompt_of
from nanoserve.engine.request import Request
from nanoserve.engine.scheduler import Scheduler
from nanoserve.engine.types import FinishReason, InvalidRequest, Prompt, SamplingParams, TokenEvent
from nanoserve.engine.work import WorkItem
from nanoserve.model.checkpoint import Checkpoint
from nanoserve.model.config import GPTConfig
from nanoserve.model.gpt import GPT
from tests.engine.conftest import EngineFactory, collect, token_ids

# 24 characters: longer than the prefill chunk the tests set (5), within the lively window (32).
PROMPT = "the quick brown fox jump"


def reference(lively: Checkpoint, ids: list[int]) -> torch.Tensor:
    """log_softmax of the reference model's full forward over `ids`: (T, V)."""
    model = lively.build_model("cpu")
    with torch.no_grad():
        return model(torch.tensor([ids]))[0].log_softmax(-1)


def check_scores(prompt: Prompt, ids: list[int], want: torch.Tensor, top_n: int) -> None:
    assert [t.id for t in prompt.tokens] == ids
    first, *rest = prompt.tokens
    assert first.logprob is None and first.top_tokens == ()  # nothing predicts the first token
    for i, token in enumerate(rest, start=1):
        assert token.logprob == pytest.approx(want[i - 1, ids[i]].item(), abs=1e-4)
        assert len(token.top_tokens) == top_n
        expected = want[i - 1].topk(top_n)
        got = torch.tensor([t.logprob for t in token.top_tokens])
        torch.testing.assert_close(got, expected.values, rtol=0, atol=1e-4)


def first_prompt(events: list[TokenEvent]) -> Prompt:
    assert events[0].prompt is not None
    assert all(e.prompt is None for e in events[1:])  # the prompt comes once, on the first event
    return events[0].prompt


async def test_prompt_logprobs_match_the_reference_across_prefill_chunks(
    make_engine: EngineFactory, lively: Checkpoint
) -> None:
    engine = make_engine(prefill_budget=5, idle_prefill_budget=5)
    ids = lively.tokenizer.encode(PROMPT)
    events = await collect(engine, PROMPT, max_new_tokens=3, temperature=0.0, echo=True, prompt_logprobs=3)
    prompt = first_prompt(events)
    assert prompt.text == PROMPT
    check_scores(prompt, ids, reference(lively, ids), top_n=3)
    # The generated tokens are those of a request without echo.
    plain = await collect(engine, PROMPT, max_new_tokens=3, temperature=0.0)
    assert token_ids(events) == token_ids(plain)


async def test_max_new_tokens_zero_scores_the_prompt_only(
    make_engine: EngineFactory, lively: Checkpoint
) -> None:
    engine = make_engine(prefill_budget=7)
    ids = lively.tokenizer.encode(PROMPT)
    events = await collect(engine, PROMPT, max_new_tokens=0, echo=True, prompt_logprobs=0)
    assert len(events) == 1 and events[0].token_id is None
    assert events[0].finish_reason is FinishReason.LENGTH
    assert events[0].usage is not None and events[0].usage.generated_tokens == 0
    check_scores(first_prompt(events), ids, reference(lively, ids), top_n=0)
    with pytest.raises(InvalidRequest) as refused:  # nothing to do without scoring
        await collect(engine, PROMPT, max_new_tokens=0)
    assert refused.value.param == "max_new_tokens"


async def test_a_scored_prompt_batched_with_plain_ones_changes_nobody(
    make_engine: EngineFactory, lively: Checkpoint
) -> None:
    engine = make_engine(prefill_budget=6)
    other = "a lazy dog sleeps in the"[: len(PROMPT)]
    alone = token_ids(await collect(engine, other, max_new_tokens=6, temperature=0.0))
    scored, plain = await asyncio.gather(
        collect(engine, PROMPT, max_new_tokens=6, temperature=0.0, echo=True, prompt_logprobs=2),
        collect(engine, other, max_new_tokens=6, temperature=0.0),
    )
    ids = lively.tokenizer.encode(PROMPT)
    check_scores(first_prompt(scored), ids, reference(lively, ids), top_n=2)
    assert token_ids(plain) == alone
    assert all(e.prompt is None for e in plain)


async def test_echo_without_logprobs_carries_the_prompt_unscored(
    make_engine: EngineFactory, lively: Checkpoint
) -> None:
    engine = make_engine()
    events = await collect(engine, PROMPT, max_new_tokens=2, temperature=0.0, echo=True)
    prompt = first_prompt(events)
    assert prompt.text == PROMPT
    assert [t.text for t in prompt.tokens] == list(PROMPT)  # a char model: one token a character
    assert all(t.logprob is None for t in prompt.tokens)


async def test_choices_share_one_scored_prefill(make_engine: EngineFactory, lively: Checkpoint) -> None:
    engine = make_engine(max_seqs=4, prefill_budget=5)
    ids = lively.tokenizer.encode(PROMPT)
    before = engine.stats().extra["prefill_tokens_total"]
    params = SamplingParams(max_new_tokens=2, temperature=1.0, seed=3, echo=True, prompt_logprobs=1)
    streams = await engine.generate_choices(PROMPT, params, 3)
    want = reference(lively, ids)
    for stream in streams:
        events = [e async for e in stream]
        check_scores(first_prompt(events), ids, want, top_n=1)
    # The leader prefills the prompt once; each follower feeds only its last token.
    assert engine.stats().extra["prefill_tokens_total"] - before == len(ids) + 2


async def test_the_request_says_while_it_needs_prompt_logits(make_engine: EngineFactory) -> None:
    """A prefix cache must not skip the prompt of a request still to score it."""
    engine = make_engine(prefill_budget=5)
    stream = await engine.generate(PROMPT, SamplingParams(max_new_tokens=1, echo=True, prompt_logprobs=0))
    req = stream._request
    assert req.needs_prompt_logits
    _ = [e async for e in stream]
    assert not req.needs_prompt_logits
    plain = await engine.generate(PROMPT, SamplingParams(max_new_tokens=1, echo=True))
    assert not plain._request.needs_prompt_logits  # echo alone scores nothing
    _ = [e async for e in plain]


def _request(lively: Checkpoint, text: str, params: SamplingParams, loop: asyncio.AbstractEventLoop,
             slot: int = -1) -> Request:
    req = Request(text, lively.tokenizer.encode(text), params, 0, 0, lively.tokenizer, loop,
                  Inbox(loop, 1, lambda e: False))
    req.slot = slot
    return req


async def test_scoring_and_plain_prompt_chunks_share_one_forward(
    make_engine: EngineFactory, lively: Checkpoint
) -> None:
    """The runner driven directly (the engine is idle), so both items surely share each forward:
    one scores its prompt, the other wants its last position's logits only."""
    engine = make_engine(max_seqs=2)
    loop = asyncio.get_running_loop()
    other = "a lazy dog sleeps in the"
    scored = _request(lively, PROMPT, SamplingParams(echo=True, prompt_logprobs=2), loop, slot=0)
    plain = _request(lively, other, SamplingParams(), loop, slot=1)
    assert len(scored.prompt_ids) == len(plain.prompt_ids) == 24
    for start, stop in ((0, 10), (10, 24)):
        items = [WorkItem(r, r.prompt_ids[start:stop], start, completes=stop == 24,
                          scores=r.prompt_rows_to_score(start, stop - start)) for r in (scored, plain)]
        forward = engine.runner.forward(items)
        assert not forward.errors
    assert forward.logits is not None and forward.rows == [0, 1]
    want = reference(lively, scored.prompt_ids)
    prompt = prompt_of(lively.tokenizer, scored.prompt_ids, scored.prompt_scores)
    check_scores(prompt, scored.prompt_ids, want, top_n=2)
    assert len(plain.prompt_scores) == 0
    # Each item's sampling row is its last position's logits, whichever forward computed it (on
    # the backend's device; the reference is the CPU's).
    got = forward.logits.log_softmax(-1).cpu()
    torch.testing.assert_close(got[0], want[-1], rtol=0, atol=1e-4)
    torch.testing.assert_close(got[1], reference(lively, plain.prompt_ids)[-1], rtol=0, atol=1e-4)


def test_a_request_preempted_mid_prompt_is_scored_again_from_its_start(lively: Checkpoint) -> None:
    """Preemption forgets the cache: partial scores go too, and the re-prefill scores every row."""
    loop = asyncio.new_event_loop()
    try:
        ids = lively.tokenizer.encode(PROMPT)
        req = _request(lively, PROMPT, SamplingParams(echo=True, prompt_logprobs=0), loop)
        scheduler = Scheduler(lively.tokenizer, EngineConfig(), window=32, batch_invariant=True)
        req.slot, req.n_cached = scheduler.free_slots.pop(0), 5
        scheduler.running.append(req)
        req.prompt_scores.extend(PromptScores([-1.0] * 5, [[]] * 5, [[]] * 5))  # the first chunk's
        assert req.prompt_rows_to_score(5, 5) == 5  # the next chunk continues the scores
        scheduler.preempt(req)
        assert len(req.prompt_scores) == 0 and req.needs_prompt_logits
        assert req.prompt_rows_to_score(0, 5) == 5
        assert req.prompt_rows_to_score(5, 5) == 0  # not before the rows ahead of it are scored again
        req.prompt_scores.extend(PromptScores([-1.0] * 20, [[]] * 20, [[]] * 20))
        assert req.prompt_rows_to_score(20, 5) == len(ids) - 1 - 20  # the last row samples, scores nothing
    finally:
        loop.close()


async def test_non_finite_prompt_logits_fail_that_request_alone(make_engine: EngineFactory) -> None:
    from tests.faults import injected_faults

    with injected_faults("nan:POISON"):
        engine = make_engine(max_seqs=2, prefill_budget=5)
    poisoned, fine = await asyncio.gather(
        collect(engine, "the POISON jump", max_new_tokens=0, echo=True, prompt_logprobs=1),
        collect(engine, "the quick jumps", max_new_tokens=2, temperature=0.0, echo=True, prompt_logprobs=1),
    )
    assert poisoned[-1].finish_reason is FinishReason.ERROR and "non-finite" in (poisoned[-1].error or "")
    assert fine[-1].finish_reason is FinishReason.LENGTH and len(token_ids(fine)) == 2
    assert all(t.logprob is not None for t in first_prompt(fine).tokens[1:])


def test_a_scored_row_is_charged_its_output_layer() -> None:
    # GPT-2's block holds 12 x n_embd^2 weights (attention 4, MLP 8): a plain row multiplies each
    # once, a scored row adds the output layer's vocab x n_embd. 124M: 1 + 50257 / (12 x 12 x 768).
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=50257, block_size=8, n_layer=12, n_head=12, n_embd=768, bias=False))
    cost = ScoringCost.of(model.h, 768, 50257)
    assert cost.weight == pytest.approx(1 + 50257 / (12 * 12 * 768))  # 1.454
    assert cost.rows(96) == 66 and cost.cost(66) == 96  # a 96-token budget scores 66 rows
    assert cost.max_rows == (1 << 22) // 50257 == 83  # 16 MiB of float32 logits
    assert ScoringCost(weight=200.0).rows(96) == 1  # never less than one row


def _planned(lively: Checkpoint, prompts: list[tuple[str | None, bool]], steps: int, **config: int,
             ) -> list[list[tuple[int, int]]]:
    """Plan `steps` steps (each as if run) for requests (client, scores its prompt) admitted in
    order, scored rows costing 4 plain ones and at most 6 a step: (request index, rows) each step."""
    loop = asyncio.new_event_loop()
    try:
        scheduler = Scheduler(lively.tokenizer, EngineConfig(max_seqs=4, **config), window=32,
                              batch_invariant=True, scoring=ScoringCost(weight=4.0, max_rows=6))
        reqs = []
        for client, scored in prompts:
            params = SamplingParams(max_new_tokens=1, echo=scored, prompt_logprobs=0 if scored else None)
            req = _request(lively, PROMPT, params, loop)
            req.client = client
            scheduler.admit(req, 0.0)
            reqs.append(req)
        out = []
        for _ in range(steps):
            items = scheduler.plan()
            out.append([(reqs.index(item.req), len(item.tokens)) for item in items])
            for item in items:  # as update_from_output records a chunk
                item.req.n_cached += len(item.tokens)
                item.req.prompt_scores.extend(PromptScores([0.0] * item.scores, [[]] * item.scores,
                                                           [[]] * item.scores))
        return out
    finally:
        loop.close()


def test_scored_chunks_take_the_rows_their_cost_allows(lively: Checkpoint) -> None:
    # A budget of 8 plain rows: a plain chunk of 8, a scored one of 2 (2 x 4 = 8); both run
    # within the idle budget of 16 (nothing decodes).
    plan = _planned(lively, [(None, True), (None, False)], 1, prefill_budget=8, idle_prefill_budget=16)
    assert plan == [[(0, 2), (1, 8)]]
    plan = _planned(lively, [(None, True)] * 4, 1, prefill_budget=24, idle_prefill_budget=1000)
    # 6 rows (24 / 4) a chunk: the first fills the step's 6 scored rows (the logits a step may
    # hold), the others wait however much budget is left.
    assert plan == [[(0, 6)]]


def test_prompt_chunks_go_round_robin_between_clients(lively: Checkpoint) -> None:
    # One chunk a step (the idle budget is the normal one): client a's two prompts, admitted
    # first, do not hold b's first chunk for all of theirs (FIFO served a, a, a, a, a, ... b).
    plan = _planned(lively, [("a", False), ("a", False), ("b", False)], 4, prefill_budget=5,
                    idle_prefill_budget=5)
    assert [step[0][0] for step in plan] == [0, 2, 0, 2]
