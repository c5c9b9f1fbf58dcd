"""The OpenAI request schemas: what they accept, and that every refusal names its field."""

from __future__ import annotations

import math

import pytest
from pydantic import BaseModel, ValidationError

from nanoserve.server.api.openai.messages import ChatMessage
from nanoserve.server.api.openai.schemas import ChatCompletionRequest, CompletionRequest

CHAT = {"messages": [{"role": "user", "content": "hi"}]}


def refusal(model: type[BaseModel], body: dict) -> tuple[str, str]:
    """(field path, message) of the first error pydantic raises for `body`."""
    with pytest.raises(ValidationError) as info:
        model.model_validate(body)
    err = info.value.errors()[0]
    return ".".join(str(p) for p in err["loc"]), err["msg"]


def test_supported_fields_are_accepted() -> None:
    req = ChatCompletionRequest.model_validate({
        **CHAT, "model": "m", "max_completion_tokens": 5, "temperature": 0, "top_p": 0.5, "top_k": 3,
        "frequency_penalty": 0.5, "presence_penalty": -0.5, "stop": "\n", "seed": 7, "stream": True,
        "stream_options": {"include_usage": True}, "logprobs": True, "top_logprobs": 2, "user": "me",
        "n": 1, "response_format": {"type": "text"}, "logit_bias": {},
    })
    assert req.token_limit() == 5 and req.stop_list() == ["\n"] and req.include_usage()
    assert CompletionRequest.model_validate({"prompt": ["one"]}).prompt_inputs() == ["one"]
    assert CompletionRequest.model_validate({"prompt": [5, 6]}).prompt_inputs() == [[5, 6]]
    assert CompletionRequest.model_validate({"prompt": "x"}).prompt_inputs() == ["x"]
    several = CompletionRequest.model_validate({"prompt": [[1, 2], [3]]}).prompt_inputs()
    assert several == [[1, 2], [3]]
    assert CompletionRequest.model_validate({"prompt": ["a", "b"]}).prompt_inputs() == ["a", "b"]
    # Omitted and null are the same: the route then uses OpenAI's default of 16.
    assert CompletionRequest.model_validate({"prompt": "x"}).max_tokens is None
    assert CompletionRequest.model_validate({"prompt": "x", "max_tokens": None}).max_tokens is None


def test_neutral_values_some_clients_always_send_are_accepted() -> None:
    # Tool-less, storeless defaults that SDKs and frameworks fill in: they ask for nothing.
    ChatCompletionRequest.model_validate({
        **CHAT, "tools": [], "tool_choice": "none", "parallel_tool_calls": False, "store": False,
        "metadata": {}, "functions": [], "function_call": "none", "service_tier": "auto",
        "safety_identifier": "u1", "max_tokens": None, "response_format": None,
    })
    ChatCompletionRequest.model_validate({**CHAT, "tool_choice": "auto", "parallel_tool_calls": True,
                                          "metadata": {"app": "x"}})
    # null is the default for every optional field, as in OpenAI's API (the SDK sends null for an
    # argument given as None).
    nulls = ChatCompletionRequest.model_validate({
        **CHAT, "temperature": None, "top_p": None, "n": None, "stream": None, "logprobs": None,
        "frequency_penalty": None, "presence_penalty": None, "max_tokens": None,
    })
    assert (nulls.temperature, nulls.top_p, nulls.n) == (1.0, 1.0, 1)
    assert nulls.stream is False and nulls.logprobs is False
    assert CompletionRequest.model_validate({"prompt": "x", "echo": None}).echo is False
    biased = ChatCompletionRequest.model_validate({**CHAT, "logit_bias": {"5": -100, "17": 2.5}})
    assert biased.bias_pairs() == ((5, -100.0), (17, 2.5))


