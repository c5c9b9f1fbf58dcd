"""Chat messages as clients return them, rendered by published Hugging Face templates exactly as
transformers renders the same conversation written the way its documentation writes it (tool call
arguments as data, no null keys)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from nanoserve.model.chat_template import ChatTemplateError, render_chat
from nanoserve.server.api.openai.schemas import ChatCompletionRequest
from tests.conftest import require_module

TEMPLATES = Path(__file__).resolve().parents[1] / "data" / "chat_templates"
ARGS = {"city": "Paris", "unit": "celsius"}
# The conversation as the openai SDK sends it back: every key the response had, nulls included.
FROM_THE_SDK: list[dict[str, Any]] = [
    {"role": "system", "content": "You are helpful."},
    {"role": "user",
     "content": [{"type": "text", "text": "Weather in "}, {"type": "text", "text": "Paris?"}]},
    {"role": "assistant", "content": None, "refusal": None, "audio": None, "function_call": None,
     "annotations": [], "tool_calls": [{"id": "call_1", "type": "function", "function": {
         "name": "get_weather", "arguments": json.dumps(ARGS)}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18C, sunny"},
    {"role": "assistant", "content": "It is 18C and sunny.", "refusal": None, "tool_calls": None},
    {"role": "user", "content": "Thanks!"},
]
# The same conversation as transformers' chat template documentation writes it.
AS_TRANSFORMERS_TAKES_IT: list[dict[str, Any]] = [
    {"role": "system", "content": "You are helpful."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function", "function": {
        "name": "get_weather", "arguments": ARGS}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18C, sunny"},
    {"role": "assistant", "content": "It is 18C and sunny."},
    {"role": "user", "content": "Thanks!"},
]


def render_both(name: str, ours: list[dict[str, Any]], theirs: list[dict[str, Any]]) -> tuple[str, str]:
    """(nanoserve's prompt for the messages as a client sent them, transformers' for the same
    conversation as its documentation writes it), with published template `name`."""
    require_module("transformers")
    from transformers.utils.chat_template_utils import render_jinja_template

    from nanoserve.server.api.openai.messages import template_messages

    source = (TEMPLATES / f"{name}.jinja").read_text()
    specials = json.loads((TEMPLATES / "models.json").read_text())[name]["special_tokens"]
    body = ChatCompletionRequest.model_validate({"messages": ours})
    template = {"jinja": source, "special_tokens": specials}
    reference = render_jinja_template([theirs], chat_template=source, add_generation_prompt=True, **specials)
    return render_chat(template, template_messages(body.messages, template)), reference[0][0]


@pytest.mark.parametrize("name", ["qwen2.5", "llama3.2"])
def test_tool_turns_render_as_transformers_renders_them(name: str) -> None:
    ours, theirs = render_both(name, FROM_THE_SDK, AS_TRANSFORMERS_TAKES_IT)
    assert ours == theirs
    assert '"city": "Paris"' in ours and "18C, sunny" in ours


@pytest.mark.parametrize("name", ["qwen2.5", "llama3.2", "smollm2", "mistral", "gemma2", "llama3"])
def test_returned_assistant_messages_render_as_transformers_renders_them(name: str) -> None:
    """Plain turns, each reply sent back with the keys the SDK, huggingface_hub and TGI's client
    return (`refusal`, `annotations`, `tool_calls: null`, `tool_call_id: null`, `reasoning`)."""
    returned: list[dict[str, Any]] = [
        {"role": "user", "content": "Hi", "name": None, "tool_calls": None},
        {"role": "assistant", "content": "Hello.", "refusal": None, "annotations": [], "audio": None},
        {"role": "user", "content": [{"type": "text", "text": "And you?"}]},
        {"role": "assistant", "content": "Fine.", "tool_call_id": None, "tool_calls": None,
         "reasoning": None},
        {"role": "user", "content": "Good."},
    ]
    plain: list[dict[str, Any]] = [{"role": m["role"], "content": t} for m, t in
             zip(returned, ["Hi", "Hello.", "And you?", "Fine.", "Good."], strict=True)]
    ours, theirs = render_both(name, returned, plain)
    assert ours == theirs


def test_a_template_without_tool_turns_is_a_clear_error() -> None:
    """SmolLM2's template reads every message's `content`, which a tool-calls-only turn lacks (as
    transformers would, it fails): a ChatTemplateError with the template's message (the route's 400
    naming `messages`), not a 500."""
    from nanoserve.server.api.openai.messages import template_messages

    template = {"jinja": (TEMPLATES / "smollm2.jinja").read_text()}
    body = ChatCompletionRequest.model_validate({"messages": FROM_THE_SDK})
    with pytest.raises(ChatTemplateError, match="chat template refused these messages"):
        render_chat(template, template_messages(body.messages, template))
