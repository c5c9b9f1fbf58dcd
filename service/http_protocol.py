"""The server's HTTP/1.1 protocol: uvicorn's httptools protocol, with a way for a streaming
response to put body chunks on its socket without a trip through ASGI.

A streamed token through ASGI costs the event loop a task wake-up, the async generators between
the engine's inbox and the encoder, the middlewares' `send` wrappers and uvicorn's `send`: with a
client that costs little (wrk), each microsecond of that a token cost the 10.7M model ~1.4% of its
HTTP throughput (docs/performance.md). So every request's scope carries a `BodyWriter`
(`scope["extensions"][BODY_WRITER]`) that writes a chunk of a started, chunked body to the
transport at once, from a plain callback: `sse.py` uses it for the events of a stream in the
middle (never its start or end, which go through ASGI as before, so the middlewares see them).
That holds only while no middleware rewrites a response body (compression, say): the app's
middlewares look at the start and the end alone.
"""

from __future__ import annotations

from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

BODY_WRITER = "nanoserve.body_writer"


class BodyWriter:
    """Writes body chunks of one request's response straight to its transport."""

    __slots__ = ("_cycle",)

    def __init__(self, cycle: RequestResponseCycle) -> None:
        self._cycle = cycle

    def ready(self) -> bool:
        """Whether `write` may be called now: the response has started with a chunked body that is
        not complete, the client is there and its socket is not applying back-pressure. When not,
        the caller sends through ASGI, whose `send` waits for the socket as it should."""
        c = self._cycle
        return bool(
            c.response_started
            and c.chunked_encoding
            and not c.response_complete
            and not c.disconnected
            and not c.flow.write_paused
            and not c.transport.is_closing()
        )

    def write(self, data: bytes) -> None:
        """One chunk of the body (not empty: an empty chunk would end it). Call only when ready()."""
        self._cycle.transport.write(b"%x\r\n%b\r\n" % (len(data), data))


def body_writer(scope: Any) -> BodyWriter | None:
    """The request's BodyWriter, when the server runs this protocol."""
    writer = scope.get("extensions", {}).get(BODY_WRITER)
    return writer if isinstance(writer, BodyWriter) else None


class NanoserveHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol (`uvicorn.Config(http=...)`) whose scopes carry a BodyWriter."""

    def on_headers_complete(self) -> None:
        super().on_headers_complete()
        cycle = self.cycle
        if cycle is not None and cycle.scope is self.scope:  # the cycle this request just got
            extensions: dict[str, Any] = self.scope.setdefault("extensions", {})  # type: ignore[assignment]
            extensions[BODY_WRITER] = BodyWriter(cycle)
