"""Shapes shared by every API: the error body, and the strict field types requests are built from.

Strict means no coercion: `true` is not a number, `"5"` is not an integer, NaN and infinities are
refused, so a client's mistake is a 422 naming the field instead of a silent surprise.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

STRICT = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

# A non-negative integer that fits the engine's seed (u64 in TGI; 63 bits keep torch happy).
Seed = Annotated[int, Field(ge=0, le=2**63 - 1)]
# vLLM's cache_salt: requests naming the same salt share their cached prompt prefixes, whatever
# their client (nanoserve/engine/prefix_cache.py); without one a prefix is reused by its client only.
CacheSalt = Annotated[str, Field(min_length=1, max_length=256, description=(
    "Prompt prefixes cached by requests with this salt are reused by requests with the same salt "
    "only (vLLM's field); without one, by the same client only (API key or address)."))]
MAX_STOP_LENGTH = 256  # characters in one stop string
# The largest count or length a request may give: the engine hands them to C ints and int64
# tensors, and a larger value is a 422 here instead of an overflow inside a batch's step.
MAX_COUNT = 2**31 - 1


class ErrorDetail(BaseModel):
    message: str = Field(description="What went wrong, naming the offending field or limit.")
    type: str = Field(description="Class of error, e.g. invalid_request_error, rate_limit_error.")
    code: str = Field(description="Machine-readable reason, e.g. missing, overloaded, body_too_large.")
    param: str | None = Field(default=None, description="The offending request field (dotted path), if any.")


class ErrorResponse(BaseModel):
    """Every error response has this body."""

    error: ErrorDetail


def error_responses(
    *statuses: int, model: type[BaseModel] = ErrorResponse
) -> dict[int | str, dict[str, Any]]:
    """OpenAPI documentation of the error statuses a route can answer with (in `model`'s shape)."""
    descriptions = {
        401: "Missing or invalid API key.",
        413: "Request body too large.",
        415: "Body is not JSON.",
        422: "Invalid request (the message names the field).",
        424: "Generation failed inside the engine (TGI's status for it).",
        429: "Overloaded: retry after `Retry-After` seconds.",
        500: "Generation failed inside the engine.",
        503: "Not ready, or shutting down.",
    }
    return {s: {"model": model, "description": descriptions[s]} for s in statuses}
