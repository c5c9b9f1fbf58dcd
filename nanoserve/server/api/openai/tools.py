"""Tool calling on /v1/chat/completions: tool definitions, `tool_choice`, the grammar that forces a
call, and the format a reply's calls are read in (nanoserve/server/api/openai/tool_parsers.py).

- `tool_choice` "none" (or no tools): the tools are not shown to the model; a plain reply.
- "auto" (the default with tools): a Jinja chat template renders the tools into the prompt; when
  it teaches a known call format (Hermes `<tool_call>`, Llama 3's JSON) the reply is parsed into
  `tool_calls`, otherwise it is plain content. A data-only template cannot show tools: a plain reply.
- "required" or a named function: the grammar engine constrains the reply to a call (a list of
  them, with parallel calls under "required") whose `arguments` match the function's schema.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic_core import PydanticCustomError

from nanoserve.engine.types import GrammarSpec
from nanoserve.model.chat_template import is_jinja
from nanoserve.server.api.openai.tool_parsers import FORMATS, CallReader, format_of_template

MAX_TOOLS = 128  # OpenAI's bound on `tools`
MAX_PARALLEL_CALLS = 8  # calls in one forced reply with parallel_tool_calls (the grammar's maxItems)
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names
# A function without `parameters` takes none: its arguments are `{}`.
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}
_STRICT = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


def _invalid(message: str) -> PydanticCustomError:
    return PydanticCustomError("value_error", message)


class FunctionDefinition(BaseModel):
    model_config = _STRICT

    name: str = Field(description="Letters, digits, `_` and `-`, up to 64.")
    description: str | None = None
    parameters: dict[str, Any] | None = Field(
        None, description="A JSON Schema of the arguments object; absent: the function takes none."
    )
    strict: bool | None = Field(None, description="Accepted: forced calls always match the schema.")

    @field_validator("name")
    @classmethod
    def _openai_name(cls, v: str) -> str:
        if not _NAME.fullmatch(v):
            raise _invalid(f"function names are 1 to 64 letters, digits, `_` or `-`; got {v[:80]!r}")
        return v

    @field_validator("parameters")
    @classmethod
    def _object_schema(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v is not None and v.get("type", "object") != "object":
            raise _invalid(f'parameters must be a JSON Schema of an object ("type": "object"), '
                           f'got "type": {json.dumps(v.get("type"))}')
        return v

    def arguments_schema(self) -> dict[str, Any]:
        return self.parameters if self.parameters is not None else NO_PARAMETERS


class ToolDefinition(BaseModel):
    """One entry of `tools`: OpenAI's function tool."""

    model_config = _STRICT

    type: Literal["function"] = Field(description="Only function tools (no custom tools).")
    function: FunctionDefinition


