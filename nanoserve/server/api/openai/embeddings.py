"""`POST /v1/embeddings`: OpenAI's embeddings route (also llama.cpp's and vLLM's shape).

The route validates and tokenizes; the engine computes (nanoserve/engine/embeddings.py: mean-pooled
final hidden states, L2-normalised, on the engine thread between generation steps). A request
waits in the engine like a generation: refused with 429 when the queue, or the client's share of
it, is full, and 503 while the server drains.
"""

from __future__ import annotations

import asyncio
import base64
from typing import TYPE_CHECKING, Any, Literal

import torch
from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic_core import PydanticCustomError, to_json

from nanoserve.engine.embeddings import EmbeddingFailed, EmbeddingJob
from nanoserve.engine.types import InvalidRequest
from nanoserve.model.checkpoint import load_checkpoint
from nanoserve.model.gpt import GPT
from nanoserve.server.deps import EngineDep, SettingsDep
from nanoserve.server.http.access_log import record_of
from nanoserve.server.http.errors import APIError
from nanoserve.server.settings import Settings
from nanoserve.server.streaming.clients import client_id
from nanoserve.server.streaming.encoding import INLINE_ENCODE_CHARS, check_prompt_chars, prompt_too_long

if TYPE_CHECKING:
    from nanoserve.engine.engine import Engine

router = APIRouter(prefix="/v1", tags=["OpenAI-compatible"])

MAX_INPUTS = 2048  # inputs in one request: OpenAI's own limit

InputField = str | list[str] | list[int] | list[list[int]]


def _input_error(message: str) -> PydanticCustomError:
    return PydanticCustomError("invalid_input", message)


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    input: InputField = Field(
        description=f"A text, a list of texts, a list of token ids, or a list of lists of token ids "
        f"(at most {MAX_INPUTS} inputs, each at most the server's prompt limit and the model's context)."
    )
    model: str | None = Field(
        None, max_length=256,
        description="Not used to choose: the served model answers (as on the other routes).",
    )
    encoding_format: Literal["float", "base64"] | None = Field(
        None, description='"float" (the default): lists of numbers; "base64": each vector\'s '
        "little-endian float32 bytes, base64-encoded (what the openai SDK asks for by default)."
    )
    dimensions: int | None = Field(
        None, ge=1, description="The model's width only (its embeddings cannot be shortened: the model "
        "was not trained for it); any other value is a 400."
    )
    user: str | None = Field(None, max_length=256, description="Accepted for compatibility and ignored.")

    @field_validator("input", mode="before")
    @classmethod
    def _one_of_four_shapes(cls, v: Any) -> Any:
        """Clear messages for the four shapes, before the union's (which lists every branch)."""
        if isinstance(v, str):
            return v
        if not isinstance(v, list):
            raise _input_error("must be a string, a list of strings, a list of token ids or a list "
                               "of lists of token ids")
        if not v:
            raise _input_error("must not be empty")
        if len(v) > MAX_INPUTS:
            raise _input_error(f"has {len(v)} inputs, more than this server's limit of {MAX_INPUTS}")
        if all(isinstance(x, str) for x in v) or all(_is_id(x) for x in v):
            return v
        if all(isinstance(x, list) and all(_is_id(t) for t in x) for x in v):
            return v
        raise _input_error("a list must hold only strings, only token ids, or only lists of token ids")

    def inputs(self) -> list[str | list[int]]:
        """Every input: a text or a list of token ids."""
        v: Any = self.input
        if isinstance(v, str):
            return [v]
        if all(isinstance(x, int) for x in v):
            return [list(v)]
        return list(v)


