"""The chat messages of /v1/chat/completions, as OpenAI's and TGI's clients send them back.

A conversation's assistant turns come back as the server (or another provider) returned them:
`refusal`, `tool_calls`, `function_call`, `audio`, `annotations`, `reasoning`, `parsed` (the SDK's
`parse()`), null-valued keys clients fill in (TGI's client sends `tool_calls: null` on every
message; huggingface_hub `tool_call_id: null`). Every field of OpenAI's message objects is declared
here: what the prompt can carry is kept, what only describes a past response is accepted and left
out (docs/api.md lists which), and a field that belongs to another role is refused naming it.
Unknown fields stay errors. Images, audio and files cannot be read by a text model: a 400 naming
the part.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from nanoserve.model.chat_template import is_jinja

# Strict as the requests that carry them (nanoserve/server/api/openai/schemas.py).
_STRICT = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
# Fields only an assistant message carries (non-null on another role is refused).
ASSISTANT_ONLY = ("refusal", "tool_calls", "function_call", "audio", "annotations", "reasoning",
                  "reasoning_content", "parsed")
_TEXT_PARTS = {"text", "refusal"}  # "refusal" parts: assistant messages only
_MEDIA_PARTS = {"image_url", "input_audio", "file", "image", "audio", "video"}


def _unsupported(field: str, why: str) -> PydanticCustomError:
    return PydanticCustomError("unsupported", f"`{field}` is not supported by this server: {why}")


def _invalid(message: str) -> PydanticCustomError:
    return PydanticCustomError("value_error", message)


class FunctionCall(BaseModel):
    """A function a past assistant turn called. TGI returns `arguments` as an object; OpenAI as a
    JSON string; TGI also echoes a `description`."""

    model_config = _STRICT

    name: str = Field(min_length=1, max_length=256)
    arguments: str | dict[str, Any] = ""
    description: str | None = None

    def arguments_value(self) -> Any:
        """The arguments as JSON data where they parse (as chat templates take them), else the text."""
        if isinstance(self.arguments, dict):
            return self.arguments
        try:
            return json.loads(self.arguments)
        except ValueError:
            return self.arguments


class CustomCall(BaseModel):
    model_config = _STRICT

    name: str = Field(min_length=1, max_length=256)
    input: str


class ToolCall(BaseModel):
    """One entry of an assistant message's `tool_calls` (OpenAI function or custom tool calls; the
    `index` the SDK's stream accumulator leaves in them is accepted)."""

    model_config = _STRICT

    id: str | int  # TGI's client types it as an int
    type: Literal["function", "custom"] = "function"
    function: FunctionCall | None = None
    custom: CustomCall | None = None
    index: int | None = None

    @model_validator(mode="after")
    def _body_of_its_type(self) -> ToolCall:
        body = self.function if self.type == "function" else self.custom
        if body is None:
            raise _invalid(f"a tool call of type {self.type!r} needs its `{self.type}` object")
        return self

    def for_template(self) -> dict[str, Any]:
        """As Hugging Face chat templates read a tool call: arguments as data."""
        if self.function is not None:
            call = {"name": self.function.name, "arguments": self.function.arguments_value()}
        else:
            assert self.custom is not None
            call = {"name": self.custom.name, "arguments": self.custom.input}
        return {"id": str(self.id), "type": "function", "function": call}


