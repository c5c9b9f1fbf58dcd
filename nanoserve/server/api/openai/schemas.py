"""Request and response shapes of the OpenAI-compatible API, as the `openai` SDK sends and reads them.

Requests are strict, so a mistake is an error rather than a silent surprise: unknown fields are
rejected (422 naming the field), a boolean is not a number, NaN and infinities are refused. OpenAI
features this server does not implement (`n > 1`, tools, JSON mode, logit bias, ...) are declared
here only so that their rejection can say exactly that, instead of "extra field". docs/api.md
lists what is supported.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    ValidationInfo,
    field_validator,
    model_serializer,
    model_validator,
)
from pydantic_core import PydanticCustomError

from nanoserve.engine.types import GrammarSpec
from nanoserve.server.api.common import MAX_COUNT
from nanoserve.server.api.structured import openai_grammar

MAX_CHOICES = 16  # n and best_of (also at most the engine's slots: each choice holds one)
MAX_PROMPTS = 16  # prompts in one completions request (each is a request of the engine's)
PromptField = str | list[str] | list[int] | list[list[int]]

# Strict: no str -> number or bool -> number coercion; NaN/inf refused on every float.
_STRICT = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


def _unsupported(field: str, why: str) -> PydanticCustomError:
    # A custom error keeps the message as written (no "Value error, " prefix); its location is the field.
    return PydanticCustomError("unsupported", f"`{field}` is not supported by this server: {why}")


def _invalid(message: str) -> PydanticCustomError:
    return PydanticCustomError("value_error", message)


class StreamOptions(BaseModel):
    model_config = _STRICT

    include_usage: bool = Field(False, description="Send a last chunk with `usage` before `[DONE]`.")


def _null_is_default(schema: dict[str, Any], model: type[BaseModel]) -> None:
    """OpenAPI: the fields `_nulls_to_defaults` accepts null for say so."""
    for name in _defaulted(model):
        prop = schema.get("properties", {}).get(name)
        if prop is not None and "anyOf" not in prop:
            default = prop.pop("default", None)
            schema["properties"][name] = {"anyOf": [prop, {"type": "null"}], "default": default}


def _defaulted(model: type[BaseModel]) -> list[str]:
    """Optional fields whose default is a value, not null."""
    return [name for name, f in model.model_fields.items() if not f.is_required() and f.default is not None]


class GenerationRequest(BaseModel):
    """Fields shared by completions and chat completions. OpenAI's API takes null for any optional
    field as "the default": so does this one (null `temperature` is 1, null `n` is 1, ...)."""

    model_config = ConfigDict(**_STRICT, json_schema_extra=_null_is_default)  # type: ignore[typeddict-item]

    @model_validator(mode="before")
    @classmethod
    def _nulls_to_defaults(cls, data: Any) -> Any:
        if isinstance(data, dict):
            defaulted = set(_defaulted(cls))
            return {k: v for k, v in data.items() if v is not None or k not in defaulted}
        return data

    model: str | None = Field(
        None, max_length=256, description="Not used to choose: the server serves one model, which "
        "answers whatever is named here (as TGI and llama.cpp's server do); responses name it."
    )
    temperature: float = Field(1.0, ge=0.0, le=2.0, description="0 = greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int | None = Field(
        None, ge=1, le=MAX_COUNT, description="Extension (as in vLLM): keep the k most likely."
    )
    min_p: float | None = Field(None, ge=0.0, le=1.0, description="Extension: drop p < min_p * p(max).")
    repetition_penalty: float | None = Field(
        None, gt=0.0, le=10.0, description="Extension: multiplicative penalty on seen tokens (> 1: fewer)."
    )
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    stop: str | list[str] | None = Field(None, description="Non-empty stop strings (server-limited count).")
    seed: int | None = Field(None, ge=0, le=2**63 - 1, description="Same seed + same request = same output.")
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(None, max_length=256, description="Accepted for compatibility and ignored.")
    safety_identifier: str | None = Field(None, max_length=256, description="Accepted and ignored.")
    store: bool | None = Field(None, description="Nothing is stored: false or null only.")
    metadata: dict[str, str] | None = Field(
        None, max_length=16, description="Accepted and ignored (it labels stored completions; none are)."
    )
    service_tier: Literal["auto", "default"] | None = Field(None, description="One tier: auto/default only.")
    n: int = Field(
        1, ge=1, le=MAX_CHOICES, description=f"Choices to generate (1 to {MAX_CHOICES}, and at most the "
        "server's max_seqs); the prompt is prefilled once. Choice i samples with seed + i."
    )
    response_format: dict[str, Any] | None = Field(
        None, description='{"type": "text"}, {"type": "json_object"} (any JSON object) or '
        '{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}: the output is '
        "constrained to match (also on /v1/completions, as vLLM)."
    )
    logit_bias: dict[str, float] | None = Field(
        None, description="Token id (as a string) -> bias in [-100, 100], added to the logits before "
        "sampling: -100 all but bans a token, 100 all but forces it."
    )

    def choices(self) -> int:
        return self.n

    @field_validator("store")
    @classmethod
    def _not_stored(cls, v: bool | None) -> bool | None:
        if v:
            raise _unsupported("store", "completions are not stored; send false or leave it out")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _bias_by_token_id(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        ids: set[int] = set()
        for key, bias in (v or {}).items():
            if not key.isascii() or not key.isdecimal() or len(key) > 10:
                raise _invalid(f"logit_bias keys are token ids (decimal strings), got {key[:20]!r}")
            if int(key) in ids:
                raise _invalid(f"logit_bias names token {int(key)} twice")
            ids.add(int(key))
            if not -100.0 <= bias <= 100.0:
                raise _invalid(f"logit_bias[{key!r}] is {bias}; biases are in [-100, 100]")
        return v

    @field_validator("response_format")
    @classmethod
    def _known_format(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        openai_grammar(v)  # raises on a shape that is not one of OpenAI's three
        return v

    def grammar(self) -> GrammarSpec | None:
        """response_format as the engine's grammar (None: plain text)."""
        return openai_grammar(self.response_format)

    def bias_pairs(self) -> tuple[tuple[int, float], ...]:
        """logit_bias as the engine takes it: (token id, bias) pairs."""
        return tuple((int(k), float(b)) for k, b in (self.logit_bias or {}).items())

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, v: str | list[str] | None) -> str | list[str] | None:
        for s in [v] if isinstance(v, str) else v or []:
            if not s:
                raise _invalid("stop strings must not be empty")
        return v

    @field_validator("stream_options")
    @classmethod
    def _needs_stream(cls, v: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        if v is not None and not info.data.get("stream"):
            raise _invalid("`stream_options` is only allowed when `stream` is true")
        return v

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(GenerationRequest):
    """POST /v1/completions."""

    prompt: PromptField = Field(
        description=f"A string, a list of token ids, or up to {MAX_PROMPTS} of either in a list (one "
        "choice each, `index` in the order given)."
    )
    max_tokens: int | None = Field(
        None, ge=0, le=MAX_COUNT, description="Tokens to generate; null or omitted: 16 (OpenAI's default). "
        "0 (with `echo`) generates nothing: the prompt is echoed, and scored with `logprobs`."
    )
    logprobs: int | None = Field(None, ge=0, le=20, description="Also return this many top alternatives; "
                                 "with `echo`, the prompt's tokens are scored too.")
    echo: bool = Field(False, description="Prepend the prompt (as the model saw it) to each choice's text; "
                       "with `logprobs`, its tokens lead the logprobs (the first token's logprob is null).")
    suffix: str | None = Field(None, description="Not supported (needs a fill-in-the-middle model).")
    best_of: int | None = Field(
        None, ge=1, le=MAX_CHOICES, description="Generate this many (at least n; no streaming) and return "
        "the n with the highest mean token logprob (OpenAI's 'log probability per token')."
    )

    @field_validator("prompt")
    @classmethod
    def _prompts(cls, v: PromptField) -> PromptField:
        if isinstance(v, list):
            if not v:
                raise _invalid("prompt must not be an empty list")
            if not isinstance(v[0], int) and len(v) > MAX_PROMPTS:
                raise _invalid(f"prompt holds {len(v)} prompts; at most {MAX_PROMPTS} in one request")
            for ids in [v] if isinstance(v[0], int) else [p for p in v if isinstance(p, list)]:
                if not ids:
                    raise _invalid("a prompt of token ids must not be empty")
                if any(not 0 <= t <= MAX_COUNT for t in ids):  # type: ignore[operator]
                    raise _invalid(f"token ids must be in [0, {MAX_COUNT}]")
        return v

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v: str | None) -> str | None:
        if v:
            raise _unsupported("suffix", "this model has no fill-in-the-middle training")
        return v

    @model_validator(mode="after")
    def _best_of_rules(self) -> CompletionRequest:
        # OpenAI's rules: best_of >= n, and best_of > n cannot stream (the best are known at the end).
        if self.best_of is not None and self.best_of < self.choices():
            raise _invalid(f"best_of ({self.best_of}) must be at least n ({self.choices()})")
        if self.stream and self.best_of is not None and self.best_of > self.choices():
            raise _invalid("best_of greater than n cannot be streamed")
        if self.max_tokens == 0 and not self.echo:
            raise _invalid("max_tokens 0 generates nothing: it is allowed with echo (to score the prompt)")
        return self

    def prompt_inputs(self) -> list[str | list[int]]:
        """Each prompt as `Engine.generate` takes it: text or token ids."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]  # type: ignore[list-item]
        return list(p)  # type: ignore[arg-type]


class ChatMessage(BaseModel):
    model_config = _STRICT

    role: Literal["system", "developer", "user", "assistant"] = Field(
        description="`developer` is treated as `system`; tool/function roles are not supported."
    )
    content: str | list[dict[str, Any]] | None = Field(
        description="A string, or a list of text parts `{\"type\": \"text\", \"text\": ...}`."
    )
    name: str | None = Field(None, min_length=1, max_length=64, description="Replaces the role's speaker.")

    @field_validator("content")
    @classmethod
    def _text_only(cls, v: str | list[dict[str, Any]] | None) -> str | list[dict[str, Any]] | None:
        for part in v if isinstance(v, list) else []:
            kind = part.get("type")
            if kind != "text":
                raise _unsupported(f"content part of type {kind!r}", "this model reads text only")
            if set(part) != {"type", "text"} or not isinstance(part["text"], str):
                raise _invalid('a text part is {"type": "text", "text": "<string>"} and nothing else')
        return v

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part["text"] for part in self.content)
        return self.content or ""

    def for_template(self) -> dict[str, str | None]:
        """The message as model.chat_template.render_chat reads it."""
        role = "system" if self.role == "developer" else self.role
        return {"role": role, "content": self.text(), "name": self.name}


class ChatCompletionRequest(GenerationRequest):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(
        None, ge=1, le=MAX_COUNT, description="Deprecated by OpenAI: max_completion_tokens."
    )
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_COUNT)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    # Tool calling is not implemented: accepted only in the forms that call no tool.
    tools: list[Any] | None = Field(None, description="Empty or null only.")
    tool_choice: Any = Field(None, description='"none", "auto" (with no tools) or null only.')
    functions: list[Any] | None = Field(None, description="Empty or null only.")
    function_call: Any = Field(None, description='"none", "auto" or null only.')
    parallel_tool_calls: bool | None = Field(None, description="Accepted and ignored (no tools).")
    modalities: list[str] | None = Field(None, description='Only ["text"].')
    audio: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    web_search_options: Any = None

    @field_validator("tools", "functions")
    @classmethod
    def _no_tools(cls, v: list[Any] | None, info: ValidationInfo) -> list[Any] | None:
        if v:
            raise _unsupported(str(info.field_name), "tool and function calling are not implemented")
        return v

    @field_validator("tool_choice", "function_call")
    @classmethod
    def _no_tool_call(cls, v: Any, info: ValidationInfo) -> Any:
        # With no tools, "auto" and "none" both mean a plain reply.
        if v is not None and v not in ("none", "auto"):
            raise _unsupported(str(info.field_name), "tool and function calling are not implemented; "
                               'send "none", "auto" or leave it out')
        return v

    @field_validator("audio", "prediction", "reasoning_effort", "web_search_options")
    @classmethod
    def _text_model(cls, v: Any, info: ValidationInfo) -> Any:
        if v is not None:
            raise _unsupported(str(info.field_name), "this is a small text model")
        return v

    @field_validator("modalities")
    @classmethod
    def _text_modality(cls, v: list[str] | None) -> list[str] | None:
        if v is not None and v != ["text"]:
            raise _unsupported("modalities", 'only ["text"]')
        return v

    @field_validator("top_logprobs")
    @classmethod
    def _top_needs_logprobs(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v is not None and not info.data.get("logprobs"):
            raise _invalid("`top_logprobs` requires `logprobs: true`")
        return v

    @field_validator("max_completion_tokens")
    @classmethod
    def _one_limit(cls, v: int | None, info: ValidationInfo) -> int | None:
        other = info.data.get("max_tokens")
        if v is not None and other is not None and other != v:
            raise _invalid("`max_tokens` and `max_completion_tokens` disagree; send only one")
        return v

    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


# ---------------------------------------------------------------- responses

FinishName = Literal["stop", "length"]


class _Response(BaseModel):
    """What every response object and streamed chunk starts with."""

    id: str
    created: int
    model: str
    system_fingerprint: str | None = None


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


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str
    refusal: None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishName


class ChatCompletionResponse(_Response):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None

    @model_serializer(mode="wrap")
    def _omit_unset(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # OpenAI sends only what a delta changes: {"content": "x"}, and {} with the finish.
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
