"""Request and response shapes of the OpenAI-compatible API, as the `openai` SDK sends and reads them.

Requests are strict, so a mistake is an error rather than a silent surprise: unknown fields are
rejected (400 naming the field), a boolean is not a number, NaN and infinities are refused. Every
field of OpenAI's requests is declared, each as OpenAI's semantics allow here: honoured where it
means something; accepted and ignored where it is only a hint (caching, latency, verbosity,
labels); refused, naming it, only where honouring it is impossible and ignoring it would change
the answer (audio output, web search, moderation, legacy functions). docs/api.md lists which is which.
Chat messages are in nanoserve/server/api/openai/messages.py.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from nanoserve.engine.types import GrammarSpec
from nanoserve.server.api.common import MAX_COUNT, CacheSalt
from nanoserve.server.api.openai.messages import ChatMessage
from nanoserve.server.api.openai.tools import (
    MAX_TOOLS,
    ToolDefinition,
    ToolUse,
    check_tool_choice,
    check_tools,
    duplicate_name,
)
from nanoserve.server.api.structured import response_format_grammar

# Messages in one chat request. Each costs the template a few tokens at least, so more than this
# cannot fit any window served here (8,192 tokens at most); the cap keeps a body of tens of
# thousands of tiny messages from costing the event loop their rendering (~50 us each) before the
# window refuses them.
MAX_MESSAGES = 2048
MAX_CHOICES = 16  # n and best_of (also at most the engine's slots: each choice holds one)
MAX_PROMPTS = 16  # prompts in one completions request (each is a request of the engine's)
# Token ids before strings: pydantic's smart union picks the same member either way, but a list of
# token ids tried as strings first makes one error per id (300,000 ids: 0.14 s of the event loop
# instead of 0.01 s).
PromptField = str | list[int] | list[str] | list[list[int]]

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
    include_obfuscation: bool | None = Field(
        None, description="Accepted and ignored: chunks carry no `obfuscation` padding."
    )


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
        None, max_length=256, description="The served model to answer (GET /v1/models); none: the "
        "first. While one model is served it answers any name (as TGI and llama.cpp's server do); "
        "responses name it."
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
    cache_salt: CacheSalt | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(None, max_length=256, description="Accepted for compatibility and ignored.")
    safety_identifier: str | None = Field(None, max_length=256, description="Accepted and ignored.")
    store: bool | None = Field(None, description="Accepted and ignored: nothing is stored.")
    metadata: dict[str, str] | None = Field(
        None, max_length=16, description="Accepted and ignored (it labels stored completions; none are)."
    )
    service_tier: Literal["auto", "default", "flex", "scale", "priority", "fast"] | None = Field(
        None, description="Accepted and ignored: one tier serves every request."
    )
    n: int = Field(
        1, ge=1, le=MAX_CHOICES, description=f"Choices to generate (1 to {MAX_CHOICES}, and at most the "
        "server's max_seqs); the prompt is prefilled once. Choice i samples with seed + i."
    )
    response_format: dict[str, Any] | None = Field(
        None, description='{"type": "text"}, {"type": "json_object"} (any JSON object) or '
        '{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}: the output is '
        "constrained to match (also on /v1/completions, as vLLM). TGI's forms too: "
        '{"type": "json" | "json_object", "value": <schema>}, {"type": "regex", "value": "..."}, '
        '{"type": "json_schema", "value": {"name": ..., "schema": {...}}}.'
    )
    logit_bias: dict[str, float] | None = Field(
        None, description="Token id (as a string) -> bias in [-100, 100], added to the logits before "
        "sampling: -100 all but bans a token, 100 all but forces it."
    )

    def choices(self) -> int:
        return self.n

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
        response_format_grammar(v)  # raises on a shape that is not OpenAI's or TGI's
        return v

    def grammar(self) -> GrammarSpec | None:
        """response_format as the engine's grammar (None: plain text)."""
        return response_format_grammar(self.response_format)

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


class Prediction(BaseModel):
    """A predicted output (a latency hint): checked for shape, then ignored."""

    model_config = _STRICT

    type: Literal["content"]
    content: str | list[dict[str, Any]]


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
                if min(ids) < 0 or max(ids) > MAX_COUNT:  # min and max loop in C
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


