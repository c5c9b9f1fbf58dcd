"""Token events -> the Responses API's objects: the whole response, and its typed stream events.

Pure translation, no I/O (the route, nanoserve/server/api/openai/responses.py, sends what this
returns). A stream is, in OpenAI's order, each event with the next `sequence_number`:

    response.created, response.in_progress              the response, status in_progress, no output
    response.output_item.added, response.content_part.added   the message and its empty text part
    response.output_text.delta ...                      one per text delta
    response.output_text.done, response.content_part.done, response.output_item.done
    response.completed | response.incomplete            the whole response, usage included

With tools whose calls are read (nanoserve/server/api/openai/tools.py), the message item opens
with the first text that cannot be a call (never, for a forced call), and each call follows the
message as a `function_call` item: output_item.added (arguments ""),
response.function_call_arguments.delta and .done, output_item.done.

A failure after the 200 ends it with `response.failed` (status failed, `error` set). The stream has
no `[DONE]`: OpenAI's Responses streams end with the last event.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from nanoserve.engine.types import FinishReason, TokenEvent
from nanoserve.server.api.openai.responses_schemas import (
    FunctionCallItem,
    OutputMessage,
    OutputText,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
)
from nanoserve.server.api.openai.tool_parsers import CallReader, Parsed
from nanoserve.server.streaming.sse import sse_event


def _unguessable(prefix: str) -> str:
    # From the OS, not the engine's new_id (unique, not unpredictable): on a server without API
    # keys a stored response's id, or its message's (`item_reference`), is what keeps one
    # caller's conversation from another.
    return f"{prefix}_{secrets.token_hex(24)}"


@dataclass
class Draft:
    """What a response says before its text is known: its identity and the request's settings,
    echoed as OpenAI echoes them."""

    model: str
    request: ResponsesRequest
    id: str = field(default_factory=lambda: _unguessable("resp"))
    item_id: str = field(default_factory=lambda: _unguessable("msg"))
    created_at: int = field(default_factory=lambda: int(time.time()))

    def response(self, status: str, output: list[OutputMessage | FunctionCallItem],
                 usage: ResponseUsage | None = None,
                 error: dict[str, str] | None = None) -> ResponseObject:
        r = self.request
        fmt = r.text.format if r.text is not None else None
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return ResponseObject(
            id=self.id, created_at=self.created_at, status=status, error=error,  # type: ignore[arg-type]
            incomplete_details=incomplete, instructions=r.instructions,
            max_output_tokens=r.max_output_tokens, model=self.model, output=output,
            parallel_tool_calls=r.parallel_tool_calls is not False,
            previous_response_id=r.previous_response_id, store=r.stored(),
            temperature=1.0 if r.temperature is None else r.temperature,
            text={"format": fmt.echo() if fmt is not None else {"type": "text"},
                  "verbosity": (r.text.verbosity if r.text is not None else None) or "medium"},
            tool_choice=r.tool_choice if r.tool_choice is not None else "auto", tools=r.tools or [],
            top_p=1.0 if r.top_p is None else r.top_p, truncation=r.truncation or "disabled",
            usage=usage, user=r.user, safety_identifier=r.safety_identifier, metadata=r.metadata or {},
        )

    def message(self, text: str | None, status: str) -> OutputMessage:
        """The message item (no content part while in progress: text None)."""
        content = [] if text is None else [OutputText(text=text)]
        return OutputMessage(id=self.item_id, status=status, content=content)  # type: ignore[arg-type]

    def finished(self, text: str, last: TokenEvent, reader: CallReader | None = None) -> ResponseObject:
        """The whole response of a generation that ended with `last`: its message, and the
        function calls `reader` finds in its text."""
        status = "incomplete" if last.finish_reason is FinishReason.LENGTH else "completed"
        parsed = reader.parse(text) if reader is not None else Parsed(text, [])
        calls = [FunctionCallItem.of(c, _unguessable("fc"), status) for c in parsed.calls]  # type: ignore[arg-type]
        output: list[OutputMessage | FunctionCallItem] = [self.message(parsed.content, status)] \
            if parsed.content is not None or not calls else []
        return self.response(status, [*output, *calls], usage_of(last))


def usage_of(event: TokenEvent) -> ResponseUsage:
    assert event.usage is not None, "the last event of a generation carries usage"
    u = event.usage
    return ResponseUsage(input_tokens=u.prompt_tokens, output_tokens=u.generated_tokens,
                         total_tokens=u.prompt_tokens + u.generated_tokens)


class ResponseEvents:
    """One stream's renderer (a `nanoserve.server.streaming.sse.Render`), and its `error_event`.
    `on_finished` gets the whole response once the generation has ended (to store it)."""

    def __init__(self, draft: Draft, on_finished: Callable[[ResponseObject], None],
                 reader: CallReader | None = None) -> None:
        self.draft = draft
        self.on_finished = on_finished
        self.reader = reader
        self.calls = reader.stream() if reader is not None else None
        self.sequence = 0
        self.started = False
        self.opened = False  # the message item
        self.text: list[str] = []
        self._part = {"item_id": draft.item_id, "output_index": 0, "content_index": 0}

    def _event(self, kind: str, **fields: Any) -> bytes:
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return sse_event(data, event=kind)

    def _open(self) -> Iterator[bytes]:
        self.started = True
        opening = self.draft.response("in_progress", []).model_dump()
        yield self._event("response.created", response=opening)
        yield self._event("response.in_progress", response=opening)

    def _open_message(self) -> Iterator[bytes]:
        self.opened = True
        item = self.draft.message(None, "in_progress").model_dump()
        yield self._event("response.output_item.added", output_index=0, item=item)
        yield self._event("response.content_part.added", **self._part, part=OutputText(text="").model_dump())

    def _delta(self, text: str) -> Iterator[bytes]:
        if text and not self.opened:
            yield from self._open_message()
        if text:
            yield self._event("response.output_text.delta", **self._part, delta=text, logprobs=[])

    def __call__(self, event: TokenEvent) -> Iterator[bytes]:
        if not self.started:
            yield from self._open()
            if self.calls is None:  # plain text: the message opens at once
                yield from self._open_message()
        self.text.append(event.text)
        yield from self._delta(event.text if self.calls is None else self.calls.feed(event.text))
        if event.finish_reason is not None:
            yield from self._finish(event)

    def _finish(self, last: TokenEvent) -> Iterator[bytes]:
        if self.calls is not None:
            rest, _ = self.calls.end()
            yield from self._delta(rest)
        final = self.draft.finished("".join(self.text), last, self.reader)
        calls = [item for item in final.output if isinstance(item, FunctionCallItem)]
        if not calls and not self.opened:  # an empty reply still has its message
            yield from self._open_message()
        if self.opened:
            message = final.output[0]
            assert isinstance(message, OutputMessage)
            part = message.content[0]
            yield self._event("response.output_text.done", **self._part, text=part.text, logprobs=[])
            yield self._event("response.content_part.done", **self._part, part=part.model_dump())
            yield self._event("response.output_item.done", output_index=0, item=message.model_dump())
        for index, call in enumerate(calls, start=len(final.output) - len(calls)):
            yield from self._call_events(index, call)
        kind = "response.incomplete" if final.status == "incomplete" else "response.completed"
        yield self._event(kind, response=final.model_dump())
        self.on_finished(final)

    def _call_events(self, index: int, call: FunctionCallItem) -> Iterator[bytes]:
        added = call.model_copy(update={"arguments": "", "status": "in_progress"}).model_dump()
        yield self._event("response.output_item.added", output_index=index, item=added)
        where = {"item_id": call.id, "output_index": index}
        yield self._event("response.function_call_arguments.delta", **where, delta=call.arguments)
        yield self._event("response.function_call_arguments.done", **where, name=call.name,
                          arguments=call.arguments)
        yield self._event("response.output_item.done", output_index=index, item=call.model_dump())

    def error_event(self, message: str, code: str) -> bytes:
        """The end of a stream whose generation failed after the 200: `response.failed` (with the
        lifecycle's opening events first, when the failure came before any token)."""
        opening = b"".join(self._open()) if not self.started else b""
        failed = self.draft.response("failed", [], error={"code": "server_error", "message": message})
        return opening + self._event("response.failed", response=failed.model_dump())
