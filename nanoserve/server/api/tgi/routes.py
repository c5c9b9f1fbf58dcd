"""The TGI API, in text-generation-inference's shapes: /generate, /generate_stream, POST /,
/tokenize and /info. Routes validate, call the engine, and translate its token events."""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from nanoserve.engine.types import SamplingParams, TokenEvent, TopToken
from nanoserve.server.api.common import error_responses
from nanoserve.server.api.docs import sse_response_doc
from nanoserve.server.api.openai.schemas import MAX_PROMPTS
from nanoserve.server.api.structured import tgi_grammar
from nanoserve.server.api.tgi.schemas import (
    BestOfSequence,
    Details,
    GenerateParameters,
    GenerateRequest,
    GenerateResponse,
    Info,
    PrefillToken,
    SimpleToken,
    StreamDetails,
    StreamResponse,
    TGIErrorResponse,
    Token,
    TokenizeRequest,
)
from nanoserve.server.api.tgi.tokenize import spans_json
from nanoserve.server.deps import EngineDep, SettingsDep, server_version
from nanoserve.server.http.error_dialects import tgi_error_body
from nanoserve.server.http.errors import APIError
from nanoserve.server.settings import Settings
from nanoserve.server.streaming.encoding import check_prompt_chars, encode_off_loop, prompt_too_long
from nanoserve.server.streaming.generation import (
    Completed,
    check_limits,
    collect_all,
    sse_response,
    start_choices,
    start_generation,
)
from nanoserve.server.streaming.sse import sse_event

router = APIRouter(tags=["TGI"])

# Errors on these routes are in TGI's shape (nanoserve/server/http/error_dialects.py).
GENERATION_ERRORS = error_responses(401, 413, 415, 422, 424, 429, 500, 503, model=TGIErrorResponse)

_STREAM_DOC = sse_response_doc("One event per token; the last carries generated_text and details.",
                               StreamResponse)
# /generate and POST /: JSON, or with `stream: true` the same event stream as /generate_stream.
_JSON_OR_SSE: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "A GenerateResponse, or with `stream: true` StreamResponse events.",
        "content": {
            "application/json": {"schema": {"$ref": "#/components/schemas/GenerateResponse"}},
            **_STREAM_DOC[200]["content"],
        },
    }
}
# POST /: TGI answers a one-element list there.
_LIST_OR_SSE: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "A one-element list of GenerateResponse, or with `stream: true` StreamResponse "
        "events.",
        "content": {
            "application/json": {"schema": {"type": "array", "minItems": 1, "maxItems": 1,
                                            "items": {"$ref": "#/components/schemas/GenerateResponse"}}},
            **_STREAM_DOC[200]["content"],
        },
    }
}


def sampling_params(p: GenerateParameters, settings: Settings) -> SamplingParams:
    """TGI parameters -> the engine's, after the server's caps."""
    max_new = p.max_new_tokens or settings.default_max_new_tokens
    check_limits(
        settings,
        max_new_tokens=("parameters.max_new_tokens", max_new),
        stop=("parameters.stop", p.stop or []),
        top_n=("parameters.top_n_tokens", p.top_n_tokens or 0),
    )
    sample = p.sampling()
    return SamplingParams(
        max_new_tokens=max_new,
        temperature=(1.0 if p.temperature is None else p.temperature) if sample else 0.0,
        top_k=p.top_k if sample else None,
        top_p=p.top_p if sample else None,
        min_p=p.min_p if sample else None,
        typical_p=p.typical_p if sample else None,
        repetition_penalty=p.repetition_penalty,
        frequency_penalty=p.frequency_penalty or 0.0,
        presence_penalty=p.presence_penalty or 0.0,
        stop=tuple(p.stop or ()),
        keep_stop=True,  # TGI's generated_text ends with the stop sequence
        seed=p.seed,
        cache_salt=p.cache_salt,
        logprobs=True,  # TGI reports every token's logprob
        top_n_tokens=p.top_n_tokens or 0,
        truncate=p.truncate,
        grammar=tgi_grammar(p.grammar),
        grammar_param="parameters.grammar",
        # The prompt scored in its prefill, only where the answer shows it (details.prefill).
        echo=p.decoder_input_details and p.details,
        prompt_logprobs=0 if p.decoder_input_details and p.details else None,
    )


