"""The load generator's HTTP client: one request sent, its SSE stream read and classified.

`one_raw_request` speaks HTTP/1.1 over a plain asyncio connection (`Connection`, kept alive for a
client's next request), reading chunked, sized or close-delimited bodies itself; `one_request` does
the same through httpx (https:// URLs, or a test's own client). Both read the stream with
`SSEParser` and `_StreamState`, which time every token, check the TGI or OpenAI event sequence, and
classify how the request ended (see `KINDS` in load_config.py).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlsplit

import httpx

from bench.load_config import OPENAI_ROUTES, LoadConfig, RequestResult, build_request


class SSEParser:
    """Incremental `text/event-stream` parser: feed lines, get (event, data) pairs."""

    def __init__(self) -> None:
        self.event: str | None = None
        self.data: list[str] = []

    def feed(self, line: str) -> tuple[str, str] | None:
        if line == "":
            if not self.data:
                self.event = None
                return None
            out = (self.event or "message", "\n".join(self.data))
            self.event, self.data = None, []
            return out
        if line.startswith(":"):  # comment, e.g. `: keep-alive`
            return None
        name, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if name == "event":
            self.event = value
        elif name == "data":
            self.data.append(value)
        return None


class _StreamState:
    """What one request's stream has shown so far; `on_event` returns True when it is complete."""

    def __init__(self, result: RequestResult, config: LoadConfig, t0: float) -> None:
        self.result, self.route, self.t0 = result, config.route, t0
        self.on_token = config.on_token
        self.last_token_at: float | None = None
        self.last_index: int | None = None

    def token_arrived(self, text: str) -> None:
        now = time.perf_counter()
        r = self.result
        if self.last_token_at is None:
            r.ttft_s = now - self.t0
        else:
            r.itl_s.append(now - self.last_token_at)
        self.last_token_at = now
        r.tokens += 1
        r.text += text
        if self.on_token is not None:
            self.on_token(r)

    def on_event(self, event: str, data: str) -> bool:
        r = self.result
        if self.route in OPENAI_ROUTES and data == "[DONE]":
            return True
        try:
            payload = json.loads(data)
        except json.JSONDecodeError:
            r.malformed.append(f"data is not JSON: {data[:80]!r}")
            return False
        if not isinstance(payload, dict):
            r.malformed.append(f"data is not a JSON object: {data[:80]!r}")
            payload = {"error": payload} if event == "error" else {}
        if event == "error" or "error" in payload:
            err = payload.get("error")
            r.kind = "error_event"
            r.error = str(err.get("message", err) if isinstance(err, dict) else err)
            return True
        return self._on_openai(payload) if self.route in OPENAI_ROUTES else self._on_tgi(payload)

    def _on_tgi(self, payload: dict[str, Any]) -> bool:
        r = self.result
        token = payload.get("token")
        if isinstance(token, dict):
            index = payload.get("index")
            if self.last_index is not None and index != self.last_index + 1:
                r.malformed.append(f"token index {index} after {self.last_index}")
            self.last_index = index
            self.token_arrived(token.get("text") or "")
        details = payload.get("details")
        if payload.get("generated_text") is None and details is None:
            return False
        r.final_text = payload.get("generated_text")
        if details is None:
            r.malformed.append("final event without details")
        else:
            r.details_tokens = details.get("generated_tokens")
            r.finish_reason = details.get("finish_reason")
        r.kind = "ok"
        return True

    def _on_openai(self, payload: dict[str, Any]) -> bool:
        r = self.result
        for choice in payload.get("choices") or []:
            # chat: the text in a delta; completions: in the choice itself
            delta = choice.get("delta") or {}
            content = delta.get("content") if self.route == "chat" else choice.get("text")
            if content:
                self.token_arrived(content)
            if choice.get("finish_reason"):
                r.finish_reason = choice["finish_reason"]
        usage = payload.get("usage")
        if usage:
            r.details_tokens = usage.get("completion_tokens")
        if r.finish_reason is not None:
            r.kind = "ok"  # provisional: [DONE] must still follow, else the stream was cut
        return False


async def one_request(client: httpx.AsyncClient, config: LoadConfig, index: int) -> RequestResult:
    """Send request `index` through an httpx client, read its stream, classify how it ended."""
    path, body = build_request(config, index)
    result = RequestResult(index=index)
    t0 = time.perf_counter()
    try:
        async with client.stream("POST", path, json=body, headers=_headers(config),
                                 timeout=config.timeout_s) as resp:
            result.status = resp.status_code
            result.request_id = resp.headers.get("x-request-id")
            if resp.status_code != 200:
                result.retry_after = resp.headers.get("retry-after")
                result.kind = _status_kind(resp.status_code)
                result.error = (await resp.aread()).decode("utf-8", "replace")[:500]
                return result
            await _read_stream(resp.aiter_lines(), result, config, t0)
    except (httpx.TransportError, httpx.StreamError) as e:
        # A stream that broke after it started was cut; one that never answered is transport.
        result.kind = "cut" if result.status == 200 else "transport"
        result.error = f"{type(e).__name__}: {e}"
    finally:
        result.duration_s = time.perf_counter() - t0
    return result