def check_tool_choice(v: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    """`tool_choice`: "none", "auto", "required" or {"type": "function", "function": {"name": ...}}
    (or TGI's {"function": {"name": ...}})."""
    if v is None or v in ("none", "auto", "required"):
        return v
    if isinstance(v, str):
        raise _invalid(f'`tool_choice` is "none", "auto", "required" or {{"type": "function", '
                       f'"function": {{"name": ...}}}}, got {v[:80]!r}')
    fn = v.get("function")
    # TGI's clients (huggingface_hub) leave out "type".
    if v.get("type", "function") != "function" or not set(v) <= {"type", "function"} \
            or not isinstance(fn, dict) or set(fn) != {"name"} or not isinstance(fn["name"], str):
        raise _invalid('a named `tool_choice` is {"type": "function", "function": {"name": ...}}')
    return v


def check_tools(tools: list[ToolDefinition] | None,
                choice: str | dict[str, Any] | None) -> None:
    """What `tools` and `tool_choice` must agree on (the choice's field is named in the error)."""
    names = [t.function.name for t in tools or []]
    if (choice == "required" or isinstance(choice, dict)) and not names:
        raise _invalid("`tool_choice` asks for a tool call, but `tools` is empty or absent")
    if isinstance(choice, dict) and choice["function"]["name"] not in names:
        raise _invalid(f"`tool_choice` names function {choice['function']['name']!r}, which is not "
                       f"in `tools` ({', '.join(names)})")


def duplicate_name(tools: list[ToolDefinition]) -> str | None:
    seen: set[str] = set()
    for t in tools:
        if t.function.name in seen:
            return t.function.name
        seen.add(t.function.name)
    return None


def _hoisted(schema: dict[str, Any], owner: str, defs: dict[str, Any]) -> dict[str, Any]:
    """`schema` without its own `$defs` (or `definitions`), which go into `defs` under
    "<owner>.<name>", its references rewritten to match: nested in the call's grammar, a
    reference such as "#/$defs/Address" (pydantic writes them) resolves from the grammar's root."""
    local = {**schema.get("definitions", {}), **schema.get("$defs", {})}
    if not local:
        return schema

    def moved(node: Any) -> Any:
        if isinstance(node, list):
            return [moved(v) for v in node]
        if not isinstance(node, dict):
            return node
        out = {k: moved(v) for k, v in node.items()}
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith(("#/$defs/", "#/definitions/")):
            out["$ref"] = f"#/$defs/{owner}.{ref.split('/', 2)[2]}"
        return out

    for name, sub in local.items():
        defs[f"{owner}.{name}"] = moved(sub)
    hoisted: dict[str, Any] = moved({k: v for k, v in schema.items() if k not in ("$defs", "definitions")})
    return hoisted


@dataclass(frozen=True)
class ToolUse:
    """What a request's tools make of its reply."""

    tools: list[ToolDefinition]
    mode: Literal["auto", "required", "named"]
    parallel: bool
    forced: str | None = None  # the named function

    @classmethod
    def of(cls, tools: list[ToolDefinition] | None, choice: str | dict[str, Any] | None,
           parallel: bool | None) -> ToolUse | None:
        """None when the reply is plain text (no tools, or "none")."""
        if not tools or choice == "none":
            return None
        if isinstance(choice, dict):
            return cls(tools, "named", False, choice["function"]["name"])
        mode: Literal["auto", "required"] = "required" if choice == "required" else "auto"
        return cls(tools, mode, parallel is not False)

    @property
    def offered(self) -> frozenset[str]:
        return frozenset(t.function.name for t in self.tools)

    def for_template(self) -> list[dict[str, Any]]:
        """The tools as Hugging Face chat templates read them (OpenAI's shape)."""
        return [t.model_dump(exclude_none=True) for t in self.tools]

    def grammar(self) -> GrammarSpec | None:
        """The forced reply's grammar: one call of `forced`, or any offered function's (a list of
        1 to MAX_PARALLEL_CALLS with parallel calls); None for "auto"."""
        if self.mode == "auto":
            return None
        chosen = [t for t in self.tools if self.forced in (None, t.function.name)]
        defs: dict[str, Any] = {}
        calls = [{"type": "object", "properties": {
            "name": {"const": t.function.name},
            "arguments": _hoisted(t.function.arguments_schema(), t.function.name, defs)},
            "required": ["name", "arguments"], "additionalProperties": False} for t in chosen]
        call: dict[str, Any] = calls[0] if len(calls) == 1 else {"anyOf": calls}
        if self.parallel:
            call = {"type": "array", "items": call, "minItems": 1, "maxItems": MAX_PARALLEL_CALLS}
        return GrammarSpec("json_schema", json.dumps({**call, "$defs": defs} if defs else call))

    def reader(self, template: dict[str, Any]) -> CallReader | None:
        """How the reply's calls are read: the grammar's JSON when forced; for "auto", the format
        the chat template teaches, if known (else None: the reply is plain content)."""
        fmt = FORMATS["json"] if self.mode != "auto" else None
        if fmt is None and is_jinja(template):
            fmt = format_of_template(self.template_source(template))
        return CallReader(fmt, self.offered) if fmt is not None else None

    def shown_to(self, template: dict[str, Any]) -> list[dict[str, Any]] | None:
        """The `tools` a template renders (a data-only template shows none)."""
        return self.for_template() if is_jinja(template) else None

    @staticmethod
    def template_source(template: dict[str, Any]) -> str:
        """The Jinja source that renders a request with tools (its `tool_use` one when named)."""
        source: str = template.get("named", {}).get("tool_use") or template["jinja"]
        return source