class ChatMessage(BaseModel):
    """One message of `messages`, of any of OpenAI's roles (and TGI's and huggingface_hub's echoes)."""

    model_config = _STRICT

    role: Literal["system", "developer", "user", "assistant", "tool", "function"] = Field(
        description="`developer` is treated as `system`; `tool` (and the legacy `function`) carry a "
        "tool's result."
    )
    content: str | list[dict[str, Any]] | None = Field(
        None, description="A string, or a list of text parts `{\"type\": \"text\", \"text\": ...}` "
        "(joined); null for an assistant message that only calls tools. Required for other roles."
    )
    name: str | None = Field(None, min_length=1, max_length=64, description="Replaces the role's "
                             "speaker; on a `function` message, the function's name.")
    tool_call_id: str | None = Field(None, max_length=256, description="`tool` messages: the call answered.")
    refusal: str | None = Field(None, description="Assistant: a refusal's text (rendered as its content).")
    tool_calls: list[ToolCall] | None = Field(None, description="Assistant: the tool calls it made.")
    function_call: FunctionCall | None = Field(None, description="Assistant: legacy function call.")
    audio: dict[str, Any] | None = Field(None, description="Assistant: a past audio reply's id; ignored.")
    annotations: list[Any] | None = Field(None, description="Assistant: citations; ignored.")
    reasoning: str | None = Field(None, description="Assistant: past reasoning; not part of the prompt.")
    reasoning_content: str | None = Field(None, description="As `reasoning` (vLLM's name).")
    parsed: Any = Field(None, description="The openai SDK's `parse()` result; ignored (`content` "
                        "holds the same JSON).")

    @field_validator("content")
    @classmethod
    def _text_only(cls, v: str | list[dict[str, Any]] | None) -> str | list[dict[str, Any]] | None:
        for part in v if isinstance(v, list) else []:
            kind = part.get("type")
            if kind in _MEDIA_PARTS:
                raise _unsupported(f"content part of type {kind!r}", "this model reads text only")
            if kind not in _TEXT_PARTS:
                raise _invalid(f'content parts are {{"type": "text", "text": ...}}; got type {kind!r}')
            extra = set(part) - {"type", kind, "prompt_cache_breakpoint"}
            if extra or not isinstance(part.get(kind), str):
                raise _invalid(f'a {kind} part is {{"type": "{kind}", "{kind}": "<string>"}}')
        return v

    @model_validator(mode="after")
    def _fields_of_its_role(self) -> ChatMessage:
        if self.role != "assistant":
            extra = [f for f in ASSISTANT_ONLY if getattr(self, f) is not None]
            if extra:
                raise _invalid(f"`{extra[0]}` is only for assistant messages, not {self.role!r} ones")
            if "content" not in self.model_fields_set:
                raise _invalid(f"a {self.role!r} message needs `content`")
            parts = self.content if isinstance(self.content, list) else []
            if any(p.get("type") == "refusal" for p in parts):
                raise _invalid("refusal content parts are only for assistant messages")
        if self.role == "tool" and not self.tool_call_id:
            raise _invalid("a tool message needs `tool_call_id`, the id of the call it answers")
        if self.role != "tool" and self.tool_call_id is not None:
            raise _invalid(f"`tool_call_id` is only for tool messages, not {self.role!r} ones")
        if self.role == "function" and not self.name:
            raise _invalid("a function message needs `name`, the function's")
        return self

    def text(self) -> str:
        """The content as one string (text and refusal parts joined)."""
        if isinstance(self.content, list):
            return "".join(part.get("text") or part.get("refusal") or "" for part in self.content)
        return self.content or ""

    def calls(self) -> list[dict[str, Any]]:
        """The tool calls (and a legacy function call) as chat templates read them."""
        calls = [c.for_template() for c in self.tool_calls or []]
        if self.function_call is not None:
            fc = self.function_call
            calls.append({"id": fc.name, "type": "function",
                          "function": {"name": fc.name, "arguments": fc.arguments_value()}})
        return calls

    def for_template(self) -> dict[str, Any]:
        """The message as OpenAI and Hugging Face chat templates read it: `role`, `content` (text,
        or null for a tool-calls-only turn), `name`, and where present `tool_calls`,
        `tool_call_id`, `reasoning_content`; keys with no value are left out."""
        role = {"developer": "system", "function": "tool"}.get(self.role, self.role)
        text = self.text() or self.refusal or ""
        msg: dict[str, Any] = {"role": role, "content": text, "name": self.name}
        if calls := self.calls():
            msg["tool_calls"] = calls
            msg["content"] = text or None
        if self.tool_call_id is not None or self.role == "function":
            msg["tool_call_id"] = self.tool_call_id or self.name
        if reasoning := self.reasoning_content or self.reasoning:
            msg["reasoning_content"] = reasoning
        # Absent rather than null, as transformers' own examples write messages (templates test
        # `message.name is defined`).
        return {k: v for k, v in msg.items() if v is not None}


def data_template_message(msg: dict[str, Any], roles: dict[str, str]) -> dict[str, Any]:
    """A `for_template` message for a data-only template (nanoserve/model/chat_template.py), which
    has one text per turn and a speaker per role: tool calls are written into the assistant's
    text, one JSON object per line; a tool's result is a turn of the template's `tool` speaker,
    or, when it has none, a user turn that says whose result it is."""
    content = msg.get("content") or ""
    lines = [json.dumps({"name": c["function"]["name"], "arguments": c["function"]["arguments"]},
                        ensure_ascii=False) for c in msg.get("tool_calls", [])]
    text = "\n".join(([content] if content else []) + lines)
    if msg["role"] != "tool":
        return {"role": msg["role"], "content": text, "name": msg.get("name")}
    if "tool" in roles:
        return {"role": "tool", "content": text, "name": msg.get("name")}
    source = msg.get("name") or msg.get("tool_call_id")
    return {"role": "user", "content": f"Tool result ({source}): {text}", "name": None}


def template_messages(messages: list[ChatMessage], template: dict[str, Any]) -> list[dict[str, Any]]:
    """The conversation as the checkpoint's template renders it: OpenAI's message shape for a
    Jinja template (which reads it as transformers passes it), turns of text for a data-only one."""
    msgs = [m.for_template() for m in messages]
    if is_jinja(template):
        return msgs
    return [data_template_message(m, template["roles"]) for m in msgs]
