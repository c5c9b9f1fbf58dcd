"""Prompt prefix reuse (nanoserve/engine/prefix_cache.py): where a request is placed, and that reuse
never changes what is generated (a chat's next turn, concurrent prompts, eviction, cropping)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from nanoserve.engine.engine import Engine
from nanoserve.engine.prefix_cache import Placement, PrefixCache, common_prefix, tenant_of
from nanoserve.engine.request import Request
from nanoserve.engine.types import FinishReason, SamplingParams, TokenEvent
from nanoserve.model.checkpoint import Checkpoint, load_checkpoint
from tests.engine.conftest import EngineFactory, make_lively_checkpoint
from tests.engine.test_llama_family import lively_llama  # noqa: F401  # a fixture
from tests.faults import injected_faults

GREEDY = {"temperature": 0.0, "stop_on_eos": False, "logprobs": True}


@pytest.fixture(scope="module")
def wide(tmp_path_factory: pytest.TempPathFactory) -> Checkpoint:
    """A lively model with room for a few chat turns (a 256-token window)."""
    return load_checkpoint(make_lively_checkpoint(tmp_path_factory.mktemp("wide") / "ckpt", block_size=256))


# ---- placement (no model) ------------------------------------------------------------------

def test_common_prefix() -> None:
    assert common_prefix([1, 2, 3], [1, 2, 3, 4], 10) == 3
    assert common_prefix([1, 2, 3, 4], [1, 2, 9, 4], 10) == 2
    assert common_prefix([1, 2, 3], [1, 2, 3], 2) == 2  # the limit
    assert common_prefix([5, 2], [1, 2], 10) == 0
    assert common_prefix([], [1], 10) == 0
    a = list(range(1000))
    for k in (1, 2, 3, 500, 998, 999):  # the bisection at every kind of split
        assert common_prefix(a, [*a[:k], -1, *a[k + 1 :]], 1000) == k


def _running(slot: int, ctx: list[int], n_cached: int, client: str | None = None,
             salt: str | None = None) -> Request:
    return SimpleNamespace(slot=slot, ctx=ctx, n_cached=n_cached, client=client,  # type: ignore[return-value]
                           params=SamplingParams(cache_salt=salt))


def test_a_follow_up_takes_the_slot_whose_whole_content_leads_it() -> None:
    cache = PrefixCache(enabled=True)
    cache.remember(2, [1, 2, 3, 4])
    cache.remember(3, [7, 8])
    assert cache.place([1, 2, 3, 4, 5, 6], [0, 1, 2, 3], []) == Placement(2, 4)
    assert (cache.lookups, cache.hits, cache.reused_tokens) == (1, 1, 4)


def test_a_partial_match_is_copied_so_the_warm_slot_survives() -> None:
    cache = PrefixCache(enabled=True)
    cache.remember(0, [1, 2, 3, 4])
    # Only [1, 2] is shared: copied into the cold slot 1, slot 0 keeps its four tokens.
    assert cache.place([1, 2, 9], [0, 1], []) == Placement(1, 2, source=0)
    # With no cold slot left the slot used longest ago is taken; if that is the match, in place.
    cache.remember(1, [5, 6])
    assert cache.place([1, 2, 9], [0, 1], []) == Placement(0, 2)


def test_a_slot_copied_from_counts_as_recently_used() -> None:
    cache = PrefixCache(enabled=True)
    cache.remember(0, [1, 2, 3, 4])  # a shared system prompt, say
    cache.remember(1, [5, 6])
    assert cache.place([1, 2, 9], [0, 1, 2], []) == Placement(2, 2, source=0)  # slot 1 is the older now
    assert cache.place([7, 7], [0, 1], []) == Placement(1)


def test_the_last_prompt_token_is_always_fed() -> None:
    cache = PrefixCache(enabled=True)
    cache.remember(0, [1, 2, 3])
    assert cache.place([1, 2, 3], [0], []) == Placement(0, 2)  # the same prompt again
    assert cache.place([1], [0], []) == Placement(0, 0)


def test_no_match_takes_a_cold_slot_then_the_least_recently_used() -> None:
    cache = PrefixCache(enabled=True)
    cache.remember(0, [1, 2])
    cache.remember(2, [3, 4])
    assert cache.place([9, 9, 9], [0, 1, 2], []) == Placement(1)
    cache.remember(1, [5, 6])
    assert cache.place([9, 9, 9], [0, 1, 2], []) == Placement(0)
    assert (cache.lookups, cache.hits) == (2, 0)


def test_a_running_sequence_is_copied_from_never_taken() -> None:
    cache = PrefixCache(enabled=True)
    busy = _running(3, [1, 2, 3, 4, 5], n_cached=4)  # its last token is not in its cache yet
    assert cache.place([1, 2, 3, 4, 5, 6], [0, 1], [busy]) == Placement(0, 4, source=3)


A, B = ("client", "key:a"), ("client", "key:b")


def test_a_prefix_is_reused_only_by_the_tenant_that_left_it() -> None:
    cache = PrefixCache(enabled=True)
    cache.remember(0, [1, 2, 3, 4], A)
    # B's probe shares A's tokens but not A's tenant: a cold slot, nothing reused or counted.
    assert cache.place([1, 2, 3, 4, 5], [0, 1], [], B) == Placement(1)
    assert (cache.hits, cache.reused_tokens) == (0, 0)
    assert cache.held(0) == [1, 2, 3, 4]  # and A's slot stays warm for A
    assert cache.place([1, 2, 3, 4, 5], [0, 1], [], A) == Placement(0, 4)
    # A running sequence is copied from by its own tenant only.
    cache = PrefixCache(enabled=True)
    busy = _running(3, [1, 2, 3, 4, 5], n_cached=4, client="key:a")
    assert cache.place([1, 2, 3, 9], [0, 1], [busy], B) == Placement(0)
    assert cache.place([1, 2, 3, 9], [0, 1], [busy], A) == Placement(0, 3, source=3)


def test_a_salt_shares_across_clients_and_only_with_itself() -> None:
    salted = _running(3, [1, 2, 3, 4, 5], n_cached=4, client="key:a", salt="team")
    cache = PrefixCache(enabled=True)
    assert tenant_of(salted) == ("salt", "team")
    assert cache.place([1, 2, 3, 9], [0], [salted], ("salt", "team")) == Placement(0, 3, source=3)
    assert cache.place([1, 2, 3, 9], [0], [salted], A) == Placement(0)  # its own client, unsalted
    assert cache.place([1, 2, 3, 9], [0], [salted], ("salt", "other")) == Placement(0)


def test_shared_reuses_across_tenants() -> None:
    cache = PrefixCache(enabled=True, shared=True)
    cache.remember(0, [1, 2, 3, 4], A)
    assert cache.place([1, 2, 3, 4, 5], [0, 1], [], B) == Placement(0, 4)


def test_disabled_reuses_nothing_and_forgets_everything() -> None:
    cache = PrefixCache(enabled=False)
    cache.remember(1, [1, 2, 3])
    assert cache.warm_slots == 0
    assert cache.place([1, 2, 3, 4], [1, 2], []) == Placement(1)
    assert cache.lookups == 0


# ---- the engine: the same tokens and logprobs with and without reuse -------------------------

async def _run(engine: Engine, prompt: str, n: int) -> list[TokenEvent]:
    stream = await engine.generate(prompt, SamplingParams(max_new_tokens=n, **GREEDY))
    events = [e async for e in stream]
    assert events[-1].finish_reason is FinishReason.LENGTH, events[-1]
    return events


def _same(a: list[TokenEvent], b: list[TokenEvent], backend: str) -> None:
    assert [e.token_id for e in a] == [e.token_id for e in b]
    got, want = [e.logprob for e in a], [e.logprob for e in b]
    if backend == "native":  # rows are computed alone: the reused keys and values are the same bits
        assert got == want
    else:  # torch's kernels may round a different forward shape differently in the last bits
        assert got == pytest.approx(want, abs=1e-4)


async def test_a_chat_turn_reuses_the_previous_turn_and_generates_the_same(
    make_engine: EngineFactory, wide: Checkpoint, backend: str
) -> None:
    engines = [make_engine(wide, max_seqs=3, prefix_cache=on) for on in (True, False)]
    turns = ["Hello there, how are you?", " Fine, thanks. And", " So it goes on."]
    history = ""
    results: list[list[list[TokenEvent]]] = [[], []]
    for turn in turns:
        history += turn
        for engine, out in zip(engines, results, strict=True):
            out.append(await _run(engine, history, 10))
        history += "".join(e.text for e in results[0][-1])
    for a, b in zip(*results, strict=True):
        _same(a, b, backend)
    on, off = (e.stats().extra for e in engines)
    assert off["prefix_cache_lookups_total"] == 0
    assert (on["prefix_cache_lookups_total"], on["prefix_cache_hits_total"]) == (3, 2)
    # Each follow-up reused the whole previous conversation but the answer's last token (sampled,
    # never fed); the char tokenizer encodes the answer's text back to its tokens.
    first, second = len(turns[0]) + 10 - 1, len(turns[0] + turns[1]) + 20 - 1
    assert on["prefix_cache_reused_tokens_total"] == first + second
    assert on["prefill_tokens_total"] == off["prefill_tokens_total"] - first - second


async def test_concurrent_prompts_sharing_a_prefix(
    make_engine: EngineFactory, wide: Checkpoint, backend: str
) -> None:
    engines = [make_engine(wide, max_seqs=3, prefix_cache=on) for on in (True, False)]
    system = "You are a helpful assistant who answers briefly. "
    results = []
    for engine in engines:
        await _run(engine, system + "Hi!", 4)  # leaves the shared prefix in a slot
        # Five at once over three slots: copies from the warm slot and from running ones.
        results.append(await asyncio.gather(*(_run(engine, system + q, 12) for q in "ABCDE")))
    for a, b in zip(*results, strict=True):
        _same(a, b, backend)
    stats = engines[0].stats().extra
    assert stats["prefix_cache_hits_total"] == 5
    assert stats["prefix_cache_reused_tokens_total"] == 5 * len(system)


async def test_more_prompts_than_slots_evict_the_least_recently_used(
    make_engine: EngineFactory, wide: Checkpoint, backend: str
) -> None:
    engines = [make_engine(wide, max_seqs=2, prefix_cache=on) for on in (True, False)]
    prompts = [f"{c} is the letter of the day." for c in "PQRST"]
    results = [[await _run(e, p, 6) for p in [*prompts, prompts[4], prompts[0]]] for e in engines]
    for a, b in zip(*results, strict=True):
        _same(a, b, backend)
    stats = engines[0].stats().extra
    # Two slots hold the last two prompts: the repeat of T reuses, P was evicted long ago.
    assert (stats["prefix_cache_lookups_total"], stats["prefix_cache_hits_total"]) == (7, 1)
    assert stats["prefix_cache_reused_tokens_total"] == len(prompts[4]) - 1


@pytest.mark.parametrize("policy", ["shift", "sliding"])
async def test_a_cropped_sequence_leaves_only_what_its_slot_holds(
    make_engine: EngineFactory, lively: Checkpoint, backend: str, policy: str
) -> None:
    # The 32-token window: 40 new tokens crop the context (and re-prefill it from position 0).
    engines = [make_engine(lively, max_seqs=2, crop_policy=policy, prefix_cache=on) for on in (True, False)]
    results: list[list[list[TokenEvent]]] = [[], []]
    for engine, out in zip(engines, results, strict=True):
        out.append(await _run(engine, "Once upon a time", 40))
    assert engines[0].stats().extra["context_shifts_total"] > 0
    held = engines[0].scheduler.prefix.held(0)
    assert held is not None and len(held) <= 32
    text = lively.tokenizer.decode(lively.tokenizer.encode("Once upon a time") + [
        e.token_id for e in results[0][0] if e.token_id is not None])
    assert lively.tokenizer.decode(held) in text  # the cropped context, not the original prompt
    # The original prompt again (its slot no longer starts with it), then what the slot holds.
    for engine, out in zip(engines, results, strict=True):
        out.append(await _run(engine, "Once upon a time", 5))
        out.append(await _run(engine, lively.tokenizer.decode(held[:20]), 5))
    for a, b in zip(*results, strict=True):
        _same(a, b, backend)
    assert engines[0].stats().extra["prefix_cache_reused_tokens_total"] >= 19


async def test_a_failed_sequence_leaves_its_slot_cold(make_engine: EngineFactory, lively: Checkpoint) -> None:
    with injected_faults("nan:FAULTY"):
        engine = make_engine(lively, max_seqs=2)
    stream = await engine.generate("FAULTY once", SamplingParams(max_new_tokens=4, temperature=0.0))
    assert [e async for e in stream][-1].finish_reason is FinishReason.ERROR
    assert engine.scheduler.prefix.warm_slots == 0
    await _run(engine, "fine once", 4)
    assert engine.scheduler.prefix.warm_slots == 1


async def test_deterministic_mode_reuses_only_on_a_batch_invariant_backend(
    make_engine: EngineFactory, backend: str
) -> None:
    engine = make_engine(deterministic=True)
    assert engine.info()["prefix_cache"] is (backend == "native")
    assert make_engine(prefix_cache=False).info()["prefix_cache"] is False


async def test_a_preempted_request_copies_back_what_a_running_twin_holds(
    make_engine: EngineFactory, wide: Checkpoint, backend: str
) -> None:
    # Client a runs the same greedy prompt twice in both slots; b arrives and one of a's steps
    # aside. When it comes back, its twin's cache holds its whole context (the same tokens, no
    # crop in the window): it copies it, and still generates what the prompt does alone.
    alone = await _run(make_engine(wide, prefix_cache=False), "Hello", 200)
    engine = make_engine(wide, max_seqs=2, max_queue=8)
    params = SamplingParams(max_new_tokens=200, **GREEDY)
    with engine._cond:  # both admitted in one step, whatever the machine's load
        streams = [await engine.generate("Hello", params, client="a") for _ in range(2)]
    end = asyncio.get_running_loop().time() + 30
    while engine.scheduler.generated_tokens < 40:
        assert asyncio.get_running_loop().time() < end, "the engine made no progress"
        await asyncio.sleep(0.005)
    other = await engine.generate("xyz", SamplingParams(max_new_tokens=3), client="b")
    assert [e async for e in other][-1].finish_reason is FinishReason.LENGTH
    for stream in streams:
        _same([e async for e in stream], alone, backend)
    stats = engine.stats().extra
    assert stats["preemptions_total"] == 1
    # Admitted together, the twins copied nothing from each other; the return copies 20 and more.
    assert stats["prefix_cache_reused_tokens_total"] >= 20


async def test_a_request_scoring_its_prompt_reuses_nothing(
    make_engine: EngineFactory, wide: Checkpoint, backend: str
) -> None:
    # Prompt logprobs need every prompt position's logits: a warm prefix must not skip any.
    engines = [make_engine(wide, prefix_cache=on) for on in (True, False)]
    scored = SamplingParams(max_new_tokens=4, echo=True, prompt_logprobs=2, **GREEDY)
    results = []
    for engine in engines:
        first = await _run(engine, "Hello there", 6)
        follow = "Hello there" + "".join(e.text for e in first)
        results.append([e async for e in await engine.generate(follow, scored)])
    assert engines[0].stats().extra["prefix_cache_reused_tokens_total"] == 0
    with_cache, without = (events[0].prompt for events in results)
    assert with_cache is not None and without is not None
    assert len(with_cache.tokens) == len(without.tokens) > 6
    got, want = ([t.logprob for t in p.tokens] for p in (with_cache, without))
    assert got == pytest.approx(want, abs=1e-4)
    _same(*results, backend)


@pytest.mark.backends("native")
async def test_bfloat16_weights_and_cache_reuse_the_same_bits(
    make_engine: EngineFactory, wide: Checkpoint, backend: str
) -> None:
    # A bf16 model keeps its KV cache in bf16: a reused prefix is the same rounded numbers.
    engines = [make_engine(wide, dtype="bfloat16", prefix_cache=on) for on in (True, False)]
    first = [await _run(e, "Hello there, how are you?", 10) for e in engines]
    follow = "Hello there, how are you?" + "".join(e.text for e in first[0]) + " Good."
    second = [await _run(e, follow, 10) for e in engines]
    _same(*first, backend)
    _same(*second, backend)
    assert engines[0].stats().extra["prefix_cache_hits_total"] == 1


@pytest.mark.backends("torch", "torch-cuda")  # where the Llama family runs
async def test_rotary_positions_reuse_a_prefix_at_its_positions(
    make_engine: EngineFactory, lively_llama: Checkpoint, backend: str  # noqa: F811
) -> None:
    # Rotary keys are rotated by their absolute position in the slot: a reused prefix keeps them.
    engines = [make_engine(lively_llama, prefix_cache=on) for on in (True, False)]
    first = [await _run(e, "Hi there", 8) for e in engines]
    follow = "Hi there" + "".join(e.text for e in first[0]) + " ok"
    second = [await _run(e, follow, 8) for e in engines]
    _same(*first, backend)
    _same(*second, backend)
    assert engines[0].stats().extra["prefix_cache_reused_tokens_total"] == len("Hi there") + 8 - 1


async def _first_turn(engine: Engine, prompt: str, client: str, salt: str | None = None) -> None:
    params = SamplingParams(max_new_tokens=2, cache_salt=salt, **GREEDY)
    stream = await engine.generate(prompt, params, client=client)
    assert [e async for e in stream][-1].finish_reason is FinishReason.LENGTH


async def test_the_engine_reuses_a_prefix_within_a_client_or_a_salt_only(
    make_engine: EngineFactory, wide: Checkpoint
) -> None:
    engine = make_engine(wide, max_seqs=4)
    secret = "The PIN of the vault is 48213975. Keep it safe."
    await _first_turn(engine, secret, "key:a")
    await _first_turn(engine, secret[:25] + "9 and more", "key:b")  # another client's probe
    assert engine.stats().extra["prefix_cache_reused_tokens_total"] == 0
    await _first_turn(engine, secret[:25] + "9 and more", "key:a")  # the same client's
    assert engine.stats().extra["prefix_cache_reused_tokens_total"] == 25
    await _first_turn(engine, secret, "key:c", salt="s")
    await _first_turn(engine, secret, "key:d", salt="s")  # a shared salt: reused across clients
    assert engine.stats().extra["prefix_cache_reused_tokens_total"] == 25 + len(secret) - 1
    shared = make_engine(wide, max_seqs=4, prefix_cache_shared=True)
    await _first_turn(shared, secret, "key:a")
    await _first_turn(shared, secret[:25] + "9 and more", "key:b")
    assert shared.stats().extra["prefix_cache_reused_tokens_total"] == 25