def _is_id(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


class Embedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str = Field(description="The vector, or its float32 bytes in base64.")


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingList(BaseModel):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage


@router.post("/embeddings", response_model=EmbeddingList)
async def embeddings(body: EmbeddingRequest, request: Request, engine: EngineDep,
                     settings: SettingsDep) -> Response:
    """Embeddings of texts or token ids: the final hidden states, mean-pooled and L2-normalised."""
    emb = engine.embeddings
    if body.dimensions is not None and body.dimensions != emb.width:
        raise APIError(400, f"dimensions is {body.dimensions}: this model's embeddings have {emb.width} "
                       "dimensions and cannot be shortened", code="unsupported_dimensions",
                       param="dimensions")
    client = client_id(request)
    engine.check_admission(client)  # a full queue or a draining server refuses before any work
    ids = await _token_ids(request, engine, body.inputs(), min(settings.max_prompt_tokens, emb.max_tokens))
    if emb.needs_model:
        await asyncio.to_thread(emb.load_model, lambda: _load_weights(engine, settings))
    job = EmbeddingJob(ids, client, asyncio.get_running_loop())
    emb.submit(job, engine.config.max_queue, engine.config.client_queue_share())
    tokens = sum(len(x) for x in ids)
    record_of(request).started(tokens, 0)  # the access log's prompt tokens
    vectors = await _vectors(request, job)
    model = engine.checkpoint.name
    base64_format = body.encoding_format == "base64"
    # A large batch's JSON takes a while to build: off the event loop.
    content = await asyncio.to_thread(_render, vectors, model, tokens, base64_format)
    return Response(content, media_type="application/json")


async def _vectors(request: Request, job: EmbeddingJob) -> torch.Tensor:
    """The job's vectors. A client that goes away cancels it: the engine skips its other inputs."""
    gone: asyncio.Future[None] = asyncio.ensure_future(_disconnected(request))
    either: set[asyncio.Future[Any]] = {job.future, gone}
    try:
        await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        job.future.cancel()  # no-op once it has its result
    if job.future.cancelled():
        raise APIError(499, "client disconnected", code="client_disconnected")
    try:
        return job.future.result()
    except EmbeddingFailed as e:
        raise APIError(500, str(e), code="embedding_error") from None


async def _disconnected(request: Request) -> None:
    # After the body is read, the next ASGI message can only be the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _token_ids(request: Request, engine: Engine, inputs: list[str | list[int]],
                     limit: int) -> list[list[int]]:
    """Each input's token ids, checked against `limit` and the vocabulary (400 naming the input);
    texts are encoded together, off the event loop unless short."""
    param = ["input" if len(inputs) == 1 else f"input[{i}]" for i in range(len(inputs))]
    vocab = engine.tokenizer.vocab_size
    texts: dict[int, str] = {}
    for i, x in enumerate(inputs):
        if not x:
            raise APIError(400, f"{param[i]} is empty: an embedding needs at least one token",
                           code="empty_input", param=param[i])
        if isinstance(x, str):
            check_prompt_chars(engine, x, limit, param[i])
            texts[i] = x
        elif (bad := next((t for t in x if not 0 <= t < vocab), None)) is not None:
            raise APIError(400, f"{param[i]}: token id {bad} is not in this model's vocabulary [0, {vocab})",
                           code="invalid_token_id", param=param[i])

    def encode_texts() -> dict[int, list[int]]:
        out = {}
        for i, text in texts.items():
            try:
                out[i] = engine.encode(text)
            except InvalidRequest as exc:
                exc.param = param[i]
                raise
        return out

    chars = sum(len(text) for text in texts.values())
    encoded = encode_texts() if chars <= INLINE_ENCODE_CHARS else (
        await request.app.state.encode_queue.run(encode_texts, chars))
    ids = [encoded[i] if isinstance(x, str) else x for i, x in enumerate(inputs)]
    for i, x in enumerate(ids):
        if not x:  # a text the tokenizer turns into nothing
            raise APIError(400, f"{param[i]} has no tokens", code="empty_input", param=param[i])
        if len(x) > limit:
            raise prompt_too_long(len(x), limit, param[i])
    return ids


def _load_weights(engine: Engine, settings: Settings) -> GPT:
    """The served checkpoint's weights again, for torch (the native backend released them)."""
    checkpoint = load_checkpoint(settings.checkpoint)
    if checkpoint.config != engine.checkpoint.config or checkpoint.name != engine.checkpoint.name:
        raise APIError(500, f"embeddings need the served model's weights, and {settings.checkpoint} "
                       "holds another model", code="embedding_error")
    return checkpoint.build_model(engine.device, engine.config.torch_dtype)


def _render(vectors: torch.Tensor, model: str, tokens: int, base64_format: bool) -> bytes:
    data: list[dict[str, Any]] = []
    if base64_format:
        raw = vectors.numpy().astype("<f4", copy=False)  # little-endian float32, as OpenAI sends
        embedded: list[Any] = [base64.b64encode(row.tobytes()).decode("ascii") for row in raw]
    else:
        embedded = vectors.tolist()
    for i, e in enumerate(embedded):
        data.append({"object": "embedding", "index": i, "embedding": e})
    usage = {"prompt_tokens": tokens, "total_tokens": tokens}
    return to_json({"object": "list", "data": data, "model": model, "usage": usage})
