"""Each API family's error shape (TGI's on the TGI routes, OpenAI's on /v1 and elsewhere), the
right status for each failure, and request ids / access logs."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import pytest_asyncio

from nanoserve.engine.types import InvalidRequest, NotReady, Overloaded
from nanoserve.model.tokenizer import CharTokenizer
from nanoserve.server.app import create_app
from nanoserve.server.deps import get_engine
from nanoserve.server.http.access_log import JsonFormatter
from nanoserve.server.settings import Settings
from tests.server.asgi import AppClient, asgi_client

pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def client(tiny_checkpoint) -> AsyncIterator[AppClient]:  # type: ignore[no-untyped-def]
    async with asgi_client(tiny_checkpoint, max_body_bytes=4096, max_prompt_tokens=100,
                           reject_long_prompts=True) as c:
        yield c


def assert_error(r: httpx.Response, status: int, code: str | None = None, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "code", "param"}, body
    error: dict[str, Any] = body["error"]
    assert error["message"] and "Traceback" not in error["message"]
    if code is not None:
        assert error["code"] == code, error
    if param is not None:
        assert error["param"] == param, error
    assert r.headers.get("x-request-id")
    return error


def assert_tgi_error(r: httpx.Response, status: int, error_type: str, names: str | None = None) -> str:
    """TGI's error shape (what its clients parse); returns the message, which names the field."""
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error", "error_type"} and isinstance(body["error"], str), body
    assert body["error_type"] == error_type, body
    assert body["error"] and "Traceback" not in body["error"]
    if names is not None:
        assert names in body["error"], body
    assert r.headers.get("x-request-id")
    message: str = body["error"]
    return message


def gen(**params: Any) -> dict[str, Any]:
    return {"inputs": "Hello", "parameters": params}


RAW = {"content-type": "application/json"}


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (gen(max_new_tokens=True), "parameters.max_new_tokens"),  # a bool is not a number
        (gen(temperature=False), "parameters.temperature"),
        (gen(max_new_tokens="5"), "parameters.max_new_tokens"),  # no string -> number coercion
        (gen(max_new_tokens=5.0), "parameters.max_new_tokens"),  # an integer field wants an integer
        (gen(max_new_tokens=-3), "parameters.max_new_tokens"),
        (gen(top_k=0), "parameters.top_k"),
        (gen(top_p=1.5), "parameters.top_p"),
        (gen(temperature=-0.1), "parameters.temperature"),
        (gen(frequency_penalty=2.5), "parameters.frequency_penalty"),
        (gen(seed=-1), "parameters.seed"),
        (gen(seed=2**64), "parameters.seed"),
        (gen(stop="x"), "parameters.stop"),
        (gen(stop=[1]), "parameters.stop[0]"),
        ({"inputs": 3}, "inputs"),
        ({"inputs": None}, "inputs"),
        ({"inputs": ""}, "inputs"),
        ({"parameters": {}}, "inputs"),
        ({"inputs": "x", "extra": 1}, "extra"),
        ({"inputs": "x", "stream": "yes"}, "stream"),
        ({"inputs": "x", "parameters": []}, "parameters"),
    ],
)
async def test_invalid_fields_are_422_naming_the_field(client: AppClient, body: Any, param: str) -> None:
    assert_tgi_error(await client.post("/generate", json=body), 422, "validation", names=param)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "x", "max_tokens": True}, "max_tokens"),
        ({"prompt": "x", "temperature": "1"}, "temperature"),
        ({"prompt": "x", "stop": [1]}, "stop"),
        ({"prompt": 3}, "prompt"),
        ({"prompt": "x", "extra": 1}, "extra"),
    ],
)
async def test_invalid_fields_on_v1_are_400_naming_the_field(
    client: AppClient, body: Any, param: str
) -> None:
    # OpenAI's dialect: 400 (the SDK's BadRequestError), with type, code and param.
    error = assert_error(await client.post("/v1/completions", json=body), 400)
    assert error["param"] is not None and error["param"].startswith(param) and param in error["message"]
    assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity"])
async def test_non_finite_numbers_are_422(client: AppClient, value: str) -> None:
    raw = f'{{"inputs": "x", "parameters": {{"temperature": {value}}}}}'
    r = await client.post("/generate", content=raw, headers=RAW)
    assert_tgi_error(r, 422, "validation", names="parameters.temperature")
    raw = f'{{"prompt": "x", "temperature": {value}}}'
    assert_error(await client.post("/v1/completions", content=raw, headers=RAW), 400, param="temperature")


async def test_malformed_json_is_422_and_invalid_utf8_is_400(client: AppClient) -> None:
    message = assert_tgi_error(await client.post("/generate", content=b'{"inputs": ', headers=RAW), 422,
                               "validation")
    assert "JSON" in message
    r = await client.post("/generate", content=b'{"inputs": "\xff\xfe"}', headers=RAW)
    assert "UTF-8" in assert_tgi_error(r, 400, "validation")
    r = await client.post("/v1/completions", content=b'{"prompt": ', headers=RAW)
    assert "JSON" in assert_error(r, 400, code="json_invalid")["message"]
    r = await client.post("/v1/completions", content=b'{"prompt": "\xff\xfe"}', headers=RAW)
    assert "UTF-8" in assert_error(r, 400, code="invalid_utf8")["message"]


