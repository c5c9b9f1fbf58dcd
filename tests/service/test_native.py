"""The native (TGI-shaped) API in-process: /generate, POST /, /tokenize, /info and their limits."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from tests.service.asgi import AppClient, asgi_client

pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def client(tiny_checkpoint) -> AsyncIterator[AppClient]:  # type: ignore[no-untyped-def]
    async with asgi_client(tiny_checkpoint, max_stop_sequences=2, max_new_tokens=50) as c:
        yield c


async def generate(client: AppClient, inputs: str = "Hello", route: str = "/generate", **params):  # type: ignore[no-untyped-def]
    r = await client.post(route, json={"inputs": inputs, "parameters": params})
    assert r.status_code == 200, r.text
    return r.json()


async def test_generate_returns_text_and_details(client: AppClient) -> None:
    out = await generate(client, max_new_tokens=6, details=True)
    details = out["details"]
    assert details["finish_reason"] == "length"
    assert details["generated_tokens"] == 6 == len(details["tokens"])
    assert details["prompt_tokens"] == 5 and details["cropped_tokens"] == 0
    assert "".join(t["text"] for t in details["tokens"]) == out["generated_text"]
    for token in details["tokens"]:
        assert isinstance(token["id"], int) and token["logprob"] <= 0.0 and token["special"] is False
    assert details["prefill"] == [] and details["top_tokens"] is None


async def test_details_are_omitted_unless_asked(client: AppClient) -> None:
    out = await generate(client, max_new_tokens=3)
    assert set(out) == {"generated_text", "details"} and out["details"] is None
    assert len(out["generated_text"]) == 3  # char model: one character per token


async def test_greedy_by_default_and_with_do_sample_false(client: AppClient) -> None:
    a, b, c = await asyncio.gather(
        generate(client, max_new_tokens=8),
        generate(client, max_new_tokens=8, do_sample=False, temperature=1.5, top_k=3),
        generate(client, max_new_tokens=8, temperature=0.0),
    )
    assert a["generated_text"] == b["generated_text"] == c["generated_text"]


async def test_seeded_sampling_is_reproducible(client: AppClient) -> None:
    params = {"max_new_tokens": 12, "do_sample": True, "temperature": 1.5, "seed": 1234, "details": True}
    # Concurrent, so they share engine steps: the same seed gives the same tokens even when batched.
    a, b, *others = await asyncio.gather(
        *(generate(client, **{**params, "seed": s}) for s in (1234, 1234, 1, 2, 3))
    )
    assert a["generated_text"] == b["generated_text"]
    assert a["details"]["seed"] == 1234
    assert len({o["generated_text"] for o in others}) > 1  # different seeds do not all agree


async def test_return_full_text_prepends_the_prompt(client: AppClient) -> None:
    plain = await generate(client, inputs="Once", max_new_tokens=4)
    full = await generate(client, inputs="Once", max_new_tokens=4, return_full_text=True)
    assert full["generated_text"] == "Once" + plain["generated_text"]


async def test_stop_sequence_ends_generation_without_the_stop_text(client: AppClient) -> None:
    greedy = (await generate(client, max_new_tokens=20))["generated_text"]
    stop = greedy[3:5]  # greedy output is deterministic: this string will appear at position 3
    out = await generate(client, max_new_tokens=20, stop=[stop], details=True)
    assert out["details"]["finish_reason"] == "stop_sequence"
    assert out["generated_text"] == greedy[: greedy.index(stop)]


async def test_top_n_tokens_lists_alternatives(client: AppClient) -> None:
    out = await generate(client, max_new_tokens=3, top_n_tokens=3, details=True)
    tops = out["details"]["top_tokens"]
    assert len(tops) == 3 and all(len(step) == 3 for step in tops)
    for step, chosen in zip(tops, out["details"]["tokens"], strict=True):
        logprobs = [t["logprob"] for t in step]
        assert logprobs == sorted(logprobs, reverse=True)
        assert chosen["id"] == step[0]["id"]  # greedy picks the most likely


async def test_compat_route_answers_like_generate(client: AppClient) -> None:
    a = await generate(client, max_new_tokens=5)
    b = await generate(client, route="/", max_new_tokens=5)
    assert a["generated_text"] == b["generated_text"]


@pytest.mark.parametrize("route", ["/", "/generate"])
async def test_stream_true_answers_with_sse(client: AppClient, route: str) -> None:
    body = {"inputs": "Hello", "parameters": {"max_new_tokens": 4}, "stream": True}
    r = await client.post(route, json=body)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = [json.loads(line[len("data: ") :]) for line in r.text.splitlines() if line.startswith("data: ")]
    assert [e["index"] for e in events] == [0, 1, 2, 3]
    assert events[-1]["details"]["generated_tokens"] == 4
    assert events[-1]["generated_text"] == "".join(e["token"]["text"] for e in events)


async def test_truncate_keeps_the_last_prompt_tokens(client: AppClient) -> None:
    out = await generate(client, inputs="abcdefghij", max_new_tokens=2, truncate=4, details=True)
    assert out["details"]["prompt_tokens"] == 4 and out["details"]["cropped_tokens"] == 6


async def test_long_prompt_is_cropped_to_the_window(client: AppClient) -> None:
    out = await generate(client, inputs="x" * 100, max_new_tokens=2, details=True)
    d = out["details"]
    assert d["prompt_tokens"] + d["cropped_tokens"] == 100 and d["cropped_tokens"] > 0


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"max_new_tokens": 51}, "parameters.max_new_tokens"),  # the server caps it at 50
        ({"stop": ["a", "b", "c"]}, "parameters.stop"),  # at most 2 here
        ({"top_n_tokens": 6}, "parameters.top_n_tokens"),  # at most 5 by default
        ({"watermark": True}, "parameters.watermark"),
        ({"decoder_input_details": True}, "parameters.decoder_input_details"),
        ({"best_of": 2}, "parameters.best_of"),
        ({"grammar": {"type": "json", "value": {}}}, "parameters.grammar"),
        ({"stop": [""]}, "parameters.stop"),
        ({"frobnicate": 1}, "parameters.frobnicate"),
    ],
)
async def test_server_limits_and_unsupported_parameters_are_422(
    client: AppClient, params: dict, field: str
) -> None:
    r = await client.post("/generate", json={"inputs": "Hello", "parameters": params})
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert error["param"] == field and field.split(".")[-1] in error["message"]


async def test_neutral_values_of_unsupported_parameters_are_accepted(client: AppClient) -> None:
    # What huggingface_hub's InferenceClient sends by default.
    await generate(client, max_new_tokens=2, watermark=False, decoder_input_details=False, best_of=None,
                   grammar=None, adapter_id=None)


async def test_tokenize_gives_ids_and_offsets(client: AppClient) -> None:
    r = await client.post("/tokenize", json={"inputs": "Hi, you"})
    assert r.status_code == 200
    tokens = r.json()
    assert "".join(t["text"] for t in tokens) == "Hi, you"
    assert [(t["start"], t["stop"]) for t in tokens] == [(i, i + 1) for i in range(7)]
    engine = client.app.state.engine
    assert [t["id"] for t in tokens] == engine.encode("Hi, you")


async def test_tokenize_rejects_unrepresentable_text(client: AppClient) -> None:
    r = await client.post("/tokenize", json={"inputs": "naïve"})
    assert r.status_code == 422
    assert r.json()["error"]["param"] == "inputs" and "ï" in r.json()["error"]["message"]


async def test_info_reports_model_and_limits(client: AppClient) -> None:
    info = (await client.get("/info")).json()
    assert info["model_id"] == "tiny-test" and info["window"] == 64
    assert info["max_new_tokens"] == 50 and info["max_stop_sequences"] == 2
    assert info["engine"]["model_config"]["n_layer"] == 2
    assert info["engine"]["provenance"] == {"note": "random weights for tests"}
    assert info["version"]


async def test_max_context_shrinks_the_window_and_the_kv_cache(tiny_checkpoint, client: AppClient) -> None:  # type: ignore[no-untyped-def]
    full = (await client.get("/info")).json()
    async with asgi_client(tiny_checkpoint, max_context=16) as small:
        info = (await small.get("/info")).json()
        assert info["window"] == 16 and full["window"] == 64
        assert info["engine"]["kv_cache_bytes"] * 4 == full["engine"]["kv_cache_bytes"]
        # A prompt longer than the window is cropped to it, as with the model's own window.
        r = await small.post("/generate", json={"inputs": "abcdefghij" * 3, "parameters": {
            "max_new_tokens": 2, "details": True}})
        assert r.status_code == 200 and r.json()["details"]["cropped_tokens"] > 0


async def test_openapi_documents_streaming_routes_as_event_stream(client: AppClient) -> None:
    spec = (await client.get("/openapi.json")).json()
    stream_200 = spec["paths"]["/generate_stream"]["post"]["responses"]["200"]["content"]
    assert list(stream_200) == ["text/event-stream"]
    assert "text/event-stream" in spec["paths"]["/generate"]["post"]["responses"]["200"]["content"]
    assert "422" in spec["paths"]["/generate"]["post"]["responses"]