def _token(event: TokenEvent) -> Token:
    # A last event without a new token (e.g. a time budget ran out) still has to carry a token in
    # TGI's stream shape: it is marked special with id -1 and holds any held-back text.
    if event.token_id is None:
        return Token(id=-1, text=event.text, logprob=None, special=True)
    return Token(id=event.token_id, text=event.text, logprob=event.logprob, special=event.special)


def token_event_bytes(event: TokenEvent) -> bytes:
    """`sse_event(StreamResponse(index, token=_token(event)))` for a mid-stream token event, from a
    plain dict (same serializer, same bytes; tests compare the two): building the models was
    ~10% of the event loop's time while streaming to 32 clients."""
    token = {"id": event.token_id, "text": event.text, "logprob": event.logprob, "special": event.special}
    return sse_event({"index": event.index, "token": token, "top_tokens": None, "generated_text": None,
                      "details": None})


def _prefill(done: Completed) -> list[PrefillToken]:
    """details.prefill: the prompt's tokens (decoder_input_details), else empty."""
    prompt = done.events[0].prompt
    if prompt is None:
        return []
    return [PrefillToken(id=t.id, text=t.text, logprob=t.logprob) for t in prompt.tokens]


def _top(tops: Iterable[TopToken], special_id: int | None) -> list[Token]:
    return [Token(id=t.id, text=t.text, logprob=t.logprob, special=t.id == special_id) for t in tops]


MAX_BEST_OF = 16  # TGI's --max-best-of defaults to 2; each sequence holds one of max_seqs slots


def max_best_of(settings: Settings) -> int:
    return min(MAX_BEST_OF, settings.max_seqs)


def check_best_of(p: GenerateParameters, settings: Settings, streaming: bool) -> int:
    """The number of sequences to generate, after TGI's rules (router/src/validation.rs), in its
    words: best_of > 1 needs sampling asked for, no seed, and no streaming."""
    best_of = p.best_of or 1
    if best_of == 1:
        return 1
    cap = max_best_of(settings)

    def refuse(message: str) -> APIError:
        return APIError(422, message, code="invalid_best_of", param="parameters.best_of")

    if best_of > cap:
        raise refuse(f"`best_of` must be > 0 and <= {cap}. Given: {best_of}")
    asked = p.do_sample or any(v is not None for v in (p.temperature, p.top_k, p.top_p, p.typical_p))
    if not asked:
        raise refuse("you must use sampling when `best_of` is > 1")
    if p.seed is not None:
        raise refuse("`seed` must not be set when `best_of` > 1")
    if streaming:
        raise refuse("`best_of` != 1 is not supported when streaming tokens")
    return best_of


def check_stream_details(p: GenerateParameters) -> None:
    """TGI refuses prompt details on a stream (router/src/validation.rs), in its words."""
    if p.decoder_input_details:
        raise APIError(422, "`decoder_input_details` == true is not supported when streaming tokens",
                       code="invalid_decoder_input_details", param="parameters.decoder_input_details")


def best_sequence(dones: list[Completed]) -> int:
    """TGI's pick (router/src/infer): the highest mean token logprob, the first of equals."""

    def mean(done: Completed) -> float:
        lps = [e.logprob for e in done.tokens if e.logprob is not None]
        return sum(lps) / len(lps) if lps else float("-inf")

    scores = [mean(d) for d in dones]
    return scores.index(max(scores))