async def test_unrepresentable_text_is_422_naming_the_character(client: AppClient) -> None:
    r = await client.post("/generate", json={"inputs": "caf\u00e9"})
    message = assert_tgi_error(r, 422, "validation", names="inputs")
    assert "U+00E9" in message
    raw = b'{"inputs": "a\\ud800b"}'  # a lone surrogate, legal in JSON text, not a character
    r = await client.post("/generate", content=raw, headers=RAW)
    # Refused by the strict schema itself, before any tokenizer sees it.
    assert "unicode" in assert_tgi_error(r, 422, "validation", names="inputs")
    r = await client.post("/v1/completions", json={"prompt": "caf\u00e9"})
    assert "U+00E9" in assert_error(r, 400, param="prompt")["message"]


async def test_wrong_content_type_is_415(client: AppClient) -> None:
    r = await client.post("/generate", content=json.dumps(gen()), headers={"content-type": "text/plain"})
    assert "application/json" in assert_tgi_error(r, 415, "validation")
    r = await client.post("/v1/completions", content=json.dumps({"prompt": "x"}),
                          headers={"content-type": "text/plain"})
    assert "application/json" in assert_error(r, 415, code="unsupported_media_type")["message"]


async def test_body_too_large_is_413_by_length_and_while_streaming(client: AppClient) -> None:
    big = json.dumps({"inputs": "a" * 5000}).encode()
    assert_tgi_error(await client.post("/generate", content=big, headers=RAW), 413, "validation")

    async def chunks() -> AsyncIterator[bytes]:  # no Content-Length: counted as it arrives
        for i in range(0, len(big), 1000):
            yield big[i : i + 1000]

    assert_tgi_error(await client.post("/generate", content=chunks(), headers=RAW), 413, "validation")
    r = await client.post("/v1/completions", content=big, headers=RAW)
    assert_error(r, 413, code="body_too_large")


async def test_prompt_limits(client: AppClient) -> None:
    # Over the server's cap (100 tokens): refused before the engine sees it.
    r = await client.post("/generate", json={"inputs": "a" * 150})
    message = assert_tgi_error(r, 422, "validation", names="inputs")
    assert "150" in message and "100" in message
    # Over the model's window (64) with cropping disabled: the engine's PromptTooLong.
    r = await client.post("/generate", json={"inputs": "a" * 80})
    message = assert_tgi_error(r, 422, "validation", names="inputs")
    assert "80" in message and "64" in message
    r = await client.post("/v1/completions", json={"prompt": "a" * 80})
    assert_error(r, 400, "prompt_too_long", "prompt")


async def test_unknown_route_and_wrong_method(client: AppClient) -> None:
    assert_error(await client.get("/nope"), 404, code="not_found")
    assert_tgi_error(await client.get("/generate"), 405, "method_not_allowed")
    # OpenAI's own answer to an unknown path under /v1.
    error = assert_error(await client.post("/v1/frobnicate", json={}), 404, code="unknown_url")
    assert error["message"] == "Invalid URL (POST /v1/frobnicate)"


class FakeEngine:
    """Raises the given error from generate(), as the engine does before the first token."""

    def __init__(self, error: Exception) -> None:
        self.error = error

    tokenizer = CharTokenizer.train("Hello")
    checkpoint = type("Checkpoint", (), {"name": "fake"})()

    def check_admission(self, client: str | None = None) -> None:
        pass  # the error comes from generate(), after the prompt is encoded

    def encode(self, text: str) -> list[int]:
        return [1] * len(text)

    async def generate(self, *args: Any, **kwargs: Any) -> Any:
        raise self.error

    generate_choices = generate


@pytest.mark.parametrize(
    ("error", "status", "code", "error_type", "v1_status"),
    [
        (Overloaded("queue full", retry_after_s=2.5), 429, "overloaded", "overloaded", 429),
        (NotReady("shutting down"), 503, "not_ready", "not_ready", 503),
        (InvalidRequest("bad token id", param="inputs"), 422, "invalid_request", "validation", 400),
    ],
)
async def test_engine_errors_map_to_statuses(
    tiny_checkpoint, error: Exception, status: int, code: str, error_type: str, v1_status: int  # type: ignore[no-untyped-def]
) -> None:
    app = create_app(Settings(checkpoint=tiny_checkpoint, device="cpu"))
    app.dependency_overrides[get_engine] = lambda: FakeEngine(error)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        for route in ("/generate", "/generate_stream", "/"):
            r = await c.post(route, json=gen())
            message = assert_tgi_error(r, status, error_type)
            assert message.endswith(str(error))
            if status == 429:
                assert r.headers["retry-after"] == "3"  # rounded up, whole seconds
        r = await c.post("/v1/completions", json={"prompt": "Hello"})
        assert_error(r, v1_status, code=code)
        assert r.json()["error"]["message"] == str(error)


