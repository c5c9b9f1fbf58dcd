"""TGI's own Python client (`text-generation`) and huggingface_hub's InferenceClient, unmodified,
against one `nanoserve serve` with a single KV slot: answers, streams, and each error mapped to
the client's own exception class (validation, overload, generation failure)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest

from tests.conftest import require_module
from tests.server.server import ServerProcess, running_server

FAULT = "FAULTY"  # prompts containing this get NaN logits (the engine's test-only fault injection)
MAX_NEW_TOKENS = 1_000_000


@pytest.fixture(scope="module")
def server(tiny_checkpoint) -> Iterator[ServerProcess]:  # type: ignore[no-untyped-def]
    env = {
        "NANOSERVE_MAX_SEQS": "1",
        "NANOSERVE_MAX_QUEUE": "1",
        "NANOSERVE_MAX_NEW_TOKENS": str(MAX_NEW_TOKENS),
    }
    with running_server(tiny_checkpoint, env=env, fault=f"nan:{FAULT}") as srv:
        yield srv


@contextmanager
def slot_and_queue_taken(server: ServerProcess) -> Iterator[None]:
    """One endless generation holds the only KV slot and another waits in the only queue place."""
    endless = {"inputs": "Hello", "parameters": {"max_new_tokens": MAX_NEW_TOKENS}}
    with httpx.Client(base_url=server.base_url, timeout=30) as client, \
            client.stream("POST", "/generate_stream", json=endless) as running:
        assert running.status_code == 200
        # Kept referenced: a line iterator that is collected closes the connection, and so the request.
        lines = running.iter_lines()
        next(line for line in lines if line.startswith("data: "))  # it holds the slot
        with client.stream("POST", "/generate_stream", json=endless) as queued:
            assert queued.status_code == 200
            yield
        del lines
    # Both close now; their slot and queue place are freed within a step or two.
    with httpx.Client(base_url=server.base_url, timeout=30) as client:
        for _ in range(80):
            short = {"inputs": "Hi", "parameters": {"max_new_tokens": 1}}
            if client.post("/generate", json=short).status_code == 200:
                return
            time.sleep(0.25)
    raise AssertionError("the slot was not freed within 20 s")


def test_text_generation_client_generate_and_stream(server: ServerProcess) -> None:
    require_module("text_generation")
    from text_generation import Client

    client = Client(server.base_url, timeout=30)
    out = client.generate("Hello", max_new_tokens=6)  # POST /, read as TGI's one-element list
    assert out.details is not None and out.details.generated_tokens == 6
    assert out.details.finish_reason.value == "length" and len(out.generated_text) == 6
    assert "".join(t.text for t in out.details.tokens) == out.generated_text
    stream = list(client.generate_stream("Hello", max_new_tokens=6))
    assert [r.token.text for r in stream] == [t.text for t in out.details.tokens]  # greedy both ways
    assert stream[-1].generated_text == out.generated_text
    # TGI's rules: a stop sequence stays in the text, and temperature alone samples (seed reported).
    stop = out.generated_text[2:4]
    stopped = client.generate("Hello", max_new_tokens=6, stop_sequences=[stop])
    assert stopped.generated_text == out.generated_text[: out.generated_text.index(stop) + 2]
    assert stopped.details.finish_reason.value == "stop_sequence"
    sampled = client.generate("Hello", max_new_tokens=6, temperature=0.7, seed=5)
    assert sampled.details.seed == 5


def test_text_generation_client_error_classes(server: ServerProcess) -> None:
    require_module("text_generation")
    from text_generation import Client
    from text_generation.errors import GenerationError, OverloadedError, ValidationError

    client = Client(server.base_url, timeout=30)
    with pytest.raises(ValidationError, match="top_n_tokens"):  # over the server's cap of 5
        client.generate("Hello", max_new_tokens=2, top_n_tokens=6)
    with pytest.raises(ValidationError, match="top_n_tokens"):
        list(client.generate_stream("Hello", max_new_tokens=2, top_n_tokens=6))
    with pytest.raises(GenerationError, match=r"(?i)finite|nan"):  # fails inside the engine: 424
        client.generate(f"{FAULT} x", max_new_tokens=4)
    with pytest.raises(GenerationError, match=r"(?i)finite|nan"):  # ... or after the stream's 200
        list(client.generate_stream(f"{FAULT} x", max_new_tokens=4))
    with slot_and_queue_taken(server):
        with pytest.raises(OverloadedError):
            client.generate("Hello", max_new_tokens=2)
        with pytest.raises(OverloadedError):
            list(client.generate_stream("Hello", max_new_tokens=2))
    assert client.generate("Hello", max_new_tokens=2).details.generated_tokens == 2  # free again


def test_huggingface_hub_inference_client(server: ServerProcess) -> None:
    from huggingface_hub import InferenceClient
    from huggingface_hub.errors import OverloadedError, ValidationError

    client = InferenceClient(model=server.base_url, timeout=30)
    text = client.text_generation("Hello", max_new_tokens=4)
    assert "".join(client.text_generation("Hello", max_new_tokens=4, stream=True)) == text
    with pytest.raises(ValidationError, match="top_n_tokens"):
        client.text_generation("Hello", max_new_tokens=2, top_n_tokens=6)
    # chat_completion posts /v1/chat/completions with a placeholder model name: the served model answers.
    messages = [{"role": "user", "content": "Hello"}]
    reply = client.chat_completion(messages, max_tokens=4, temperature=0)
    assert reply.model == "tiny-test" and reply.choices[0].message.content
    chunks = list(client.chat_completion(messages, max_tokens=4, temperature=0, stream=True))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == reply.choices[0].message.content
    with slot_and_queue_taken(server), pytest.raises(OverloadedError):
        client.text_generation("Hello", max_new_tokens=2)


def test_tgi_stream_error_event_shape(server: ServerProcess) -> None:
    body = {"inputs": f"{FAULT} x", "parameters": {"max_new_tokens": 4}}
    with httpx.Client(base_url=server.base_url, timeout=30) as client:
        r = client.post("/generate_stream", json=body)
        assert r.status_code == 200
        last = [b for b in r.text.split("\n\n") if b and not b.startswith(":")][-1]
        assert last.startswith("data: "), r.text  # TGI's error event: a data line, no event name
        error = json.loads(last[len("data: "):])
        assert set(error) == {"error", "error_type"} and error["error_type"] == "generation"
        r = client.post("/generate", json=body)
        assert r.status_code == 424 and r.json()["error_type"] == "generation"