async def _generate_json(request: Request, engine: EngineDep, body: GenerateRequest) -> GenerateResponse:
    settings: Settings = request.app.state.settings
    p = body.parameters
    best_of = check_best_of(p, settings, streaming=False)
    params = sampling_params(p, settings)
    gens = await start_choices(request, engine, body.inputs, params, best_of)
    dones = await collect_all(request, gens)
    best = best_sequence(dones)
    done = dones[best]
    prefix = body.inputs if p.return_full_text else ""
    if not p.details:
        return GenerateResponse(generated_text=prefix + done.text)
    usage = done.final.usage
    assert usage is not None
    others = [_sequence(engine, p, prefix, d) for i, d in enumerate(dones) if i != best]
    seq = _sequence(engine, p, prefix, done)
    details = Details(
        finish_reason=seq.finish_reason, generated_tokens=seq.generated_tokens,
        prompt_tokens=usage.prompt_tokens, cropped_tokens=usage.cropped_tokens, seed=seq.seed,
        prefill=seq.prefill, tokens=seq.tokens, top_tokens=seq.top_tokens,
        best_of_sequences=others if best_of > 1 else None,
    )
    return GenerateResponse(generated_text=seq.generated_text, details=details)


def _sequence(engine: EngineDep, p: GenerateParameters, prefix: str, done: Completed) -> BestOfSequence:
    final, usage = done.final, done.final.usage
    assert final.finish_reason is not None and usage is not None
    eos = engine.tokenizer.eos_id
    return BestOfSequence(
        generated_text=prefix + done.text,
        finish_reason=final.finish_reason.value,  # type: ignore[arg-type]  # ERROR/CANCELLED raised
        generated_tokens=usage.generated_tokens,
        seed=usage.seed if p.sampling() else None,  # TGI: no seed for greedy
        prefill=_prefill(done),
        tokens=[_token(e) for e in done.tokens],
        top_tokens=[_top(e.top_tokens, eos) for e in done.tokens] if p.top_n_tokens else None,
    )


async def _generate_sse(request: Request, engine: EngineDep, body: GenerateRequest) -> Response:
    settings: Settings = request.app.state.settings
    check_best_of(body.parameters, settings, streaming=True)
    check_stream_details(body.parameters)
    params = sampling_params(body.parameters, settings)
    gen = await start_generation(request, engine, body.inputs, params)
    prefix = body.inputs if body.parameters.return_full_text else ""
    parts: list[str] = []
    eos = engine.tokenizer.eos_id
    with_top = bool(body.parameters.top_n_tokens)

    def render(event: TokenEvent) -> Iterable[bytes]:
        parts.append(event.text)
        if event.finish_reason is None and not with_top and event.token_id is not None:
            yield token_event_bytes(event)  # the common event, without building pydantic models
            return
        out = StreamResponse(
            index=event.index,
            token=_token(event),
            top_tokens=_top(event.top_tokens, eos) if with_top else None,
        )
        if event.finish_reason is not None and event.usage is not None:
            u = event.usage
            out.generated_text = prefix + "".join(parts)
            out.details = StreamDetails(
                finish_reason=event.finish_reason.value,  # type: ignore[arg-type]
                generated_tokens=u.generated_tokens, prompt_tokens=u.prompt_tokens,
                cropped_tokens=u.cropped_tokens, input_length=u.prompt_tokens,
                seed=u.seed if body.parameters.sampling() else None,
            )
        yield sse_event(out)

    return sse_response(gen, render, settings, error_event=tgi_sse_error)


def tgi_sse_error(message: str, code: str) -> bytes:
    """The event that ends a failed stream, as TGI sends it: `data: {"error", "error_type"}`."""
    return sse_event(tgi_error_body(500, message, code)[1])


@router.post("/generate", response_model=GenerateResponse,
             responses={**GENERATION_ERRORS, **_JSON_OR_SSE})
async def generate(request: Request, engine: EngineDep, body: GenerateRequest) -> Response | GenerateResponse:
    """Generate text for a prompt (TGI's /generate); `stream: true` answers with SSE instead."""
    if body.stream:
        return await _generate_sse(request, engine, body)
    return await _generate_json(request, engine, body)


@router.post(
    "/generate_stream",
    response_class=Response,
    responses={**GENERATION_ERRORS, **_STREAM_DOC},
)
async def generate_stream(request: Request, engine: EngineDep, body: GenerateRequest) -> Response:
    """Stream tokens as server-sent events; the last event carries generated_text and details."""
    return await _generate_sse(request, engine, body)


