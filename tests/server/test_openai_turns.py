"""Multi-turn chats as clients really hold them: each reply goes back into the next request as the
client returned it (the openai SDK's `messages.append(resp.choices[0].message)`, huggingface_hub's
output message, TGI's `Message`), five turns, streamed and not, against a real server.

The oracle for "the conversation reached the model": the char checkpoint encodes one token per
character, so each turn's `usage.prompt_tokens` must equal the length of the conversation written
out by hand in the default template ("User: ...\\n", "Assistant: ...\\n", then "Assistant:").
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from tests.conftest import make_tiny_checkpoint, require_module
from tests.server.server import ServerProcess, running_server

TURNS = 5
SPEAKERS = {"system": "System", "user": "User", "assistant": "Assistant"}  # the default template


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """A char model with a window of 1024, so five turns fit and none is dropped."""
    checkpoint = make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "long", block_size=1024)
    with running_server(checkpoint, env={"NANOSERVE_MAX_SEQS": "2"}) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


def written_out(turns: list[tuple[str, str]]) -> str:
    """The prompt the default template makes of (role, text) turns."""
    return "".join(f"{SPEAKERS[role]}: {text}\n" for role, text in turns) + "Assistant:"


def question(i: int) -> str:
    return f"Question {i}: what next?"


def test_openai_sdk_five_turns_appending_the_returned_message(client: openai.OpenAI) -> None:
    messages: list[Any] = [{"role": "system", "content": "Be brief."}]
    turns = [("system", "Be brief.")]
    for i in range(TURNS):
        messages.append({"role": "user", "content": question(i)})
        turns.append(("user", question(i)))
        resp = client.chat.completions.create(model="any", messages=messages, max_tokens=4, temperature=0)
        message = resp.choices[0].message
        assert resp.usage is not None and resp.usage.prompt_tokens == len(written_out(turns))
        assert message.refusal is None and message.content
        messages.append(message)  # OpenAI's documented pattern: the SDK object, `refusal: null` and all
        turns.append(("assistant", message.content))


def test_openai_sdk_five_streamed_turns_rebuilding_the_message(client: openai.OpenAI) -> None:
    messages: list[Any] = []
    turns: list[tuple[str, str]] = []
    for i in range(TURNS):
        messages.append({"role": "user", "content": question(i)})
        turns.append(("user", question(i)))
        stream = client.chat.completions.create(model="any", messages=messages, max_tokens=4, temperature=0,
                                                stream=True, stream_options={"include_usage": True})
        parts, role, usage = [], None, None
        for chunk in stream:
            usage = chunk.usage or usage
            for choice in chunk.choices:
                role = choice.delta.role or role
                parts.append(choice.delta.content or "")
        assert usage is not None and usage.prompt_tokens == len(written_out(turns))
        messages.append({"role": role, "content": "".join(parts)})  # as SDK users rebuild it
        turns.append(("assistant", "".join(parts)))


def test_openai_sdk_stream_helper_final_message_goes_back(client: openai.OpenAI) -> None:
    """`chat.completions.stream(...).get_final_completion()` gives a parsed message (`parsed`,
    `refusal`, `tool_calls` keys): appended as it is, it is accepted on the next turns. (The helper
    refuses a reply cut by max_tokens, so each turn ends on a stop string: the first character of
    the seeded reply that it has not written before.)"""
    messages: list[Any] = [{"role": "user", "content": question(0)}]
    sampling: dict[str, Any] = {"model": "any", "max_tokens": 8, "temperature": 1.0, "seed": 3}
    for _ in range(3):
        text = client.chat.completions.create(messages=messages, **sampling).choices[0].message.content or ""
        cut = next(i for i in range(1, len(text)) if text[i] not in text[:i])
        with client.chat.completions.stream(messages=messages, stop=[text[cut]], **sampling) as stream:
            final = stream.get_final_completion()
        assert final.choices[0].finish_reason == "stop" and final.choices[0].message.content == text[:cut]
        messages += [final.choices[0].message, {"role": "user", "content": "And then?"}]
    assert client.chat.completions.create(messages=messages, **sampling).choices


def test_openai_sdk_parse_message_goes_back(client: openai.OpenAI) -> None:
    """`chat.completions.parse(response_format=<pydantic model>)` returns a message whose `parsed`
    holds the object; appended as it is, the next turn is served."""
    from pydantic import BaseModel, Field

    class Digit(BaseModel):
        n: int = Field(ge=0, le=9)

    messages: list[Any] = [{"role": "user", "content": "A digit?"}]
    for turn in range(2):
        resp = client.chat.completions.parse(model="any", messages=messages, response_format=Digit,
                                             max_tokens=40, seed=turn)
        message = resp.choices[0].message
        assert isinstance(message.parsed, Digit)
        assert Digit.model_validate_json(message.content or "") == message.parsed
        messages += [message, {"role": "user", "content": "Another?"}]


def test_tool_call_turns_render_into_the_prompt(client: openai.OpenAI) -> None:
    """An assistant turn with content null and tool_calls, then the tool's result: the calls are
    written into the assistant's turn (one JSON object per line) and the result is a user turn
    naming its call (the default template has no `tool` speaker)."""
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}
    messages: list[Any] = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [call], "refusal": None},
        {"role": "tool", "tool_call_id": "call_1", "content": "18C, sunny"},
    ]
    resp = client.chat.completions.create(model="any", messages=messages, max_tokens=3, temperature=0)
    expected = written_out([
        ("user", "Weather in Paris?"),
        ("assistant", '{"name": "get_weather", "arguments": {"city": "Paris"}}'),
        ("user", "Tool result (call_1): 18C, sunny"),
    ])
    assert resp.usage is not None and resp.usage.prompt_tokens == len(expected)


def test_huggingface_hub_chat_completion_five_turns(server: ServerProcess) -> None:
    require_module("huggingface_hub")
    from huggingface_hub import InferenceClient

    hub = InferenceClient(base_url=server.base_url, timeout=60)
    messages: list[Any] = []
    turns: list[tuple[str, str]] = []
    for i in range(TURNS):
        messages.append({"role": "user", "content": question(i)})
        turns.append(("user", question(i)))
        if i % 2:  # streamed on odd turns: the message rebuilt from the deltas
            chunks = list(hub.chat_completion(messages, max_tokens=4, temperature=0, stream=True))
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            messages.append({"role": "assistant", "content": text})
        else:
            resp = hub.chat_completion(messages, max_tokens=4, temperature=0)
            assert resp.usage.prompt_tokens == len(written_out(turns))
            text = resp.choices[0].message.content or ""
            messages.append(resp.choices[0].message)  # role, content, tool_calls/tool_call_id/reasoning
        turns.append(("assistant", text))
    final = hub.chat_completion(messages, max_tokens=2, temperature=0)
    assert final.usage.prompt_tokens == len(written_out(turns))


def test_text_generation_client_chat_five_turns(server: ServerProcess) -> None:
    """TGI's own client sends `tool_calls: null` (and `name: null`) on every message."""
    require_module("text_generation")
    from text_generation import Client
    from text_generation.types import Message

    tgi = Client(server.base_url, timeout=60)
    messages = []
    turns: list[tuple[str, str]] = []
    for i in range(TURNS):
        messages.append(Message(role="user", content=question(i)))
        turns.append(("user", question(i)))
        resp = tgi.chat(messages, max_tokens=4, temperature=0)
        assert resp.usage["prompt_tokens"] == len(written_out(turns))
        messages.append(resp.choices[0].message)
        turns.append(("assistant", resp.choices[0].message.content or ""))


