"""Response objects and streamed chunks of the OpenAI-compatible API, as the `openai` SDK reads them
(and TGI's client, which needs a string `system_fingerprint`). Requests are in
nanoserve/server/api/openai/schemas.py.
"""

from __future__ import annotations

from functools import cache
from typing import Any, Literal

from pydantic import BaseModel, Field, SerializerFunctionWrapHandler, model_serializer

from nanoserve.server.deps import server_version

FinishName = Literal["stop", "length", "tool_calls"]


@cache  # read once: package metadata is files on disk, and every streamed chunk carries it
def system_fingerprint() -> str:
    """The serving stack that produced a response (OpenAI's `system_fingerprint`; a string, as TGI
    sends it and its client requires)."""
    return f"nanoserve-{server_version()}"


class _Response(BaseModel):
    """What every response object and streamed chunk starts with."""

    id: str
    created: int
    model: str
    system_fingerprint: str = Field(default_factory=system_fingerprint)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None] | None  # None for an echoed prompt's first token
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishName | None = None


class CompletionResponse(_Response):
    """A completion (non-streaming), or one streamed chunk of it (`object` is the same)."""

    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None


class FunctionCallOut(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None  # null when the reply only calls tools
    refusal: None = None
    tool_calls: list[ToolCallOut] | None = None

    @model_serializer(mode="wrap")
    def _calls_when_made(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # `tool_calls` only on a reply that made calls (OpenAI leaves the key out otherwise).
        out: dict[str, Any] = handler(self)
        if out.get("tool_calls") is None:
            out.pop("tool_calls", None)
        return out


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishName


class ChatCompletionResponse(_Response):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: Usage


class FunctionDelta(BaseModel):
    name: str | None = None
    arguments: str | None = None

    @model_serializer(mode="wrap")
    def _omit_unset(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class ToolCallDelta(BaseModel):
    """A streamed tool call: its `index`, `id`, `type` and `function.name` first, then
    `function.arguments` fragments under the same index (OpenAI's deltas)."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionDelta

    @model_serializer(mode="wrap")
    def _omit_unset(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None

    @model_serializer(mode="wrap")
    def _omit_unset(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # OpenAI sends only what a delta changes: {"content": "x"}, and {} with the finish. (The
        # role only once: the openai SDK's stream helper concatenates every string it is sent.)
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishName | None = None


class ChatCompletionChunk(_Response):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "nanoserve"
    max_model_len: int | None = Field(None, description="Extension: the model's context window in tokens.")


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
