"""Structured output inside the engine, on every backend (make_engine runs each test once per
backend: the native step's sampler and greedy pick, the torch sampler, torch on CUDA where present):
the mask holds on greedy and sampled rows, ends the text when the grammar is complete, and leaves
the unconstrained rows of the same steps alone."""

from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import pytest

from nanoserve.engine.types import FinishReason, GrammarSpec, InvalidRequest
from tests.conftest import TINY_VOCAB_TEXT
from tests.engine.conftest import EngineFactory, collect, token_ids

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "b": {"type": "boolean"}},
          "required": ["n", "b"], "additionalProperties": False}
JSON = GrammarSpec("json_schema", json.dumps(SCHEMA))


def text(events: list) -> str:  # type: ignore[type-arg]
    return "".join(e.text for e in events)


async def test_json_schema_greedy_and_sampled(make_engine: EngineFactory) -> None:
    engine = make_engine()
    runs = [await collect(engine, "Hello", max_new_tokens=40, temperature=0.0, grammar=JSON)]
    for seed in range(4):
        runs.append(await collect(engine, "Hello", max_new_tokens=40, temperature=1.0, top_p=0.9,
                                  seed=seed, grammar=JSON))
    for events in runs:
        assert events[-1].finish_reason is FinishReason.EOS_TOKEN, text(events)
        jsonschema.validate(json.loads(text(events)), SCHEMA)


async def test_regex_beside_an_unconstrained_row(make_engine: EngineFactory) -> None:
    engine = make_engine()
    free = token_ids(await collect(engine, "Hello", max_new_tokens=12, temperature=0.0, stop_on_eos=False))
    regex = GrammarSpec("regex", "[a-c]{2}[0-9]{3}")
    constrained, plain = await asyncio.gather(
        collect(engine, "Hello", max_new_tokens=12, temperature=0.8, seed=3, grammar=regex),
        collect(engine, "Hello", max_new_tokens=12, temperature=0.0, stop_on_eos=False),
    )
    assert re.fullmatch("[a-c]{2}[0-9]{3}", text(constrained)), text(constrained)
    assert constrained[-1].finish_reason is FinishReason.EOS_TOKEN
    assert token_ids(plain) == free  # the mask touched only its own row


@pytest.mark.parametrize(("spec", "says"), [
    (GrammarSpec("json_schema", '{"type": "nonsense"}'), "invalid JSON schema"),
    (GrammarSpec("regex", "(open"), "invalid regular expression"),
    (GrammarSpec("regex", "é+"), "cannot express"),  # no such character in the vocabulary
])
async def test_bad_grammars_are_refused_before_queueing(make_engine: EngineFactory, spec: GrammarSpec,
                                                        says: str) -> None:
    engine = make_engine()
    with pytest.raises(InvalidRequest, match=says) as info:
        await collect(engine, "Hello", grammar=spec, grammar_param="response_format")
    assert info.value.param == "response_format"
    assert engine.stats().waiting == 0 and engine.stats().running == 0


def test_a_word_vocabulary_is_refused_naming_the_field() -> None:
    from nanoserve.engine.grammar import Grammars
    from nanoserve.model.tokenizer import WordTokenizer

    grammars = Grammars(WordTokenizer.train("to be or not to be"))
    with pytest.raises(InvalidRequest, match="cannot be constrained") as info:
        grammars.constraint(GrammarSpec("regex", "to+"), "parameters.grammar")
    assert info.value.param == "parameters.grammar"


def test_a_failed_grammar_leaves_its_row_unmasked_and_ends_its_request() -> None:
    import torch

    from nanoserve.engine.grammar import GrammarMask, Grammars
    from nanoserve.model.tokenizer import CharTokenizer

    tok = CharTokenizer.train(TINY_VOCAB_TEXT)
    constraint = Grammars(tok).constraint(GrammarSpec("regex", "ab"), "grammar")
    # float32 on CPU goes through numpy, bfloat16 through torch (the path of GPU logits).
    for dtype in (torch.float32, torch.bfloat16):
        logits = torch.zeros((2, tok.vocab_size), dtype=dtype)
        GrammarMask().apply([(1, constraint)], logits)
        allowed = (logits[1] > float("-inf")).nonzero().flatten().tolist()
        assert allowed == tok.encode("a") and bool((logits[0] == 0).all())  # row 0 untouched
        both = torch.zeros((1, tok.vocab_size), dtype=dtype)
        GrammarMask().apply([(0, constraint)], both)  # every row: one fill
        assert (both[0] > float("-inf")).nonzero().flatten().tolist() == tok.encode("a")
    constraint.accept(tok.encode("z")[0])  # a token the mask forbade puts the matcher in error
    assert constraint.failure is not None and "the grammar failed while generating" in constraint.failure
    assert not constraint.complete  # an error is not the grammar's end
    logits = torch.zeros((1, tok.vocab_size))
    GrammarMask().apply([(0, constraint)], logits)
    assert bool((logits == 0).all())  # not masked to nothing: the request ends by name instead
