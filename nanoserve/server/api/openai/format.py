"""Token events -> OpenAI response objects: whole completions, streamed chunks, logprobs, usage.

Pure translation, no I/O: the routes in nanoserve/server/api/openai/routes.py feed it the engine's
`TokenEvent`s and send what it returns. Held-back deltas (`text == ""` while a possible stop
string or a partial character waits) produce no chunk unless the client asked for logprobs, so
every token's logprob is still reported exactly once.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from nanoserve.engine.ids import new_id
from nanoserve.engine.types import FinishReason, Prompt, TokenEvent
from nanoserve.model.tokenizer import Tokenizer
from nanoserve.server.api.openai.objects import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    FinishName,
    FunctionCallOut,
    FunctionDelta,
    TokenLogprob,
    ToolCallDelta,
    ToolCallOut,
    TopLogprob,
    Usage,
)
from nanoserve.server.api.openai.tool_parsers import CallArgs, CallHead, Parsed, StreamedCalls
from nanoserve.server.streaming.sse import EventTemplate, sse_event

DONE = b"data: [DONE]\n\n"


def finish_reason(reason: FinishReason) -> FinishName:
    """OpenAI's vocabulary: the token budget ran out ("length") or the model/stop string ended it."""
    return "length" if reason is FinishReason.LENGTH else "stop"


def usage_of(event: TokenEvent) -> Usage:
    assert event.usage is not None, "the last event of a generation carries usage"
    u = event.usage
    return Usage(prompt_tokens=u.prompt_tokens, completion_tokens=u.generated_tokens,
                 total_tokens=u.prompt_tokens + u.generated_tokens)


@dataclass
class Reply:
    """Identity shared by every object of one response."""

    model: str
    tokenizer: Tokenizer
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))

    @classmethod
    def new(cls, prefix: str, model: str, tokenizer: Tokenizer) -> Reply:
        return cls(model=model, tokenizer=tokenizer, id=f"{prefix}-{new_id()}")

    def piece(self, token_id: int | None) -> str:
        return "" if token_id is None else self.tokenizer.id_to_piece(token_id)


# ------------------------------------------------------------------ logprobs


def chat_logprob(reply: Reply, event: TokenEvent) -> TokenLogprob | None:
    if event.token_id is None or event.logprob is None:
        return None
    token = reply.piece(event.token_id)
    tops = [TopLogprob(token=t.text, logprob=t.logprob, bytes=list(t.text.encode()))
            for t in event.top_tokens]
    return TokenLogprob(token=token, logprob=event.logprob, bytes=list(token.encode()), top_logprobs=tops)


class CompletionLogprobsBuilder:
    """Accumulates the legacy completions `logprobs` object (parallel lists)."""

    def __init__(self, reply: Reply, top_n: int) -> None:
        self.reply = reply
        self.top_n = top_n
        self.value = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
        self.offset = 0

    def add(self, event: TokenEvent) -> None:
        if event.token_id is None:
            return
        token = self.reply.piece(event.token_id)
        v = self.value
        v.tokens.append(token)
        v.token_logprobs.append(event.logprob)
        if v.top_logprobs is not None:
            tops = {t.text: t.logprob for t in event.top_tokens[: self.top_n]}
            if event.logprob is not None:  # OpenAI: the chosen token is always among them (up to N + 1)
                tops.setdefault(token, event.logprob)
            v.top_logprobs.append(tops)
        v.text_offset.append(self.offset)
        self.offset += len(token)

    def add_prompt(self, prompt: Prompt) -> None:
        """An echoed prompt's tokens, ahead of the generated ones; the first has no logprob."""
        v = self.value
        for i, token in enumerate(prompt.tokens):
            v.tokens.append(token.text)
            v.token_logprobs.append(token.logprob)
            if v.top_logprobs is not None:
                tops: dict[str, float] | None = None
                if i > 0 and token.logprob is not None:
                    tops = {t.text: t.logprob for t in token.top_tokens[: self.top_n]}
                    tops.setdefault(token.text, token.logprob)  # the prompt's token, as for generated ones
                v.top_logprobs.append(tops)
            v.text_offset.append(self.offset)
            self.offset += len(token.text)

    def take(self) -> CompletionLogprobs:
        """What accumulated since the last call (the whole object for a non-streamed reply)."""
        out = self.value
        self.value = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
        return out


# ------------------------------------------------------------------ whole responses


