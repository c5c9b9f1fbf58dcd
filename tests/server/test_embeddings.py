"""`POST /v1/embeddings` through the official `openai` client against a real server (the native
backend where it is built: embeddings then load torch weights of their own), and in-process on
the torch backend. Vectors are checked against the model's own mean-pooled final hidden states
computed here, so the route is shown to return the model's embedding, not merely a vector."""

from __future__ import annotations

import asyncio
import contextlib
import io
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch
import torch.nn.functional as F
from pydantic import SecretStr

from nanoserve.engine.embeddings import EmbeddingJob
from nanoserve.model.checkpoint import Checkpoint, load_checkpoint
from nanoserve.model.config import GPTConfig
from nanoserve.model.gpt import GPT
from nanoserve.server.api.openai.embeddings import MAX_INPUTS
from tests.conftest import require_module
from tests.server.asgi import asgi_client
from tests.server.conftest import OPENAI_API_KEY
from tests.server.doc_text import blocks
from tests.server.server import ServerProcess

TEXTS = ["The quick brown fox", "jumps over", "the lazy dog."]


@pytest.fixture(scope="module")
def reference(tiny_checkpoint: Path) -> Iterator[tuple[Checkpoint, GPT]]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the test process shares the cores with the server
    checkpoint = load_checkpoint(tiny_checkpoint)
    yield checkpoint, checkpoint.build_model("cpu")
    torch.set_num_threads(threads)


def pooled(reference: tuple[Checkpoint, GPT], text: str | list[int]) -> torch.Tensor:
    """The embedding as defined: the mean over positions of the final norm's output, normalised,
    taken from the model's own forward (a hook on the norm), not from the method the server uses."""
    checkpoint, model = reference
    ids = checkpoint.tokenizer.encode(text) if isinstance(text, str) else text
    seen: list[torch.Tensor] = []
    hook = model.ln_f.register_forward_hook(lambda _module, _args, out: seen.append(out))
    try:
        with torch.inference_mode():
            model(torch.tensor([ids]))
    finally:
        hook.remove()
    return F.normalize(seen[0][0].mean(dim=0), dim=0)  # (T, C) -> (C,)


def as_tensor(vectors: list[Any]) -> torch.Tensor:
    return torch.tensor([list(v) for v in vectors], dtype=torch.float32)


def test_float_embeddings_are_the_models_pooled_hidden_states(
    openai_client: openai.OpenAI, reference: tuple[Checkpoint, GPT]
) -> None:
    checkpoint = reference[0]
    resp = openai_client.embeddings.create(model="anything", input=TEXTS, encoding_format="float")
    assert resp.object == "list" and resp.model == checkpoint.name
    assert [d.index for d in resp.data] == [0, 1, 2]
    assert all(d.object == "embedding" and len(d.embedding) == checkpoint.config.n_embd for d in resp.data)
    tokens = sum(len(checkpoint.tokenizer.encode(t)) for t in TEXTS)
    assert resp.usage.prompt_tokens == resp.usage.total_tokens == tokens
    got = as_tensor([d.embedding for d in resp.data])
    want = torch.stack([pooled(reference, t) for t in TEXTS])
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got.norm(dim=1), torch.ones(3), rtol=0, atol=1e-5)


def test_base64_the_sdk_default_decodes_to_the_same_vectors(openai_client: openai.OpenAI) -> None:
    # Without encoding_format the SDK asks for base64 and decodes the float32 bytes itself.
    b64 = openai_client.embeddings.create(model="m", input=TEXTS)
    floats = openai_client.embeddings.create(model="m", input=TEXTS, encoding_format="float")
    assert torch.equal(as_tensor([d.embedding for d in b64.data]),
                       as_tensor([d.embedding for d in floats.data]))
    raw = httpx.post(openai_client.base_url.join("embeddings").__str__(),
                     headers={"Authorization": f"Bearer {OPENAI_API_KEY}"},
                     json={"input": "hi", "encoding_format": "base64"}, timeout=60).json()
    assert isinstance(raw["data"][0]["embedding"], str)


