"""OpenAI's Responses API: `POST /v1/responses`, `GET` and `DELETE /v1/responses/{id}`.

Thin, as the chat route is: the input items become chat messages (`instructions` a system message
first, a `previous_response_id`'s stored conversation before them), rendered by the checkpoint's
chat template exactly as /v1/chat/completions renders them, with its stop strings and its
window fitting (`truncation: "auto"`); then `Engine.generate`, and the token events translated
(nanoserve/server/api/openai/responses_format.py). Finished responses are kept, unless
`store` is false, in the app's bounded store (nanoserve/server/api/openai/responses_store.py),
scoped to the caller's API key.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from nanoserve.engine.types import SamplingParams
from nanoserve.model.chat_template import ChatTemplateError, is_jinja, render_chat, template_stop_sequences
from nanoserve.server.api.common import ErrorResponse
from nanoserve.server.api.openai.messages import data_template_message
from nanoserve.server.api.openai.responses_format import Draft, ResponseEvents
from nanoserve.server.api.openai.responses_schemas import (
    DeletedResponse,
    FunctionCallItem,
    OutputMessage,
    ResponseObject,
    ResponsesRequest,
    item_message,
)
from nanoserve.server.api.openai.responses_store import ResponseStore
from nanoserve.server.api.openai.responses_tools import merged_calls, reply_message
from nanoserve.server.api.openai.routes import DROPPED_HEADER, fit_window, served_model
from nanoserve.server.api.openai.tools import ToolUse
from nanoserve.server.deps import EngineDep, SettingsDep
from nanoserve.server.http.errors import APIError
from nanoserve.server.settings import Settings
from nanoserve.server.streaming.clients import client_id
from nanoserve.server.streaming.encoding import encode
from nanoserve.server.streaming.generation import check_limits, collect, sse_response, start_generation

router = APIRouter(prefix="/v1", tags=["OpenAI-compatible"])

_STREAM_DOC: dict[int | str, dict[str, Any]] = {
    200: {
        "content": {"text/event-stream": {"itemSchema": {"type": "object", "required": ["event", "data"]}}},
        "description": "The response, or with `stream: true` its typed events (response.created ... "
        "response.completed), each with a `sequence_number`.",
    },
}
_NOT_FOUND: dict[int | str, dict[str, Any]] = {
    404: {"description": "No stored response of the caller's with this id.", "model": ErrorResponse},
}


def _owner(request: Request) -> str:
    """Whose stored responses a request may see: its API key's (hashed), or everyone's when the
    server has no keys (then anyone may call it, and the ids are unguessable)."""
    return client_id(request) if request.app.state.api_keys else ""


def _store(request: Request) -> ResponseStore:
    store: ResponseStore = request.app.state.responses_store
    return store


def _not_found(response_id: str) -> APIError:
    return APIError(404, f"No response found with id '{response_id}'.", code="response_not_found")


def _history(request: Request, previous_id: str | None) -> list[dict[str, Any]]:
    """The stored conversation a follow-up continues (none without previous_response_id); an
    unknown id is OpenAI's 400 `previous_response_not_found`."""
    if previous_id is None:
        return []
    entry = _store(request).get(_owner(request), previous_id)
    if entry is None:
        raise APIError(400, f"Previous response with id '{previous_id}' not found.",
                       code="previous_response_not_found", param="previous_response_id")
    return [dict(m) for m in entry.conversation]