def completion_response(
    reply: Reply, results: list[tuple[str, TokenEvent, CompletionLogprobs | None]],
    usage: Usage | None = None,
) -> CompletionResponse:
    """One choice per (text, last event, logprobs), `index` in the order given; usage summed over
    them unless given (n > 1 and best_of count each prompt once)."""
    choices, usages = [], []
    for i, (text, last, logprobs) in enumerate(results):
        assert last.finish_reason is not None
        choices.append(CompletionChoice(index=i, text=text, logprobs=logprobs,
                                        finish_reason=finish_reason(last.finish_reason)))
        usages.append(usage_of(last))
    return CompletionResponse(id=reply.id, created=reply.created, model=reply.model, choices=choices,
                              usage=usage or summed_usage(usages))


def summed_usage(usages: list[Usage], per_prompt: int = 1) -> Usage:
    """Usage of several generations; `per_prompt` of them share each prompt, which counts once
    (as OpenAI counts n > 1: the prompt once, every choice's tokens)."""
    prompt = sum(u.prompt_tokens for u in usages) // per_prompt
    completion = sum(u.completion_tokens for u in usages)
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def assistant_message(text: str, reason: FinishName,
                      calls: Callable[[str], Parsed] | None) -> tuple[AssistantMessage, FinishName]:
    """The reply as a message, its tool calls parsed out when `calls` reads them; a reply that
    ended by itself with calls finishes with "tool_calls"."""
    parsed = calls(text) if calls is not None else Parsed(text, [])
    if not parsed.calls:
        return AssistantMessage(content=text), reason
    out = [ToolCallOut(id=c.id, function=FunctionCallOut(name=c.name, arguments=c.arguments))
           for c in parsed.calls]
    return AssistantMessage(content=parsed.content, tool_calls=out), \
        "tool_calls" if reason == "stop" else reason


def chat_response(reply: Reply, results: list[tuple[str, TokenEvent, list[TokenLogprob] | None]],
                  calls: Callable[[str], Parsed] | None = None) -> ChatCompletionResponse:
    """One choice per (text, last event, logprobs) of one prompt (n), the prompt counted once;
    `calls` parses a reply's tool calls."""
    choices = []
    for i, (text, last, logprobs) in enumerate(results):
        assert last.finish_reason is not None
        message, reason = assistant_message(text, finish_reason(last.finish_reason), calls)
        choices.append(ChatChoice(index=i, message=message,
                                  logprobs=ChatLogprobs(content=logprobs) if logprobs is not None else None,
                                  finish_reason=reason))
    usage = summed_usage([usage_of(last) for _, last, _ in results], per_prompt=len(results))
    return ChatCompletionResponse(id=reply.id, created=reply.created, model=reply.model, choices=choices,
                                  usage=usage)


# ------------------------------------------------------------------ streamed chunks


class _Chunks:
    """One stream's renderer (a `nanoserve.server.streaming.sse.Render`): content chunks, the finish,
    optional usage."""

    def __init__(self, reply: Reply, include_usage: bool) -> None:
        self.reply = reply
        self.include_usage = include_usage

    def usage_chunk(self, finals: list[TokenEvent], per_prompt: int = 1) -> Iterator[bytes]:
        """The usage chunk of several streams (prompts, choices), summed (when asked for)."""
        if self.include_usage:
            yield self._envelope([], summed_usage([usage_of(e) for e in finals], per_prompt))

    def _envelope(self, choices: list[Any], usage: Usage | None = None) -> bytes:
        raise NotImplementedError

    def _finish_choice(self, reason: FinishName) -> Any:
        raise NotImplementedError

    def _content(self, event: TokenEvent) -> Iterator[bytes]:
        raise NotImplementedError

    def __call__(self, event: TokenEvent) -> Iterator[bytes]:
        yield from self._content(event)
        if event.finish_reason is not None:
            yield self._envelope([self._finish_choice(finish_reason(event.finish_reason))])
            if self.include_usage:  # OpenAI: a last chunk with no choices and the usage
                yield self._envelope([], usage_of(event))


