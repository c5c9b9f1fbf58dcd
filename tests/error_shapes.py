"""Reading an error answer in either API family's dialect (nanoserve/server/http/error_dialects.py)."""

from __future__ import annotations

import httpx


def error_message(resp: httpx.Response) -> str:
    """The message: TGI's `{"error": str, "error_type"}` or OpenAI's `{"error": {"message", ...}}`."""
    error = resp.json()["error"]
    return str(error if isinstance(error, str) else error["message"])


def error_kind(resp: httpx.Response) -> str:
    """TGI's `error_type`, or OpenAI's `code`."""
    body = resp.json()
    return str(body["error_type"] if isinstance(body["error"], str) else body["error"]["code"])