class Connection:
    """One client's HTTP/1.1 connection to the server, reused for its next request while the
    server keeps it open (`LoadConfig.keep_alive`)."""

    def __init__(self) -> None:
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def open(self, host: str, port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        self.close()
        self.reader, self.writer = await asyncio.open_connection(host, port)
        return self.reader, self.writer

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None


async def one_raw_request(config: LoadConfig, index: int, conn: Connection | None = None) -> RequestResult:
    """The same request over a plain asyncio connection (HTTP/1.1): `conn`'s, kept open for the
    client's next request when the response ended cleanly, or a new one closed afterwards.

    The load generator shares the machine's cores with the server it measures, so its own cost
    per streamed token is part of what a same-machine benchmark sees: through httpx (httpcore,
    h11, anyio) it was ~300 us per token, a third of a core at 32 streams.
    """
    path, body = build_request(config, index)
    result = RequestResult(index=index)
    url = urlsplit(config.url)
    payload = json.dumps(body).encode()
    keep = config.keep_alive and conn is not None
    conn = conn or Connection()
    head = [f"POST {path} HTTP/1.1", f"Host: {url.netloc}", "Content-Type: application/json",
            f"Content-Length: {len(payload)}"] + ([] if keep else ["Connection: close"])
    head += [f"{k}: {v}" for k, v in _headers(config).items()]
    message = "\r\n".join(head).encode() + b"\r\n\r\n" + payload
    t0 = time.perf_counter()
    reusable = False
    try:
        async with asyncio.timeout(config.timeout_s):
            reader, raw = await _send(conn, url.hostname or "127.0.0.1", url.port or 80, message)
            status, headers = _parse_head(raw)
            result.status = status
            result.request_id = headers.get("x-request-id")
            framed = "chunked" in headers.get("transfer-encoding", "").lower() or "content-length" in headers
            if status != 200:
                result.retry_after = headers.get("retry-after")
                result.kind = _status_kind(status)
                data = b"".join([chunk async for chunk in _body(reader, headers)])
                result.error = data.decode("utf-8", "replace")[:500]
            else:
                await _read_stream(_lines(_body(reader, headers)), result, config, t0)
            # Read to its end (not left mid-stream on purpose), and the server did not say close.
            reusable = framed and result.kind != "disconnected" and headers.get("connection") != "close"
    except (OSError, EOFError, ValueError, TimeoutError, asyncio.LimitOverrunError) as e:
        # EOFError covers asyncio.IncompleteReadError: the peer closed mid-message.
        result.kind = "cut" if result.status == 200 else "transport"
        result.error = f"{type(e).__name__}: {e}"
    finally:
        if not (keep and reusable):
            conn.close()
        result.duration_s = time.perf_counter() - t0
    return result


async def _send(conn: Connection, host: str, port: int,
                message: bytes) -> tuple[asyncio.StreamReader, bytes]:
    """Send `message` and read the response head, on `conn`'s open connection if it has one. A
    kept connection the server has closed meanwhile (its idle timeout) fails before any byte of
    a response: then once more on a new connection, as HTTP clients' pools do."""
    if conn.reader is not None and conn.writer is not None:
        try:
            conn.writer.write(message)
            return conn.reader, await conn.reader.readuntil(b"\r\n\r\n")
        except (ConnectionError, asyncio.IncompleteReadError) as e:
            if isinstance(e, asyncio.IncompleteReadError) and e.partial:
                raise
    reader, writer = await conn.open(host, port)
    writer.write(message)
    return reader, await reader.readuntil(b"\r\n\r\n")


def _headers(config: LoadConfig) -> dict[str, str]:
    headers = {"Accept": "text/event-stream"}
    if config.api_key:
        headers["Authorization"] = f"Bearer {config.api_key}"
    return headers


def _parse_head(raw: bytes) -> tuple[int, dict[str, str]]:
    lines = raw.decode("latin-1").split("\r\n")
    version, _, rest = lines[0].partition(" ")
    if not version.startswith("HTTP/1."):
        raise ValueError(f"not an HTTP/1.x response: {lines[0][:80]!r}")
    headers = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if sep:
            headers[name.strip().lower()] = value.strip()
    return int(rest.split(" ", 1)[0]), headers


async def _body(reader: asyncio.StreamReader, headers: dict[str, str]) -> AsyncIterator[bytes]:
    """The response body as it arrives: chunked, by Content-Length, or up to the close."""
    if "chunked" in headers.get("transfer-encoding", "").lower():
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";", 1)[0], 16)
            if size == 0:
                while await reader.readuntil(b"\r\n") != b"\r\n":  # trailer fields
                    pass
                return
            chunk = await reader.readexactly(size + 2)
            yield chunk[:-2]
    elif "content-length" in headers:
        yield await reader.readexactly(int(headers["content-length"]))
    else:
        while chunk := await reader.read(65536):
            yield chunk


async def _lines(chunks: AsyncIterator[bytes]) -> AsyncIterator[str]:
    """Lines of a byte stream (split before decoding, so a character split across chunks is whole)."""
    pending = b""
    async for chunk in chunks:
        *complete, pending = (pending + chunk).split(b"\n")
        for line in complete:
            yield line.removesuffix(b"\r").decode("utf-8", "replace")
    if pending:
        yield pending.decode("utf-8", "replace")


async def _read_stream(lines: AsyncIterator[str], result: RequestResult, config: LoadConfig,
                       t0: float) -> None:
    state, parser, complete = _StreamState(result, config, t0), SSEParser(), False
    result.kind = "cut"  # until the final event arrives
    async for line in lines:
        parsed = parser.feed(line)
        if parsed is None:
            continue
        if config.read_delay_s:
            await asyncio.sleep(config.read_delay_s)
        if complete:
            result.malformed.append(f"event after the final one: {parsed[1][:80]!r}")
            continue
        complete = state.on_event(*parsed)
        if config.disconnect_after is not None and result.tokens >= config.disconnect_after \
                and not complete:
            result.kind = "disconnected"
            return  # the caller closes the connection mid-stream
    if config.route in OPENAI_ROUTES and not complete:
        result.kind = "cut"  # finish_reason seen but no [DONE], or nothing at all


def _status_kind(status: int) -> str:
    if status in (429, 503):
        return f"http_{status}"
    return "http_5xx" if status >= 500 else "http_4xx"