def test_the_same_text_gives_the_same_bits_alone_or_in_a_batch(
    openai_client: openai.OpenAI, reference: tuple[Checkpoint, GPT]
) -> None:
    alone = openai_client.embeddings.create(model="m", input="jumps over", encoding_format="float")
    batch = openai_client.embeddings.create(model="m", input=["a", "jumps over", "b c", "jumps over"],
                                            encoding_format="float")
    assert alone.data[0].embedding == batch.data[1].embedding == batch.data[3].embedding
    assert batch.data[0].embedding != batch.data[1].embedding
    # Token ids embed as the text they encode.
    ids = reference[0].tokenizer.encode("jumps over")
    by_ids = openai_client.embeddings.create(model="m", input=[ids, ids[:3]], encoding_format="float")
    assert by_ids.data[0].embedding == alone.data[0].embedding
    assert by_ids.usage.prompt_tokens == len(ids) + 3
    torch.testing.assert_close(as_tensor([by_ids.data[1].embedding])[0], pooled(reference, ids[:3]),
                               rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(("request_kwargs", "param"), [
    ({"input": []}, "input"),
    ({"input": ""}, "input"),
    ({"input": ["ok", ""]}, "input[1]"),
    ({"input": [[1, 2], []]}, "input[1]"),
    ({"input": [1, "a"]}, "input"),
    ({"input": [-1]}, "input"),
    ({"input": [10**6]}, "input"),
    ({"input": "x" * 10_000}, "input"),
    ({"input": ["x"] * (MAX_INPUTS + 1)}, "input"),
    ({"input": "x", "dimensions": 7}, "dimensions"),
    ({"input": "x", "encoding_format": "binary"}, "encoding_format"),
])
def test_bad_input_is_a_400_naming_the_field(openai_client: openai.OpenAI, request_kwargs: dict[str, Any],
                                             param: str) -> None:
    kwargs = {"model": "m", "encoding_format": "float", **request_kwargs}
    with pytest.raises(openai.BadRequestError) as err:
        openai_client.embeddings.create(**kwargs)
    assert err.value.status_code == 400
    body: Any = err.value.body
    assert body["param"] == param, body
    assert param.split("[")[0] in body["message"]


def test_the_models_own_width_is_accepted_as_dimensions(openai_client: openai.OpenAI,
                                                        reference: tuple[Checkpoint, GPT]) -> None:
    width = reference[0].config.n_embd
    resp = openai_client.embeddings.create(model="m", input="x", dimensions=width, user="u1",
                                           encoding_format="float")
    assert len(resp.data[0].embedding) == width


def test_a_full_batch_through_the_sdk(openai_client: openai.OpenAI) -> None:
    resp = openai_client.embeddings.create(model="m", input=["abcdefghij" * 6] * MAX_INPUTS)
    assert len(resp.data) == MAX_INPUTS and resp.data[0].embedding == resp.data[-1].embedding
    assert resp.usage.prompt_tokens == 60 * MAX_INPUTS


async def test_a_large_batch_leaves_the_loop_and_generation_running(tiny_checkpoint: Path) -> None:
    """The engine thread computes a batch one slice per step: while it is under way /health
    answers, and a generation runs to its end (it needs a few steps, the batch over a thousand);
    the waiting embedding request counts against the queue."""
    async with asgi_client(tiny_checkpoint, max_queue=1) as client:
        engine = client.app.state.engine
        embedding = asyncio.create_task(
            client.post("/v1/embeddings", json={"input": ["abcdefghij" * 6] * MAX_INPUTS}))
        for _ in range(3000):  # until the engine holds the job (bounded: at most 30 s)
            if engine.embeddings.unfinished or embedding.done():
                break
            await asyncio.sleep(0.01)
        assert engine.embeddings.unfinished == 1
        assert (await client.get("/health")).status_code == 200
        refused = await client.post("/v1/embeddings", json={"input": "x"})  # the queue (1) is full
        assert refused.status_code == 429 and refused.json()["error"]["code"] == "overloaded"
        assert int(refused.headers["retry-after"]) >= 1
        r = await client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 4})
        assert r.status_code == 200, r.text
        assert not embedding.done() and engine.embeddings.unfinished == 1
        r = await embedding
        assert r.status_code == 200 and len(r.json()["data"]) == MAX_INPUTS

        # A job whose request went away (its future cancelled) is dropped at its next turn.
        job = EmbeddingJob([[1, 2, 3]] * MAX_INPUTS, None, asyncio.get_running_loop())
        engine.embeddings.submit(job, max_waiting=1, client_share=1)
        for _ in range(3000):
            if job.vectors:
                break
            await asyncio.sleep(0.01)
        job.future.cancel()
        for _ in range(3000):
            if not engine.embeddings.unfinished:
                break
            await asyncio.sleep(0.01)
        assert engine.embeddings.unfinished == 0 and 0 < len(job.vectors) < MAX_INPUTS


