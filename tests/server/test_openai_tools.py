"""Tool calling on /v1/chat/completions: the openai SDK and LangChain's `bind_tools` against a real
server, forced calls (tool_choice "required", a named function) whose arguments the grammar holds
to each function's schema on a random-weight char model, streamed tool-call deltas, a round trip
through a tool's result, `auto` replies read in the Hermes and Llama 3 formats their templates
teach, and the 400s of bad tool definitions."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
import pytest_asyncio
from pydantic import BaseModel, Field

from nanoserve.model.chat_template import render_chat
from nanoserve.server.api.openai.tool_parsers import (
    FORMATS,
    CallArgs,
    CallHead,
    CallReader,
    StreamedCalls,
    format_of_template,
)
from tests.conftest import make_tiny_checkpoint, require_module
from tests.server.asgi import AppClient, asgi_client
from tests.server.server import REPO_ROOT, ServerProcess, running_server

TEMPLATES = REPO_ROOT / "tests" / "data" / "chat_templates"
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                         "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "days"], "additionalProperties": False}
WEATHER: Any = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": CITY}}
CLOCK: Any = {"type": "function", "function": {"name": "get_time"}}  # no parameters: arguments are {}
SCHEMAS = {"get_weather": CITY, "get_time": {"type": "object", "additionalProperties": False}}
ASK: Any = [{"role": "user", "content": "Weather in Paris?"}]
ENV = {"NANOSERVE_MAX_SEQS": "4", "OMP_NUM_THREADS": "1"}
OFFERED = frozenset(SCHEMAS)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random char model of printable ASCII (it can write JSON), with room for a template's
    prompt with tools (a character a token)."""
    path: Path = make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "tools", block_size=1024)
    return path


@pytest.fixture(scope="module")
def server(checkpoint: Path) -> Iterator[ServerProcess]:
    with running_server(checkpoint, env=ENV) as s:
        yield s


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0) as c:
        yield c


@pytest_asyncio.fixture
async def app(checkpoint: Path) -> AsyncIterator[AppClient]:
    async with asgi_client(checkpoint) as c:
        yield c


def check_call(call: Any) -> dict[str, Any]:
    """A tool call as the SDK parsed it: OpenAI's shape, arguments valid against its function's schema."""
    assert call.type == "function" and call.id.startswith("call_")
    args: dict[str, Any] = json.loads(call.function.arguments)
    jsonschema.validate(args, SCHEMAS[call.function.name])
    return args


# ------------------------------------------------------------------ forced calls, the openai SDK


def test_required_returns_tool_calls_the_sdk_parses(client: openai.OpenAI) -> None:
    """Parallel calls are at most MAX_PARALLEL_CALLS (8): 700 tokens hold 8 of these, so every
    reply of this random model ends by itself."""
    for seed, parallel in ((0, False), (1, False), (2, True), (3, True)):
        r = client.chat.completions.create(model="m", messages=ASK, tools=[WEATHER, CLOCK],
                                           tool_choice="required", parallel_tool_calls=parallel,
                                           max_tokens=700, seed=seed)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        assert choice.message.content is None and choice.message.tool_calls
        assert parallel or len(choice.message.tool_calls) == 1
        for call in choice.message.tool_calls:
            check_call(call)


def test_a_named_function_is_the_one_called(client: openai.OpenAI) -> None:
    """OpenAI's form, and TGI's without "type" (huggingface_hub sends it so)."""
    for seed in range(3):
        named: Any = {"function": {"name": "get_weather"}, **({"type": "function"} if seed else {})}
        r = client.chat.completions.create(
            model="m", messages=ASK, tools=[CLOCK, WEATHER], max_tokens=200, seed=seed,
            tool_choice=named)
        calls: Any = r.choices[0].message.tool_calls
        assert calls is not None and len(calls) == 1 and calls[0].function.name == "get_weather"
        assert set(check_call(calls[0])) == {"city", "days"}


class Place(BaseModel):
    city: str = Field(max_length=12)


class Trip(BaseModel):
    start: Place
    stops: list[Place] = Field(max_length=2)


