"""Tool calls in a model's text: the formats chat templates teach, parsed whole or as a stream.

- `json`: a forced call's output (tool_choice "required" or a named function), which the grammar
  makes `{"name": ..., "arguments": {...}}`, or with parallel calls a list of those.
- `hermes`: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, one block per call,
  after optional text (Qwen2.5 and the Hermes models: their templates teach it).
- `llama3`: the whole reply one JSON object `{"name": ..., "parameters": {...}}`, optionally after
  `<|python_tag|>` (the templates of Llama 3.1 to 3.3 teach it), or a list of them.

A reply in which no call parses, or whose calls name a function that was not offered, is plain
content, as the model wrote it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field, replace
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
        if not calls:
            return Parsed(text, [])
        # Each call's arguments as written, as a stream sends them (the same bytes either way).
        scan = ForcedCallStream(self, offered)
        scan.feed(text)
        pieces = scan.take()
        written = ["".join(p.text for p in pieces if isinstance(p, CallArgs) and p.index == k)
                   for k in range(len(calls))]
        return Parsed(None, [replace(c, arguments=w or c.arguments)
                             for c, w in zip(calls, written, strict=True)])

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


@dataclass(frozen=True)
class CallHead:
    """A streamed call's start: its index in the reply, id and function name."""

    index: int
    id: str
    name: str


@dataclass(frozen=True)
class CallArgs:
    """A fragment of a streamed call's arguments."""

    index: int
    text: str


class StreamedCalls:
    """One streamed reply: content is released as soon as it cannot be part of a call; the
    calls (and any held text that turned out not to be one) come at the end."""

    def __init__(self, fmt: CallFormat, offered: frozenset[str]) -> None:
        self.fmt = fmt
        self.offered = offered
        self.text = ""
        self.sent = 0
        self.started = 0  # calls already streamed as they were written
        self.pieces: list[CallHead | CallArgs] = []

    def take(self) -> list[CallHead | CallArgs]:
        """The calls' pieces written since the last take (only a forced call streams them)."""
        out, self.pieces = self.pieces, []
        return out

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


class ForcedCallStream(StreamedCalls):
    """A forced reply (the grammar's `{"name": ..., "arguments": ...}` layout, or a list of them)
    streamed as it is written: each call's head once its name is complete, then its arguments in
    the fragments they arrive in. The JSON is scanned once, a character at a time, for string
    and nesting state."""

    _HEAD = re.compile(r'\{"name": ("(?:[^"\\]|\\.)*"), "arguments": ')

    def __init__(self, fmt: CallFormat, offered: frozenset[str]) -> None:
        super().__init__(fmt, offered)
        self.depth = 0
        self.base: int | None = None  # the depth of a call object's braces: 1 inside a list
        self.in_string = self.escaped = False
        self.phase = "between"  # "head" (its name being written), "args", "between"
        self.head_at = 0

    def feed(self, delta: str) -> str:
        start, self.text = len(self.text), self.text + delta
        args_from = start if self.phase == "args" else None
        for i in range(start, len(self.text)):
            ch = self.text[i]
            if self.in_string:
                self.escaped, self.in_string = (False, True) if self.escaped else (ch == "\\", ch != '"')
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                if self.base is None:
                    self.base = 1 if ch == "[" else 0
                if ch == "{" and self.depth == self.base and self.phase == "between":
                    self.phase, self.head_at = "head", i
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.phase == "args" and self.depth == self.base:  # the call object closed
                    self._args(args_from if args_from is not None else i, i)
                    self.phase, args_from = "between", None
            if self.phase == "head" and (m := self._HEAD.fullmatch(self.text, self.head_at, i + 1)):
                self.pieces.append(CallHead(self.started, f"call_{new_id()[:24]}", json.loads(m[1])))
                self.started += 1
                self.phase, args_from = "args", i + 1
        if self.phase == "args" and args_from is not None:
            self._args(args_from, len(self.text))
        return ""

    def _args(self, start: int, end: int) -> None:
        if end > start:
            self.pieces.append(CallArgs(self.started - 1, self.text[start:end]))

    def end(self) -> tuple[str, list[ParsedCall]]:
        return ("", []) if self.started else super().end()


@dataclass(frozen=True)
class CallReader:
    """Reads one request's replies for calls of the functions it offered."""

    fmt: CallFormat
    offered: frozenset[str]

    def parse(self, text: str) -> Parsed:
        return self.fmt.parse(text, self.offered)

    def stream(self) -> StreamedCalls:
        kind = ForcedCallStream if self.fmt.name == "json" else StreamedCalls
        return kind(self.fmt, self.offered)
