"""Every field of OpenAI's message objects and every request field current clients send, over HTTP:
honoured, ignored (then the answer is the one without it), or refused with a 400 naming it."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio

from tests.server.asgi import AppClient, asgi_client

pytestmark = pytest.mark.asyncio(loop_scope="module")

CALL = {"id": "call_1", "type": "function", "index": 0,
        "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}
# Every field each role's message object has in OpenAI's API, and what other clients add.
EVERY_MESSAGE_FIELD: list[dict[str, Any]] = [
    {"role": "developer", "content": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}],
     "name": "rules"},
    {"role": "system", "content": "Answer in English.", "name": None, "tool_calls": None},
    {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?",
                                  "prompt_cache_breakpoint": {"mode": "explicit"}}], "name": "ann"},
    {"role": "assistant", "content": None, "refusal": None, "tool_calls": [CALL], "audio": None,
     "annotations": [], "function_call": None, "reasoning": None, "reasoning_content": None,
     "tool_call_id": None, "parsed": None, "name": None},
    {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "18C, sunny"}]},
    {"role": "assistant",
     "content": [{"type": "text", "text": "18C. "}, {"type": "refusal", "refusal": "No."}],
     "refusal": "No.", "annotations": [{"type": "url_citation", "url_citation": {
         "url": "https://example.com", "title": "t", "start_index": 0, "end_index": 1}}],
     "audio": {"id": "audio_1"}, "reasoning": "It said 18C.",
     "function_call": {"name": "lookup", "arguments": "{}"}},
    {"role": "function", "name": "lookup", "content": "nothing"},
    {"role": "assistant", "content": "Done.", "reasoning_content": "ok", "tool_calls": []},
    {"role": "user", "content": "Thanks", "tool_calls": None, "name": None},
]
# The request fields clients send by default or commonly set: each a hint, ignored here.
HINTS: dict[str, Any] = {
    "user": "u-1", "safety_identifier": "s-1", "store": True, "metadata": {"app": "tests"},
    "service_tier": "flex", "prompt_cache_key": "conversation-7", "prompt_cache_retention": "24h",
    "prompt_cache_options": {"mode": "implicit", "ttl": "30m"}, "verbosity": "low",
    "reasoning_effort": "minimal", "prediction": {"type": "content", "content": "18C."},
    "modalities": ["text"], "parallel_tool_calls": True, "tools": [{"type": "function", "function": {
        "name": "get_weather", "parameters": {"type": "object"}}}], "tool_choice": "none",
    "functions": [], "function_call": "none", "audio": None, "web_search_options": None, "moderation": None,
    "tool_prompt": "Use tools.", "top_logprobs": None, "logit_bias": None,
}
BASE = {"model": "any", "max_tokens": 6, "temperature": 0}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def client(tiny_checkpoint) -> AsyncIterator[AppClient]:  # type: ignore[no-untyped-def]
    async with asgi_client(tiny_checkpoint) as c:
        yield c


async def test_every_message_field_and_hint_is_accepted_and_hints_change_nothing(client: AppClient) -> None:
    plain = await client.post("/v1/chat/completions", json={**BASE, "messages": EVERY_MESSAGE_FIELD})
    assert plain.status_code == 200, plain.text
    hinted = await client.post("/v1/chat/completions",
                               json={**BASE, **HINTS, "messages": EVERY_MESSAGE_FIELD})
    assert hinted.status_code == 200, hinted.text
    assert hinted.json()["choices"] == plain.json()["choices"]
    assert hinted.json()["usage"] == plain.json()["usage"]
    assert isinstance(hinted.json()["system_fingerprint"], str)


async def test_stream_options_of_current_clients(client: AppClient) -> None:
    options = {"include_usage": True, "include_obfuscation": False}
    for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                       ("/v1/completions", {"prompt": "hi"})):
        r = await client.post(path, json={**BASE, **body, "stream": True, "stream_options": options})
        assert r.status_code == 200, r.text
        events = [json.loads(e[6:]) for e in r.text.split("\n\n") if e.startswith("data: {")]
        assert events[-1]["usage"]["completion_tokens"] == 6  # include_usage honoured
        assert not any("obfuscation" in e for e in events)


async def test_completions_take_the_shared_hints(client: AppClient) -> None:
    hints = {k: HINTS[k] for k in ("user", "safety_identifier", "store", "metadata", "service_tier")}
    plain = await client.post("/v1/completions", json={**BASE, "prompt": "Hath"})
    hinted = await client.post("/v1/completions", json={**BASE, **hints, "prompt": "Hath"})
    assert hinted.status_code == 200, hinted.text
    assert hinted.json()["choices"] == plain.json()["choices"]


async def test_tgi_response_formats_constrain_the_chat(client: AppClient) -> None:
    messages = [{"role": "user", "content": "A date?"}]
    r = await client.post("/v1/chat/completions", json={
        **BASE, "max_tokens": 12, "messages": messages,
        "response_format": {"type": "regex", "value": "[0-9]{4}-[0-9]{2}"}})
    assert r.status_code == 200, r.text
    text = r.json()["choices"][0]["message"]["content"]
    assert len(text) == 7 and text[4] == "-" and (text[:4] + text[5:]).isdigit()
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    for fmt in ({"type": "json", "value": schema}, {"type": "json_object", "value": json.dumps(schema)},
                {"type": "json_schema", "value": {"name": "s", "schema": schema}}):
        r = await client.post("/v1/chat/completions", json={**BASE, "max_tokens": 30, "messages": messages,
                                                             "response_format": fmt})
        assert r.status_code == 200, r.text
        assert set(json.loads(r.json()["choices"][0]["message"]["content"])) == {"ok"}


TOOLS = HINTS["tools"]


@pytest.mark.parametrize(("extra", "param", "says"), [
    ({"tools": [*TOOLS, *TOOLS]}, "tools", "twice"),
    ({"tool_choice": "required"}, "tool_choice", "`tools` is empty or absent"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice",
     "not in `tools`"),
    ({"functions": [{"name": "f"}], "function_call": "auto"}, "functions", "not supported"),
    ({"audio": {"voice": "alloy", "format": "wav"}}, "audio", "no audio"),
    ({"modalities": ["text", "audio"]}, "modalities", "text only"),
    ({"web_search_options": {}}, "web_search_options", "search the web"),
    ({"moderation": {"model": "omni-moderation-latest"}}, "moderation", "moderation"),
    ({"verbosity": "very"}, "verbosity", "low"),
    ({"response_format": {"type": "json", "value": 5}}, "response_format", "JSON Schema"),
    ({"response_format": {"type": "regex"}}, "response_format", '"value"'),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content", "text only"),
    ({"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]},
     "messages[0].content", "text only"),
    ({"messages": [{"role": "user", "content": "x", "refusal": None, "reasoning": "r"}]}, "messages[0]",
     "only for assistant"),
    ({"messages": [{"role": "tool", "content": "18C"}]}, "messages[0]", "tool_call_id"),
    ({"messages": [{"role": "assistant", "content": "x", "tool_calls": [{"id": 1}]}]},
     "messages[0].tool_calls[0]", "function"),
    ({"messages": [{"role": "assistant", "content": "x", "feelings": "fine"}]}, "messages[0].feelings",
     "Extra inputs"),
])
async def test_refusals_name_the_field(client: AppClient, extra: dict[str, Any], param: str,
                                       says: str) -> None:
    body = {**BASE, "messages": [{"role": "user", "content": "hi"}], **extra}
    r = await client.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and says in error["message"], error
