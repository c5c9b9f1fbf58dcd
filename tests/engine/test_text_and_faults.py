"""Streamed text (stop strings, UTF-8 with BPE), logprobs, and fault isolation."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from nanoserve.engine.detokenizer import IncrementalDecoder, StopMatcher
from nanoserve.engine.types import FinishReason, InvalidRequest, SamplingParams
from nanoserve.model.checkpoint import Checkpoint, load_checkpoint, save_checkpoint
from nanoserve.model.config import GPTConfig
from nanoserve.model.gpt import GPT
from nanoserve.model.reference import reference_generate
from nanoserve.model.tokenizer import EOT, BPETokenizer, CharTokenizer
from tests.engine.conftest import EngineFactory, collect, token_ids
from tests.faults import injected_faults

MULTIBYTE = "héllo wörld, ça va? 日本語のテキスト 🎉🎉 naïve café — ünïcödé ∑∫ " * 4


@pytest.fixture(scope="module")
def bpe() -> BPETokenizer:
    # A small vocabulary leaves most multi-byte characters split over several byte tokens.
    return BPETokenizer.train(MULTIBYTE + "plain ascii text for merges " * 10, vocab_size=300)


def test_bpe_incremental_decode_never_emits_half_a_character(bpe: BPETokenizer) -> None:
    ids = bpe.encode(MULTIBYTE)
    assert len(ids) > len(MULTIBYTE.encode()) / 4  # really split
    assert any("\ufffd" in bpe.decode([i]) for i in ids)  # some tokens are partial characters
    dec = IncrementalDecoder(bpe)
    deltas = [dec.add(i) for i in ids]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) + dec.flush() == MULTIBYTE


def test_a_character_vocabulary_streams_each_token_as_its_text_without_decoding() -> None:
    # CharTokenizer declares its pieces: every delta is the token's character, the deltas add up
    # to decode(ids), and the decoder never calls decode (the per-token cost it saves).
    tok = CharTokenizer.train("hello world!\n" + EOT)
    ids = tok.encode("hello\nworld" + EOT + "!!")
    calls = []
    tok.decode = lambda ids: calls.append(ids) or CharTokenizer.decode(tok, ids)  # type: ignore[method-assign]
    dec = IncrementalDecoder(tok)
    deltas = [dec.add(i) for i in ids]
    assert deltas == [tok.vocab[i] for i in ids] and not calls
    assert "".join(deltas) + dec.flush() == CharTokenizer.decode(tok, ids)


def test_stop_matcher_holds_back_prefixes() -> None:
    m = StopMatcher(("END", "\n\n"))
    assert m.feed("abc E") == ("abc ", False)
    assert m.feed("N") == ("", False)
    assert m.feed("x") == ("ENx", False)  # not a stop after all: released
    assert m.feed("\n") == ("", False)
    assert m.feed("\nrest") == ("", True)


def test_stop_matcher_keeping_the_stop_emits_every_token_whole() -> None:
    # TGI's rule: nothing held back, the stop string stays in the text, found across tokens.
    m = StopMatcher(("END", "\n\n"), keep=True)
    assert m.feed("abc E") == ("abc E", False)
    assert m.feed("N") == ("N", False)
    assert m.feed("x") == ("x", False)
    assert m.feed("E") == ("E", False)
    assert m.feed("ND!") == ("ND!", True)  # "END" spans the last two feeds
    assert m.flush() == ""
    m = StopMatcher(("\n\n",), keep=True)
    assert m.feed("a\n") == ("a\n", False) and m.feed("\nb") == ("\nb", True)


async def test_keep_stop_ends_at_the_stop_with_its_text(make_engine: EngineFactory) -> None:
    engine = make_engine()
    free = await collect(engine, "Hello", max_new_tokens=60, temperature=0.0, stop_on_eos=False)
    text = "".join(e.text for e in free)
    stop = text[20:23]
    end = text.index(stop) + len(stop)
    events = await collect(engine, "Hello", max_new_tokens=60, temperature=0.0, stop=(stop,),
                           keep_stop=True, stop_on_eos=False)
    assert events[-1].finish_reason is FinishReason.STOP_SEQUENCE
    assert [e.text for e in events] == list(text[:end])  # char model: one character a token


async def test_stop_string_spanning_tokens_is_never_streamed(make_engine: EngineFactory) -> None:
    engine = make_engine()
    free = await collect(engine, "Hello", max_new_tokens=60, temperature=0.0, stop_on_eos=False)
    text = "".join(e.text for e in free)
    stop = text[20:23]  # three characters = three tokens of the char model
    cut = text.index(stop)
    events = await collect(engine, "Hello", max_new_tokens=60, temperature=0.0, stop=(stop, "never!"))
    assert events[-1].finish_reason is FinishReason.STOP_SEQUENCE
    streamed = "".join(e.text for e in events)
    assert streamed == text[:cut]
    # Tokens after the stop's first character were produced but their text held back.
    assert any(e.text == "" for e in events[:-1]) or len(events) == cut + 3


async def test_bpe_engine_streams_whole_characters(
    tmp_path: Path, bpe: BPETokenizer, make_engine: EngineFactory
) -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=bpe.vocab_size, block_size=32, n_layer=1, n_head=2, n_embd=32))
    ckpt = load_checkpoint(save_checkpoint(tmp_path / "bpe", model, bpe, name="bpe-test"))
    engine = make_engine(ckpt)
    events = await collect(engine, "日本", max_new_tokens=40, temperature=1.5, seed=5, stop_on_eos=False)
    ids = token_ids(events)
    assert "".join(e.text for e in events) == bpe.decode(ids)
    partial = [e.text for e in events[:-1] if e.text.endswith("\ufffd")]
    assert not partial


async def test_logprobs_and_top_tokens(make_engine: EngineFactory, lively: Checkpoint) -> None:
    engine = make_engine()
    events = await collect(engine, "Hello", max_new_tokens=5, temperature=0.0, logprobs=True, top_n_tokens=3)
    model = lively.build_model("cpu")
    ids = lively.tokenizer.encode("Hello")
    for e in events:
        assert e.token_id is not None and e.logprob is not None and len(e.top_tokens) == 3
        with torch.no_grad():
            expected = model(torch.tensor([ids]))[0, -1].log_softmax(-1)
        assert e.logprob == pytest.approx(expected[e.token_id].item(), abs=1e-4)
        assert e.top_tokens[0].id == e.token_id  # greedy: the chosen token is the most likely
        assert [t.logprob for t in e.top_tokens] == sorted((t.logprob for t in e.top_tokens), reverse=True)
        assert e.top_tokens[0].text == lively.tokenizer.decode([e.token_id])
        ids.append(e.token_id)
    plain = await collect(engine, "Hello", max_new_tokens=2, temperature=0.0)
    assert all(e.logprob is None and e.top_tokens == () for e in plain)


@pytest.mark.parametrize("kind", ["nan", "raise"])
async def test_failing_request_does_not_take_down_batch_mates(
    make_engine: EngineFactory, lively: Checkpoint, kind: str
) -> None:
    with injected_faults(f"{kind}:POISON"):
        engine = make_engine(max_seqs=4)
    prompts = ["Hello", "abc POISON", "xyz", "The end"]
    results = await asyncio.gather(
        *(collect(engine, p, max_new_tokens=30, temperature=0.0, stop_on_eos=False) for p in prompts)
    )
    model = lively.build_model("cpu")
    for prompt, events in zip(prompts, results, strict=True):
        if "POISON" in prompt:
            assert events[-1].finish_reason is FinishReason.ERROR
            assert events[-1].error and ("non-finite" in events[-1].error or "injected" in events[-1].error)
        else:
            expected = reference_generate(model, lively.tokenizer.encode(prompt), 30, policy="shift")
            assert token_ids(events) == expected
    assert engine.health()
    again = await collect(engine, "fine", max_new_tokens=3, temperature=0.0)
    assert again[-1].finish_reason is FinishReason.LENGTH


async def test_a_request_whose_sampling_raises_fails_alone(
    make_engine: EngineFactory, lively: Checkpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Whatever a request's parameters make the sampler raise, only that request ends in an error:
    # the step bisects the batch and its mates get the tokens they get alone.
    engine = make_engine(max_seqs=4)
    real_sample = engine.runner.next_tokens

    def sample(reqs, logits):  # type: ignore[no-untyped-def]
        if any(r.seed == 666 for r in reqs):
            raise OverflowError("Overflow when unpacking long long")
        return real_sample(reqs, logits)

    monkeypatch.setattr(engine.runner, "next_tokens", sample)
    prompts = ["Hello", "abc", "xyz", "The end"]
    seeds = [1, 666, 2, 3]
    results = await asyncio.gather(*(
        collect(engine, p, max_new_tokens=20, temperature=0.0, stop_on_eos=False, seed=s)
        for p, s in zip(prompts, seeds, strict=True)
    ))
    model = lively.build_model("cpu")
    for prompt, seed, events in zip(prompts, seeds, results, strict=True):
        if seed == 666:
            assert events[-1].finish_reason is FinishReason.ERROR
            assert events[-1].error and "sampling failed: OverflowError" in events[-1].error
        else:
            expected = reference_generate(model, lively.tokenizer.encode(prompt), 20, policy="shift")
            assert token_ids(events) == expected
    assert engine.health()


@pytest.mark.parametrize("field", ["top_k", "top_n_tokens", "truncate", "max_new_tokens"])
async def test_counts_beyond_a_c_int_are_refused_before_queueing(
    make_engine: EngineFactory, field: str
) -> None:
    engine = make_engine()
    for value in (2**31, 2**63, 2**64):
        with pytest.raises(InvalidRequest, match=field):
            await engine.generate("Hello", SamplingParams(**{field: value}))


async def test_a_top_k_of_the_whole_vocabulary_or_more_is_off(
    make_engine: EngineFactory, lively: Checkpoint
) -> None:
    engine = make_engine()
    vocab = lively.tokenizer.vocab_size
    plain = await collect(engine, "Hello", max_new_tokens=12, temperature=1.0, seed=7)
    for k in (vocab, vocab + 1, 2**31 - 1):
        same = await collect(engine, "Hello", max_new_tokens=12, temperature=1.0, seed=7, top_k=k)
        assert token_ids(same) == token_ids(plain)