def test_schemas_with_their_own_defs_constrain_each_call(client: openai.OpenAI) -> None:
    """pydantic writes nested models as `$defs` and `#/$defs/...` references (LangChain sends them
    so); two tools with a `Place` each keep theirs apart inside the one grammar."""
    trip = Trip.model_json_schema()
    tools: Any = [{"type": "function", "function": {"name": name, "parameters": trip}}
                  for name in ("plan_trip", "book_trip")]
    for seed in range(3):
        r = client.chat.completions.create(model="m", messages=ASK, tools=tools, tool_choice="required",
                                           max_tokens=900, seed=seed)
        calls: Any = r.choices[0].message.tool_calls
        assert r.choices[0].finish_reason == "tool_calls" and calls
        for call in calls:
            assert call.function.name in ("plan_trip", "book_trip")
            Trip.model_validate_json(call.function.arguments)
            jsonschema.validate(json.loads(call.function.arguments), trip)


def test_streamed_calls_are_reassembled_by_the_sdk_stream_helper(client: openai.OpenAI) -> None:
    with client.chat.completions.stream(model="m", messages=ASK, tools=[WEATHER],
                                        tool_choice="required", max_tokens=700, seed=4) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_completion()
    assert "tool_calls.function.arguments.done" in kinds and "content.delta" not in kinds
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    assert choice.message.content is None
    for call in choice.message.tool_calls:
        check_call(call)
    # OpenAI's deltas: index, id, type and name first, then the arguments under the same index.
    chunks = list(client.chat.completions.create(model="m", messages=ASK, tools=[WEATHER],
                                                 tool_choice="required", parallel_tool_calls=False,
                                                 max_tokens=200, seed=4, stream=True))
    deltas = [c.choices[0].delta.tool_calls for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    head, *rest = [d[0] for d in deltas]
    assert head.index == 0 and head.id and head.type == "function"
    assert head.function is not None and head.function.name == "get_weather"
    assert all(d.index == 0 and d.id is None and d.function and d.function.name is None for d in rest)
    assert len(rest) > 1  # the arguments stream as they are written, not at the end
    args = "".join((d.function.arguments or "") for d in [head, *rest] if d.function)
    jsonschema.validate(json.loads(args), CITY)
    whole = client.chat.completions.create(model="m", messages=ASK, tools=[WEATHER], tool_choice="required",
                                           parallel_tool_calls=False, max_tokens=200, seed=4)
    calls: Any = whole.choices[0].message.tool_calls
    assert calls[0].function.arguments == args  # the same bytes, streamed or not
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == \
        ["tool_calls"]


def test_a_round_trip_through_the_tool_result(client: openai.OpenAI) -> None:
    """The assistant's calls, as the SDK returned them, and the tool's result go back; the next
    answer is a plain reply (tool_choice none), its prompt longer by the calls and the result."""
    messages: list[Any] = list(ASK)
    first = client.chat.completions.create(model="m", messages=messages, tools=[WEATHER],
                                           tool_choice="required", parallel_tool_calls=False,
                                           max_tokens=200, seed=5)
    calls: Any = first.choices[0].message.tool_calls
    call = calls[0]
    messages.append(first.choices[0].message)
    messages.append({"role": "tool", "tool_call_id": call.id, "content": "18C, sunny"})
    second = client.chat.completions.create(model="m", messages=messages, tools=[WEATHER],
                                            tool_choice="none", max_tokens=8, temperature=0)
    assert second.choices[0].message.content and second.choices[0].message.tool_calls is None
    assert second.choices[0].finish_reason == "length"
    assert first.usage is not None and second.usage is not None
    added = len(call.function.arguments) + len("18C, sunny")
    assert second.usage.prompt_tokens > first.usage.prompt_tokens + added


def test_langchain_bind_tools_with_tool_choice_required(server: ServerProcess) -> None:
    require_module("langchain_openai")
    from langchain_openai import ChatOpenAI

    class GetWeather(BaseModel):
        """Weather in a city."""

        city: str = Field(max_length=12)
        days: int = Field(ge=1, le=7)

    llm = ChatOpenAI(base_url=server.base_url + "/v1", api_key="unused", model="gpt-4o-mini",  # type: ignore[arg-type]
                     max_retries=0, timeout=60, max_tokens=700, seed=6)  # type: ignore[call-arg]
    reply = llm.bind_tools([GetWeather], tool_choice="required").invoke("Weather in Paris?")
    assert reply.tool_calls, reply
    for call in reply.tool_calls:
        assert call["name"] == "GetWeather" and (call["id"] or "").startswith("call_")
        GetWeather.model_validate(call["args"])


def test_huggingface_hub_chat_completion_with_tools(server: ServerProcess) -> None:
    """huggingface_hub sends TGI's named choice, {"function": {"name": ...}} without "type"."""
    require_module("huggingface_hub")
    from huggingface_hub import InferenceClient

    hub = InferenceClient(base_url=server.base_url, timeout=60)
    choices: list[Any] = ["required", {"function": {"name": "get_weather"}}]
    for choice in choices:
        out = hub.chat_completion(ASK, tools=[WEATHER, CLOCK], tool_choice=choice, max_tokens=700, seed=7)
        message = out.choices[0].message
        assert out.choices[0].finish_reason == "tool_calls" and message.tool_calls
        for call in message.tool_calls:
            args = json.loads(call.function.arguments)
            jsonschema.validate(args, SCHEMAS[call.function.name])
            assert choice == "required" or call.function.name == "get_weather"


# ------------------------------------------------------------------ auto


@pytest.mark.parametrize(("template", "script", "content"), [
    ("qwen2.5.jinja", 'Let me see.\n<tool_call>\n{"name": "get_weather", "arguments": '
     '{"city": "Paris", "days": 2}}\n</tool_call>', "Let me see."),
    ("llama3.2.jinja", '{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}', None),
])
async def test_auto_reads_the_calls_in_the_format_the_template_teaches(
        checkpoint: Path, template: str, script: str, content: str | None) -> None:
    """The model's output is scripted with a regex grammar (response_format, TGI's form), so the
    reply is what a model taught by the template would write; `auto` parses it without a grammar."""
    async with asgi_client(checkpoint, chat_template=TEMPLATES / template) as app:
        body = {"messages": ASK, "tools": [WEATHER, CLOCK], "max_tokens": 200,
                "response_format": {"type": "regex", "value": _literal(script)}}
        r = await app.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "tool_calls", choice
        message = choice["message"]
        assert message["content"] == content
        [call] = message["tool_calls"]
        assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}
        async with app.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as s:
            chunks = [json.loads(line[6:]) async for line in s.aiter_lines()
                      if line.startswith("data: {")]
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert "".join(d.get("content") or "" for d in deltas) == ("Let me see.\n" if content else "")
    calls = [t for d in deltas for t in d.get("tool_calls", [])]
    assert calls[0]["function"]["name"] == "get_weather" and calls[0]["id"].startswith("call_")
    args = "".join(t["function"].get("arguments", "") for t in calls)
    assert json.loads(args) == {"city": "Paris", "days": 2}
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def _literal(text: str) -> str:
    """A regex that matches exactly `text`."""
    return "".join("\\" + ch if ch in ".^$*+?()[]{}|\\" else ch for ch in text)


