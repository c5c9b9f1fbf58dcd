"""Structured output on both API families, against a real server on a BPE checkpoint.

The checkpoint has random weights: whatever the model prefers, the grammar's mask must make every
answer parse and validate. Refusals (invalid or unwritable grammars) are checked on a char model.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest

from tests.conftest import make_tiny_bpe_checkpoint
from tests.error_shapes import error_kind, error_message
from tests.server.server import REPO_ROOT, ServerProcess, running_server

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "ok"],
    "additionalProperties": False,
}
SMALL = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                        "b": {"type": "boolean"}}, "required": ["n", "b"],
         "additionalProperties": False}
CORPUS = ('{"name": "Ada", "age": 36, "tags": ["math", "poetry"], "ok": true}\n'
          "Plain prose, with commas: colons, [brackets] and {braces}. 0123456789 null false\n") * 30
DATE = r"[0-9]{4}-[0-9]{2}-[0-9]{2}"  # \d would take any Unicode digit, as in Rust's regex
ENV = {"NANOSERVE_MAX_SEQS": "8", "OMP_NUM_THREADS": "1"}


def make_json_bpe_checkpoint(path: Path) -> Path:
    """Random weights, a BPE vocabulary trained on JSON-ish text, a window of 256."""
    return make_tiny_bpe_checkpoint(path, CORPUS, vocab_size=400, block_size=256, name="tiny-json")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    with running_server(make_json_bpe_checkpoint(tmp_path_factory.mktemp("ckpt") / "bpe"), env=ENV) as s:
        yield s


@pytest.fixture(scope="module")
def names_server() -> Iterator[ServerProcess]:
    """The shipped baby-names char model: lower-case letters and a newline, no `{`, no digits."""
    with running_server(REPO_ROOT / "checkpoints" / "baby-names", env=ENV) as s:
        yield s


@pytest.fixture(scope="module")
def char_server(tiny_checkpoint: Path) -> Iterator[ServerProcess]:
    """A char model whose vocabulary is printable ASCII: it can write JSON one character a step."""
    with running_server(tiny_checkpoint, env=ENV) as s:
        yield s


def test_openai_json_schema_at_concurrency(server: ServerProcess) -> None:
    client = openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}

    async def one(seed: int) -> str:
        r = await client.chat.completions.create(
            model="any", messages=[{"role": "user", "content": "A person as JSON"}], max_tokens=120,
            temperature=1.0, seed=seed, response_format=fmt,  # type: ignore[arg-type]
        )
        assert r.choices[0].finish_reason == "stop"
        return r.choices[0].message.content or ""

    async def all_of() -> list[str]:
        return await asyncio.gather(*(one(seed) for seed in range(8)))

    for text in asyncio.run(all_of()):
        jsonschema.validate(json.loads(text), SCHEMA)


def test_completions_json_schema_greedy_and_json_object(server: ServerProcess) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    r = httpx.post(server.base_url + "/v1/completions", timeout=60, json={
        "prompt": "{", "max_tokens": 120, "temperature": 0, "response_format": fmt})
    assert r.status_code == 200, r.text
    jsonschema.validate(json.loads(r.json()["choices"][0]["text"]), SCHEMA)
    for seed in range(4):
        r = httpx.post(server.base_url + "/v1/completions", timeout=60, json={
            "prompt": "{", "max_tokens": 200, "seed": seed, "response_format": {"type": "json_object"}})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "stop", choice
        assert isinstance(json.loads(choice["text"]), dict), choice


def test_tgi_grammar_json_and_regex(server: ServerProcess) -> None:
    for seed in range(4):
        r = httpx.post(server.base_url + "/generate", timeout=60, json={
            "inputs": "JSON:", "parameters": {"max_new_tokens": 120, "do_sample": True, "seed": seed,
                                              "grammar": {"type": "json", "value": SCHEMA}}})
        assert r.status_code == 200, r.text
        jsonschema.validate(json.loads(r.json()["generated_text"]), SCHEMA)
        r = httpx.post(server.base_url + "/generate", timeout=60, json={
            "inputs": "Date:", "parameters": {"max_new_tokens": 30, "do_sample": True, "seed": seed,
                                              "grammar": {"type": "regex", "value": DATE}}})
        assert r.status_code == 200, r.text
        assert re.fullmatch(DATE, r.json()["generated_text"]), r.json()


def test_tgi_stream_and_json_schema_shape(server: ServerProcess) -> None:
    """generate_stream honours the grammar too; TGI's json_schema shape and a schema sent as text."""
    body = {"inputs": "JSON:", "parameters": {"max_new_tokens": 120, "do_sample": True, "seed": 5,
                                              "grammar": {"type": "json_schema",
                                                          "value": {"name": "p", "schema": SCHEMA}}}}
    with httpx.stream("POST", server.base_url + "/generate_stream", json=body, timeout=60) as r:
        assert r.status_code == 200
        events = [json.loads(line[5:]) for line in r.iter_lines() if line.startswith("data:")]
    streamed = "".join(e["token"]["text"] for e in events)
    jsonschema.validate(json.loads(streamed), SCHEMA)
    assert events[-1]["generated_text"] == streamed
    body["parameters"]["grammar"] = {"type": "json", "value": json.dumps(SCHEMA)}
    r = httpx.post(server.base_url + "/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    jsonschema.validate(json.loads(r.json()["generated_text"]), SCHEMA)


def test_tgi_client_grammar(server: ServerProcess) -> None:
    """TGI's own Python client sends its Grammar objects unmodified."""
    text_generation = pytest.importorskip("text_generation")
    from text_generation.types import Grammar, GrammarType

    client = text_generation.Client(server.base_url, timeout=60)
    out = client.generate("JSON:", max_new_tokens=120, do_sample=True, seed=2,
                          grammar=Grammar(type=GrammarType.Json, value=SCHEMA))
    jsonschema.validate(json.loads(out.generated_text), SCHEMA)
    out = client.generate("Date:", max_new_tokens=30, grammar=Grammar(type=GrammarType.Regex, value=DATE))
    assert re.fullmatch(DATE, out.generated_text), out.generated_text


@pytest.mark.parametrize(("body", "needle"), [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}},
     "invalid JSON schema"),
    ({"type": "json_schema"}, '{"type": "json_object"}'),
    ({"type": "xml"}, '{"type": "json_object"}'),
])
def test_openai_refuses_bad_formats(server: ServerProcess, body: dict, needle: str) -> None:
    r = httpx.post(server.base_url + "/v1/chat/completions", timeout=30, json={
        "messages": [{"role": "user", "content": "hi"}], "response_format": body})
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"]


