"""The bounds on a request's grammar inside the engine: compile-time limits refused naming them,
a limit hit while generating (or masks past their time budget) ending the request with an explicit
error and never a finish read as complete, one compile per request whatever its choices, and the
grammar pool's turns, room and cancellation."""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time

import pytest

from nanoserve.engine import grammar_limits
from nanoserve.engine.grammar import Constraint, Grammars
from nanoserve.engine.grammar_pool import GrammarPool
from nanoserve.engine.types import GRAMMAR_FAILED, FinishReason, GrammarSpec, InvalidRequest, Overloaded
from tests.engine.conftest import EngineFactory, collect

BOMB = GrammarSpec("regex", "(x{1000}){1000}")  # 15 characters, a million-state lexer
# The compile's probe walks 4 tokens (PROBE_TOKENS) and finds nothing: the bomb is 10 characters in.
LATE_SCHEMA = {"type": "object", "properties": {"a": {"type": "boolean"},
                                                "b": {"type": "string", "pattern": "^(x{1000}){1000}$"}},
               "required": ["a", "b"], "additionalProperties": False}
LATE_BOMB = GrammarSpec("json_schema", json.dumps(LATE_SCHEMA))
# 1,500 optional properties: a parser row of 6,000 items (the order they may come in).
WIDE = GrammarSpec("json_schema", json.dumps({
    "type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(1500)}}))


def text(events: list) -> str:  # type: ignore[type-arg]
    return "".join(e.text for e in events)


@pytest.mark.parametrize(("spec", "limit"), [
    (BOMB, "initial_lexer_fuel"),
    (GrammarSpec("json_schema", json.dumps({"type": "string", "pattern": "^x{100000}$"})),
     "initial_lexer_fuel"),
    (WIDE, "max_items_in_row"),
    (GrammarSpec("regex", "a" * (grammar_limits.MAX_GRAMMAR_CHARS + 1)), "max_grammar_chars"),
])
async def test_grammars_past_a_bound_are_refused_naming_it(make_engine: EngineFactory, spec: GrammarSpec,
                                                           limit: str) -> None:
    engine = make_engine()
    t0 = time.perf_counter()
    with pytest.raises(InvalidRequest, match=limit) as info:
        await collect(engine, "Hello", grammar=spec, grammar_param="response_format", max_new_tokens=8)
    assert time.perf_counter() - t0 < 2 * grammar_limits.MAX_COMPILE_S  # refused in bounded time
    assert info.value.param == "response_format"
    assert engine.stats().waiting == 0 and engine.grammar_pool.pending() == 0


async def test_a_limit_hit_while_generating_ends_the_request_by_name(make_engine: EngineFactory) -> None:
    engine = make_engine()
    events = await collect(engine, "Hello", grammar=LATE_BOMB, max_new_tokens=24, temperature=0.0)
    last = events[-1]
    assert last.finish_reason is FinishReason.ERROR, (text(events), last)
    assert last.error_code == GRAMMAR_FAILED
    # The lexer's bound, or the time its states took first (a mask over max_mask_ms).
    assert re.search("initial_lexer_fuel|max_lexer_states|max_mask_ms", last.error or ""), last.error
    # What the grammar allowed before its limit, nothing drawn unmasked.
    assert any(done.startswith(text(events)) for done in ('{"a": true, "b": "', '{"a": false, "b": "'))
    # The engine serves the next request as before.
    ok = await collect(engine, "Hello", grammar=GrammarSpec("regex", "[a-c]{3}"), max_new_tokens=8)
    assert ok[-1].finish_reason is FinishReason.EOS_TOKEN and re.fullmatch("[a-c]{3}", text(ok))


async def test_masks_past_their_time_budget_end_the_request(make_engine: EngineFactory,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    engine = make_engine()
    free = await collect(engine, "Hello", max_new_tokens=6, temperature=0.0, stop_on_eos=False)
    monkeypatch.setattr(grammar_limits, "MASK_BURST_S", 0.0)
    monkeypatch.setattr(grammar_limits, "MASK_PER_TOKEN_S", 0.0)  # any mask is over budget
    constrained, plain = await asyncio.gather(
        collect(engine, "Hello", grammar=GrammarSpec("regex", "[a-z]{20}"), max_new_tokens=20),
        collect(engine, "Hello", max_new_tokens=6, temperature=0.0, stop_on_eos=False))
    last = constrained[-1]
    assert last.finish_reason is FinishReason.ERROR and last.error_code == GRAMMAR_FAILED
    assert "mask_budget" in (last.error or "")
    assert re.fullmatch("[a-z]*", text(constrained))  # no token drawn without its mask was kept
    assert [e.token_id for e in plain] == [e.token_id for e in free]  # its batch-mate unharmed


async def test_choices_share_one_compile(make_engine: EngineFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    from nanoserve.engine.types import SamplingParams

    engine = make_engine(max_seqs=4)
    calls: list[GrammarSpec] = []
    compile_once = engine.grammars.constraint

    def counted(spec: GrammarSpec, param: str) -> Constraint:
        calls.append(spec)
        return compile_once(spec, param)

    monkeypatch.setattr(engine.grammars, "constraint", counted)
    params = SamplingParams(max_new_tokens=12, temperature=1.0, seed=5,
                            grammar=GrammarSpec("regex", "[a-c]{2}[0-9]{3}"))
    texts = []
    for stream in await engine.generate_choices("Hello", params, 4):
        texts.append(text([e async for e in stream]))
    assert len(calls) == 1
    assert all(re.fullmatch("[a-c]{2}[0-9]{3}", t) for t in texts), texts
    assert len(set(texts)) > 1  # each choice advanced its own copy of the matcher


def test_a_compile_is_timed_from_the_start_and_its_first_mask_is_not_charged() -> None:
    from nanoserve.model.tokenizer import CharTokenizer
    from tests.conftest import TINY_VOCAB_TEXT

    c = Grammars(CharTokenizer.train(TINY_VOCAB_TEXT)).constraint(GrammarSpec("regex", "[a-c]{3}"), "g")
    assert c.failure is None and c.masks == 0 and c.mask_s == 0.0
    assert c.words is not None and c.masked_at == 0  # the first step reuses the compile's mask
    copy = c.copy()
    assert copy.matcher is not c.matcher and copy.masked_at == 0


async def test_the_pool_takes_clients_in_turn_and_drops_work_whose_caller_left() -> None:
    pool = GrammarPool()
    gate, ran = threading.Event(), []

    def job(name: str, wait: bool = False):  # type: ignore[no-untyped-def]
        def run() -> str:
            if wait:
                gate.wait(10)
            ran.append(name)
            return name
        return run

    first = asyncio.ensure_future(pool.run(job("a1", wait=True), "a", client_room=8, total_room=8))
    await asyncio.sleep(0.05)  # a1 runs (held at the gate)
    queued = [asyncio.ensure_future(pool.run(job(n), c, client_room=8, total_room=8))
              for n, c in (("a2", "a"), ("a3", "a"), ("b1", "b"))]
    left = asyncio.ensure_future(pool.run(job("gone"), "c", client_room=8, total_room=8))
    await asyncio.sleep(0.05)
    assert pool.pending("a") == 3 and pool.pending() == 5
    with pytest.raises(Overloaded, match="max_waiting_per_client"):
        await pool.run(job("over"), "a", client_room=3, total_room=8)
    left.cancel()  # its client went away while it waited
    with pytest.raises(asyncio.CancelledError):
        await left
    gate.set()
    assert await first == "a1" and [await q for q in queued] == ["a2", "a3", "b1"]
    # b1 went before a's second and third: clients in turn; "gone" never ran.
    assert ran == ["a1", "a2", "b1", "a3"] or ran == ["a1", "b1", "a2", "a3"], ran
    assert "gone" not in ran and pool.pending() == 0


async def test_a_slow_mask_defers_its_own_row_not_the_batch(make_engine: EngineFactory,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A row whose mask is not ready by the end of the forward (and MASK_WAIT_S) is not sampled that
    step and feeds its token again next step: its batch-mate's steps do not wait for it, and its
    own text still follows the grammar token for token."""
    engine = make_engine()
    alone = await collect(engine, "Hello", max_new_tokens=12, temperature=0.0, stop_on_eos=False)
    monkeypatch.setattr(grammar_limits, "MASK_BURST_S", 60.0)  # slow, but within its budget
    slow_mask = Constraint.compute_mask

    def slow(self: Constraint, width: int):  # type: ignore[no-untyped-def]
        time.sleep(0.03)
        return slow_mask(self, width)

    monkeypatch.setattr(Constraint, "compute_mask", slow)
    regex = GrammarSpec("regex", "[a-c]{10}")
    constrained, plain = await asyncio.gather(
        collect(engine, "Hello", grammar=regex, max_new_tokens=12, temperature=0.8, seed=1),
        collect(engine, "Hello", max_new_tokens=12, temperature=0.0, stop_on_eos=False))
    assert re.fullmatch("[a-c]{10}", text(constrained)), text(constrained)
    assert constrained[-1].finish_reason is FinishReason.EOS_TOKEN
    assert [e.token_id for e in plain] == [e.token_id for e in alone]
    slow_s, plain_s = constrained[-1].usage.total_time_s, plain[-1].usage.total_time_s  # type: ignore[union-attr]
    assert plain_s < slow_s / 2, (plain_s, slow_s)  # 10 masks of 30 ms did not hold the plain row
