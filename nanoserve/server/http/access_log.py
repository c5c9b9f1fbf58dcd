"""Request ids, arrival times and one structured access-log line per request.

`RequestContextMiddleware` is the outermost middleware: it stamps `request.state.arrival`
(`time.perf_counter()` at the very start, so queueing shows in every latency), assigns the request
id (an incoming `X-Request-Id` is honoured when it is a sane token), echoes it on every response, and
when the response has finished logs one line: id, method, route, status, prompt/generated tokens,
TTFT and duration. Routes fill the token fields through `record_of(request)`.

Log lines carry what clients send (a path, a model name, a header): every formatter here escapes
control and other non-printable characters (`\\x0a`, `\\x1b`, `\\u2028`) and backslashes in
messages and fields, so no client can forge a line or write terminal escapes; the text access line
quotes a value with a space, quote or `=` in it, so no client can forge a field.
"""

from __future__ import annotations

import json
import logging
import re
import time
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from nanoserve.engine.ids import new_id
from nanoserve.engine.types import TokenEvent

log = logging.getLogger("nanoserve.access")

_QUIET_PATHS = frozenset({"/health", "/ready", "/metrics"})
# Printable, no spaces or quotes: an id that is safe to echo in headers and logs.
_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")


@dataclass
class RequestRecord:
    """What the access log says about one request; routes update the generation fields."""

    request_id: str
    method: str
    path: str
    arrival: float
    status: int = 0
    route: str | None = None
    prompt_tokens: int | None = None
    generated_tokens: int | None = None
    cropped_tokens: int | None = None
    finish_reason: str | None = None
    ttft_s: float | None = None

    def started(self, prompt_tokens: int, cropped_tokens: int) -> None:
        """The engine accepted the generation (counts are known before any token)."""
        self.prompt_tokens, self.cropped_tokens, self.generated_tokens = prompt_tokens, cropped_tokens, 0

    def observe(self, event: TokenEvent) -> None:
        """Note one token event of this request's generation (first token time, final usage)."""
        if event.token_id is not None:
            self.generated_tokens = (self.generated_tokens or 0) + 1
            if self.ttft_s is None:
                self.ttft_s = time.perf_counter() - self.arrival
        if event.finish_reason is not None:
            self.finish_reason = event.finish_reason.value
        if event.usage is not None:
            self.prompt_tokens = event.usage.prompt_tokens
            self.generated_tokens = event.usage.generated_tokens
            self.cropped_tokens = event.usage.cropped_tokens

    def fields(self, duration_s: float) -> dict[str, Any]:
        out: dict[str, Any] = {
            "request_id": self.request_id,
            "method": self.method,
            "route": self.route or self.path,
            "status": self.status,
            "duration_ms": round(duration_s * 1000, 2),
        }
        if self.prompt_tokens is not None:
            out.update(prompt_tokens=self.prompt_tokens, generated_tokens=self.generated_tokens,
                       cropped_tokens=self.cropped_tokens)
        if self.finish_reason is not None:
            out["finish_reason"] = self.finish_reason
        if self.ttft_s is not None:
            out["ttft_ms"] = round(self.ttft_s * 1000, 2)
        return out


def record_of(request: Request) -> RequestRecord:
    """This request's access-log record (created by the middleware)."""
    record: RequestRecord = request.state.access
    return record


def request_id_of(request: Request) -> str:
    return str(request.state.request_id)


class RequestContextMiddleware:
    """Outermost ASGI middleware: arrival time, request id, access log line."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        arrival = time.perf_counter()
        incoming = _header(scope, b"x-request-id")
        request_id = incoming if incoming and _REQUEST_ID.match(incoming) else new_id()
        record = RequestRecord(request_id, scope["method"], scope["path"], arrival)
        state = scope.setdefault("state", {})
        state.update(arrival=arrival, request_id=request_id, access=record)

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                record.status = message["status"]
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"x-request-id"]
                headers.append((b"x-request-id", request_id.encode()))
                message = {**message, "headers": headers}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except BaseException:
            record.status = record.status or 500
            raise
        finally:
            route = scope.get("route")
            record.route = getattr(route, "path", None) or record.route
            fields = record.fields(time.perf_counter() - arrival)
            # Successful probes and scrapes come every few seconds: debug level, not noise at info.
            quiet = record.path in _QUIET_PATHS and record.status < 400
            message = logfmt_line(fields)
            log.log(logging.DEBUG if quiet else logging.INFO, message, extra={"fields": fields})


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", []):
        if key.lower() == name:
            return str(value.decode("latin-1"))
    return None


def escape(text: str, keep_newlines: bool = False) -> str:
    """`text` with backslashes doubled and every non-printable character as a Python escape
    (`\\x1b`, `\\u2028`); newlines kept only with `keep_newlines` (a traceback's own lines)."""
    if text.isprintable() and "\\" not in text:
        return text
    out = []
    for ch in text:
        if ch == "\\":
            out.append("\\\\")
        elif ch.isprintable() or (keep_newlines and ch == "\n"):
            out.append(ch)
        else:
            code = ord(ch)
            out.append(f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000
                       else f"\\U{code:08x}")
    return "".join(out)


def _logfmt(value: object) -> str:
    """A value of the text access line, escaped, and quoted when a space, quote or `=` would blur
    the fields (a quote inside is `\\x22`, as nginx writes it)."""
    text = escape(str(value))
    if text and not any(c in text for c in ' "='):
        return text
    return '"' + text.replace('"', "\\x22") + '"'


def logfmt_line(fields: dict[str, Any]) -> str:
    """`key=value ...`: the text form of an access-log line (already escaped)."""
    return " ".join(f"{k}={_logfmt(v)}" for k, v in fields.items())


class TextFormatter(logging.Formatter):
    """`time level logger: message`, with the message and any traceback escaped."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        fields = getattr(record, "fields", None)
        # An access line is rendered from its fields, each escaped once (escaping the message
        # again would double the backslashes of its escapes).
        record.message = logfmt_line(fields) if isinstance(fields, dict) else escape(record.message)
        return super().formatMessage(record)

    def formatException(self, ei: Any) -> str:
        return escape(super().formatException(ei), keep_newlines=True)

    def formatStack(self, stack_info: str) -> str:
        return escape(super().formatStack(stack_info), keep_newlines=True)


class JsonFormatter(logging.Formatter):
    """One JSON object per line; access-log lines carry their fields as keys (strings escaped)."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": self.formatTime(record, "%Y-%m-%dT%H:%M:%S"),
            "level": record.levelname.lower(),
            "logger": record.name,
        }
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            out.update({k: escape(v) if isinstance(v, str) else v for k, v in fields.items()})
        else:
            out["message"] = escape(record.getMessage())
        if record.exc_info:
            out["exception"] = escape(self.formatException(record.exc_info), keep_newlines=True)
        return json.dumps(out, ensure_ascii=False, default=str)


def configure_logging(level: str, fmt: str) -> None:
    """Root logging for `nanoserve serve` (uvicorn's loggers propagate into it)."""
    handler = logging.StreamHandler()
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(TextFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logging.getLogger(name).handlers[:] = []
        logging.getLogger(name).propagate = True
