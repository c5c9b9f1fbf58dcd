"""`--stream-interval N`: a stream's tokens go out N to a body chunk, the first one at once."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from starlette.types import Message

from tests.server.asgi import AppClient, asgi_client

N_TOKENS = 10


def _events(chunk: bytes) -> list[str]:
    return [block.removeprefix("data: ") for block in chunk.decode().split("\n\n") if block]


async def _body_chunks(client: AppClient, path: str, body: dict[str, Any]) -> list[list[str]]:
    """The SSE events of each body message the app sends (httpx's ASGI transport joins them)."""
    payload = json.dumps(body).encode()
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
        "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())],
        "client": ("127.0.0.1", 50000), "server": ("testserver", 80),
    }
    requested = False
    sent: list[Message] = []

    async def receive() -> Message:
        nonlocal requested
        if not requested:
            requested = True
            return {"type": "http.request", "body": payload, "more_body": False}
        await asyncio.Event().wait()  # the client never leaves
        raise AssertionError("unreachable")

    async def send(message: Message) -> None:
        sent.append(message)

    await asyncio.wait_for(client.app(scope, receive, send), 30)
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 200, sent[:2]
    return [_events(m["body"]) for m in sent[1:] if m.get("body")]


async def test_tokens_go_out_n_to_a_chunk_with_the_first_at_once(tiny_checkpoint: Path) -> None:
    body = {"inputs": "Hello", "parameters": {"max_new_tokens": N_TOKENS, "do_sample": False}}
    async with asgi_client(tiny_checkpoint, stream_interval=4) as client:
        whole = (await client.post("/generate", json=body)).json()["generated_text"]
        chunks = await _body_chunks(client, "/generate_stream", body)
        openai_chunks = await _body_chunks(client, "/v1/completions", {
            "prompt": "Hello", "max_tokens": N_TOKENS, "temperature": 0, "stream": True,
        })

    events = [json.loads(e) for chunk in chunks for e in chunk]
    assert len(events) == N_TOKENS and events[-1]["details"]["finish_reason"] == "length"
    assert "".join(e["token"]["text"] for e in events) == whole  # nothing lost, nothing reordered
    # The reader wakes for the first token, then for every fourth, and for the last; it sends
    # whatever is waiting when it wakes. So the first chunk holds what had arrived when the
    # response began (one token unless the engine was quicker than the route), every later one
    # four or more, except the one the last event ended early. (That the first token wakes the
    # reader at once is tested on the Inbox itself.)
    sizes = [len(c) for c in chunks]
    assert all(size >= 4 for size in sizes[1:-1]), sizes
    assert len(chunks) <= 1 + -(-(N_TOKENS - 1) // 4), sizes

    openai_events = [e for chunk in openai_chunks for e in chunk]
    assert openai_events[-1] == "[DONE]"
    text = "".join(json.loads(e)["choices"][0]["text"] for e in openai_events[:-1])
    assert text == whole
    assert all(len(c) >= 4 for c in openai_chunks[1:-1])