@pytest.mark.parametrize(("body", "field", "says"), [
    ({**CHAT, "tools": [{"type": "function"}]}, "tools.0.function", "Field required"),
    ({**CHAT, "tool_choice": "required"}, "tool_choice", "`tools` is empty or absent"),
    ({**CHAT, "tool_choice": "sometimes"}, "tool_choice", '"required" or {"type": "function"'),
    ({**CHAT, "tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice",
     "`tools` is empty or absent"),
    ({**CHAT, "functions": [{"name": "f"}]}, "functions", "not supported"),
    ({**CHAT, "service_tier": "gold"}, "service_tier", "'auto'"),
    ({**CHAT, "verbosity": "loud"}, "verbosity", "'low'"),
    ({**CHAT, "audio": {"voice": "alloy", "format": "wav"}}, "audio", "no audio"),
    ({**CHAT, "modalities": ["text", "audio"]}, "modalities", "text only"),
    ({**CHAT, "web_search_options": {}}, "web_search_options", "search the web"),
    ({**CHAT, "moderation": {"model": "omni-moderation-latest"}}, "moderation", "not supported"),
    ({**CHAT, "prediction": {"type": "guess", "content": "x"}}, "prediction.type", "'content'"),
    ({**CHAT, "response_format": {"type": "xml"}}, "response_format", "json_schema"),
    ({**CHAT, "response_format": {"type": "regex"}}, "response_format", 'needs its "value"'),
    ({**CHAT, "response_format": {"type": "regex", "value": ""}}, "response_format", "non-empty"),
    ({**CHAT, "logit_bias": {"a": 5}}, "logit_bias", "token ids"),
    ({**CHAT, "logit_bias": {"1": 5, "01": 3}}, "logit_bias", "twice"),
    ({**CHAT, "logit_bias": {"1": 101}}, "logit_bias", "[-100, 100]"),
    ({**CHAT, "frobnicate": 1}, "frobnicate", "Extra inputs"),
    ({**CHAT, "temperature": True}, "temperature", "valid number"),
    ({**CHAT, "temperature": math.nan}, "temperature", "finite"),
    ({**CHAT, "temperature": 2.5}, "temperature", "less than or equal to 2"),
    ({**CHAT, "max_tokens": 0}, "max_tokens", "greater than or equal to 1"),
    ({**CHAT, "max_tokens": "5"}, "max_tokens", "valid integer"),
    ({**CHAT, "stop": ["ok", ""]}, "stop", "must not be empty"),
    ({**CHAT, "stream_options": {"include_usage": True}}, "stream_options", "only allowed when `stream`"),
    ({**CHAT, "top_logprobs": 2}, "top_logprobs", "requires `logprobs: true`"),
    ({**CHAT, "max_tokens": 3, "max_completion_tokens": 4}, "max_completion_tokens", "disagree"),
    ({"messages": []}, "messages", "at least 1"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role", "'assistant'"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages.0", "needs `tool_call_id`"),
    ({"messages": [{"role": "function", "content": "x"}]}, "messages.0", "needs `name`"),
    ({"messages": [{"role": "user"}]}, "messages.0", "needs `content`"),
    ({"messages": [{"role": "user", "content": "x", "refusal": "no"}]}, "messages.0",
     "`refusal` is only for assistant"),
    ({"messages": [{"role": "user", "content": "x", "tool_call_id": "c"}]}, "messages.0",
     "only for tool messages"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function"}]}]},
     "messages.0.tool_calls.0", "needs its `function`"),
    ({"messages": [{"role": "assistant", "content": "x", "mood": "ok"}]}, "messages.0.mood", "Extra inputs"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages.0.content", "'image_url'` is not supported"),
    ({"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]},
     "messages.0.content", "'input_audio'` is not supported"),
    ({"messages": [{"role": "user", "content": [{"type": "file", "file": {}}]}]},
     "messages.0.content", "'file'` is not supported"),
    ({"messages": [{"role": "user", "content": [{"type": "refusal", "refusal": "no"}]}]},
     "messages.0", "only for assistant"),
    ({"messages": [{"role": "user", "content": [{"type": "txt", "text": "a"}]}]},
     "messages.0.content", "got type 'txt'"),
])
def test_chat_refusals_name_the_field(body: dict, field: str, says: str) -> None:
    where, message = refusal(ChatCompletionRequest, body)
    assert where == field
    assert says in message


@pytest.mark.parametrize(("body", "field", "says"), [
    ({"prompt": ["a"] * 17}, "prompt", "at most 16"),
    ({"prompt": [[1], []]}, "prompt", "must not be empty"),
    ({"prompt": []}, "prompt", "empty"),
    ({"prompt": "x", "max_tokens": 0}, "", "allowed with echo"),
    ({"prompt": "x", "max_tokens": -1}, "max_tokens", "greater than or equal to 0"),
    ({"prompt": "x", "suffix": "y"}, "suffix", "fill-in-the-middle"),
    ({"prompt": "x", "logprobs": True}, "logprobs", "valid integer"),
    ({}, "prompt", "Field required"),
])
def test_completion_refusals_name_the_field(body: dict, field: str, says: str) -> None:
    where, message = refusal(CompletionRequest, body)
    assert where == field
    assert says in message


def test_chat_message_text_parts_and_developer_role() -> None:
    msg = ChatMessage.model_validate(
        {"role": "developer", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
    )
    assert msg.for_template() == {"role": "system", "content": "ab"}


STREAMED_TEXTS = ["a", " the", "é\n\"x\" \\ 🎉", "\u2028</script>", "\x00", "\x00nanoserve-slot\x00",
                  "'{}[]:,"]


@pytest.mark.parametrize("text", STREAMED_TEXTS)
def test_streamed_content_chunks_are_the_models_bytes(text: str) -> None:
    """Chat and completion content chunks are rendered from a per-stream template (the hot path:
    one JSON string encoding per token); they must be the very bytes the schemas produce."""
    from nanoserve.engine.types import TokenEvent
    from nanoserve.model.tokenizer import CharTokenizer
    from nanoserve.server.api.openai.format import ChatChunks, CompletionChunks, Reply
    from nanoserve.server.api.openai.objects import (
        ChatChunkChoice,
        ChatCompletionChunk,
        ChatDelta,
        CompletionChoice,
        CompletionResponse,
    )
    from nanoserve.server.streaming.sse import sse_event

    reply = Reply.new("x", "tiny", CharTokenizer(["a", "b"]))
    event = TokenEvent(index=4, token_id=1, text=text, logprob=-0.5)
    chat = list(ChatChunks(reply, logprobs=False, include_usage=True)(event))
    assert chat[-1] == sse_event(ChatCompletionChunk(
        id=reply.id, created=reply.created, model=reply.model,
        choices=[ChatChunkChoice(delta=ChatDelta(content=text))]))
    completion = list(CompletionChunks(reply, None, include_usage=False)(event))
    assert completion == [sse_event(CompletionResponse(
        id=reply.id, created=reply.created, model=reply.model, choices=[CompletionChoice(text=text)]))]


def test_an_event_template_needs_its_slot_exactly_once() -> None:
    from pydantic_core import to_json

    from nanoserve.server.streaming.sse import EventTemplate

    with pytest.raises(ValueError, match="exactly once"):
        EventTemplate(lambda text: b"data: {}\n\n")  # the text never appears
    with pytest.raises(ValueError, match="exactly once"):
        EventTemplate(lambda text: b"data: [" + to_json(text) + b"," + to_json(text) + b"]\n\n")
    template = EventTemplate(lambda text: b"data: {\"t\":" + to_json(text) + b"}\n\n")
    assert template("q\"") == b'data: {"t":"q\\""}\n\n'


def test_a_conversation_past_the_message_cap_is_refused_by_its_count() -> None:
    from nanoserve.server.api.openai.schemas import MAX_MESSAGES

    turn = {"role": "user", "content": "hi"}
    ChatCompletionRequest.model_validate({"messages": [turn] * MAX_MESSAGES})  # at the cap: accepted
    where, msg = refusal(ChatCompletionRequest, {"messages": [turn] * (MAX_MESSAGES + 1)})
    assert where == "messages" and f"at most {MAX_MESSAGES} items" in msg, msg


@pytest.mark.parametrize("prompt", [[1, -1], [[3], [1, 2**31]], [2**31 - 1, -5, 7]])
def test_token_ids_out_of_range_are_refused_by_name(prompt: list) -> None:
    where, msg = refusal(CompletionRequest, {"prompt": prompt})
    assert where == "prompt" and "token ids must be in [0, 2147483647]" in msg, msg


def test_a_prompt_of_token_ids_stays_ids_and_one_of_strings_stays_strings() -> None:
    # The union tries ids first (cheaper for long id lists); which member wins must not change.
    assert CompletionRequest.model_validate({"prompt": [1, 2]}).prompt_inputs() == [[1, 2]]
    assert CompletionRequest.model_validate({"prompt": ["1", "2"]}).prompt_inputs() == ["1", "2"]
