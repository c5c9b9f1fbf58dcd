"""The OpenAI-compatible API: /v1/completions, /v1/chat/completions and /v1/models.

Thin by design: validate the request (nanoserve/server/api/openai/schemas.py), turn it into `SamplingParams`,
call `Engine.generate`, and translate its token events (nanoserve/server/api/openai/format.py).
Everything that can be refused is refused before the 200: schema errors (400 naming the field, in
OpenAI's dialect: nanoserve/server/http/error_dialects.py), server limits, a prompt the tokenizer cannot
represent, a full queue (429). The request's `model` picks the engine (nanoserve/server/deps.py);
responses name the model that answered (`served_model`).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from nanoserve.engine.types import SamplingParams
from nanoserve.model.chat_template import ChatTemplateError, fit_chat, render_chat, template_stop_sequences
from nanoserve.server.api.common import ErrorResponse
from nanoserve.server.api.openai.format import (
    DONE,
    ChatChunks,
    CompletionChunks,
    CompletionLogprobsBuilder,
    Reply,
    chat_logprob,
    chat_response,
    completion_response,
    summed_usage,
    usage_of,
)
from nanoserve.server.api.openai.messages import template_messages
from nanoserve.server.api.openai.objects import (
    ChatCompletionResponse,
    CompletionResponse,
    ModelCard,
    ModelList,
    TokenLogprob,
)
from nanoserve.server.api.openai.schemas import ChatCompletionRequest, CompletionRequest, GenerationRequest
from nanoserve.server.deps import EngineDep, SettingsDep
from nanoserve.server.http.errors import APIError
from nanoserve.server.settings import Settings
from nanoserve.server.streaming.clients import client_id
from nanoserve.server.streaming.encoding import encode
from nanoserve.server.streaming.generation import (
    Completed,
    Generation,
    check_limits,
    collect_all,
    sse_response,
    start_choices,
    start_generation,
)
from nanoserve.server.streaming.merged_stream import MergedStream, merged_sse_response
from nanoserve.server.streaming.sse import Render

router = APIRouter(prefix="/v1", tags=["OpenAI-compatible"])

# Streaming answers are SSE, not JSON: say so in the OpenAPI document.
_SSE_DOC: dict[int | str, dict[str, Any]] = {
    200: {
        # itemSchema: one SSE event (OpenAPI 3.2's way; without it `schema` describes each event).
        "content": {"text/event-stream": {"itemSchema": {"type": "object", "required": ["data"]}}},
        "description": "JSON, or with `stream: true` server-sent events: one chunk per text delta, "
        "then `data: [DONE]`.",
    },
}


# OpenAI's default for completions; chat's is the server's default_max_new_tokens.
COMPLETIONS_MAX_TOKENS = 16


def served_model(engine: Any) -> str:
    """The name of the model that answers, which responses carry. With one model served, a request's
    `model` may be a placeholder (huggingface_hub "dummy" or "tgi", LangChain a configured name) and
    is not matched, as TGI and llama.cpp's server do; with several it chose this engine (deps.py)."""
    served: str = engine.checkpoint.name
    return served


def _sampling_params(body: GenerationRequest, settings: Settings, *, max_tokens: int | None,
                     extra_stop: list[str], logprobs: bool, top_n: int) -> SamplingParams:
    """The engine's parameters for a validated request, after the server's limits."""
    limit = max_tokens if max_tokens is not None else settings.default_max_new_tokens
    chat = isinstance(body, ChatCompletionRequest)
    named_new = isinstance(body, ChatCompletionRequest) and body.max_completion_tokens is not None
    limit_name = "max_completion_tokens" if named_new else "max_tokens"
    stop = body.stop_list()
    check_limits(settings, max_new_tokens=(limit_name, limit), stop=("stop", stop),
                 top_n=("top_logprobs" if chat else "logprobs", top_n))
    return SamplingParams(
        max_new_tokens=limit,
        temperature=body.temperature,
        top_k=body.top_k,
        top_p=body.top_p if body.top_p < 1.0 else None,
        min_p=body.min_p,
        repetition_penalty=body.repetition_penalty,
        frequency_penalty=body.frequency_penalty,
        presence_penalty=body.presence_penalty,
        stop=tuple(stop + [s for s in extra_stop if s not in stop]),
        seed=body.seed,
        cache_salt=body.cache_salt,
        logprobs=logprobs,
        top_n_tokens=top_n,
        logit_bias=body.bias_pairs(),
        grammar=body.grammar(),
        grammar_param="response_format",
    )


def _sse(gen: Generation, render: Render, settings: Settings,
         headers: Mapping[str, str] | None = None) -> Response:
    return sse_response(gen, render, settings, trailer=[DONE], headers=headers)


