"""The load tool classifies every way a stream can end; checked against scripted fake servers."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable

import httpx
import pytest

from bench.load import LoadConfig, SSEParser, main, percentiles, run_load


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