class ChatCompletionRequest(GenerationRequest):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_tokens: int | None = Field(
        None, ge=1, le=MAX_COUNT, description="Deprecated by OpenAI: max_completion_tokens."
    )
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_COUNT)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    # The tools come before the choice, so that the choice's check reads them.
    tools: list[ToolDefinition] | None = Field(
        None, max_length=MAX_TOOLS, description=f"Function tools (up to {MAX_TOOLS}, distinct names): "
        "with `tool_choice` other than \"none\" the reply may call them (docs/api.md, Tools)."
    )
    tool_choice: str | dict[str, Any] | None = Field(
        None, description='"none", "auto" (the default with tools), "required" (a call, its arguments '
        'matching the schema) or {"type": "function", "function": {"name": ...}} (that call).'
    )
    parallel_tool_calls: bool | None = Field(
        None, description='With "required": true (the default) lets the reply make several calls.'
    )
    function_call: str | dict[str, Any] | None = Field(
        None, description='The legacy form of tool_choice: "none" or "auto" (with no functions).'
    )
    functions: list[dict[str, Any]] | None = Field(
        None, description="The legacy form of tools: refused unless empty or with function_call "
        '"none"; send `tools`.'
    )
    tool_prompt: str | None = Field(
        None, description="TGI's: accepted and ignored (the chat template shows the tools)."
    )
    # Hints about caching, latency, length and effort: accepted and ignored.
    prompt_cache_key: str | None = Field(
        None, max_length=1024, description="Ignored: prompt prefixes are cached whatever the key."
    )
    prompt_cache_retention: Literal["in_memory", "24h"] | None = Field(None, description="Ignored.")
    prompt_cache_options: dict[str, Any] | None = Field(None, description="Ignored.")
    verbosity: Literal["low", "medium", "high"] | None = Field(
        None, description="Ignored: a hint this model was not trained to follow."
    )
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = Field(
        None, description="Ignored: the model does no separate reasoning."
    )
    prediction: Prediction | None = Field(None, description="Ignored: a latency hint (predicted output).")
    # Outputs this server cannot produce: refused unless null.
    modalities: list[Literal["text", "audio"]] | None = Field(None, description='Only ["text"].')
    audio: dict[str, Any] | None = Field(None, description="Refused: no audio output.")
    web_search_options: dict[str, Any] | None = Field(None, description="Refused: no web search.")
    moderation: dict[str, Any] | None = Field(None, description="Refused: no moderation model.")

    @field_validator("tools")
    @classmethod
    def _distinct_tools(cls, v: list[ToolDefinition] | None) -> list[ToolDefinition] | None:
        if v and (name := duplicate_name(v)) is not None:
            raise _invalid(f"`tools` defines function {name!r} twice")
        return v

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice(cls, v: str | dict[str, Any] | None,
                     info: ValidationInfo) -> str | dict[str, Any] | None:
        check_tool_choice(v)
        if "tools" in info.data:  # else `tools` has its own error
            check_tools(info.data["tools"], v)
        return v

    @field_validator("function_call")
    @classmethod
    def _legacy_choice(cls, v: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
        if v is None or v in ("none", "auto"):
            return v
        raise _unsupported("function_call", 'the legacy functions are not; send `tools` and `tool_choice`')

    @field_validator("functions")
    @classmethod
    def _legacy_functions(cls, v: list[dict[str, Any]] | None,
                          info: ValidationInfo) -> list[dict[str, Any]] | None:
        if v and info.data.get("function_call") != "none":
            raise _unsupported("functions", "the legacy functions are not; send `tools` (with "
                               "`function_call`: \"none\" they are ignored)")
        return v

    @field_validator("audio", "web_search_options", "moderation")
    @classmethod
    def _not_producible(cls, v: dict[str, Any] | None, info: ValidationInfo) -> dict[str, Any] | None:
        what = {"audio": "this model writes text only, no audio", "web_search_options": "it cannot "
                "search the web", "moderation": "it has no moderation model"}[str(info.field_name)]
        if v is not None:
            raise _unsupported(str(info.field_name), what)
        return v

    @field_validator("modalities")
    @classmethod
    def _text_modality(cls, v: list[str] | None) -> list[str] | None:
        if v is not None and "audio" in v:
            raise _unsupported("modalities", 'this model writes text only: ["text"]')
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

    def tool_use(self) -> ToolUse | None:
        """What the tools make of the reply (None: plain text)."""
        return ToolUse.of(self.tools, self.tool_choice, self.parallel_tool_calls)
