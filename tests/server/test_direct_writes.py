"""Mid-stream events written straight to the socket (nanoserve/server/http/protocol.py, sse.DirectEvents):
the same bytes as through ASGI, each event counted by the metrics and the access log, and the
writer only ever used where a chunk cannot land out of order."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

from nanoserve.server.http.protocol import BodyWriter, NanoserveHttpProtocol, body_writer
from tests.server.test_metrics_server import sample, serve_in_thread

NEW_TOKENS = 12


async def stream(url: str) -> bytes:
    """A greedy /generate_stream of NEW_TOKENS tokens, its body as the client got it."""
    request = {"inputs": "Hello", "parameters": {"max_new_tokens": NEW_TOKENS, "temperature": 0, "seed": 7}}
    async with httpx.AsyncClient(base_url=url, timeout=60) as client, \
            client.stream("POST", "/generate_stream", json=request) as response:
        assert response.status_code == 200
        return b"".join([chunk async for chunk in response.aiter_bytes()])


def events_of(body: bytes) -> list[dict[str, Any]]:
    lines = body.decode().split("\n")
    return [json.loads(line[len("data: "):]) for line in lines if line.startswith("data: ")]


@pytest.fixture
def written(monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    """Every chunk a BodyWriter writes, in order."""
    chunks: list[bytes] = []
    write = BodyWriter.write

    def recorded(self: BodyWriter, data: bytes) -> None:
        chunks.append(data)
        write(self, data)

    monkeypatch.setattr(BodyWriter, "write", recorded)
    return chunks


async def test_mid_stream_events_go_out_directly_with_the_same_bytes_and_counts(
    tiny_checkpoint: Path, written: list[bytes], caplog: pytest.LogCaptureFixture
) -> None:
    with serve_in_thread(tiny_checkpoint, http="httptools") as (url, _):
        through_asgi = await stream(url)  # uvicorn's own protocol: no writer in the scope
    assert written == []
    caplog.clear()  # the first server's access line (the app sets its loggers' level) is not this one
    # The log level outermost: it is restored only after the server has stopped, so an access line
    # written after the client saw the stream end is still captured.
    with caplog.at_level(logging.INFO, logger="nanoserve.access"), \
            serve_in_thread(tiny_checkpoint) as (url, metrics):
        tokens, ttfts, itls = (sample(metrics, name) for name in (
            "nanoserve_generated_tokens_total", "nanoserve_time_to_first_token_seconds_count",
            "nanoserve_inter_token_latency_seconds_count"))
        direct = await stream(url)
        assert sample(metrics, "nanoserve_generated_tokens_total") - tokens == NEW_TOKENS
        assert sample(metrics, "nanoserve_time_to_first_token_seconds_count") - ttfts == 1
        assert sample(metrics, "nanoserve_inter_token_latency_seconds_count") - itls == NEW_TOKENS - 1
    assert direct == through_asgi  # greedy: the same tokens, the same bytes
    events = events_of(direct)
    assert [e["index"] for e in events] == list(range(NEW_TOKENS))
    assert events[-1]["details"]["generated_tokens"] == NEW_TOKENS
    assert events[-1]["generated_text"] == "".join(e["token"]["text"] for e in events)
    # The last event always goes through ASGI; the first may too (it can arrive before the body
    # waits for it). The rest went out one write each, in order.
    assert NEW_TOKENS - 2 <= len(written) <= NEW_TOKENS - 1
    assert [e["index"] for w in written for e in events_of(w)] == list(range(NEW_TOKENS - 1 - len(written),
                                                                          NEW_TOKENS - 1))
    logged = [getattr(r, "fields", {}) for r in caplog.records if r.name == "nanoserve.access"]
    (line,) = [fields for fields in logged if fields.get("route") == "/generate_stream"]
    assert line["generated_tokens"] == NEW_TOKENS and line["finish_reason"] == "length"


async def writer_app(scope: Any, receive: Any, send: Any) -> None:
    """Reports what the BodyWriter allowed at each point of a response, in its body."""
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    writer = body_writer(scope)
    assert writer is not None
    before_start = writer.ready()
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": b"asgi;", "more_body": True})
    if writer.ready():
        writer.write(b"direct;")
    await send({"type": "http.response.body", "body": f"ready before start: {before_start}".encode(),
                "more_body": False})
    assert not writer.ready()  # complete: nothing more may be written


async def test_the_writer_frames_chunks_between_asgi_sends_and_only_while_the_body_is_open() -> None:
    config = uvicorn.Config(writer_app, host="127.0.0.1", port=0, log_level="warning",
                            http=NanoserveHttpProtocol)
    server = uvicorn.Server(config)
    serving = asyncio.ensure_future(server.serve())
    try:
        for _ in range(500):
            if server.started:
                break
            await asyncio.sleep(0.01)
        port = server.servers[0].sockets[0].getsockname()[1]
        async with httpx.AsyncClient(timeout=10) as client:
            response = await client.get(f"http://127.0.0.1:{port}/")
        head_response = await asyncio.wait_for(_raw_head(port), 10)
    finally:
        server.should_exit = True
        await asyncio.wait_for(serving, 10)
    assert response.status_code == 200
    assert response.text == "asgi;direct;ready before start: False"
    # HEAD has no body to write into: the writer stays out, and the response is still well formed.
    assert head_response.startswith(b"HTTP/1.1 200") and b"direct;" not in head_response


async def _raw_head(port: int) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"HEAD / HTTP/1.1\r\nhost: test\r\nconnection: close\r\n\r\n")
    data = await reader.read()
    writer.close()
    return data


def dechunk(raw: bytes) -> bytes:
    """The body of a chunked HTTP/1.1 response (head included in `raw`)."""
    _, _, rest = raw.partition(b"\r\n\r\n")
    body = b""
    while True:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            return body
        body, rest = body + rest[:size], rest[size + 2:]


class SmallSendBuffer(NanoserveHttpProtocol):
    """The server's protocol on sockets with a small kernel send buffer: back-pressure comes soon."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        super().connection_made(transport)