def test_text_generation_client_chat_stream_request_is_served(server: ServerProcess) -> None:
    """TGI's client's streamed chat request, as it serializes it (every field, nulls included), is
    served. (Its chunk parser needs `role` and `tool_calls` in every delta and JSON on every data
    line, which neither TGI nor OpenAI's shape gives: `role` once, then `data: [DONE]`. Sending the
    role in every delta would break the openai SDK's stream helper, which concatenates it.)"""
    require_module("text_generation")
    import httpx
    from text_generation.types import ChatRequest, Message

    messages = [Message(role="user", content=question(0))]
    for _ in range(3):
        request = ChatRequest(model="tgi", messages=messages, max_tokens=4, temperature=0, stream=True)
        body = request.model_dump()  # what the client's `request.dict()` sends
        assert body["messages"][0]["tool_calls"] is None and body["tools"] is None
        with httpx.stream("POST", server.base_url + "/v1/chat/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            events = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        text = "".join(c["choices"][0]["delta"].get("content", "") for c in map(json.loads, events[:-1]))
        messages += [Message(role="assistant", content=text), Message(role="user", content="Go on.")]


def test_huggingface_hub_structured_chat_in_tgi_form(server: ServerProcess) -> None:
    """huggingface_hub's documented structured chat sends TGI's `{"type": "json_object", "value":
    schema}`; the reply is constrained to the schema (on a random model)."""
    require_module("huggingface_hub")
    import jsonschema
    from huggingface_hub import InferenceClient

    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["n"], "additionalProperties": False}
    hub = InferenceClient(base_url=server.base_url, timeout=60)
    for kind in ("json_object", "json"):
        fmt: Any = {"type": kind, "value": schema}  # TGI's grammar form (not in the hub's typed forms)
        resp = hub.chat_completion([{"role": "user", "content": "A number?"}], max_tokens=40, seed=1,
                                   response_format=fmt)
        jsonschema.validate(json.loads(resp.choices[0].message.content or ""), schema)
    date: Any = {"type": "regex", "value": "[0-9]{4}-[0-9]{2}"}
    regex = hub.chat_completion([{"role": "user", "content": "A date?"}], max_tokens=20, seed=1,
                                response_format=date)
    written = regex.choices[0].message.content or ""
    assert len(written) == 7 and written[4] == "-" and (written[:4] + written[5:]).isdigit()
