"""The load tool classifies every way a stream can end; checked against scripted fake servers."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable

import httpx
import pytest

from bench.load import LoadConfig, main, run_load
from bench.load_config import build_request, new_tokens
from bench.load_http import SSEParser
from bench.load_report import percentiles


def tgi_events(n: int, *, final: bool = True) -> list[bytes]:
    events = []
    for i in range(1, n + 1):
        last = final and i == n
        payload = {
            "index": i,
            "token": {"id": 65, "text": "A", "logprob": None, "special": False},
            "generated_text": "A" * n if last else None,
            "details": {"finish_reason": "length", "generated_tokens": n} if last else None,
        }
        events.append(f"data: {json.dumps(payload)}\n\n".encode())
    return events


def chat_events(n: int, *, done: bool = True) -> list[bytes]:
    chunks: list[dict[str, object]] = [
        {"choices": [{"index": 0, "delta": {"role": "assistant"}, "finish_reason": None}]}
    ]
    chunks += [{"choices": [{"index": 0, "delta": {"content": "b"}, "finish_reason": None}]}] * n
    chunks.append({"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]})
    chunks.append({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": n}})
    out = [f"data: {json.dumps(c)}\n\n".encode() for c in chunks]
    return [*out, b"data: [DONE]\n\n"] if done else out


class _Body(httpx.AsyncByteStream):
    def __init__(self, parts: list[bytes], fail_after: bool = False) -> None:
        self.parts, self.fail_after = parts, fail_after

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for part in self.parts:
            yield part
        if self.fail_after:
            raise httpx.RemoteProtocolError("peer closed connection without sending complete body")


def sse(parts: list[bytes], fail_after: bool = False) -> httpx.Response:
    return httpx.Response(200, headers={"content-type": "text/event-stream"},
                          stream=_Body(parts, fail_after))


async def run_with(handler: Callable[[httpx.Request], httpx.Response], **kw) -> list:  # type: ignore[no-untyped-def]
    config = LoadConfig(url="http://test", **kw)
    async with httpx.AsyncClient(base_url="http://test", transport=httpx.MockTransport(handler)) as c:
        return (await run_load(config, client=c)).results


async def test_every_outcome_is_classified() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        i = json.loads(request.content)["parameters"]["seed"]
        return [
            lambda: sse(tgi_events(5)),
            lambda: httpx.Response(429, headers={"retry-after": "1"}, json={"error": {}}),
            lambda: httpx.Response(503, json={"error": {"message": "draining"}}),
            lambda: httpx.Response(500, text="boom"),
            lambda: sse(tgi_events(3, final=False)),  # ends cleanly but without the final event
            lambda: sse(tgi_events(2, final=False), fail_after=True),  # connection dropped
            lambda: sse([*tgi_events(2, final=False),
                         b'event: error\ndata: {"error": {"message": "NaN logits", "code": "x"}}\n\n']),
            lambda: httpx.Response(422, json={"error": {"message": "bad"}}),
        ][i]()

    results = await run_with(handler, concurrency=3, requests=8, seed=0)
    assert [r.kind for r in results] == ["ok", "http_429", "http_503", "http_5xx", "cut", "cut",
                                         "error_event", "http_4xx"]
    ok = results[0]
    assert (ok.tokens, ok.details_tokens, ok.finish_reason, ok.text) == (5, 5, "length", "AAAAA")
    assert ok.ttft_s is not None and len(ok.itl_s) == 4 and not ok.malformed
    assert results[1].retry_after == "1"
    assert results[6].error == "NaN logits" and results[6].tokens == 2


async def test_chat_stream_needs_done() -> None:
    calls = iter([sse(chat_events(4)), sse(chat_events(4, done=False))])
    results = await run_with(lambda _: next(calls), route="chat", concurrency=1, requests=2)
    assert [r.kind for r in results] == ["ok", "cut"]
    assert (results[0].tokens, results[0].details_tokens, results[0].text) == (4, 4, "bbbb")


async def test_protocol_violations_are_reported() -> None:
    events = tgi_events(3)
    skipped = [events[0], events[2]]  # index jumps from 1 to 3
    results = await run_with(lambda _: sse([*skipped, b"data: not json\n\n"]), requests=1)
    assert results[0].kind == "ok"
    assert any("index 3 after 1" in m for m in results[0].malformed)
    assert any("event after the final one" in m for m in results[0].malformed)


async def test_disconnect_after_stops_reading() -> None:
    results = await run_with(lambda _: sse(tgi_events(10)), requests=2, disconnect_after=3)
    assert [(r.kind, r.tokens) for r in results] == [("disconnected", 3)] * 2


def test_sse_parser_handles_comments_multiline_and_event_names() -> None:
    p = SSEParser()
    lines = [": keep-alive", "", "event: error", "data: a", "data: b", "", "data:x", ""]
    assert [e for e in map(p.feed, lines) if e] == [("error", "a\nb"), ("message", "x")]


def test_spread_gives_every_budget_once_a_cycle_around_the_mean() -> None:
    for mean, spread in ((64, 16), (40, 3), (10, 0), (64, 10)):  # 2 * 3 + 1 = 7: another stride
        width = 2 * spread + 1
        cycle = [new_tokens(mean, spread, i) for i in range(width)]
        assert sorted(cycle) == list(range(mean - spread, mean + spread + 1))
        assert [new_tokens(mean, spread, i + width) for i in range(width)] == cycle
    assert len({new_tokens(64, 16, i) for i in range(2)}) == 2  # neighbours differ
    config = LoadConfig(url="http://x", max_new_tokens=64, spread=16)
    assert build_request(config, 1)[1]["parameters"]["max_new_tokens"] == new_tokens(64, 16, 1)
    chat = LoadConfig(url="http://x", route="chat", max_new_tokens=64, spread=16)
    assert build_request(chat, 2)[1]["max_tokens"] == new_tokens(64, 16, 2)


def test_percentiles_are_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert percentiles(values) == {"p50": 50.0, "p90": 90.0, "p99": 99.0}
    assert percentiles([]) == {"p50": None, "p90": None, "p99": None}


def test_config_rejects_unbounded_runs() -> None:
    with pytest.raises(ValueError, match="count, a duration"):
        LoadConfig(url="http://x", requests=None, duration_s=None)


def test_cli_exits_nonzero_when_nothing_listens(capsys: pytest.CaptureFixture[str]) -> None:
    # Port 9 (discard) on loopback is closed on any sane test machine: every request is `transport`.
    code = main(["--url", "http://127.0.0.1:9", "-n", "2", "-c", "2", "--timeout", "5", "--json"])
    summary = json.loads(capsys.readouterr().out)
    assert code == 1 and summary["outcomes"] == {"transport": 2}


# ---- the same outcomes over raw sockets (what run_load uses for an http:// URL) -----------------
def raw_sse(parts: list[bytes], *, complete: bool = True) -> bytes:
    """A chunked 200 response, one chunk per part; without `complete` the connection just ends."""
    head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n" \
           b"x-request-id: r1\r\n\r\n"
    body = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts)
    return head + body + (b"0\r\n\r\n" if complete else b"")


def raw_status(status: int, text: bytes, extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 %d X\r\ncontent-length: %d\r\n%s\r\n%s" % (status, len(text), extra, text)


async def run_raw(responses: list[bytes], **kw) -> list:  # type: ignore[no-untyped-def]
    """Serve `responses[seed]` to each connection from a loopback socket, then run the load."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length")))
        body = json.loads(await reader.readexactly(length))
        seed = body["parameters"].get("seed", 0) if "parameters" in body else body.get("seed", 0)
        writer.write(responses[seed])
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        config = LoadConfig(url=f"http://127.0.0.1:{port}", seed=0, timeout_s=10, **kw)
        return (await run_load(config)).results