async def test_tools_are_shown_to_a_jinja_template_unless_the_choice_is_none(checkpoint: Path) -> None:
    """The prompt is the template's rendering with the tools (one token a character here), and
    without them under tool_choice "none"."""
    qwen = TEMPLATES / "qwen2.5.jinja"
    async with asgi_client(checkpoint, chat_template=qwen) as app:
        counts = []
        for choice in ("auto", "none"):
            r = await app.post("/v1/chat/completions", json={"messages": ASK, "tools": [WEATHER],
                                                             "tool_choice": choice, "max_tokens": 1})
            assert r.status_code == 200, r.text
            counts.append(r.json()["usage"]["prompt_tokens"])
    template = {"jinja": qwen.read_text(encoding="utf-8")}
    shown = render_chat(template, ASK, tools=[WEATHER])
    assert '"name": "get_weather"' in shown
    assert counts == [len(shown), len(render_chat(template, ASK))]


async def test_auto_on_a_data_template_is_a_plain_reply(app: AppClient) -> None:
    r = await app.post("/v1/chat/completions", json={"messages": ASK, "tools": [WEATHER], "max_tokens": 8,
                                                     "temperature": 0})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert isinstance(choice["message"]["content"], str) and "tool_calls" not in choice["message"]
    assert choice["finish_reason"] == "length"


# ------------------------------------------------------------------ the parsers


