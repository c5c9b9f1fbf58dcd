"""Tool calls in a model's text: the formats chat templates teach, parsed whole or as a stream.

- `json`: a forced call's output (tool_choice "required" or a named function), which the grammar
  makes `{"name": ..., "arguments": {...}}`, or with parallel calls a list of those.
- `hermes`: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, one block per call,
  after optional text (Qwen2.5, SmolLM3, the Hermes models: their templates teach it).
- `llama3`: the whole reply one JSON object `{"name": ..., "parameters": {...}}`, optionally after
  `<|python_tag|>` (the templates of Llama 3.1 to 3.3 teach it), or a list of them.

A reply in which no call parses, or whose calls name a function that was not offered, is plain
content, as the model wrote it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from nanoserve.engine.ids import new_id


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text, as OpenAI's `function.arguments`
    id: str = field(default_factory=lambda: f"call_{new_id()[:24]}")


@dataclass(frozen=True)
class Parsed:
    """A reply as a message: its text (None when it only calls tools) and its calls."""

    content: str | None
    calls: list[ParsedCall]


def _calls_in(value: Any, offered: frozenset[str], args_keys: tuple[str, ...]) -> list[ParsedCall] | None:
    """`value` (parsed JSON: one call object or a list of them) as calls; None unless every entry
    is a call of an offered function with an object of arguments."""
    items = value if isinstance(value, list) else [value]
    calls = []
    for item in items:
        if not isinstance(item, dict) or item.get("name") not in offered:
            return None
        args: Any = next((item[k] for k in args_keys if k in item), {})
        if not isinstance(args, dict):
            return None
        calls.append(ParsedCall(item["name"], json.dumps(args, ensure_ascii=False)))
    return calls or None


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


class CallFormat:
    """How one family of models writes tool calls."""

    name = ""

    def parse(self, text: str, offered: frozenset[str]) -> Parsed:
        raise NotImplementedError

    def releasable(self, text: str) -> int:
        """How much of a stream's text so far can be sent as content: the part that cannot be
        (the start of) a tool call."""
        raise NotImplementedError


class JsonCalls(CallFormat):
    """The grammar-forced output: all of it is calls."""

    name = "json"

    def parse(self, text: str, offered: frozenset[str]) -> Parsed:
        calls = _calls_in(_json(text), offered, ("arguments",))
        return Parsed(None, calls) if calls else Parsed(text, [])

    def releasable(self, text: str) -> int:
        return 0


class HermesCalls(CallFormat):
    name = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    _BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)

    def parse(self, text: str, offered: frozenset[str]) -> Parsed:
        start = text.find(self.OPEN)
        if start < 0:
            return Parsed(text, [])
        calls: list[ParsedCall] = []
        for block in self._BLOCK.findall(text, start):
            found = _calls_in(_json(block.strip()), offered, ("arguments", "parameters"))
            if found is None:
                return Parsed(text, [])
            calls += found
        if not calls:
            return Parsed(text, [])
        return Parsed(text[:start].strip() or None, calls)

    def releasable(self, text: str) -> int:
        upto = text.find(self.OPEN)
        if upto < 0:
            upto = len(text)
            for keep in range(min(len(self.OPEN) - 1, len(text)), 0, -1):  # a marker may be arriving
                if self.OPEN.startswith(text[-keep:]):
                    upto = len(text) - keep
                    break
        return upto if text[:upto].strip() else 0  # leading whitespace waits: calls may follow


class Llama3Calls(CallFormat):
    name = "llama3"
    TAG = "<|python_tag|>"

    def parse(self, text: str, offered: frozenset[str]) -> Parsed:
        body = text.strip().removeprefix(self.TAG)
        calls = _calls_in(_json(body), offered, ("parameters", "arguments"))
        return Parsed(None, calls) if calls else Parsed(text, [])

    def releasable(self, text: str) -> int:
        head = text.lstrip()
        if not head or head.startswith(("{", "[", self.TAG)) or self.TAG.startswith(head):
            return 0  # a call (or not yet known): held to the end
        return len(text)


FORMATS: dict[str, CallFormat] = {f.name: f for f in (JsonCalls(), HermesCalls(), Llama3Calls())}


def format_of_template(source: str) -> CallFormat | None:
    """The tool-call format a Jinja chat template teaches its model, if it is one known here."""
    if HermesCalls.OPEN in source:
        return FORMATS["hermes"]
    if '"parameters": ' in source and "<|start_header_id|>" in source:
        return FORMATS["llama3"]
    return None


class StreamedCalls:
    """One streamed reply: content is released as soon as it cannot be part of a call; the
    calls (and any held text that turned out not to be one) come at the end."""

    def __init__(self, fmt: CallFormat, offered: frozenset[str]) -> None:
        self.fmt = fmt
        self.offered = offered
        self.text = ""
        self.sent = 0

    def feed(self, delta: str) -> str:
        """The content this delta releases ("" while a call may be arriving). A format's
        releasable part only grows, so what was sent stays sent."""
        self.text += delta
        upto = max(self.fmt.releasable(self.text), self.sent)
        out, self.sent = self.text[self.sent:upto], upto
        return out

    def end(self) -> tuple[str, list[ParsedCall]]:
        """(content not yet sent, the calls)."""
        parsed = self.fmt.parse(self.text, self.offered)
        if parsed.calls:
            return "", parsed.calls
        return self.text[self.sent:], []


@dataclass(frozen=True)
class CallReader:
    """Reads one request's replies for calls of the functions it offered."""

    fmt: CallFormat
    offered: frozenset[str]

    def parse(self, text: str) -> Parsed:
        return self.fmt.parse(text, self.offered)

    def stream(self) -> StreamedCalls:
        return StreamedCalls(self.fmt, self.offered)
