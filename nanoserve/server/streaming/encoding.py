"""Prompt encoding as the HTTP layer runs it: cheap checks first, long texts off the event loop,
and the work waiting for the encoder bounded like generation is.

A prompt's characters bound its tokens from below (`Tokenizer.max_piece_chars`), so a text that
cannot fit the server's prompt cap is refused before it is encoded. What is left to encode goes
to the encoder's one thread; the characters waiting there are capped (`max_pending_encode_chars`),
and past the cap a request gets 429 with the time the encoder needs to catch up, instead of
queueing CPU work nobody bounds. The byte-level BPE encoder releases the GIL on long texts
(nanoserve/model/tokenizer.py), so the engine thread keeps stepping meanwhile.

One thread, not a pool: what an encoding job does in Python (a chat template, /tokenize's spans)
holds the GIL, and every thread waiting for the GIL makes the event loop's turn at it rarer (a
flood of 120 /tokenize calls on the default pool's six threads kept /health waiting up to 1.3-3 s,
on one thread 0.6-1.2 s, on a 2-core host that other work kept busy). It keeps the server's
priority, unlike the grammar threads (nanoserve/engine/worker_priority.py): those run llguidance
without the GIL, but this thread holds it, and a thread the kernel deschedules while it holds the
GIL stalls the loop with it (at niceness 10 the same flood kept /health waiting 2.2-4.5 s).
"""

from __future__ import annotations

import asyncio
import contextvars
import math
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, TypeVar

from nanoserve.engine.threads import single_threaded_executor
from nanoserve.engine.types import InvalidRequest
from nanoserve.server.http.errors import APIError
from nanoserve.server.runtime.heap import return_free_memory

if TYPE_CHECKING:
    from nanoserve.engine.engine import Engine

T = TypeVar("T")

# Prompts up to this many characters are encoded on the event loop: that takes tens of microseconds;
# a worker-thread hop costs more (a thread pool round trip per request).
INLINE_ENCODE_CHARS = 1024  # the char tokenizer: ~55 us for 1024 characters
# The encoder's speed before any has been measured (characters a second; GPT-2's BPE: ~1.3 M).
INITIAL_CHARS_PER_S = 1e6
TRIM_AFTER_CHARS = 100_000


class EncodeQueue:
    """Runs encoding jobs on its one thread; counts the characters handed to it and not yet
    encoded, and refuses past a cap."""

    def __init__(self, max_pending_chars: int) -> None:
        self.max_pending_chars = max_pending_chars
        self.pending_chars = 0
        self.chars_per_s = INITIAL_CHARS_PER_S
        self._executor: ThreadPoolExecutor | None = None  # started by the first job

    def _thread(self) -> ThreadPoolExecutor:
        if self._executor is None:
            self._executor = single_threaded_executor(1, "nanoserve-encoder")
        return self._executor

    def retry_after_s(self) -> int:
        return max(1, math.ceil(self.pending_chars / self.chars_per_s))

    async def run(self, fn: Callable[[], T], chars: int) -> T:
        """`fn()` on the encoder's thread, or 429 when the characters waiting would pass the cap."""
        if self.pending_chars + chars > self.max_pending_chars:
            raise APIError(
                429,
                f"{self.pending_chars} characters are already waiting to be tokenized (limit "
                f"{self.max_pending_chars}); retry later",
                code="tokenizer_busy",
                headers={"Retry-After": str(self.retry_after_s())},
            )
        self.pending_chars += chars
        t0 = time.perf_counter()

        def job() -> T:
            try:
                return fn()
            finally:
                if chars >= TRIM_AFTER_CHARS:
                    # The encoder's buffers for a long text (~100 MB for 400k characters) go back
                    # to the OS rather than staying resident after the request.
                    return_free_memory()

        context = contextvars.copy_context()  # as asyncio.to_thread does
        try:
            return await asyncio.get_running_loop().run_in_executor(self._thread(), context.run, job)
        finally:
            self.pending_chars -= chars
            elapsed = time.perf_counter() - t0
            if chars >= INLINE_ENCODE_CHARS and elapsed > 0:
                # Queueing time counts too: what a waiting client cares about is throughput.
                self.chars_per_s = 0.8 * self.chars_per_s + 0.2 * (chars / elapsed)


def check_prompt_chars(engine: Engine, text: str, max_tokens: int, param: str) -> None:
    """422 when `text` has more characters than `max_tokens` tokens can stand for."""
    per = engine.tokenizer.max_piece_chars
    if len(text) > max_tokens * per:
        raise APIError(
            422,
            f"{param} has {len(text)} characters, more than this server's limit of {max_tokens} "
            f"tokens can hold (a token stands for at most {per} characters)",
            code="prompt_too_long",
            param=param,
        )


def prompt_too_long(n_tokens: int, limit: int, param: str) -> APIError:
    return APIError(422, f"{param} has {n_tokens} tokens, more than this server's limit of {limit}",
                    code="prompt_too_long", param=param)


async def encode_off_loop(engine: Engine, queue: EncodeQueue, text: str, fn: Callable[[], T],
                          param: str) -> T:
    """`fn()` (which encodes `text`) inline when short, else on the encoder's thread through `queue`;
    a text the tokenizer cannot represent is a 422 naming `param`."""
    try:
        if len(text) <= INLINE_ENCODE_CHARS:
            return fn()
        return await queue.run(fn, len(text))
    except InvalidRequest as exc:
        exc.param = param  # the engine says "inputs"; the OpenAI routes call it "prompt"/"messages"
        raise


async def encode(engine: Engine, queue: EncodeQueue, text: str, max_tokens: int,
                 param: str = "inputs") -> list[int]:
    """Token ids of `text`, refused (422) when over `max_tokens` before or after encoding it."""
    check_prompt_chars(engine, text, max_tokens, param)
    ids = await encode_off_loop(engine, queue, text, lambda: engine.encode(text), param)
    if len(ids) > max_tokens:
        raise prompt_too_long(len(ids), max_tokens, param)
    return ids