def test_hermes_parser_reads_calls_and_leaves_anything_else_as_content() -> None:
    hermes = FORMATS["hermes"]
    two = ('I will look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 1}}\n'
           '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
    parsed = hermes.parse(two, OFFERED)
    assert parsed.content == "I will look."
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == [
        ("get_weather", {"city": "Oslo", "days": 1}), ("get_time", {})]
    assert len({c.id for c in parsed.calls}) == 2
    for text in ("no calls here", '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>',
                 '<tool_call>\n{"name": "get_time", "arguments": {\n</tool_call>'):
        assert hermes.parse(text, OFFERED).content == text and not hermes.parse(text, OFFERED).calls
    # An unclosed last block (the reply cut at its end token) still reads.
    assert hermes.parse('<tool_call>{"name": "get_time", "arguments": {}}', OFFERED).calls


def test_streamed_parsing_matches_the_whole_parse_one_character_at_a_time() -> None:
    cases = [("hermes", 'Sure.<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'),
             ("hermes", "a <tool of mine> is not a call"),
             ("llama3", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome", "days": 3}}'),
             ("llama3", "{not json at all"), ("llama3", "Plain answer."),
             ("json", '[{"name": "get_time", "arguments": {}}, {"name": "get_time", "arguments": {}}]')]
    for name, text in cases:
        fmt = FORMATS[name]
        stream = StreamedCalls(fmt, OFFERED)
        sent = "".join(stream.feed(ch) for ch in text)
        rest, calls = stream.end()
        whole = fmt.parse(text, OFFERED)
        assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in whole.calls]
        if calls:
            assert (sent.strip() or None) == whole.content and rest == ""
        else:
            assert sent + rest == text
            assert name != "hermes" or sent == text  # no marker: content flows as it comes


def test_a_forced_call_streams_its_arguments_as_they_are_written() -> None:
    """Braces, brackets, quotes and escapes inside strings do not end a call's arguments early."""
    text = ('[{"name": "get_weather", "arguments": {"city": "a\\"}]{", "days": 2}}, '
            '{"name": "get_time", "arguments": {}}]')
    for step in (1, 3, len(text)):
        calls = CallReader(FORMATS["json"], OFFERED).stream()
        pieces = []
        for k in range(0, len(text), step):
            calls.feed(text[k:k + step])
            pieces += calls.take()
        heads = [p for p in pieces if isinstance(p, CallHead)]
        assert [(h.index, h.name) for h in heads] == [(0, "get_weather"), (1, "get_time")]
        args = ["".join(p.text for p in pieces if isinstance(p, CallArgs) and p.index == i) for i in (0, 1)]
        assert [json.loads(a) for a in args] == [{"city": 'a"}]{', "days": 2}, {}]
        assert calls.end() == ("", [])


def test_the_formats_templates_teach() -> None:
    found = {name: format_of_template((TEMPLATES / f"{name}.jinja").read_text(encoding="utf-8"))
             for name in ("qwen2.5", "llama3.2", "llama3", "smollm2", "mistral", "gemma2")}
    assert {k: v.name if v else None for k, v in found.items()} == {
        "qwen2.5": "hermes", "llama3.2": "llama3", "llama3": None, "smollm2": None, "mistral": None,
        "gemma2": None}


# ------------------------------------------------------------------ refusals


@pytest.mark.parametrize(("extra", "param", "says"), [
    ({"tools": [{"type": "function", "function": {"name": "get weather"}}]}, "tools[0].function.name",
     "letters, digits"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
     "tools[0].function.parameters", '"type": "object"'),
    ({"tools": [{"type": "custom", "custom": {"name": "f"}}]}, "tools[0].type", "function"),
    ({"tools": [{"type": "function", "function": {"name": "f", "params": {}}}]},
     "tools[0].function.params", "Extra inputs"),
    ({"tools": [WEATHER, WEATHER]}, "tools", "twice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}},
     "tool_choice", "not in `tools`"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function"}}, "tool_choice", '{"type": "function"'),
    ({"tool_choice": "required"}, "tool_choice", "empty or absent"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "nonsense"}}}}}], "tool_choice": "required"},
     "tools", "invalid JSON schema"),
])
async def test_bad_tool_definitions_are_400s_naming_the_field(app: AppClient, extra: dict[str, Any],
                                                              param: str, says: str) -> None:
    r = await app.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 4, **extra})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and says in error["message"], error


async def test_a_vocabulary_that_cannot_write_json_is_refused_clearly() -> None:
    """The baby-names model writes lower-case letters and newlines only: no call can be forced, a
    400 naming `tools`."""
    async with asgi_client(REPO_ROOT / "checkpoints" / "baby-names") as names:
        ask = [{"role": "user", "content": "anna"}]
        r = await names.post("/v1/chat/completions", json={"messages": ask, "tools": [WEATHER],
                                                           "tool_choice": "required", "max_tokens": 4})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "tools" and "cannot express" in error["message"], error
