"""The native (TGI-shaped) API in-process: /generate, POST /, /tokenize, /info and their limits."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from tests.server.asgi import AppClient, asgi_client

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


async def test_greedy_unless_do_sample_or_a_warper_asks_for_sampling(client: AppClient) -> None:
    # TGI's rule (NextTokenChooser: `do_sample or has_warpers`): neutral values stay greedy...
    greedy = [
        generate(client, max_new_tokens=8, details=True),
        generate(client, max_new_tokens=8, do_sample=False, temperature=1.0, top_p=1.0, details=True),
        generate(client, max_new_tokens=8, temperature=0.0, details=True),
        generate(client, max_new_tokens=8, do_sample=True, temperature=0.0, details=True),
    ]
    # ... and a warper samples even with do_sample false (the seed is then reported).
    sampled = [
        generate(client, max_new_tokens=8, do_sample=False, temperature=1.5, seed=s, details=True)
        for s in range(4)
    ] + [generate(client, max_new_tokens=8, top_k=5, seed=s, details=True) for s in range(4)]
    outs = await asyncio.gather(*greedy, *sampled)
    assert len({o["generated_text"] for o in outs[:4]}) == 1
    assert all(o["details"]["seed"] is None for o in outs[:4])
    assert all(o["details"]["seed"] is not None for o in outs[4:])
    assert len({o["generated_text"] for o in outs[4:]}) > 1


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


async def test_stop_sequence_ends_generation_and_stays_in_the_text(client: AppClient) -> None:
    greedy = (await generate(client, max_new_tokens=20))["generated_text"]
    stop = greedy[3:5]  # greedy output is deterministic: this string will appear at position 3
    end = greedy.index(stop) + len(stop)
    out = await generate(client, max_new_tokens=20, stop=[stop], details=True)
    # TGI's generated_text ends with the stop sequence; every token keeps its own text.
    assert out["details"]["finish_reason"] == "stop_sequence"
    assert out["generated_text"] == greedy[:end]
    assert [t["text"] for t in out["details"]["tokens"]] == list(greedy[:end])  # char model
    body = {"inputs": "Hello", "parameters": {"max_new_tokens": 20, "stop": [stop]}, "stream": True}
    events = sse_data((await client.post("/generate_stream", json=body)).text)
    assert [e["token"]["text"] for e in events] == list(greedy[:end])
    assert events[-1]["generated_text"] == greedy[:end]


async def test_top_n_tokens_lists_alternatives(client: AppClient) -> None:
    out = await generate(client, max_new_tokens=3, top_n_tokens=3, details=True)
    tops = out["details"]["top_tokens"]
    assert len(tops) == 3 and all(len(step) == 3 for step in tops)
    for step, chosen in zip(tops, out["details"]["tokens"], strict=True):
        logprobs = [t["logprob"] for t in step]
        assert logprobs == sorted(logprobs, reverse=True)
        assert chosen["id"] == step[0]["id"]  # greedy picks the most likely


async def test_compat_route_answers_a_one_element_list(client: AppClient) -> None:
    # TGI's POST / answers [GenerateResponse]; its Python client reads `payload[0]`.
    a = await generate(client, max_new_tokens=5, details=True)
    b = await generate(client, route="/", max_new_tokens=5, details=True)
    assert isinstance(b, list) and len(b) == 1
    assert a["generated_text"] == b[0]["generated_text"] and b[0]["details"]["generated_tokens"] == 5


def sse_data(text: str) -> list[dict]:  # type: ignore[type-arg]
    return [json.loads(line[len("data: ") :]) for line in text.splitlines() if line.startswith("data: ")]


@pytest.mark.parametrize("route", ["/", "/generate"])
async def test_stream_true_answers_with_sse(client: AppClient, route: str) -> None:
    body = {"inputs": "Hello", "parameters": {"max_new_tokens": 4}, "stream": True}
    r = await client.post(route, json=body)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_data(r.text)
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
        ({"best_of": 2}, "best_of"),  # greedy: TGI requires sampling for best_of > 1
        ({"grammar": {"type": "yaml", "value": {}}}, "parameters.grammar"),
        ({"stop": [""]}, "parameters.stop"),
        ({"frobnicate": 1}, "parameters.frobnicate"),
    ],
)
async def test_server_limits_and_unsupported_parameters_are_422(
    client: AppClient, params: dict, field: str
) -> None:
    for route in ("/generate", "/generate_stream", "/"):
        r = await client.post(route, json={"inputs": "Hello", "parameters": params})
        assert r.status_code == 422, r.text
        # TGI's error shape, which its clients map to their ValidationError.
        assert set(r.json()) == {"error", "error_type"} and r.json()["error_type"] == "validation"
        assert field in r.json()["error"]


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


async def test_tokenize_applies_truncate_and_validates_parameters(client: AppClient) -> None:
    r = await client.post("/tokenize", json={"inputs": "Hi, you", "parameters": {"truncate": 3}})
    assert r.status_code == 200, r.text
    assert [(t["text"], t["start"], t["stop"]) for t in r.json()] == [("y", 4, 5), ("o", 5, 6), ("u", 6, 7)]
    r = await client.post("/tokenize", json={"inputs": "Hi", "parameters": {"truncate": 0}})
    assert r.status_code == 422 and r.json()["error_type"] == "validation" and "truncate" in r.json()["error"]


async def test_tokenize_rejects_unrepresentable_text(client: AppClient) -> None:
    r = await client.post("/tokenize", json={"inputs": "naïve"})
    assert r.status_code == 422
    error = r.json()
    assert error["error_type"] == "validation" and "ï" in error["error"] and "inputs" in error["error"]


async def test_info_reports_model_and_limits(client: AppClient) -> None:
    info = (await client.get("/info")).json()
    assert info["model_id"] == "tiny-test" and info["window"] == 64
    # TGI's limits, true for this model: the window bounds what the model reads.
    assert info["max_input_tokens"] == 63 and info["max_total_tokens"] == 64
    assert info["max_prompt_tokens"] == 32768  # the cap before cropping (an extension)
    tgi_fields = {"model_id", "model_sha", "model_pipeline_tag", "max_concurrent_requests", "max_best_of",
                  "max_stop_sequences", "max_input_tokens", "max_total_tokens", "validation_workers",
                  "max_client_batch_size", "router", "version", "sha", "docker_label"}
    assert tgi_fields <= set(info)
    assert info["max_new_tokens"] == 50 and info["max_stop_sequences"] == 2
    assert info["engine"]["model_config"]["n_layer"] == 2
    assert info["engine"]["provenance"] == {"note": "random weights for tests"}
    assert info["version"]


async def test_max_context_shrinks_the_window_and_the_kv_cache(tiny_checkpoint, client: AppClient) -> None:  # type: ignore[no-untyped-def]
    full = (await client.get("/info")).json()
    async with asgi_client(tiny_checkpoint, max_context=16) as small:
        info = (await small.get("/info")).json()
        assert info["window"] == 16 and full["window"] == 64
        assert info["max_input_tokens"] == 15 and info["max_total_tokens"] == 16
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
    errors = spec["paths"]["/generate"]["post"]["responses"]
    assert errors["422"]["content"]["application/json"]["schema"]["$ref"].endswith("/TGIErrorResponse")
    assert "424" in errors and "429" in errors