async def test_torch_backend_embeds_with_the_served_model(
    tiny_checkpoint: Path, reference: tuple[Checkpoint, GPT]
) -> None:
    async with asgi_client(tiny_checkpoint, backend="torch") as client:
        r = await client.post("/v1/embeddings", json={"input": TEXTS, "model": "m"})
        assert r.status_code == 200, r.text
        got = as_tensor([d["embedding"] for d in r.json()["data"]])
        assert client.app.state.engine.embeddings.model is client.app.state.engine.model
    torch.testing.assert_close(got, torch.stack([pooled(reference, t) for t in TEXTS]), rtol=1e-4, atol=1e-5)


def test_the_docs_example_runs(openai_server: ServerProcess) -> None:
    api = (Path(__file__).resolve().parents[2] / "docs" / "api.md").read_text(encoding="utf-8")
    section = api.split("\n### Embeddings\n", 1)[1].split("\n## ", 1)[0]
    code = blocks(section, "python")[0]
    code = code.replace("http://127.0.0.1:8000/v1", openai_server.base_url + "/v1")
    code = code.replace("unused-unless-the-server-sets-keys", OPENAI_API_KEY)
    assert openai_server.base_url in code and OPENAI_API_KEY in code
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(code, "docs/api.md", "exec"), {})  # our own doc's example
    width, cosine = printed.getvalue().split()
    assert int(width) > 0 and -1.0 <= float(cosine) <= 1.0 + 1e-6


def test_a_client_that_goes_away_cancels_its_batch(openai_server: ServerProcess,
                                                   openai_client: openai.OpenAI) -> None:
    headers = {"Authorization": f"Bearer {OPENAI_API_KEY}"}
    big = {"input": ["abcdefghij" * 6] * MAX_INPUTS, "encoding_format": "float"}
    with httpx.Client(base_url=openai_server.base_url, headers=headers, timeout=0.3) as http, \
            pytest.raises(httpx.ReadTimeout):
        http.post("/v1/embeddings", json=big)  # gives up and closes the socket
    for _ in range(300):  # bounded: at most 30 s
        if "route=/v1/embeddings status=499" in openai_server.logs():
            break
        time.sleep(0.1)
    assert "route=/v1/embeddings status=499" in openai_server.logs(), openai_server.logs()[-3000:]
    assert "Traceback" not in openai_server.logs()
    assert len(openai_client.embeddings.create(model="m", input="still serving").data) == 1


@pytest.mark.parametrize("family", [
    {},
    {"norm": "rmsnorm", "mlp": "swiglu", "positions": "rope", "n_kv_head": 2, "tie_embeddings": False},
])
def test_hidden_states_are_what_the_output_layer_reads(family: dict[str, Any]) -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=40, block_size=16, n_layer=2, n_head=4, n_embd=32, **family)).eval()
    idx = torch.randint(0, 40, (2, 9))
    with torch.inference_mode():
        torch.testing.assert_close(model.lm_head(model.hidden_states(idx)), model(idx), rtol=0, atol=0)


@pytest.mark.parametrize("drain_s", [30.0, 0.0])
async def test_shutdown_drains_or_ends_accepted_embedding_requests(tiny_checkpoint: Path,
                                                                   drain_s: float) -> None:
    """Draining waits for an accepted embeddings request like a generation; one still running when
    the drain time is up ends with a 503, never a hang."""
    async with asgi_client(tiny_checkpoint) as client:
        engine = client.app.state.engine
        embedding = asyncio.create_task(
            client.post("/v1/embeddings", json={"input": ["abcdefghij" * 6] * 512}))
        for _ in range(3000):
            if engine.embeddings.unfinished or embedding.done():
                break
            await asyncio.sleep(0.01)
        assert engine.embeddings.unfinished == 1
        await engine.shutdown(drain_s)
        r = await asyncio.wait_for(embedding, 30)
        assert r.status_code == (200 if drain_s else 503), r.text
        late = await client.post("/v1/embeddings", json={"input": "x"})
        assert late.status_code == 503


def test_langchain_openai_embeddings(openai_server: ServerProcess, reference: tuple[Checkpoint, GPT]) -> None:
    """LangChain's OpenAIEmbeddings, as a RAG pipeline builds it (texts sent as text: its default
    turns them into tiktoken's ids for OpenAI's models, which are not this model's)."""
    require_module("langchain_openai")
    from langchain_openai import OpenAIEmbeddings

    embedder = OpenAIEmbeddings(model="any", base_url=openai_server.base_url + "/v1",
                                api_key=SecretStr(OPENAI_API_KEY), check_embedding_ctx_length=False,
                                max_retries=0)
    docs = embedder.embed_documents(TEXTS)
    query = embedder.embed_query(TEXTS[1])
    want = torch.stack([pooled(reference, t) for t in TEXTS])
    torch.testing.assert_close(as_tensor(docs), want, rtol=1e-4, atol=1e-5)
    assert query == docs[1]