class CompletionChunks(_Chunks):
    """/v1/completions: a chunk per text delta (and per token when logprobs are asked for)."""

    def __init__(self, reply: Reply, top_n: int | None, include_usage: bool, index: int = 0) -> None:
        super().__init__(reply, include_usage)
        self.index = index  # the prompt's choice, when a request has several
        self.logprobs = CompletionLogprobsBuilder(reply, top_n) if top_n is not None else None
        self.text_chunk = EventTemplate(
            lambda text: self._envelope([CompletionChoice(index=index, text=text)]))

    def _envelope(self, choices: list[Any], usage: Usage | None = None) -> bytes:
        r = self.reply
        return sse_event(CompletionResponse(id=r.id, created=r.created, model=r.model, choices=choices,
                                            usage=usage))

    def _finish_choice(self, reason: FinishName) -> CompletionChoice:
        return CompletionChoice(index=self.index, text="", finish_reason=reason)

    def _content(self, event: TokenEvent) -> Iterator[bytes]:
        if event.prompt is not None:  # echo: the prompt first, in a chunk of its own (as vLLM sends it)
            echoed = None
            if self.logprobs is not None:
                self.logprobs.add_prompt(event.prompt)
                echoed = self.logprobs.take()
            choice = CompletionChoice(index=self.index, text=event.prompt.text, logprobs=echoed)
            yield self._envelope([choice])
        logprobs = None
        if self.logprobs is not None and event.token_id is not None:
            self.logprobs.add(event)
            logprobs = self.logprobs.take()
        if logprobs is not None:
            yield self._envelope([CompletionChoice(index=self.index, text=event.text, logprobs=logprobs)])
        elif event.text:
            yield self.text_chunk(event.text)


class ChatChunks(_Chunks):
    """/v1/chat/completions: the assistant role first, then a chunk per content delta; with
    `calls`, content that may be a tool call is held, and the calls come as tool-call deltas
    before the finish."""

    def __init__(self, reply: Reply, logprobs: bool, include_usage: bool, index: int = 0,
                 calls: StreamedCalls | None = None) -> None:
        super().__init__(reply, include_usage)
        self.logprobs = logprobs
        self.index = index  # the choice, when n > 1
        self.started = False
        self.calls = calls
        self.called = False
        self.content_chunk = EventTemplate(
            lambda text: self._envelope([ChatChunkChoice(index=index, delta=ChatDelta(content=text))]))

    def _envelope(self, choices: list[Any], usage: Usage | None = None) -> bytes:
        r = self.reply
        return sse_event(ChatCompletionChunk(id=r.id, created=r.created, model=r.model, choices=choices,
                                             usage=usage))

    def _finish_choice(self, reason: FinishName) -> ChatChunkChoice:
        if self.called and reason == "stop":
            reason = "tool_calls"
        return ChatChunkChoice(index=self.index, delta=ChatDelta(), finish_reason=reason)

    def _delta(self, delta: ChatDelta) -> bytes:
        return self._envelope([ChatChunkChoice(index=self.index, delta=delta)])

    def _pieces(self, pieces: list[CallHead | CallArgs]) -> Iterator[bytes]:
        """Calls as OpenAI's deltas: index, id, type and name first, then arguments fragments."""
        for p in pieces:
            if isinstance(p, CallHead):
                call = ToolCallDelta(index=p.index, id=p.id, type="function",
                                     function=FunctionDelta(name=p.name, arguments=""))
            else:
                call = ToolCallDelta(index=p.index, function=FunctionDelta(arguments=p.text))
            yield self._delta(ChatDelta(tool_calls=[call]))

    def _tool_calls(self) -> Iterator[bytes]:
        """The end of a reply read for calls: held text that was not a call, or the calls not
        streamed as they were written (all but a forced call's)."""
        assert self.calls is not None
        rest, calls = self.calls.end()
        if rest:
            yield self.content_chunk(rest)
        for k, call in enumerate(calls):
            yield from self._pieces([CallHead(k, call.id, call.name), CallArgs(k, call.arguments)])
        self.called = bool(calls) or self.calls.started > 0

    def _content(self, event: TokenEvent) -> Iterator[bytes]:
        if not self.started:  # OpenAI opens every stream with the assistant role and empty content
            self.started = True  # (none when the reply is a forced call: its content is null)
            forced = self.calls is not None and self.calls.fmt.name == "json"
            role = ChatDelta(role="assistant", content=None if forced else "")
            yield self._envelope([ChatChunkChoice(index=self.index, delta=role)])
        text = event.text if self.calls is None else self.calls.feed(event.text)
        if self.calls is not None:
            yield from self._pieces(self.calls.take())
        entry = chat_logprob(self.reply, event) if self.logprobs else None
        if entry is not None:
            held = text or None if self.calls is not None else text  # no "" content for a held call
            yield self._envelope([ChatChunkChoice(index=self.index, delta=ChatDelta(content=held),
                                                  logprobs=ChatLogprobs(content=[entry]))])
        elif text:
            yield self.content_chunk(text)
        if event.finish_reason is not None and self.calls is not None:
            yield from self._tool_calls()