async def test_a_slow_reader_gets_every_event_in_order_while_back_pressure_sends_them_through_asgi(
    tiny_checkpoint: Path, written: list[bytes]
) -> None:
    tokens = 2000
    request = json.dumps({"inputs": "Hello", "parameters": {
        "max_new_tokens": tokens, "temperature": 0, "top_n_tokens": 5, "details": True}}).encode()
    with serve_in_thread(tiny_checkpoint, http=SmallSendBuffer) as (url, _):
        port = int(url.rsplit(":", 1)[1])
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", port))
        sock.sendall(b"POST /generate_stream HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                     b"Connection: close\r\n" + f"Content-Length: {len(request)}\r\n\r\n".encode() + request)
        sock.settimeout(60)
        raw = sock.recv(1024)
        await asyncio.sleep(2)  # read nothing while the engine runs on: the socket fills up
        while chunk := await asyncio.to_thread(sock.recv, 65536):
            raw += chunk
        sock.close()
    events = events_of(dechunk(raw))
    assert [e["index"] for e in events] == list(range(tokens))
    assert events[-1]["generated_text"] == "".join(e["token"]["text"] for e in events)
    # Some events went out directly, and the ones that met a full socket went through ASGI.
    print(f"{len(written)} of {tokens - 1} mid-stream events written directly")
    assert 0 < len(written) < tokens - 1


def test_the_uvicorn_installed_has_every_private_member_the_protocol_uses(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The protocol subclasses uvicorn's and uses members outside its public API; pyproject.toml pins
    the uvicorn releases it was tested on. A release that drops one is named here, not met as an
    AttributeError mid-request."""
    from nanoserve.server.http import protocol

    missing = protocol.missing_uvicorn_members()
    assert not missing, (
        f"uvicorn {uvicorn.__version__} lacks {missing}, which nanoserve/server/http/protocol.py uses: "
        "install the uvicorn range pyproject.toml pins, or port the protocol"
    )
    # The check sees a member that is not there, of either kind.
    monkeypatch.setattr(protocol, "PROTOCOL_METHODS", (*protocol.PROTOCOL_METHODS, "_gone_in_a_release"))
    monkeypatch.setattr(protocol, "CYCLE_ATTRIBUTES", ("write_paused_flag",))
    assert protocol.missing_uvicorn_members() == [
        "HttpToolsProtocol._gone_in_a_release", "RequestResponseCycle.write_paused_flag"
    ]
