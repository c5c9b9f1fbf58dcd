"""SSE keep-alives: sent only when a response has been quiet for the interval, never mid-event."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from starlette.types import Message

from nanoserve.engine.inbox import Inbox
from nanoserve.engine.types import FinishReason, TokenEvent
from nanoserve.server.streaming.sse import KEEPALIVE, EventStreamResponse, event_stream, sse_event


async def collect(body: AsyncIterator[bytes], keepalive_s: float,
                  send_delay_s: float = 0.0) -> tuple[list[bytes], int]:
    """The body chunks a response sends, and how many messages it sent in all."""
    sent: list[Message] = []

    async def send(message: Message) -> None:
        if send_delay_s:
            await asyncio.sleep(send_delay_s)  # a slow client: the socket buffer is full
        sent.append(message)

    await EventStreamResponse(body, keepalive_s=keepalive_s).stream_response(send)
    assert sent[0]["type"] == "http.response.start"
    assert sent[-1] == {"type": "http.response.body", "body": b"", "more_body": False}
    return [m["body"] for m in sent[1:-1]], len(sent)


async def paced(chunks: list[bytes], gap_s: float) -> AsyncIterator[bytes]:
    for chunk in chunks:
        await asyncio.sleep(gap_s)
        yield chunk


async def test_no_keepalive_while_events_flow_faster_than_the_interval() -> None:
    events = [b"data: %d\n\n" % i for i in range(10)]
    body, _ = await collect(paced(events, 0.01), keepalive_s=0.05)
    assert body == events


async def test_keepalives_fill_a_quiet_stretch_between_events() -> None:
    events = [b"data: a\n\n", b"data: b\n\n"]
    body, _ = await collect(paced(events, 0.27), keepalive_s=0.05)
    assert body[-1] == events[-1] and body.count(events[0]) == 1
    pings = body.count(KEEPALIVE)
    # ~0.54 s of silence in two stretches at one ping per 0.05 s: about 10, fewer if the machine
    # is slow to run timers, never more.
    assert 3 <= pings <= 11, body
    assert set(body) == {KEEPALIVE, *events}  # every chunk whole: a ping never splits an event


async def test_a_slow_send_gets_one_ping_at_a_time() -> None:
    # Sends take 0.2 s while the interval is 0.02 s: pings must not pile up behind the slow send
    # (one in flight at most), and the timer must not spin.
    events = [b"data: a\n\n"]
    cpu = time.process_time()
    body, total = await collect(paced(events, 0.3), keepalive_s=0.02, send_delay_s=0.2)
    assert time.process_time() - cpu < 0.2  # ~0.5 s of wall time, nearly all of it asleep
    assert body.count(events[0]) == 1
    assert 1 <= body.count(KEEPALIVE) <= 3, body
    assert total == len(body) + 2


def test_sse_event_shapes() -> None:
    # Text as it is, a line per `data:` field so a newline cannot end the field early.
    assert sse_event("[DONE]") == b"data: [DONE]\n\n"
    assert sse_event("a\nb", event="note") == b"event: note\ndata: a\ndata: b\n\n"
    # JSON on one line (a newline in a string is escaped); a dict as its model would render.
    assert sse_event({"text": "x\ny", "n": 1}) == b'data: {"text":"x\\ny","n":1}\n\n'
    error = sse_event({"error": {"code": "c"}}, event="error")
    assert error == b'event: error\ndata: {"error":{"code":"c"}}\n\n'


def _token(i: int, final: bool = False) -> TokenEvent:
    return TokenEvent(index=i, token_id=i, text=str(i), finish_reason=FinishReason.LENGTH if final else None)


async def _render_chunks(arrivals: list[list[TokenEvent]], coalesce: bool) -> list[bytes]:
    """The body chunks `event_stream` sends when the events arrive in these groups."""
    inbox: Inbox[TokenEvent] = Inbox(asyncio.get_running_loop())

    async def events() -> AsyncIterator[TokenEvent]:
        while True:
            event = await inbox.get()
            yield event
            if event.finish_reason is not None:
                return

    async def feed() -> None:
        for group in arrivals:
            for event in group:
                inbox.put(event)
            await asyncio.sleep(0.01)

    response = event_stream(events(), lambda e: [sse_event({"t": e.text})], keepalive_s=60,
                            trailer=[b"data: [DONE]\n\n"], ready=(lambda: len(inbox)) if coalesce else None)
    feeder = asyncio.ensure_future(feed())
    body, _ = await collect(response.body_iterator, keepalive_s=60)
    await feeder
    return body


async def test_events_already_waiting_go_out_in_one_chunk() -> None:
    arrivals = [[_token(0)], [_token(1), _token(2), _token(3)], [_token(4), _token(5, final=True)]]
    one = [b'data: {"t":"%d"}\n\n' % i for i in range(6)]
    done = b"data: [DONE]\n\n"
    assert await _render_chunks(arrivals, coalesce=True) == [
        one[0], one[1] + one[2] + one[3], one[4] + one[5] + done
    ]
    # Without `ready` every event is its own chunk (the last one carries the trailer).
    assert await _render_chunks(arrivals, coalesce=False) == [*one[:5], one[5] + done]