async def test_raw_client_classifies_every_outcome() -> None:
    # One event split across two chunks in the middle of a two-byte character.
    event = json.dumps({"index": 1, "token": {"id": 1, "text": "é"}}, ensure_ascii=False)
    split = f"data: {event}\n\n".encode()
    cut = split.index("é".encode()) + 1
    tail = tgi_events(2)[1]
    results = await run_raw([
        raw_sse(tgi_events(5)),
        raw_status(429, b'{"error": {}}', b"retry-after: 1\r\n"),
        raw_status(503, b'{"error": {"message": "draining"}}'),
        raw_status(500, b"boom"),
        raw_sse(tgi_events(3, final=False)),
        raw_sse(tgi_events(2, final=False), complete=False),  # connection dropped
        raw_sse([*tgi_events(2, final=False),
                 b'event: error\ndata: {"error": {"message": "NaN logits", "code": "x"}}\n\n']),
        raw_status(422, b'{"error": {"message": "bad"}}'),
        raw_sse([split[:cut], split[cut:], tail]),
        b"SSH-2.0-OpenSSH\r\n\r\n",  # not HTTP at all
    ], concurrency=3, requests=10)
    assert [r.kind for r in results] == ["ok", "http_429", "http_503", "http_5xx", "cut", "cut",
                                         "error_event", "http_4xx", "ok", "transport"]
    ok = results[0]
    assert (ok.tokens, ok.details_tokens, ok.finish_reason, ok.text) == (5, 5, "length", "AAAAA")
    assert ok.ttft_s is not None and len(ok.itl_s) == 4 and not ok.malformed
    assert ok.request_id == "r1" and results[1].retry_after == "1"
    assert results[3].error == "boom"
    assert results[6].error == "NaN logits" and results[6].tokens == 2
    assert results[8].text == "éA" and not results[8].malformed


