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

The protocol also enforces the connection limits (nanoserve/server/http/connection_guard.py, docs/limits.md),
which must act before a request exists, so below the app:
- at most `max_connections` open, and `max_connections_per_client` from one address when set: one
  more is answered 503 at once and closed;
- a request head (request line and headers) is counted as its bytes arrive and answered 431 past
  `max_head_bytes`, instead of growing in the parser until it ends; so are a chunked body's
  trailers and chunk framing (beyond a few bytes a chunk);
- a head must be complete `header_timeout` seconds after it began (or after the connection opened,
  or after idle bytes that start no request), else 408 (or a plain close if nothing came);
- a kept-alive connection idle for `idle_timeout` is closed;
- a malformed request is answered 400 and the connection closed, but only after the responses to
  the requests before it on the connection (pipelined) have gone out whole;
- pipelined requests are parsed only a few ahead of their turn, so a megabyte of them cannot
  hold hundreds of megabytes of request state;
- a request answered before its announced body is all here (413 by Content-Length) has the
  connection closed after its answer instead of the rest of, say, a gigabyte read and dropped on
  the loop.
An answer the protocol writes itself is followed by a half-close and a short linger that reads
and drops what the client still sends, so a client that is mid-send reads the answer instead of a
connection reset.
"""

from __future__ import annotations

import asyncio
import json
from collections import deque
from typing import Any, ClassVar

import httptools
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol, RequestResponseCycle

from nanoserve.server.http.connection_guard import (
    LINGER_MAX,
    LINGER_MAX_BYTES,
    LINGER_S,
    MAX_PIPELINED,
    MAX_UNPARSED_BYTES,
    PIPELINED_PIECE,
    ConnectionGuard,
    ConnectionLimits,
)
from nanoserve.server.http.errors import error_body

BODY_WRITER = "nanoserve.body_writer"
# A body answered before it was all here whose announced rest is at most this is still read (and
# dropped), so the connection stays open for the client's next request.
KEEP_READING_BYTES = 64 << 10


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


def raw_error(status: int, message: str, code: str, headers: tuple[bytes, ...] = ()) -> bytes:
    """A whole `Connection: close` response in the shared error shape, for the protocol to write."""
    body = json.dumps(error_body(status, message, code)).encode()
    head = [STATUS_LINE[status], b"content-type: application/json\r\n",
            b"content-length: %d\r\n" % len(body), b"connection: close\r\n",
            *(h + b"\r\n" for h in headers), b"\r\n"]
    return b"".join(head) + body


# What this protocol uses of uvicorn beyond its public API: methods of HttpToolsProtocol it calls or
# overrides, attributes of the protocol and of its RequestResponseCycle it reads. uvicorn may change
# any of them in a release, so pyproject.toml pins the range this was tested on and
# `missing_uvicorn_members` (run by tests/server/test_direct_writes.py) names any that disappear.
PROTOCOL_METHODS = (
    "_start_asgi_task", "_unset_keepalive_if_required", "_should_upgrade", "handle_websocket_upgrade",
    "timeout_keep_alive_handler", "on_headers_complete", "on_body", "on_message_complete",
    "on_response_complete", "shutdown", "connection_made", "connection_lost",
)
PROTOCOL_ATTRIBUTES = ("cycle", "flow", "parser", "server_state", "transport", "loop")
CYCLE_ATTRIBUTES = (
    "scope", "transport", "flow", "message_event", "disconnected", "response_started",
    "response_complete", "chunked_encoding", "more_body",
)


def missing_uvicorn_members() -> list[str]:
    """The members this protocol relies on that the installed uvicorn lacks (none when it fits)."""
    import inspect  # only for this check

    def assigned(cls: type, names: tuple[str, ...]) -> list[str]:
        source = inspect.getsource(vars(cls)["__init__"])  # the class's own, not an inherited one
        return [f"{cls.__name__}.{n}" for n in names
                if f"self.{n} =" not in source and f"self.{n}:" not in source]

    missing = [f"HttpToolsProtocol.{n}" for n in PROTOCOL_METHODS
               if not callable(getattr(HttpToolsProtocol, n, None))]
    missing += assigned(HttpToolsProtocol, PROTOCOL_ATTRIBUTES)
    return missing + assigned(RequestResponseCycle, CYCLE_ATTRIBUTES)


def _peer(client: tuple[str, int] | None) -> str:
    return f"{client[0]}:{client[1]}" if client else "a client"


class NanoserveHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol (`uvicorn.Config(http=...)`) whose scopes carry a BodyWriter and
    which enforces the connection limits of its class's `guard` (`with_guard` makes one per server)."""

    guard: ClassVar[ConnectionGuard] = ConnectionGuard(ConnectionLimits())

    @classmethod
    def with_guard(cls, guard: ConnectionGuard) -> type[NanoserveHttpProtocol]:
        """This protocol with `guard`'s limits and metrics (uvicorn builds one per connection)."""
        return type(cls.__name__, (cls,), {"guard": guard})

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.timeout_keep_alive = self.guard.limits.idle_timeout  # type: ignore[assignment]
        self._admitted = False
        self._host: str | None = None  # the client's address, for the per-client count
        self._reading_head = True  # bytes that arrive now belong to a request head
        self._head_bytes = 0
        self._head_timer: asyncio.TimerHandle | None = None
        self._closing = False  # answered by the protocol (or refused): nothing more is parsed
        self._linger: asyncio.TimerHandle | None = None
        self._dropped = 0  # bytes the client sent while the connection lingers
        self._after_response: bytes | None = None  # to write once the response in progress is out
        self._running: RequestResponseCycle | None = None  # the request whose app runs now
        self._unparsed: memoryview | None = None  # input held back while requests wait their turn
        # The body being read: bytes fed, bytes that were body, chunks. What was not body is
        # framing (chunk sizes and extensions) and trailers, which the parser buffers like headers.
        self._body_fed = self._body_bytes = self._chunks = 0

    # Connection.

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        peer = transport.get_extra_info("peername")
        self._host = peer[0] if isinstance(peer, tuple) else None
        refused = self.guard.admit(self._host)
        if refused is not None:
            self.transport, self.client = transport, peer
            self._refuse(refused)
            return
        self._admitted = True
        super().connection_made(transport)
        self._arm_head_timer()

    def _refuse(self, limit: str) -> None:
        if limit == "max_connections":
            n, whose = self.guard.limits.max_connections, "the server has"
        else:
            n, whose = self.guard.limits.max_connections_per_client, "this client address has"
        self.guard.hit(limit, f"503 to {_peer(self.client)}: {n} connections open ({limit})")
        self._answer_and_close(raw_error(
            503, f"{whose} {n} connections open, the limit; retry shortly", "too_many_connections",
            (b"retry-after: 1",)))

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        if self._linger is not None:
            self._linger.cancel()
            self._linger = None
            self.guard.lingering -= 1
        if not self._admitted:
            return
        self._admitted = False
        self.guard.closed(self._host)
        super().connection_lost(exc)

    def shutdown(self) -> None:
        if not self._admitted:
            self.transport.close()
            return
        super().shutdown()

    def data_received(self, data: bytes) -> None:
        if self._closing:
            # An answer is out (or due): what the client still sends is dropped, up to a bound.
            self._dropped += len(data)
            if self._linger is not None and self._dropped > LINGER_MAX_BYTES:
                self.transport.close()
            return
        self._unset_keepalive_if_required()
        if self._unparsed is not None:  # requests wait their turn: this waits behind them, unparsed
            self._hold(memoryview(bytes(self._unparsed) + data))
            return
        self._parse(memoryview(data))
        if self._head_timer is None and self._reading_head and self._head_bytes and not self._closing:
            # A head began (or bytes that begin none, blank lines, ended idleness): its clock starts.
            # Armed here rather than per request, so that a head read whole costs no timer.
            self._arm_head_timer()

    def _parse(self, view: memoryview) -> None:
        """Feed `view` to the parser in pieces no larger than the head's room, so a head is refused
        when its bytes pass the limit, not after the parser has buffered all of it; and, while
        requests wait their turn on this connection, a few heads at a time, so that no more than
        about MAX_PIPELINED of them are parsed (each holds a scope) before their turn comes."""
        limit = self.guard.limits.max_head_bytes
        while view and not self._closing:
            if len(self.pipeline) >= MAX_PIPELINED:
                self._hold(view)
                return
            if self._reading_head:
                room = limit - self._head_bytes
                if room <= 0:
                    self._head_too_large()
                    return
                if self.pipeline or self._busy():
                    room = min(room, PIPELINED_PIECE)
                piece, view = view[:room], view[room:]
                self._head_bytes += len(piece)
            else:
                piece, view = view[:limit], view[limit:]
                self._body_fed += len(piece)
            if not self._feed(piece):
                return
            if not self._reading_head and self._body_fed - self._body_bytes > limit + 32 * self._chunks:
                self._framing_too_large()
                return

    def _hold(self, view: memoryview) -> None:
        """Keep `view` unparsed until a waiting request's turn comes, and read no more meanwhile."""
        self._unparsed = view
        self.flow.pause_reading()
        if len(view) > MAX_UNPARSED_BYTES:
            self.guard.hit("pipelining", f"closing {_peer(self.client)} after its responses: over "
                           f"{MAX_UNPARSED_BYTES} bytes of pipelined requests waiting")
            self._answer_after_response(b"")

    def _busy(self) -> bool:
        """Whether a response is in progress on this connection."""
        running = self._running
        return running is not None and not running.response_complete and not running.disconnected

    def _feed(self, piece: memoryview) -> bool:
        try:
            self.parser.feed_data(piece)
        except httptools.HttpParserError as e:
            # The parser's reasons are its own fixed strings ("Invalid header value char").
            reason = str(e) or type(e).__name__
            self.guard.hit("parse_error", f"400 to {_peer(self.client)}: malformed request ({reason})")
            self._answer_after_response(raw_error(
                400, f"the request is not valid HTTP/1.1: {reason}", "bad_request"))
            return False
        except httptools.HttpParserUpgrade:
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            return False
        return True

    def _start_asgi_task(self, cycle: RequestResponseCycle, app: Any) -> None:
        self._running = cycle
        super()._start_asgi_task(cycle, app)

    # Parser callbacks.

    def on_headers_complete(self) -> None:
        self._cancel_head_timer()
        self._reading_head = False
        self._body_fed = self._body_bytes = self._chunks = 0
        super().on_headers_complete()
        cycle = self.cycle
        if cycle is not None and cycle.scope is self.scope:  # the cycle this request just got
            extensions: dict[str, Any] = self.scope.setdefault("extensions", {})  # type: ignore[assignment]
            extensions[BODY_WRITER] = BodyWriter(cycle)

    def on_body(self, body: bytes) -> None:
        self._body_bytes += len(body)
        super().on_body(body)

    def on_chunk_header(self) -> None:
        self._chunks += 1

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._reading_head, self._head_bytes = True, 0

    def on_response_complete(self) -> None:
        if self._after_response is not None and not self.pipeline and not self.transport.is_closing():
            self.server_state.total_requests += 1
            self._answer_and_close(self._after_response)
            return
        answered = self._running
        if answered is not None and answered.more_body and self._unread_body_is_large(answered):
            # Answered before its body was all here (413 by Content-Length): the rest would be
            # parsed and dropped on the loop, at whatever length the client announced. The
            # connection closes instead, lingering as after the protocol's own answers so that
            # the client reads this one. (A small rest, a 401 before a short body say, is read
            # as before and the connection kept.)
            self.server_state.total_requests += 1
            self._answer_and_close(b"")
            return
        super().on_response_complete()  # starts the next waiting request, if any
        if self._unparsed is not None and not self._closing and not self.transport.is_closing():
            view, self._unparsed = self._unparsed, None
            self._parse(view)

    def _unread_body_is_large(self, cycle: RequestResponseCycle) -> bool:
        if self.transport.is_closing():
            return False
        for name, value in cycle.scope["headers"]:
            if name == b"content-length" and value.isdigit():
                return int(value) - self._body_bytes > KEEP_READING_BYTES
        # Chunked: its rest is unknown, and kept-alive clients reused the connection as the
        # close began (httpx: "Server disconnected"), so it is read as before.
        return False

    # Limits.

    def _head_too_large(self) -> None:
        limit = self.guard.limits.max_head_bytes
        self.guard.hit("header_bytes", f"431 to {_peer(self.client)}: request head over {limit} bytes")
        self._answer_after_response(raw_error(
            431, f"the request line and headers are more than the limit of {limit} bytes",
            "headers_too_large"))

    def _framing_too_large(self) -> None:
        limit = self.guard.limits.max_head_bytes
        self.guard.hit("header_bytes", f"431 to {_peer(self.client)}: chunk framing and trailers over "
                       f"{limit} bytes")
        self._answer_after_response(raw_error(
            431, f"the body's chunk framing and trailers are more than the limit of {limit} bytes",
            "headers_too_large"))

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self._closing or self.transport.is_closing():
            return
        timeout = self.guard.limits.header_timeout
        if self._head_bytes == 0 and (self.cycle is None or self.cycle.response_complete):
            self.guard.hit("header_timeout", f"closed {_peer(self.client)}: no request in {timeout:g}s")
            self._closing = True
            self.transport.close()
            return
        self.guard.hit("header_timeout",
                       f"408 to {_peer(self.client)}: request head not complete in {timeout:g}s")
        self._answer_after_response(raw_error(
            408, f"the request line and headers were not complete within {timeout:g} s", "header_timeout"))

    def timeout_keep_alive_handler(self) -> None:
        self.guard.hit("idle_timeout", f"closed {_peer(self.client)}: idle for {self.timeout_keep_alive:g}s")
        super().timeout_keep_alive_handler()

    def _arm_head_timer(self) -> None:
        self._cancel_head_timer()
        self._head_timer = self.loop.call_later(self.guard.limits.header_timeout, self._head_timed_out)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    # Answers the protocol writes itself.

    def _answer_after_response(self, response: bytes) -> None:
        """Stop parsing; answer `response` and close now, or once the responses to the requests
        already read (the one in progress, then any pipelined) are out."""
        self._closing = True
        self._cancel_head_timer()
        broken = self.cycle
        if broken is not None and broken.more_body and not broken.response_complete:
            # The request whose body was being read is cut short: it is not served (its app, if
            # it runs, sees a disconnect and its sends are dropped).
            broken.disconnected = True
            broken.message_event.set()
            self.pipeline = deque(entry for entry in self.pipeline if entry[0] is not broken)
        self._unparsed = None
        if self._busy() or self.pipeline:
            self._after_response = response
        else:
            self._answer_and_close(response)

    def _answer_and_close(self, response: bytes) -> None:
        """Write `response`, half-close, and read (dropping it) what the client still sends for at
        most LINGER_S: a close with unread input would reset the connection, and the client's
        kernel would drop the answer unread."""
        self._closing = True
        transport = self.transport
        if transport.is_closing():
            return
        transport.write(response)
        if self.guard.lingering >= LINGER_MAX or not transport.can_write_eof():
            transport.close()
            return
        transport.write_eof()
        if self.flow is not None:
            self.flow.resume_reading()
        else:
            transport.resume_reading()
        self.guard.lingering += 1
        self._linger = self.loop.call_later(LINGER_S, transport.close)

    def wake_body_reader(self) -> None:
        """Let a request waiting for more of its body read now what has arrived (its next `receive`
        returns), so that it sees a drain that just began (request_guard.DrainGate answers 503)."""
        cycle = self.cycle
        if cycle is not None and cycle.more_body and not cycle.response_started:
            cycle.message_event.set()