async def test_unexpected_exceptions_are_a_clean_500(tiny_checkpoint) -> None:  # type: ignore[no-untyped-def]
    app = create_app(Settings(checkpoint=tiny_checkpoint, device="cpu"))
    app.dependency_overrides[get_engine] = lambda: FakeEngine(RuntimeError("secret internals"))
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
        r = await c.post("/generate", json=gen(), headers={"X-Request-Id": "trace-me-42"})
        message = assert_tgi_error(r, 500, "internal_error")
        assert "secret internals" not in r.text and "trace-me-42" in message
        assert r.headers["x-request-id"] == "trace-me-42"
        r = await c.post("/v1/completions", json={"prompt": "Hello"}, headers={"X-Request-Id": "trace-me-43"})
    error = assert_error(r, 500, code="internal_error")
    assert "secret internals" not in r.text and "trace-me-43" in error["message"]


async def test_request_ids_are_echoed_or_generated(client: AppClient) -> None:
    r = await client.get("/health", headers={"X-Request-Id": "abc-123.x"})
    assert r.headers["x-request-id"] == "abc-123.x"
    for bad in ("has spaces", "x" * 200, "quote\"d"):
        r = await client.get("/health", headers={"X-Request-Id": bad})
        assert r.headers["x-request-id"] != bad and len(r.headers["x-request-id"]) == 32
    a, b = await client.get("/health"), await client.get("/health")
    assert a.headers["x-request-id"] != b.headers["x-request-id"]
    assert (await client.get("/nope")).headers["x-request-id"]


async def test_one_access_log_line_per_request(client: AppClient, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="nanoserve.access"):
        r = await client.post("/generate", json=gen(max_new_tokens=3), headers={"X-Request-Id": "log-me-1"})
    lines = [rec for rec in caplog.records if rec.name == "nanoserve.access"]
    assert len(lines) == 1
    fields = lines[0].fields  # type: ignore[attr-defined]
    assert fields["request_id"] == "log-me-1" == r.headers["x-request-id"]
    assert fields["route"] == "/generate" and fields["method"] == "POST" and fields["status"] == 200
    assert fields["prompt_tokens"] == 5 and fields["generated_tokens"] == 3
    assert fields["finish_reason"] == "length"
    assert 0 < fields["ttft_ms"] <= fields["duration_ms"]
    parsed = json.loads(JsonFormatter().format(lines[0]))  # --log-format json: one object per line
    assert parsed["request_id"] == "log-me-1" and parsed["generated_tokens"] == 3


async def test_probes_are_logged_at_debug_level(client: AppClient, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG, logger="nanoserve.access"):
        await client.get("/ready")
        await client.get("/nope")
    levels = {rec.fields["route"]: rec.levelno for rec in caplog.records if rec.name == "nanoserve.access"}  # type: ignore[attr-defined]
    assert levels == {"/ready": logging.DEBUG, "/nope": logging.INFO}


async def test_several_prompts_run_all_or_none(tiny_checkpoint) -> None:  # type: ignore[no-untyped-def]
    # One slot and two queue places: four prompts cannot all be admitted, so none runs (429), and
    # those already submitted are cancelled (their slot and places free within a step or two).
    endless = 10**6  # those started would run for minutes unless cancelled
    async with asgi_client(tiny_checkpoint, max_seqs=1, max_queue=2, max_waiting_per_client=2,
                           max_new_tokens=endless) as client:
        body = {"prompt": ["a", "b", "c", "d"], "max_tokens": endless}
        assert_error(await client.post("/v1/completions", json=body), 429, code="overloaded")
        engine = client.app.state.engine
        for _ in range(100):
            if engine.stats().running == 0 and engine.stats().waiting == 0:
                break
            await asyncio.sleep(0.05)
        assert engine.stats().running == 0 and engine.stats().waiting == 0
        ok = await client.post("/v1/completions", json={"prompt": ["a", "b"], "max_tokens": 2})
        assert ok.status_code == 200 and [c["index"] for c in ok.json()["choices"]] == [0, 1]


async def test_a_chat_over_the_prompt_cap_is_refused_not_trimmed(tiny_checkpoint) -> None:  # type: ignore[no-untyped-def]
    # Turns are dropped to fit the window only below the server's prompt cap: a conversation over
    # it gets the same 422 as any prompt (the cap bounds the work a request may ask for).
    async with asgi_client(tiny_checkpoint, max_prompt_tokens=100) as client:
        def chat(turns: int) -> dict[str, Any]:
            talk = [{"role": "user" if i % 2 == 0 else "assistant", "content": "abcdefghij"}
                    for i in range(turns)]
            messages = [{"role": "system", "content": "x"}, *talk]
            return {"model": "tiny-test", "max_tokens": 2, "messages": messages}

        r = await client.post("/v1/chat/completions", json=chat(3))  # over the window, under the cap
        assert r.status_code == 200 and int(r.headers["x-nanoserve-dropped-messages"]) >= 1
        r = await client.post("/v1/chat/completions", json=chat(9))  # over the cap
        assert_error(r, 400, code="prompt_too_long", param="messages")