def test_tgi_refuses_bad_regex(server: ServerProcess) -> None:
    r = httpx.post(server.base_url + "/generate", timeout=30, json={
        "inputs": "x", "parameters": {"grammar": {"type": "regex", "value": "(unclosed"}}})
    assert r.status_code == 422, r.text
    assert "regular expression" in r.json()["error"]


def test_unwritable_grammar_refused_on_char_model(names_server: ServerProcess) -> None:
    """A vocabulary without `{` cannot write JSON, nor one without digits a date: refused up front."""
    base = names_server.base_url
    r = httpx.post(base + "/v1/chat/completions", timeout=30, json={
        "messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_object"}})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "response_format"
    assert "cannot express" in r.json()["error"]["message"]
    r = httpx.post(base + "/generate", timeout=30, json={
        "inputs": "ann", "parameters": {"grammar": {"type": "json", "value": {"type": "object"}}}})
    assert r.status_code == 422, r.text
    assert "cannot express" in r.json()["error"]
    r = httpx.post(base + "/generate", timeout=30, json={
        "inputs": "ann", "parameters": {"grammar": {"type": "regex", "value": DATE}}})
    assert r.status_code == 422, r.text
    # A schema its letters cannot write is refused on every route that takes one, never a 200 whose
    # text breaks it (finish "stop" on a bare "n").
    fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": SMALL}}
    for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                 "response_format": fmt}),
                       ("/v1/completions", {"prompt": "ann", "response_format": fmt}),
                       ("/v1/responses", {"input": "hi", "text": {"format": {
                           "type": "json_schema", "name": "p", "schema": SMALL}}})):
        r = httpx.post(base + path, timeout=30, json=body)
        assert r.status_code == 400, (path, r.text)
        assert "cannot express" in r.json()["error"]["message"], (path, r.text)
    # A grammar the letters can write is served.
    r = httpx.post(base + "/generate", timeout=30, json={
        "inputs": "ann",
        "parameters": {"max_new_tokens": 20, "grammar": {"type": "regex", "value": "[a-e]{3}x"}}})
    assert r.status_code == 200, r.text
    assert re.fullmatch("[a-e]{3}x", r.json()["generated_text"]), r.json()


# Past llguidance's lexer fuel: a million-state regex, a JSON string's 100,000-character pattern.
BOMB = "(x{1000}){1000}"
LONG_PATTERN = {"type": "string", "pattern": "^x{100000}$"}
# A bound passed 10 characters in, past the compile's probe: found while generating.
LATE = {"type": "object", "properties": {"a": {"type": "boolean"},
                                         "b": {"type": "string", "pattern": "^(x{1000}){1000}$"}},
        "required": ["a", "b"], "additionalProperties": False}