@router.post("/", response_model=list[GenerateResponse],
             responses={**GENERATION_ERRORS, **_LIST_OR_SSE})
async def compat_generate(
    request: Request, engine: EngineDep, body: GenerateRequest
) -> Response | list[GenerateResponse]:
    """TGI's compatibility route (clients pointed at the base URL): a one-element list of
    /generate's answer, as TGI sends it; SSE if `stream`."""
    if body.stream:
        return await _generate_sse(request, engine, body)
    return [await _generate_json(request, engine, body)]


@router.post("/tokenize", response_model=list[SimpleToken],
             responses=error_responses(401, 413, 415, 422, 429, 503, model=TGIErrorResponse))
async def tokenize(request: Request, engine: EngineDep, settings: SettingsDep,
                   body: TokenizeRequest) -> Response:
    """Split text into the model's tokens, with each token's character offsets in the input;
    `parameters.truncate` keeps the last N tokens (those the model would read)."""
    text, limit = body.inputs, settings.max_prompt_tokens
    truncate = body.parameters.truncate
    check_prompt_chars(engine, text, limit, "inputs")

    def spans() -> bytes:
        ids = engine.encode(text)
        if len(ids) > limit:
            raise prompt_too_long(len(ids), limit, "inputs")
        return spans_json(engine.tokenizer, text, ids, truncate)

    # Encoding, spans and JSON all off the event loop for a long text, bounded like any prompt's
    # encoding (nanoserve/server/streaming/encoding.py).
    body_bytes = await encode_off_loop(engine, request.app.state.encode_queue, text, spans, "inputs")
    return Response(body_bytes, media_type="application/json")


@router.get("/info", response_model=Info, responses=error_responses(401, 503, model=TGIErrorResponse))
async def info(request: Request, engine: EngineDep, settings: SettingsDep) -> Info:
    """The model (the X-Model header's, else the default), its checkpoint's provenance and version,
    every served model, the server's limits and version."""
    report = engine.info()
    served = {m.name: m for m in request.app.state.registry}
    this = served.get(engine.checkpoint.name)
    window = engine.window
    max_input = max(1, min(settings.max_prompt_tokens, window - 1))  # TGI: input < total
    return Info(
        model_id=str(report.get("model", engine.checkpoint.name)),
        model_sha=this.version.digest if this is not None else None,
        model_version=this.version.label() if this is not None else None,
        models=[m.describe() for m in served.values()],
        model_dtype=str(report.get("dtype", settings.dtype)),
        model_device_type=str(report.get("device", settings.device)),
        max_concurrent_requests=settings.max_seqs,
        max_waiting_requests=settings.max_queue,
        max_best_of=max_best_of(settings),
        max_stop_sequences=settings.max_stop_sequences,
        max_input_tokens=max_input,
        max_total_tokens=min(window, settings.max_prompt_tokens + settings.max_new_tokens),
        # prompts are encoded on one thread beside the loop (nanoserve/server/streaming/encoding.py)
        validation_workers=1,
        max_client_batch_size=MAX_PROMPTS,  # prompts in one /v1/completions request
        max_prompt_tokens=settings.max_prompt_tokens,
        max_new_tokens=settings.max_new_tokens,
        max_top_n_tokens=settings.max_top_n_tokens,
        max_body_bytes=settings.max_body_bytes,
        window=engine.window,
        version=server_version(),
        engine=without_directories(report),
    )


# An absolute path in a string (a training command's corpus or output directory, say): /info keeps
# the file's name and drops the directories, which say where the files lived on someone's machine.
_ABSOLUTE_PATH = re.compile(r"(?<![\w.~/-])(?:~|[A-Za-z]:)?(?:[/\\][^\s/\\\"']+)+[/\\]([^\s/\\\"']+)")


def without_directories(value: Any) -> Any:
    """`value` (JSON-like) with each absolute path in its strings cut to the file's name."""
    if isinstance(value, str):
        return _ABSOLUTE_PATH.sub(r"\1", value)
    if isinstance(value, dict):
        return {k: without_directories(v) for k, v in value.items()}
    if isinstance(value, list):
        return [without_directories(v) for v in value]
    return value
