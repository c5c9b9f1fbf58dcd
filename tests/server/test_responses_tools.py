"""Function tools on the Responses API through the openai SDK, against a real server on a random
char model: forced calls come back as `function_call` items whose arguments match the schema,
streamed as OpenAI's typed events; the calls and their `function_call_output` go back as input
items (or through previous_response_id) for the next answer; `auto` reads a Hermes template's
calls; bad tools are 400s naming the field."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest

from tests.conftest import make_tiny_checkpoint
from tests.server.asgi import asgi_client
from tests.server.server import REPO_ROOT, running_server

CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"], "additionalProperties": False}
WEATHER: Any = {"type": "function", "name": "get_weather", "description": "Weather in a city",
                "parameters": CITY}
CLOCK: Any = {"type": "function", "name": "get_time"}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random char model of printable ASCII, its window room for Llama 3.2's prompt with tools."""
    path: Path = make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "tools", block_size=2048)
    return path


@pytest.fixture(scope="module")
def client(checkpoint: Path) -> Iterator[openai.OpenAI]:
    env = {"NANOSERVE_MAX_SEQS": "4", "OMP_NUM_THREADS": "1"}
    with running_server(checkpoint, env=env) as server, \
            openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0) as c:
        yield c


def _calls(output: list[Any]) -> list[Any]:
    calls = [item for item in output if item.type == "function_call"]
    for call in calls:
        assert call.call_id.startswith("call_") and call.id.startswith("fc_") and call.status == "completed"
        schema = CITY if call.name == "get_weather" else {"type": "object"}
        jsonschema.validate(json.loads(call.arguments), schema)
    return calls


def test_required_and_named_calls_are_function_call_items(client: openai.OpenAI) -> None:
    r = client.responses.create(model="m", input="Weather in Oslo?", tools=[WEATHER, CLOCK],
                                tool_choice="required", max_output_tokens=700)
    assert r.status == "completed" and _calls(r.output) and r.output_text == ""
    assert all(item.type == "function_call" for item in r.output)
    named = client.responses.create(model="m", input="Weather in Oslo?", tools=[CLOCK, WEATHER],
                                    tool_choice={"type": "function", "name": "get_weather"},
                                    max_output_tokens=200)
    [call] = _calls(named.output)
    assert call.name == "get_weather" and named.tools[1].name == "get_weather"  # type: ignore[union-attr]


def test_streamed_calls_are_typed_events_the_sdk_assembles(client: openai.OpenAI) -> None:
    with client.responses.stream(model="m", input="Weather?", tools=[WEATHER], tool_choice="required",
                                 parallel_tool_calls=False, max_output_tokens=200) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert len(_calls(final.output)) == 1
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.function_call_arguments.delta", "response.function_call_arguments.done",
                     "response.output_item.done", "response.completed"]


def test_a_round_trip_through_function_call_output(client: openai.OpenAI) -> None:
    """The calls go back as input items with their output (as the SDK's docs do it), or through
    previous_response_id: the same prompt either way, so the same greedy answer."""
    first = client.responses.create(model="m", input="Weather in Oslo?", tools=[WEATHER],
                                    tool_choice="required", parallel_tool_calls=False,
                                    max_output_tokens=200)
    [call] = _calls(first.output)
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "18C, sunny"}
    items: Any = [{"role": "user", "content": "Weather in Oslo?"}, *first.output, result]
    by_items = client.responses.create(model="m", input=items, tools=[WEATHER], max_output_tokens=8,
                                       temperature=0)
    chained = client.responses.create(model="m", input=[result], previous_response_id=first.id,  # type: ignore[list-item]
                                      tools=[WEATHER], max_output_tokens=8, temperature=0)
    assert by_items.output_text and by_items.output_text == chained.output_text
    assert by_items.usage is not None and chained.usage is not None and first.usage is not None
    assert by_items.usage.input_tokens == chained.usage.input_tokens > first.usage.input_tokens + len(
        call.arguments)


async def test_auto_reads_a_llama3_templates_calls(checkpoint: Path) -> None:
    """Under a Llama 3.2 template, `auto` reads a reply that is one `{"name", "parameters"}`
    object as a call. The reply is scripted by a JSON schema of constants (text.format), so it is
    what a model taught by the template would write; the reading itself uses no grammar."""
    script = {"type": "object", "properties": {
        "name": {"const": "get_weather"},
        "parameters": {"type": "object", "properties": {"city": {"const": "Oslo"}}, "required": ["city"],
                       "additionalProperties": False}},
              "required": ["name", "parameters"], "additionalProperties": False}
    body = {"input": "Weather in Oslo?", "tools": [WEATHER, CLOCK], "max_output_tokens": 200,
            "text": {"format": {"type": "json_schema", "name": "script", "schema": script}}}
    template = REPO_ROOT / "tests" / "data" / "chat_templates" / "llama3.2.jinja"
    async with asgi_client(checkpoint, chat_template=template) as app:
        r = await app.post("/v1/responses", json=body)
        assert r.status_code == 200, r.text
        [call] = r.json()["output"]
        assert call["type"] == "function_call" and call["name"] == "get_weather"
        assert json.loads(call["arguments"]) == {"city": "Oslo"}
        async with app.stream("POST", "/v1/responses", json={**body, "stream": True}) as s:
            events = [json.loads(line[6:]) async for line in s.aiter_lines() if line.startswith("data: ")]
    assert [e["type"] for e in events if "function_call" in e["type"] or "output_text" in e["type"]] == [
        "response.function_call_arguments.delta", "response.function_call_arguments.done"]
    assert json.loads(events[-1]["response"]["output"][0]["arguments"]) == {"city": "Oslo"}


@pytest.mark.parametrize(("extra", "param", "says"), [
    ({"tools": [{"type": "function", "name": "bad name"}]}, "tools", "tools[0].name"),
    ({"tools": [{"type": "function", "name": "f", "parameters": {"type": "array"}}]}, "tools",
     '"type": "object"'),
    ({"tools": [WEATHER, WEATHER]}, "tools", "twice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "get_time"}}, "tool_choice",
     "not in `tools`"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
     "tool_choice", '{"type": "function", "name": ...}'),
    ({"input": [{"type": "function_call_output", "call_id": "c"}]}, "input", "input[0].output"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}", "x": 1}]},
     "input", "unknown field"),
])
def test_bad_tools_are_400s_naming_the_field(client: openai.OpenAI, extra: dict[str, Any], param: str,
                                             says: str) -> None:
    body = {"model": "m", "input": "x", **extra}
    with pytest.raises(openai.BadRequestError) as info:
        client.post("/responses", body=body, cast_to=dict)
    error = info.value.body
    assert isinstance(error, dict) and error["param"] == param and says in error["message"], error
