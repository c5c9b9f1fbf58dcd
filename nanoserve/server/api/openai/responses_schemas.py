"""Request and response shapes of the Responses API (`POST /v1/responses`), as the `openai` SDK
sends and reads them (openai/types/responses/).

Every field of OpenAI's request is declared, in one of three kinds (docs/api.md lists them):
honoured; accepted and ignored, where it is only a hint that changes nothing this server
answers (`reasoning`, `text.verbosity`, the prompt-cache fields, ...); refused with 400 naming it,
where ignoring it would change the answer (tools other than functions, images, background mode, ...).
Anything else is an unknown field: a 400 naming it, as on the other routes. Input items are
checked by hand rather than by a pydantic union, so a mistake names the item
(`input[2].content[0].type`) instead of listing every member of the union.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, Field, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError

from nanoserve.engine.types import GrammarSpec
from nanoserve.server.api.common import MAX_COUNT, STRICT
from nanoserve.server.api.openai.responses_tools import (
    FunctionCallItem,
    ItemStatus,
    chat_tool_choice,
    chat_tools,
    tool_item_message,
)
from nanoserve.server.api.openai.tools import ToolUse
from nanoserve.server.api.structured import openai_grammar

ROLES = ("user", "assistant", "system", "developer")
# Item types that call or answer a tool other than a function: refused.
TOOL_ITEMS = frozenset({
    "custom_tool_call", "custom_tool_call_output",
    "file_search_call", "web_search_call", "computer_call", "computer_call_output", "code_interpreter_call",
    "image_generation_call", "local_shell_call", "local_shell_call_output", "shell_call", "shell_call_output",
    "apply_patch_call", "apply_patch_call_output", "mcp_call", "mcp_list_tools", "mcp_approval_request",
    "mcp_approval_response", "tool_search_call", "tool_search_output",
})
MEDIA_PARTS = frozenset({"input_image", "input_file", "input_audio"})
_MESSAGE_KEYS = frozenset({"type", "role", "content", "id", "status", "phase"})
_PART_KEYS = {"input_text": {"type", "text", "prompt_cache_breakpoint"},
              "output_text": {"type", "text", "annotations", "logprobs"},
              "refusal": {"type", "refusal"}}
_SCHEMA_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
NO_TOOLS = "only function tools are"


def _bad(message: str) -> PydanticCustomError:
    return PydanticCustomError("value_error", message)


def _unsupported(what: str, why: str) -> PydanticCustomError:
    return PydanticCustomError("unsupported", f"{what} is not supported by this server: {why}")


def _part_text(where: str, part: Any) -> str:
    if not isinstance(part, dict):
        raise _bad(f"{where} must be an object")
    kind = part.get("type")
    if kind in MEDIA_PARTS:
        raise _unsupported(f"{where}.type {kind!r}", "this model reads text only")
    if kind not in _PART_KEYS:
        raise _bad(f"{where}.type must be 'input_text', 'output_text' or 'refusal', got {kind!r}")
    extra = sorted(set(part) - _PART_KEYS[kind])
    if extra:
        raise _bad(f"{where} has unknown field(s) {extra}")
    field = "refusal" if kind == "refusal" else "text"
    text = part.get(field)
    if not isinstance(text, str):
        raise _bad(f"{where}.{field} must be a string")
    return text


def item_message(i: int, item: Any) -> dict[str, Any] | None:
    """Input item `i` as the chat template's message (None for an item that renders as nothing:
    a reasoning item, which this server never produces and a model without reasoning ignores;
    `{"item_reference": id}` for a stored item the route looks up)."""
    where = f"input[{i}]"
    if not isinstance(item, dict):
        raise _bad(f"{where} must be an object (a message item)")
    kind = item.get("type", "message")
    if kind in TOOL_ITEMS:
        raise _unsupported(f"{where}.type {kind!r}", NO_TOOLS)
    if kind in ("function_call", "function_call_output"):
        return tool_item_message(where, item)
    if kind == "reasoning":
        return None
    if kind == "item_reference":
        if set(item) != {"type", "id"} or not isinstance(item["id"], str):
            raise _bad(f'{where} must be {{"type": "item_reference", "id": "<item id>"}}')
        return {"item_reference": item["id"]}  # resolved from the store by the route
    if kind != "message":
        raise _bad(f"{where}.type must be 'message', got {kind!r}")
    extra = sorted(set(item) - _MESSAGE_KEYS)
    if extra:
        raise _bad(f"{where} has unknown field(s) {extra}")
    role = item.get("role")
    if role not in ROLES:
        raise _bad(f"{where}.role must be one of {', '.join(ROLES)}, got {role!r}")
    content = item.get("content")
    if isinstance(content, str):
        text = content
    elif isinstance(content, list):
        text = "".join(_part_text(f"{where}.content[{j}]", part) for j, part in enumerate(content))
    else:
        raise _bad(f"{where}.content must be a string or a list of content parts")
    return {"role": "system" if role == "developer" else role, "content": text}


class TextFormat(BaseModel):
    """`text.format`: {"type": "text"}, {"type": "json_object"}, or
    {"type": "json_schema", "name", "schema", "strict", "description"} (flat, unlike chat's)."""

    model_config = STRICT

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None
    description: str | None = None

    def grammar(self) -> GrammarSpec | None:
        if self.type != "json_schema":
            return openai_grammar({"type": self.type})
        spec = {"name": self.name, "schema": self.schema_, "strict": self.strict}
        return openai_grammar({"type": "json_schema", "json_schema": spec})

    def echo(self) -> dict[str, Any]:
        """As the response object reports it."""
        return self.model_dump(by_alias=True, exclude_none=True)


class TextConfig(BaseModel):
    model_config = STRICT

    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = Field(None, description="Accepted and ignored.")

    @field_validator("format")
    @classmethod
    def _format_fields(cls, v: TextFormat | None) -> TextFormat | None:
        if v is None:
            return v
        if v.type == "json_schema":
            if v.name is None or not _SCHEMA_NAME.match(v.name):
                raise _bad("a json_schema format needs a `name` of 1 to 64 letters, digits, '_' or '-'")
            if v.schema_ is None:
                raise _bad("a json_schema format needs a `schema` (a JSON Schema object)")
        elif {"name", "schema_", "strict", "description"} & v.model_fields_set:
            raise _bad(f"a {v.type!r} format takes no other fields")
        return v


class StreamOptions(BaseModel):
    model_config = STRICT

    include_obfuscation: bool | None = Field(None, description="Accepted and ignored (no obfuscation).")


class ResponsesRequest(BaseModel):
    """POST /v1/responses. Every optional field takes null as its default."""

    model_config = STRICT

    model: str | None = Field(None, max_length=256, description="Not used to choose: the served model "
                              "answers.")
    input: str | list[Any] = Field(description="Text (one user message), or a list of message items.")
    instructions: str | None = Field(None, description="A system message ahead of the input (not carried "
                                     "over by previous_response_id).")
    previous_response_id: str | None = Field(None, max_length=128, description="Continue a stored response.")
    store: bool | None = Field(None, description="Keep the response (default true), in a bounded store.")
    max_output_tokens: int | None = Field(None, ge=1, le=MAX_COUNT)
    temperature: float | None = Field(None, ge=0.0, le=2.0, description="0 = greedy; default 1.")
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    text: TextConfig | None = None
    truncation: Literal["auto", "disabled"] | None = Field(
        None, description="auto: the oldest turns are dropped to fit the window; disabled (default): an "
        "input over the window is a 400.")
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    metadata: dict[str, str] | None = Field(None, max_length=16, description="Kept with the response.")
    user: str | None = Field(None, max_length=256, description="Echoed; not used.")
    safety_identifier: str | None = Field(None, max_length=256, description="Echoed; not used.")
    tools: list[Any] | None = Field(None, description="Function tools, {\"type\": \"function\", "
                                    "\"name\", \"parameters\", ...}, as on the chat route.")
    tool_choice: str | dict[str, Any] | None = Field(
        None, description='"none", "auto", "required" or {"type": "function", "name": ...}.')
    parallel_tool_calls: bool | None = Field(None, description='With "required": several calls (default).')
    max_tool_calls: int | None = Field(None, ge=1, description="Accepted and ignored (a reply's calls "
                                       "are bounded by the forced grammar's 8).")
    top_logprobs: int | None = Field(None, ge=0, le=20, description="0 or null only.")
    include: list[str] | None = Field(None, description="Accepted and ignored, but for "
                                      "message.output_text.logprobs (not supported).")
    service_tier: Literal["auto", "default"] | None = None
    reasoning: dict[str, Any] | None = Field(None, description="Accepted and ignored (no reasoning).")
    prompt_cache_key: str | None = Field(None, max_length=1024, description="Accepted and ignored.")
    prompt_cache_retention: str | None = Field(None, max_length=64, description="Accepted and ignored.")
    prompt_cache_options: dict[str, Any] | None = Field(None, description="Accepted and ignored.")
    image: dict[str, Any] | None = Field(None, description="Accepted and ignored (no images).")
    access_programs: dict[str, Any] | None = Field(None, description="Accepted and ignored.")
    background: bool | None = Field(None, description="false or null only.")
    conversation: Any = Field(None, description="Not supported (null only): use previous_response_id.")
    prompt: Any = Field(None, description="Not supported (null only): reusable prompts live at OpenAI.")
    moderation: Any = Field(None, description="Not supported (null only).")
    context_management: Any = Field(None, description="Not supported (null only).")
    background_options: Any = Field(None, description="Not supported (null only).")

    @field_validator("input")
    @classmethod
    def _items(cls, v: str | list[Any]) -> str | list[Any]:
        if isinstance(v, list):
            if not v:
                raise _bad("input must not be an empty list")
            if not [m for i, item in enumerate(v) if (m := item_message(i, item)) is not None]:
                raise _bad("input holds no message")
        return v

    @field_validator("tools")
    @classmethod
    def _function_tools(cls, v: list[Any] | None) -> list[Any] | None:
        chat_tools(v or [])
        return v

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice(cls, v: str | dict[str, Any] | None,
                     info: ValidationInfo) -> str | dict[str, Any] | None:
        if "tools" in info.data:  # else `tools` has its own error
            chat_tool_choice(v, chat_tools(info.data["tools"] or []))
        return v

    @field_validator("top_logprobs")
    @classmethod
    def _no_logprobs(cls, v: int | None) -> int | None:
        if v:
            raise _unsupported("top_logprobs", "the Responses API here reports no logprobs; "
                               "/v1/chat/completions does")
        return v

    @field_validator("include")
    @classmethod
    def _no_logprobs_included(cls, v: list[str] | None) -> list[str] | None:
        if v and "message.output_text.logprobs" in v:
            raise _unsupported("include 'message.output_text.logprobs'", "the Responses API here reports "
                               "no logprobs; /v1/chat/completions does")
        return v

    @field_validator("background")
    @classmethod
    def _foreground(cls, v: bool | None) -> bool | None:
        if v:
            raise _unsupported("background", "responses are answered in the request (or streamed)")
        return v

    @field_validator("conversation", "prompt", "moderation", "context_management", "background_options")
    @classmethod
    def _null_only(cls, v: Any, info: ValidationInfo) -> Any:
        if v is not None:
            raise _unsupported(str(info.field_name), "send null or leave it out")
        return v

    @field_validator("stream_options")
    @classmethod
    def _needs_stream(cls, v: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        if v is not None and not info.data.get("stream"):
            raise _bad("`stream_options` is only allowed when `stream` is true")
        return v

    def input_messages(self) -> list[dict[str, Any]]:
        """The input as the chat template's messages (validated already)."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        return [m for i, item in enumerate(self.input) if (m := item_message(i, item)) is not None]

    def grammar(self) -> GrammarSpec | None:
        fmt = self.text.format if self.text is not None else None
        return fmt.grammar() if fmt is not None else None

    def stored(self) -> bool:
        return self.store is not False  # OpenAI's default: stored

    def tool_use(self) -> ToolUse | None:
        """What the tools make of the reply, as on the chat route (None: plain text)."""
        tools = chat_tools(self.tools or [])
        return ToolUse.of(tools, chat_tool_choice(self.tool_choice, tools), self.parallel_tool_calls)


# ---------------------------------------------------------------- the response object


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class OutputMessage(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: ItemStatus
    content: list[OutputText]


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0
    cache_write_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class ResponseObject(BaseModel):
    """A response, as answered, retrieved, and carried by the streamed lifecycle events."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    error: dict[str, str] | None = None
    incomplete_details: dict[str, str] | None = None
    instructions: str | None
    max_output_tokens: int | None
    model: str
    output: list[OutputMessage | FunctionCallItem]
    parallel_tool_calls: bool
    previous_response_id: str | None
    reasoning: dict[str, Any] = Field(default_factory=lambda: {"effort": None, "summary": None})
    service_tier: str = "default"
    store: bool
    temperature: float
    text: dict[str, Any]
    tool_choice: str | dict[str, Any]
    tools: list[Any] = Field(default_factory=list)
    top_p: float
    truncation: str
    usage: ResponseUsage | None = None
    user: str | None
    safety_identifier: str | None
    metadata: dict[str, str]


class DeletedResponse(BaseModel):
    id: str
    object: Literal["response"] = "response"
    deleted: Literal[True] = True