def _resolved(request: Request, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The input's messages, each `item_reference` replaced by the stored output item it names."""
    out = []
    for message in messages:
        ref = message.get("item_reference")
        item = _store(request).item(_owner(request), ref) if ref is not None else None
        if ref is not None and item is None:
            raise APIError(400, f"Item with id '{ref}' not found.", code="item_not_found", param="input")
        out.append(item_message(0, item) if item is not None else message)
    return [m for m in out if m is not None]


def _sampling_params(body: ResponsesRequest, settings: Settings, stop: list[str],
                     tool_use: ToolUse | None) -> SamplingParams:
    limit = body.max_output_tokens or settings.default_max_new_tokens
    check_limits(settings, max_new_tokens=("max_output_tokens", limit))
    top_p = body.top_p if body.top_p is not None and body.top_p < 1.0 else None
    temperature = 1.0 if body.temperature is None else body.temperature
    grammar, param = body.grammar(), "text.format"
    if tool_use is not None and (forced := tool_use.grammar()) is not None:
        grammar, param = forced, "tools"  # a forced call, as on the chat route
    return SamplingParams(max_new_tokens=limit, temperature=temperature, top_p=top_p, stop=tuple(stop),
                          grammar=grammar, grammar_param=param)


async def _prompt(request: Request, engine: Any, settings: Settings, body: ResponsesRequest,
                  messages: list[dict[str, Any]], params: SamplingParams,
                  tools: list[dict[str, Any]] | None) -> tuple[str | list[int], int]:
    """The prompt (its ids when used as rendered) and how many old turns were dropped to fit it."""
    template = engine.checkpoint.chat_template
    if not is_jinja(template):  # one text per turn: tool calls and results written into turns
        messages = [data_template_message(m, template["roles"]) for m in messages]
    try:
        prompt = render_chat(template, messages, tools=tools)
    except ChatTemplateError as e:
        raise APIError(422, str(e), code="invalid_message", param="input") from None
    engine.check_admission(client_id(request))  # before the conversation's encodings
    if body.truncation == "auto":
        return await fit_window(request, engine, settings, template, messages, prompt, params.max_new_tokens,
                                 tools)
    ids = await encode(engine, request.app.state.encode_queue, prompt, settings.max_prompt_tokens, "input")
    if len(ids) >= engine.window:  # OpenAI's `truncation: "disabled"`: a 400, never a silent crop
        raise APIError(422, f"the input is {len(ids)} tokens and this model's window {engine.window}; "
                       'send truncation "auto" to drop the oldest turns', code="context_length_exceeded",
                       param="input")
    return ids, 0


@router.post("/responses", response_model=ResponseObject, responses=_STREAM_DOC)
async def create_response(body: ResponsesRequest, request: Request, response: Response, engine: EngineDep,
                          settings: SettingsDep) -> Response | ResponseObject:
    """A model response to text or message items (OpenAI's Responses API), through the chat template."""
    owner = _owner(request)
    conversation = merged_calls([*_history(request, body.previous_response_id),
                                 *_resolved(request, body.input_messages())])
    system = [{"role": "system", "content": body.instructions}] if body.instructions else []
    template = engine.checkpoint.chat_template
    tool_use = body.tool_use()
    reader = tool_use.reader(template) if tool_use is not None else None
    params = _sampling_params(body, settings, template_stop_sequences(template), tool_use)
    prompt, dropped = await _prompt(request, engine, settings, body, [*system, *conversation], params,
                                    tool_use.shown_to(template) if tool_use is not None else None)
    headers = {DROPPED_HEADER: str(dropped)} if dropped else {}
    gen = await start_generation(request, engine, prompt, params, param="input")
    draft = Draft(model=served_model(engine), request=body)

    def keep(final: ResponseObject) -> None:
        if body.stored():
            _store(request).put(owner, final.model_dump(), [*conversation, reply_of(final)])

    if body.stream:
        render = ResponseEvents(draft, keep, reader)
        return sse_response(gen, render, settings, headers=headers, error_event=render.error_event)
    response.headers.update(headers)
    done = await collect(request, gen)
    final = draft.finished(done.text, done.final, reader)
    keep(final)
    return final


def reply_of(final: ResponseObject) -> dict[str, Any]:
    """A finished response as the conversation's assistant turn."""
    text = next((item.content[0].text for item in final.output
                 if isinstance(item, OutputMessage) and item.content), None)
    return reply_message(text, [item for item in final.output if isinstance(item, FunctionCallItem)])


@router.get("/responses/{response_id}", response_model=ResponseObject, responses=_NOT_FOUND)
async def get_response(response_id: str, request: Request) -> Any:
    """A stored response (the caller's own; 404 once evicted or deleted)."""
    entry = _store(request).get(_owner(request), response_id)
    if entry is None:
        raise _not_found(response_id)
    return entry.response


@router.delete("/responses/{response_id}", response_model=DeletedResponse, responses=_NOT_FOUND)
async def delete_response(response_id: str, request: Request) -> DeletedResponse:
    """Forget a stored response (the caller's own)."""
    if not _store(request).delete(_owner(request), response_id):
        raise _not_found(response_id)
    return DeletedResponse(id=response_id)