async def test_raw_client_chat_and_disconnect() -> None:
    results = await run_raw([raw_sse(chat_events(4)), raw_sse(chat_events(4, done=False))],
                            route="chat", concurrency=1, requests=2)
    assert [(r.kind, r.tokens) for r in results] == [("ok", 4), ("cut", 4)]
    results = await run_raw([raw_sse(tgi_events(10))], requests=1, disconnect_after=3)
    assert [(r.kind, r.tokens) for r in results] == [("disconnected", 3)]


async def test_raw_clients_keep_their_connection_open_across_requests() -> None:
    # A server that keeps connections open: each client sends all its requests over one, and the
    # requests say nothing of closing. With keep_alive off, one connection per request.
    async def run(keep_alive: bool) -> tuple[list[str], int, list[bytes]]:
        connections, heads = 0, []

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            nonlocal connections
            connections += 1
            while head := await reader.readuntil(b"\r\n\r\n") if not reader.at_eof() else b"":
                heads.append(head)
                length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                                  if line.lower().startswith(b"content-length")))
                await reader.readexactly(length)
                writer.write(raw_sse(tgi_events(3)))
                await writer.drain()
                if b"Connection: close" in head:
                    break
            writer.close()

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        async with server:
            config = LoadConfig(url=f"http://127.0.0.1:{port}", concurrency=2, requests=6, timeout_s=10,
                                keep_alive=keep_alive)
            results = (await run_load(config)).results
        return [r.kind for r in results], connections, heads

    kinds, connections, heads = await run(keep_alive=True)
    assert kinds == ["ok"] * 6 and connections == 2
    assert not any(b"Connection: close" in h for h in heads)
    kinds, connections, heads = await run(keep_alive=False)
    assert kinds == ["ok"] * 6 and connections == 6
    assert all(b"Connection: close" in h for h in heads)


async def test_a_kept_connection_the_server_closed_is_replaced_without_an_error() -> None:
    # run_raw's server closes every connection after one response (as a server's idle timeout
    # does): each client's next request finds its kept connection closed and sends again on a
    # new one; no request is reported as failed.
    results = await run_raw([raw_sse(tgi_events(2))] * 6, concurrency=2, requests=6)
    assert [r.kind for r in results] == ["ok"] * 6
