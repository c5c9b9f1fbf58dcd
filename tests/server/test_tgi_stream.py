"""SSE over real sockets: framing, keep-alives while queued, overload, disconnects, error events,
and huggingface_hub's client, against one `nanoserve serve` with a single KV slot."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator

import httpx
import pytest

from nanoserve.engine.types import TokenEvent
from tests.server.server import ServerProcess, running_server

FAULT = "FAULTY"  # prompts containing this get NaN logits (the engine's test-only fault injection)


@pytest.fixture(scope="module")
def server(tiny_checkpoint) -> Iterator[ServerProcess]:  # type: ignore[no-untyped-def]
    env = {
        "NANOSERVE_MAX_SEQS": "1",
        "NANOSERVE_MAX_QUEUE": "1",
        "NANOSERVE_KEEPALIVE_INTERVAL": "0.2",
        "NANOSERVE_MAX_NEW_TOKENS": "1000000",
    }
    with running_server(tiny_checkpoint, env=env, fault=f"nan:{FAULT}") as srv:
        yield srv


def body(inputs: str = "Hello", **params: object) -> dict[str, object]:
    return {"inputs": inputs, "parameters": params}


ENDLESS = body(max_new_tokens=1_000_000)  # runs until cancelled


async def wait_ready_again(client: httpx.AsyncClient) -> None:
    """The single slot is free again: a short request completes (bounded by the client timeout)."""
    r = await client.post("/generate", json=body(max_new_tokens=2))
    assert r.status_code == 200, r.text


async def test_stream_framing_and_final_event(server: ServerProcess) -> None:
    async with (
        httpx.AsyncClient(base_url=server.base_url, timeout=30) as client,
        client.stream("POST", "/generate_stream", json=body(max_new_tokens=5)) as r,
    ):
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["cache-control"] == "no-cache"
        assert r.headers["x-accel-buffering"] == "no"
        assert r.headers["x-request-id"]
        raw = (await r.aread()).decode()
    blocks = [b for b in raw.split("\n\n") if b and not b.startswith(":")]
    assert all(b.startswith("data: {") and "\n" not in b for b in blocks), raw
    events = [json.loads(b[len("data: ") :]) for b in blocks]
    assert [e["index"] for e in events] == list(range(5))
    assert all(e["generated_text"] is None and e["details"] is None for e in events[:-1])
    last = events[-1]
    assert last["generated_text"] == "".join(e["token"]["text"] for e in events)
    assert last["details"]["finish_reason"] == "length"
    assert last["details"]["generated_tokens"] == 5 and last["details"]["input_length"] == 5


async def _lines(r: httpx.Response) -> AsyncIterator[str]:
    async for line in r.aiter_lines():
        yield line


async def _first_line(lines: AsyncIterator[str], prefix: str) -> str:
    async for line in lines:
        if line.startswith(prefix):
            return line
    raise AssertionError(f"stream ended before a line starting with {prefix!r}")


async def test_queued_request_gets_keepalives_and_a_full_queue_gets_429(server: ServerProcess) -> None:
    async with httpx.AsyncClient(base_url=server.base_url, timeout=30) as client:
        async with client.stream("POST", "/generate_stream", json=ENDLESS) as running:
            assert running.status_code == 200
            running_lines = _lines(running)
            await asyncio.wait_for(_first_line(running_lines, "data: "), 20)  # holds the only slot
            async with client.stream("POST", "/generate_stream", json=body(max_new_tokens=3)) as queued:
                assert queued.status_code == 200  # accepted into the queue: headers go out at once
                queued_lines = _lines(queued)
                await asyncio.wait_for(_first_line(queued_lines, ": keep-alive"), 10)
                # Slot busy, queue (size 1) full: the next one is refused before any stream starts.
                r = await client.post("/generate_stream", json=body(max_new_tokens=3))
                assert r.status_code == 429
                assert int(r.headers["retry-after"]) >= 1
                assert r.json()["error_type"] == "overloaded"  # TGI's shape on TGI's routes
                await running.aclose()  # the client goes away: its slot must go to the queued request
                first = await asyncio.wait_for(_first_line(queued_lines, "data: "), 20)
                assert json.loads(first[len("data: ") :])["index"] == 0
        await wait_ready_again(client)


async def test_disconnect_of_a_non_streaming_request_frees_its_slot(server: ServerProcess) -> None:
    async with httpx.AsyncClient(base_url=server.base_url, timeout=1.0) as client:
        with pytest.raises(httpx.ReadTimeout):
            await client.post("/generate", json=ENDLESS)  # gives up after 1 s and closes the socket
    async with httpx.AsyncClient(base_url=server.base_url, timeout=20) as client:
        await wait_ready_again(client)
    logs = server.logs()
    assert "unhandled error" not in logs and "Traceback" not in logs, logs
    assert any("route=/generate status=499" in line and "finish_reason=cancelled" in line
               for line in logs.splitlines()), logs  # logged as the client closing the request


async def test_engine_error_after_200_is_an_error_event_in_tgis_shape(server: ServerProcess) -> None:
    async with httpx.AsyncClient(base_url=server.base_url, timeout=30) as client:
        async with client.stream("POST", "/generate_stream", json=body(f"{FAULT} x", max_new_tokens=5)) as r:
            assert r.status_code == 200
            raw = (await r.aread()).decode()
        blocks = [b for b in raw.split("\n\n") if b and not b.startswith(":")]
        assert blocks[-1].startswith("data: "), raw  # TGI sends its error event as plain data
        error = json.loads(blocks[-1].split("data: ", 1)[1])
        assert error["error_type"] == "generation"
        assert "finite" in error["error"].lower() or "nan" in error["error"].lower()
        # The same fault without streaming: TGI's 424 for a failed generation.
        r2 = await client.post("/generate", json=body(f"{FAULT} x", max_new_tokens=5))
        assert r2.status_code == 424 and r2.json()["error_type"] == "generation"
        assert (await client.get("/ready")).status_code == 200
        await wait_ready_again(client)


def test_huggingface_hub_client(server: ServerProcess) -> None:
    from huggingface_hub import InferenceClient

    client = InferenceClient(model=server.base_url, timeout=30)
    text = client.text_generation("Hello", max_new_tokens=4)
    out = client.text_generation("Hello", max_new_tokens=4, details=True, do_sample=True, seed=7)
    assert len(text) == 4
    assert out.details is not None and out.details.generated_tokens == 4 and out.details.seed == 7
    streamed = list(client.text_generation("Hello", max_new_tokens=4, stream=True))
    assert "".join(streamed) == text  # greedy: same text streamed or not


@pytest.mark.parametrize(
    "event",
    [
        TokenEvent(index=0, token_id=7, text="a", logprob=-0.25),
        TokenEvent(index=12, token_id=3, text="é\n\"x\" \\ 🎉", logprob=-1e-9, special=False),
        TokenEvent(index=3, token_id=50256, text="", logprob=None, special=True),
        TokenEvent(index=1, token_id=0, text="\u2028</script>", logprob=-17.123456789012345),
    ],
)
def test_direct_token_event_json_equals_the_pydantic_rendering(event: TokenEvent) -> None:
    """The streaming hot path writes a mid-stream event's JSON directly; it must be the very
    bytes the schema (StreamResponse) would produce."""
    from nanoserve.server.api.tgi.routes import _token, token_event_bytes
    from nanoserve.server.api.tgi.schemas import StreamResponse
    from nanoserve.server.streaming.sse import sse_event

    assert token_event_bytes(event) == sse_event(StreamResponse(index=event.index, token=_token(event)))
