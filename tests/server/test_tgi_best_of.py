"""TGI's best_of: several sequences of one prompt, the best answered and the rest in
details.best_of_sequences, under TGI's validation rules."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio

from tests.conftest import require_module
from tests.server.asgi import AppClient, asgi_client
from tests.server.conftest import OPENAI_API_KEY
from tests.server.server import ServerProcess

ASYNC = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def client(tiny_checkpoint) -> AsyncIterator[AppClient]:  # type: ignore[no-untyped-def]
    async with asgi_client(tiny_checkpoint, max_seqs=3) as c:
        yield c


async def _generate(client: AppClient, **params: Any) -> dict[str, Any]:
    r = await client.post("/generate", json={"inputs": "Hello", "parameters": params})
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def _mean_logprob(tokens: list[dict[str, Any]]) -> float:
    return sum(t["logprob"] for t in tokens) / len(tokens)


@ASYNC
async def test_best_of_answers_the_best_and_lists_the_others(client: AppClient) -> None:
    out = await _generate(client, best_of=3, do_sample=True, max_new_tokens=8, details=True)
    details = out["details"]
    others = details["best_of_sequences"]
    assert len(others) == 2
    best = _mean_logprob(details["tokens"])
    assert all(best >= _mean_logprob(o["tokens"]) for o in others)
    # The three sequences drew with consecutive seeds; each is what its seed draws alone.
    seeds = sorted([details["seed"], *(o["seed"] for o in others)])
    assert seeds == [seeds[0], seeds[0] + 1, seeds[0] + 2]
    by_seed = {details["seed"]: out["generated_text"], **{o["seed"]: o["generated_text"] for o in others}}
    for seed, text in by_seed.items():
        alone = await _generate(client, do_sample=True, seed=seed, max_new_tokens=8)
        assert alone["generated_text"] == text
    for other in others:
        assert set(other) == {
            "generated_text",
            "finish_reason",
            "generated_tokens",
            "seed",
            "prefill",
            "tokens",
            "top_tokens",
        }
        assert other["generated_tokens"] == len(other["tokens"])


@ASYNC
async def test_best_of_without_details_is_one_text(client: AppClient) -> None:
    out = await _generate(client, best_of=2, temperature=0.8, max_new_tokens=4)
    assert out.get("details") is None and isinstance(out["generated_text"], str)


@ASYNC
async def test_best_of_one_has_no_sequences(client: AppClient) -> None:
    out = await _generate(client, best_of=1, max_new_tokens=2, details=True)
    assert out["details"]["best_of_sequences"] is None


@ASYNC
@pytest.mark.parametrize(
    ("params", "route", "says"),
    [
        ({"best_of": 2}, "/generate", "you must use sampling when `best_of` is > 1"),
        (
            {"best_of": 2, "do_sample": True, "seed": 1},
            "/generate",
            "`seed` must not be set when `best_of` > 1",
        ),
        (
            {"best_of": 2, "do_sample": True},
            "/generate_stream",
            "`best_of` != 1 is not supported when streaming tokens",
        ),
        ({"best_of": 4, "do_sample": True}, "/generate", "`best_of` must be > 0 and <= 3. Given: 4"),
    ],
)
async def test_tgi_best_of_rules(client: AppClient, params: dict[str, Any], route: str, says: str) -> None:
    r = await client.post(route, json={"inputs": "Hello", "parameters": params})
    assert r.status_code == 422, r.text
    body = r.json()
    assert body["error_type"] == "validation"
    assert body["error"] == f"parameters.best_of: {says}"  # TGI's words, after the field's name


@ASYNC
async def test_info_reports_max_best_of(client: AppClient) -> None:
    assert (await client.get("/info")).json()["max_best_of"] == 3


def test_the_tgi_clients_read_best_of_sequences(openai_server: ServerProcess) -> None:
    """huggingface_hub's InferenceClient and TGI's own client, unmodified, get best_of's answer."""
    from huggingface_hub import InferenceClient
    from huggingface_hub.errors import ValidationError

    hub = InferenceClient(model=openai_server.base_url, api_key=OPENAI_API_KEY, timeout=30)
    out = hub.text_generation("Hello", max_new_tokens=4, best_of=2, do_sample=True, details=True)
    assert out.details is not None and out.details.best_of_sequences is not None
    (other,) = out.details.best_of_sequences
    assert other.generated_tokens == len(other.tokens) and other.seed is not None
    assert out.details.seed is not None and abs(other.seed - out.details.seed) == 1  # consecutive seeds
    with pytest.raises(ValidationError, match="you must use sampling"):
        hub.text_generation("Hello", max_new_tokens=2, best_of=2, details=True)
    require_module("text_generation")
    from text_generation import Client

    tgi = Client(openai_server.base_url, headers={"Authorization": f"Bearer {OPENAI_API_KEY}"}, timeout=30)
    answer = tgi.generate("Hello", max_new_tokens=4, best_of=2, do_sample=True)
    assert answer.details is not None and answer.details.best_of_sequences is not None
    assert len(answer.details.best_of_sequences) == 1
