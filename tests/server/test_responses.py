"""The Responses API (`/v1/responses`) through the official `openai` client against a real server.

Greedy answers are compared with /v1/chat/completions on the same messages (itself checked token for
token against the reference generator in test_openai.py): equal text proves the input items,
instructions and a previous response's turns reach the model through the same chat template.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import time
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from nanoserve.model.chat_template import render_chat
from nanoserve.model.checkpoint import Checkpoint, load_checkpoint
from nanoserve.server.api.openai.responses_store import ResponseStore
from tests.server.asgi import asgi_client
from tests.server.conftest import FAULT_MARKER, OPENAI_API_KEY, OPENAI_MAX_NEW_TOKENS, metric_value
from tests.server.doc_text import blocks
from tests.server.server import REPO_ROOT, ServerProcess

LIFECYCLE = ["response.created", "response.in_progress", "response.output_item.added",
             "response.content_part.added"]
CLOSING = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
SMALL = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                        "b": {"type": "boolean"}},
         "required": ["n", "b"], "additionalProperties": False}


@pytest.fixture(scope="module")
def client(openai_client: openai.OpenAI) -> openai.OpenAI:
    return openai_client


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint: Path) -> Checkpoint:
    return load_checkpoint(tiny_checkpoint)


def _chat(client: openai.OpenAI, messages: list[dict[str, str]], max_tokens: int) -> str:
    out = client.chat.completions.create(model="tiny-test", messages=messages,  # type: ignore[arg-type]
                                         max_tokens=max_tokens, temperature=0)
    return out.choices[0].message.content or ""


def test_text_input_is_a_user_message_through_the_chat_template(client: openai.OpenAI,
                                                                  checkpoint: Checkpoint) -> None:
    r = client.responses.create(model="tiny-test", input="Who goes there?", max_output_tokens=12,
                                temperature=0)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == "tiny-test"
    assert r.output_text == _chat(client, [{"role": "user", "content": "Who goes there?"}], 12)
    message = r.output[0]
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    prompt = render_chat(checkpoint.chat_template, [{"role": "user", "content": "Who goes there?"}])
    assert r.usage is not None and r.usage.input_tokens == len(checkpoint.tokenizer.encode(prompt))
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens > r.usage.input_tokens
    # A reply cut by max_output_tokens is "incomplete", as OpenAI reports it.
    assert (r.status, message.status) in (("completed", "completed"), ("incomplete", "incomplete"))
    if r.status == "incomplete":
        assert r.usage.output_tokens == 12
        assert r.incomplete_details is not None and r.incomplete_details.reason == "max_output_tokens"


def test_items_and_instructions_render_as_the_chat_messages(client: openai.OpenAI) -> None:
    # Short texts: the tiny model's window is 64 characters.
    items: Any = [
        {"role": "developer", "content": "B"},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "Yo", "annotations": []}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},  # renders as nothing
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "H"},
                                                         {"type": "input_text", "text": "i"}]},
    ]
    r = client.responses.create(model="tiny-test", instructions="A", input=items, max_output_tokens=8,
                                temperature=0)
    assert r.instructions == "A"
    messages = [{"role": "system", "content": "A"}, {"role": "system", "content": "B"},
                {"role": "assistant", "content": "Yo"}, {"role": "user", "content": "Hi"}]
    assert r.output_text == _chat(client, messages, 8)


def test_json_schema_format_is_followed(client: openai.OpenAI) -> None:
    fmt: Any = {"type": "json_schema", "name": "small", "schema": SMALL, "strict": True}
    r = client.responses.create(model="tiny-test", input="JSON", text={"format": fmt}, max_output_tokens=40,
                                temperature=0)
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), SMALL)
    assert r.text is not None and r.text.format is not None and r.text.format.type == "json_schema"

    class Small(BaseModel):  # the SDK's own structured path: a pydantic model, parsed back
        n: int = Field(ge=0, le=99)
        b: bool

    parsed = client.responses.parse(model="tiny-test", input="JSON", text_format=Small, max_output_tokens=40,
                                    temperature=0)
    assert isinstance(parsed.output_parsed, Small)
    anything = client.responses.create(model="tiny-test", input="JSON", max_output_tokens=40, temperature=0,
                                       text={"format": {"type": "json_object"}})
    assert isinstance(json.loads(anything.output_text), dict)


def _events(client: openai.OpenAI, **kwargs: Any) -> list[Any]:
    return list(client.responses.create(model="tiny-test", stream=True, **kwargs))


@pytest.mark.parametrize("max_output_tokens", [3, 40])
def test_stream_events_in_order_and_the_text_is_the_deltas(client: openai.OpenAI,
                                                            max_output_tokens: int) -> None:
    args: dict[str, Any] = {"input": "Speak", "max_output_tokens": max_output_tokens, "temperature": 0}
    events = _events(client, **args)
    kinds = [e.type for e in events]
    deltas = kinds.count("response.output_text.delta")
    final = events[-1].response
    end = "response.incomplete" if final.status == "incomplete" else "response.completed"
    assert kinds == [*LIFECYCLE, *["response.output_text.delta"] * deltas, *CLOSING, end]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == final.output_text == events[-4].text == client.responses.create(**args).output_text
    assert {e.response.id for e in events if hasattr(e, "response")} == {final.id}
    assert final.usage is not None and final.usage.output_tokens >= deltas
    if max_output_tokens == 3:
        assert end == "response.incomplete" and final.incomplete_details.reason == "max_output_tokens"
    assert client.responses.retrieve(final.id).output_text == text  # a stream is stored once it ends


def test_the_sdks_stream_helper(client: openai.OpenAI) -> None:
    with client.responses.stream(model="tiny-test", input="Speak", max_output_tokens=40, temperature=0,
                                 text={"format": {"type": "json_schema", "name": "s", "schema": SMALL}}) as s:
        deltas = [e.delta for e in s if e.type == "response.output_text.delta"]
        final = s.get_final_response()
    assert final.output_text == "".join(deltas)
    jsonschema.validate(json.loads(final.output_text), SMALL)


def test_previous_response_id_continues_the_conversation(client: openai.OpenAI) -> None:
    first = client.responses.create(model="tiny-test", instructions="Be brief.", input="A",
                                    max_output_tokens=3, temperature=0)
    second = client.responses.create(model="tiny-test", previous_response_id=first.id, input="B",
                                     max_output_tokens=3, temperature=0)
    assert second.previous_response_id == first.id
    # The earlier turns, without the earlier instructions (OpenAI does not carry them over).
    messages = [{"role": "user", "content": "A"}, {"role": "assistant", "content": first.output_text},
                {"role": "user", "content": "B"}]
    assert second.output_text == _chat(client, messages, 3)
    # A third turn over the tiny window: "auto" drops the oldest turns as the chat route does.
    streamed = _events(client, previous_response_id=second.id, input="C", max_output_tokens=3,
                       temperature=0, truncation="auto")[-1].response
    third = [*messages, {"role": "assistant", "content": second.output_text},
             {"role": "user", "content": "C"}]
    assert streamed.output_text == _chat(client, third, 3)
    assert client.responses.retrieve(first.id).model_dump() == first.model_dump()
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError, match=first.id):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model="tiny-test", previous_response_id=first.id, input="x")
    assert isinstance(info.value.body, dict)
    assert info.value.body["code"] == "previous_response_not_found"
    assert info.value.body["param"] == "previous_response_id"
    # The later turns still chain: each stored response holds its whole conversation.
    again = client.responses.create(model="tiny-test", previous_response_id=second.id, input="B",
                                    max_output_tokens=3, temperature=0, truncation="auto")
    assert again.output_text == _chat(client, [*third[:-1], {"role": "user", "content": "B"}], 3)
    unstored = client.responses.create(model="tiny-test", input="x", store=False, max_output_tokens=2)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_item_references_name_stored_replies_as_the_ai_sdk_sends_them(client: openai.OpenAI) -> None:
    # The Vercel AI SDK's provider (@ai-sdk/openai 3.x) sends a stored reply back as a reference.
    first = client.responses.create(model="tiny-test", input="A", max_output_tokens=3, temperature=0)
    body = {"model": "tiny-test", "max_output_tokens": 3, "temperature": 0,
            "input": [{"role": "user", "content": [{"type": "input_text", "text": "A"}]},
                      {"type": "item_reference", "id": first.output[0].id},
                      {"role": "user", "content": [{"type": "input_text", "text": "B"}]}]}
    second = client.post("/responses", body=body, cast_to=dict)
    messages = [{"role": "user", "content": "A"}, {"role": "assistant", "content": first.output_text},
                {"role": "user", "content": "B"}]
    assert second["output"][0]["content"][0]["text"] == _chat(client, messages, 3)
    body["input"][1]["id"] = "msg_unknown"
    with pytest.raises(openai.BadRequestError, match="msg_unknown") as info:
        client.post("/responses", body=body, cast_to=dict)
    assert isinstance(info.value.body, dict) and info.value.body["code"] == "item_not_found"


BAD: list[tuple[dict[str, Any], str, str]] = [
    ({"tools": [{"type": "web_search"}]}, "tools", "only function tools"),
    ({"tool_choice": "required"}, "tool_choice", "empty or absent"),
    ({"input": [{"type": "custom_tool_call", "call_id": "c", "name": "f", "input": "x"}]}, "input",
     "input[0].type 'custom_tool_call'"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input",
     "input[0].content[0].type 'input_image'"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input", "input[0].role"),
    ({"input": []}, "input", "empty"),
    ({"text": {"format": {"type": "json_schema", "name": "s"}}}, "text.format", "schema"),
    ({"text": {"format": {"type": "yaml"}}}, "text.format.type", "json_schema"),
    ({"temperature": 3}, "temperature", "less than or equal to 2"),
    ({"max_output_tokens": OPENAI_MAX_NEW_TOKENS + 1}, "max_output_tokens", "limit"),
    ({"top_logprobs": 2}, "top_logprobs", "logprobs"),
    ({"background": True}, "background", "background"),
    ({"conversation": "conv_1"}, "conversation", "conversation"),
    ({"stream_options": {"include_obfuscation": False}}, "stream_options", "stream"),
    ({"frobnicate": 1}, "frobnicate", "Extra inputs"),
    ({"input": "x" * 200, "truncation": "disabled"}, "input", "window"),
]


@pytest.mark.parametrize(("extra", "param", "says"), BAD, ids=[b[1] + ":" + b[2] for b in BAD])
def test_bad_input_is_a_400_naming_the_field(client: openai.OpenAI, extra: dict[str, Any], param: str,
                                             says: str) -> None:
    body = {"model": "tiny-test", "input": "x", **extra}
    with pytest.raises(openai.BadRequestError, match=re.escape(says)) as info:
        client.post("/responses", body=body, cast_to=dict)
    assert isinstance(info.value.body, dict) and info.value.body["param"] == param


def test_hints_are_accepted_and_truncation_auto_drops_the_oldest_turns(client: openai.OpenAI) -> None:
    turns: Any = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"line {i} of the talk"}
                  for i in range(9)]
    raw = client.responses.with_raw_response.create(
        model="tiny-test", input=turns, truncation="auto", max_output_tokens=4, reasoning={"effort": "low"},
        prompt_cache_key="k", metadata={"who": "test"}, user="u", parallel_tool_calls=False, tools=[],
        tool_choice="auto", include=["reasoning.encrypted_content"], text={"verbosity": "low"})
    assert int(raw.headers["x-nanoserve-dropped-messages"]) > 0
    r = raw.parse()
    assert r.metadata == {"who": "test"} and r.user == "u" and r.parallel_tool_calls is False


def test_closing_a_stream_frees_its_slot_and_stores_nothing(client: openai.OpenAI,
                                                            openai_server: ServerProcess) -> None:
    cancelled = 'nanoserve_requests_cancelled_total{route="/v1/responses"}'
    scrape = openai_server.base_url + "/metrics"
    before = metric_value(httpx.get(scrape, timeout=5).text, cancelled)
    stream = client.responses.create(model="tiny-test", input="Long", max_output_tokens=OPENAI_MAX_NEW_TOKENS,
                                     temperature=1.0, stream=True)
    response_id = ""
    for i, event in enumerate(stream):
        response_id = response_id or event.response.id
        if i == 6:
            break
    stream.close()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        metrics = httpx.get(scrape, timeout=5).text
        if metric_value(metrics, cancelled) == before + 1 and "nanoserve_running_sequences 0.0" in metrics:
            break
        time.sleep(0.1)
    assert metric_value(metrics, cancelled) == before + 1
    assert "nanoserve_running_sequences 0.0" in metrics
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response_id)


def test_a_failure_after_the_200_is_response_failed(client: openai.OpenAI) -> None:
    with pytest.raises(openai.InternalServerError, match="generation failed"):
        client.responses.create(model="tiny-test", input=f"{FAULT_MARKER} please", max_output_tokens=5)
    events = _events(client, input=f"{FAULT_MARKER} please", max_output_tokens=5)
    assert [e.type for e in events] == [*LIFECYCLE[:2], "response.failed"]
    failed = events[-1].response
    assert failed.status == "failed" and failed.error is not None and "non-finite" in failed.error.message
    assert [e.sequence_number for e in events] == [0, 1, 2]


async def test_the_store_is_bounded_and_each_key_sees_only_its_own(tiny_checkpoint: Path) -> None:
    keys = ["first-key-0001", "second-key-002"]
    async with asgi_client(tiny_checkpoint, api_keys=",".join(keys), responses_store=2) as app:
        transport = httpx.ASGITransport(app=app.app)
        sdk = [openai.AsyncOpenAI(base_url="http://testserver/v1", api_key=key, max_retries=0,
                                  http_client=httpx.AsyncClient(transport=transport)) for key in keys]
        made = [await sdk[0].responses.create(model="m", input=f"turn {i}", max_output_tokens=2)
                for i in range(3)]
        with pytest.raises(openai.NotFoundError):  # the least recently used went first
            await sdk[0].responses.retrieve(made[0].id)
        assert (await sdk[0].responses.retrieve(made[2].id)).id == made[2].id
        with pytest.raises(openai.NotFoundError):  # another key's response does not exist for it
            await sdk[1].responses.retrieve(made[2].id)
        with pytest.raises(openai.BadRequestError, match="not found"):
            await sdk[1].responses.create(model="m", input="x", previous_response_id=made[2].id)
        with pytest.raises(openai.NotFoundError):
            await sdk[1].responses.delete(made[2].id)
        assert len(app.app.state.responses_store) == 2


def test_the_store_bound_in_bytes() -> None:
    store = ResponseStore(max_entries=100, max_bytes=1000)
    message = {"role": "user", "content": "x" * 300}
    for i in range(4):
        assert store.put("k", {"id": f"r{i}", "output": [{"id": f"m{i}"}]}, [message])
    assert store.bytes <= 1000 and store.get("k", "r0") is None and store.get("k", "r3") is not None
    assert store.item("k", "m0") is None and store.item("k", "m3") == {"id": "m3"}  # items go with it
    assert store.item("other", "m3") is None
    huge = [{"role": "user", "content": "x" * 1000}]
    assert not store.put("k", {"id": "huge", "output": []}, huge)  # over the bound alone: not kept
    assert store.get("k", "huge") is None and store.get("k", "r3") is not None
    assert not ResponseStore(max_entries=0, max_bytes=1000).put("k", {"id": "r", "output": []}, [message])


@pytest.mark.timeout(120)
def test_the_docs_example_runs(openai_server: ServerProcess) -> None:
    doc = (REPO_ROOT / "docs" / "api.md").read_text(encoding="utf-8")
    code = blocks(doc.split("\n## Responses API (`/v1/responses`)\n", 1)[1], "python")[0]
    code = code.replace("http://127.0.0.1:8000/v1", openai_server.base_url + "/v1")
    code = code.replace("unused-unless-the-server-sets-keys", OPENAI_API_KEY)
    assert openai_server.base_url in code and OPENAI_API_KEY in code  # the doc still reads as expected
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(code, "docs/api.md", "exec"), {})  # our own doc's example
    assert printed.getvalue().strip()