DROPPED_HEADER = "X-Nanoserve-Dropped-Messages"


async def fit_window(request: Request, engine: Any, settings: Settings, template: Mapping[str, Any],
                      messages: list[dict[str, Any]], prompt: str, max_new: int,
                      tools: list[dict[str, Any]] | None = None) -> tuple[str | list[int], int]:
    """The prompt to generate from (its ids when it is used as rendered) and how many of the
    conversation's oldest turns were left out so it leaves the reply room in the window: up to a
    quarter of the window, or `max_new` if less. System messages and the last message stay
    (nanoserve/model/chat_template.py fit_chat). Nothing is dropped from a conversation over the server's
    prompt cap, or with reject_long_prompts: those get their 422, as any prompt would."""
    queue = request.app.state.encode_queue
    ids = await encode(engine, queue, prompt, settings.max_prompt_tokens, "messages")
    budget = engine.window - min(max_new, engine.window // 4)
    if len(ids) <= budget or engine.config.reject_long_prompts:
        return ids, 0

    def fits(text: str) -> bool:
        return len(engine.encode(text)) <= budget

    # Several encodes of a long conversation: off the event loop, counted as one more encoding.
    return await queue.run(lambda: fit_chat(template, messages, fits, tools=tools), len(prompt))


@router.get("/models", response_model=ModelList)
async def list_models(request: Request, engine: EngineDep) -> ModelList:
    """The served models (OpenAI's model list; the first is the default)."""
    return ModelList(data=[_model_card(m.engine) for m in request.app.state.registry])


@router.get("/models/{model_id}", response_model=ModelCard,
            responses={404: {"description": "Not a served model.", "model": ErrorResponse}})
async def get_model(model_id: str, request: Request, engine: EngineDep) -> ModelCard:
    """One model by id (404 unless it is served)."""
    served = {m.name: m.engine for m in request.app.state.registry}
    if model_id not in served:
        names = ", ".join(repr(name) for name in served)
        raise APIError(404, f"model {model_id!r} does not exist; this server serves {names}",
                       code="model_not_found", param="model")
    return _model_card(served[model_id])


def _model_card(engine: Any) -> ModelCard:
    # Checkpoints record no creation time unless their provenance says; then "now", as vLLM does.
    created = int(engine.checkpoint.provenance.get("created_unix") or time.time())
    return ModelCard(id=engine.checkpoint.name, created=created, max_model_len=engine.window)


@router.post("/completions", response_model=CompletionResponse, responses=_SSE_DOC)
async def completions(body: CompletionRequest, request: Request, engine: EngineDep,
                      settings: SettingsDep) -> Response | CompletionResponse:
    """Text completion of a prompt, or of several (one choice each; OpenAI's legacy completions API)."""
    model = served_model(engine)
    top_n = body.logprobs or 0
    max_tokens = body.max_tokens if body.max_tokens is not None else min(COMPLETIONS_MAX_TOKENS,
                                                                          settings.max_new_tokens)
    n, generated = body.choices(), body.best_of or body.choices()
    _check_choices(engine, generated, "best_of" if body.best_of is not None else "n")
    # best_of ranks by logprob: every generation reports its tokens' logprobs.
    params = _sampling_params(body, settings, max_tokens=max_tokens, extra_stop=[],
                              logprobs=body.logprobs is not None or generated > n, top_n=top_n)
    if body.echo:
        params = replace(params, echo=True, prompt_logprobs=body.logprobs)
    prompts = body.prompt_inputs()
    vocab = engine.tokenizer.vocab_size
    for prompt in prompts:
        if isinstance(prompt, list) and (bad := next((t for t in prompt if t >= vocab), None)) is not None:
            raise APIError(422, f"prompt: token id {bad} is not in this model's vocabulary [0, {vocab})",
                           code="invalid_token_id", param="prompt")
    reply = Reply.new("cmpl", model, engine.tokenizer)
    if body.stream and len(prompts) == 1 and n == 1:
        gen = await start_generation(request, engine, prompts[0], params, param="prompt")
        render = CompletionChunks(reply, body.logprobs, body.include_usage())
        return _sse(gen, render, settings)
    gens = await _start_all(request, engine, prompts, params, generated)
    if body.stream:  # one stream; choice index = prompt * n + choice (OpenAI's order)
        renders = [CompletionChunks(reply, body.logprobs, False, index=i) for i in range(len(gens))]
        totals = CompletionChunks(reply, None, body.include_usage())
        merged = MergedStream(gens, renders, lambda finals: totals.usage_chunk(finals, n))
        return merged_sse_response(merged, settings, trailer=[DONE])
    dones = await collect_all(request, gens)
    usage = summed_usage([usage_of(d.final) for d in dones], per_prompt=generated)
    results = []
    for p in range(len(prompts)):
        for done in best_of(dones[p * generated : (p + 1) * generated], n):
            echoed = done.events[0].prompt  # set with echo
            logprobs = None
            if body.logprobs is not None:
                builder = CompletionLogprobsBuilder(reply, top_n)
                if echoed is not None:
                    builder.add_prompt(echoed)
                for event in done.tokens:
                    builder.add(event)
                logprobs = builder.take()
            results.append(((echoed.text if echoed else "") + done.text, done.final, logprobs))
    return completion_response(reply, results, usage)


def best_of(dones: list[Completed], n: int) -> list[Completed]:
    """The `n` generations with the highest mean token logprob (OpenAI: "the highest log
    probability per token"), best first; all of them, in order, when there are only `n`."""
    if len(dones) == n:
        return dones

    def mean_logprob(done: Completed) -> float:
        lps = [e.logprob for e in done.tokens if e.logprob is not None]
        return sum(lps) / len(lps) if lps else float("-inf")

    return sorted(dones, key=mean_logprob, reverse=True)[:n]


def _check_choices(engine: Any, count: int, name: str) -> None:
    """Each choice holds a KV slot while it runs: more than the engine has cannot run."""
    if count > 1 and count > engine.config.max_seqs:
        raise APIError(422, f"{name} is {count}, more than this server's {engine.config.max_seqs} "
                       "sequences at once (max_seqs)", code="too_many_choices", param=name)


async def _start_all(request: Request, engine: Any, prompts: list[str | list[int]],
                     params: SamplingParams, n: int) -> list[Generation]:
    """`n` generations per prompt (prefilled once each); if one is refused (a full queue, say),
    those already started are cancelled and the whole request gets that refusal."""
    gens: list[Generation] = []
    try:
        for prompt in prompts:
            gens += await start_choices(request, engine, prompt, params, n, param="prompt")
    except BaseException:
        for gen in gens:
            await gen.aclose()
        raise
    return gens


@router.post("/chat/completions", response_model=ChatCompletionResponse, responses=_SSE_DOC)
async def chat_completions(body: ChatCompletionRequest, request: Request, response: Response,
                           engine: EngineDep, settings: SettingsDep) -> Response | ChatCompletionResponse:
    """The assistant's next message, with the checkpoint's chat template applied. A conversation
    longer than the window loses its oldest turns, never its system messages or its last message
    (the count is in the X-Nanoserve-Dropped-Messages header)."""
    model = served_model(engine)
    template = engine.checkpoint.chat_template
    messages = template_messages(body.messages, template)
    tool_use = body.tool_use()
    tools = tool_use.shown_to(template) if tool_use is not None else None
    try:
        prompt = render_chat(template, messages, tools=tools)
    except ChatTemplateError as e:
        raise APIError(422, str(e), code="invalid_message", param="messages") from None
    top_n = body.top_logprobs or 0
    n = body.choices()
    _check_choices(engine, n, "n")
    params = _sampling_params(body, settings, max_tokens=body.token_limit(), logprobs=body.logprobs,
                              top_n=top_n, extra_stop=template_stop_sequences(template))
    reader = tool_use.reader(template) if tool_use is not None else None
    if tool_use is not None and (forced := tool_use.grammar()) is not None:
        params = replace(params, grammar=forced, grammar_param="tools")  # the call, not response_format
    engine.check_admission(client_id(request))  # before the conversation's encodings
    fitted, dropped = await fit_window(request, engine, settings, template, messages, prompt,
                                        params.max_new_tokens, tools)
    headers = {DROPPED_HEADER: str(dropped)} if dropped else {}
    gens = await start_choices(request, engine, fitted, params, n, param="messages")
    reply = Reply.new("chatcmpl", model, engine.tokenizer)

    if body.stream and n == 1:
        calls = reader.stream() if reader else None
        render = ChatChunks(reply, body.logprobs, body.include_usage(), calls=calls)
        return _sse(gens[0], render, settings, headers)
    if body.stream:  # each choice's chunks under its index
        renders = [ChatChunks(reply, body.logprobs, False, index=i, calls=reader.stream() if reader else None)
                   for i in range(n)]
        totals = ChatChunks(reply, False, body.include_usage())
        merged = MergedStream(gens, renders, lambda finals: totals.usage_chunk(finals, n))
        return merged_sse_response(merged, settings, trailer=[DONE], headers=headers)
    response.headers.update(headers)
    results = []
    for done in await collect_all(request, gens):
        logprobs: list[TokenLogprob] | None = None
        if body.logprobs:
            logprobs = [entry for e in done.tokens if (entry := chat_logprob(reply, e)) is not None]
        results.append((done.text, done.final, logprobs))
    return chat_response(reply, results, reader.parse if reader else None)