LIMITS = "initial_lexer_fuel|max_lexer_states|max_mask_ms"


def test_grammar_bombs_are_refused_in_each_dialect_naming_the_limit(server: ServerProcess) -> None:
    base = server.base_url
    fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": LONG_PATTERN}}
    regex, pattern = {"type": "regex", "value": BOMB}, {"type": "json", "value": LONG_PATTERN}
    chat = [{"role": "user", "content": "hi"}]
    cases = [
        ("/generate", {"inputs": "x", "parameters": {"grammar": regex}}, 422),
        ("/generate", {"inputs": "x", "parameters": {"best_of": 4, "do_sample": True,
                                                     "grammar": pattern}}, 422),
        ("/v1/completions", {"prompt": "x", "n": 4, "response_format": regex}, 400),
        ("/v1/chat/completions", {"messages": chat, "response_format": fmt}, 400),
        ("/v1/responses", {"input": "hi", "text": {"format": {"type": "json_schema", "name": "p",
                                                              "schema": LONG_PATTERN}}}, 400),
    ]
    for path, body, status in cases:
        t0 = time.perf_counter()
        r = httpx.post(base + path, timeout=30, json=body)
        assert r.status_code == status, (path, r.text)
        assert re.search("initial_lexer_fuel", error_message(r)), (path, r.text)
        assert time.perf_counter() - t0 < 5, path  # refused within the compile's bounds
        if path != "/generate":
            assert r.json()["error"]["param"] in ("response_format", "text.format"), r.text


def test_a_grammar_failing_while_generating_is_an_error_never_a_stop(char_server: ServerProcess) -> None:
    base = char_server.base_url
    grammar = {"type": "json", "value": LATE}
    r = httpx.post(base + "/generate", timeout=60, json={
        "inputs": "x", "parameters": {"max_new_tokens": 40, "grammar": grammar}})
    assert r.status_code == 422 and error_kind(r) == "validation", r.text  # TGI's dialect
    assert re.search(LIMITS, error_message(r)), r.text
    r = httpx.post(base + "/v1/completions", timeout=60, json={
        "prompt": "x", "max_tokens": 40, "response_format": grammar})
    assert r.status_code == 400 and error_kind(r) == "grammar_failed", r.text  # OpenAI's dialect
    # Streamed: the tokens the grammar allowed, then the error event in the route's dialect.
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 40, "stream": True,
            "response_format": {"type": "json_schema", "json_schema": {"name": "late", "schema": LATE}}}
    with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=60) as resp:
        assert resp.status_code == 200
        lines = [line for line in resp.iter_lines() if line.startswith("data:")]
    payloads = [json.loads(line[5:]) for line in lines if line != "data: [DONE]"]
    assert "grammar_failed" in lines[-1] or "grammar_failed" in lines[-2], lines[-2:]
    reasons = [c.get("finish_reason") for p in payloads for c in p.get("choices", ())]
    assert "stop" not in reasons and "length" not in reasons, reasons
    text = "".join(c["delta"].get("content") or "" for p in payloads for c in p.get("choices", ()))
    assert any(done.startswith(text) for done in ('{"a": true, "b": "', '{"a": false, "b": "')), text


def test_char_vocabulary_writes_json(char_server: ServerProcess) -> None:
    """Printable ASCII, one character a token: the mask works on a vocabulary that is not BPE."""
    for seed in range(3):
        r = httpx.post(char_server.base_url + "/generate", timeout=60, json={
            "inputs": "x", "parameters": {"max_new_tokens": 60, "do_sample": True, "seed": seed,
                                          "grammar": {"type": "json", "value": SMALL}}})
        assert r.status_code == 200, r.text
        jsonschema.validate(json.loads(r.json()["generated_text"]), SMALL)


def test_each_of_n_choices_follows_the_schema_with_its_own_grammar_state(server: ServerProcess) -> None:
    # n choices share one prefill but each advances its own matcher: every one is complete JSON.
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    r = httpx.post(server.base_url + "/v1/chat/completions", timeout=120, json={
        "messages": [{"role": "user", "content": "A person as JSON"}], "max_tokens": 120, "n": 3,
        "temperature": 1.0, "seed": 5, "response_format": fmt})
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2]
    for choice in choices:
        assert choice["finish_reason"] == "stop", choice
        jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMA)
    assert len({c["message"]["content"] for c in choices}) > 1  # different seeds, different people
