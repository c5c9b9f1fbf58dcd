"""Function tools on the Responses API: its flat tool and tool-choice shapes, its `function_call`
and `function_call_output` items in and out. The calls themselves are made as on the chat route
(nanoserve/server/api/openai/tools.py): forced by a grammar, or read in the template's format.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, Literal

from pydantic import BaseModel
from pydantic_core import PydanticCustomError, ValidationError

from nanoserve.server.api.openai.tool_parsers import ParsedCall
from nanoserve.server.api.openai.tools import (
    FunctionDefinition,
    ToolDefinition,
    check_tools,
    duplicate_name,
)

ItemStatus = Literal["in_progress", "completed", "incomplete"]
_CALL_KEYS = {"type", "id", "call_id", "name", "arguments", "status"}
_OUTPUT_KEYS = {"type", "id", "call_id", "output", "status"}


def _bad(message: str) -> PydanticCustomError:
    return PydanticCustomError("value_error", message)


class FunctionCallItem(BaseModel):
    """An output item: one call the reply made (`call_id` is what its output answers)."""

    id: str
    type: Literal["function_call"] = "function_call"
    call_id: str
    name: str
    arguments: str  # JSON text
    status: ItemStatus = "completed"

    @classmethod
    def of(cls, call: ParsedCall, item_id: str, status: ItemStatus = "completed") -> FunctionCallItem:
        return cls(id=item_id, call_id=call.id, name=call.name, arguments=call.arguments, status=status)


def chat_tools(tools: list[Any]) -> list[ToolDefinition]:
    """`tools` of a Responses request ({"type": "function", "name", "parameters", ...} each) as the
    chat route's definitions; another tool type, a bad name or schema is an error naming tools[i]."""
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise PydanticCustomError("unsupported", f"tools[{i}] (type {kind!r}) is not supported by this "
                                      "server: only function tools")
        try:
            fn = FunctionDefinition.model_validate({k: v for k, v in tool.items() if k != "type"})
        except ValidationError as e:
            first = e.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            raise _bad(f"tools[{i}]{'.' + where if where else ''}: {first['msg']}") from None
        out.append(ToolDefinition(type="function", function=fn))
    if (name := duplicate_name(out)) is not None:
        raise _bad(f"`tools` defines function {name!r} twice")
    return out


def chat_tool_choice(choice: str | dict[str, Any] | None,
                     tools: list[ToolDefinition]) -> str | dict[str, Any] | None:
    """`tool_choice` ("none", "auto", "required" or {"type": "function", "name": ...}) in the chat
    route's form, checked against the tools."""
    if isinstance(choice, dict):
        if choice.get("type") != "function" or set(choice) != {"type", "name"} \
                or not isinstance(choice["name"], str):
            raise _bad('a named `tool_choice` is {"type": "function", "name": ...} (function tools only)')
        choice = {"type": "function", "function": {"name": choice["name"]}}
    elif choice not in (None, "none", "auto", "required"):
        raise _bad(f'`tool_choice` is "none", "auto", "required" or {{"type": "function", "name": ...}}, '
                   f"got {str(choice)[:80]!r}")
    check_tools(tools, choice)
    return choice


def tool_item_message(where: str, item: dict[str, Any]) -> dict[str, Any]:
    """A `function_call` input item as the assistant turn that made the call, a
    `function_call_output` as the tool's turn (the chat template's messages)."""
    call = item.get("type") == "function_call"
    extra = sorted(set(item) - (_CALL_KEYS if call else _OUTPUT_KEYS))
    if extra:
        raise _bad(f"{where} has unknown field(s) {extra}")
    fields = ("call_id", "name", "arguments") if call else ("call_id", "output")
    for name in fields:
        if not isinstance(item.get(name), str):
            raise _bad(f"{where}.{name} must be a string")
    if not call:
        return {"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]}
    try:
        arguments = json.loads(item["arguments"])
    except ValueError:
        arguments = item["arguments"]
    # No content, as the chat route leaves it out of a turn that only calls.
    return {"role": "assistant", "tool_calls": [_template_call(item["call_id"], item["name"], arguments)]}


def _template_call(call_id: str, name: str, arguments: Any) -> dict[str, Any]:
    """A call as chat templates read it (arguments as data)."""
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def merged_calls(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Consecutive call-only assistant turns as one (a reply's calls come as one item each, and
    chat templates render a turn's calls together)."""
    out: list[dict[str, Any]] = []
    for m in messages:
        prev = out[-1] if out else None
        if prev is not None and m.get("tool_calls") and prev.get("tool_calls") and not m.get("content"):
            out[-1] = {**prev, "tool_calls": [*prev["tool_calls"], *m["tool_calls"]]}
        else:
            out.append(dict(m))
    return out


def reply_message(text: str | None, calls: list[FunctionCallItem]) -> dict[str, Any]:
    """A finished reply as the conversation's assistant turn (kept for previous_response_id)."""
    if not calls:
        return {"role": "assistant", "content": text or ""}
    message: dict[str, Any] = {"role": "assistant", "tool_calls": [
        _template_call(c.call_id, c.name, json.loads(c.arguments)) for c in calls]}
    if text:
        message["content"] = text
    return message
