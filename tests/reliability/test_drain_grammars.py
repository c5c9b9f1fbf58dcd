"""SIGTERM while requests compile their grammars: they were not admitted yet, so they get the drain's
503 `draining` at once, each in its API's dialect (TGI's `error_type`, OpenAI's `error.code`),
never a plain-text 500 with a traceback when the server stops; the process exits 0."""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from tests.error_shapes import error_kind
from tests.reliability.conftest import ONE_THREAD
from tests.server.server import running_server

# About a second and more to compile for the tiny vocabulary (llguidance expands the repetition).
SLOW_REGEX = "(x{1000}){1000}"
REQUESTS: dict[str, tuple[str, dict[str, Any]]] = {
    "tgi": ("/generate", {"inputs": "Hello", "parameters": {
        "max_new_tokens": 4, "grammar": {"type": "regex", "value": SLOW_REGEX}}}),
    "openai": ("/v1/completions", {"prompt": "Hello", "max_tokens": 4, "n": 3,
                                   "response_format": {"type": "regex", "value": SLOW_REGEX}}),
}


def test_requests_compiling_grammars_at_sigterm_get_the_drain_503(tiny_checkpoint: Path) -> None:
    env = {**ONE_THREAD, "NANOSERVE_DRAIN_TIMEOUT": "20"}
    answers: dict[str, httpx.Response] = {}

    def send(name: str, url: str) -> None:
        path, body = REQUESTS[name]
        answers[name] = httpx.post(url + path, json=body, timeout=60)

    with running_server(tiny_checkpoint, env=env, ready_timeout=240) as server:
        threads = [threading.Thread(target=send, args=(name, server.base_url)) for name in REQUESTS]
        for t in threads:
            t.start()
        time.sleep(0.5)  # both are in their grammars' compiles (a second or more each)
        server.process.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        for t in threads:
            t.join(60)
        waited = time.monotonic() - signalled
        assert server.wait(30) == 0
        logs = server.logs()
    for name, r in answers.items():
        assert r.status_code == 503, (name, r.text)
        assert error_kind(r) == "draining" and r.headers["retry-after"] == "1", (name, r.text)
    assert answers["tgi"].json()["error_type"] == answers["openai"].json()["error"]["code"] == "draining"
    assert waited < 4, waited  # at once, not after the compiles or the server's flush timeout
    for bad in ("Traceback", "CancelledError", "Exception in ASGI"):
        assert bad not in logs, logs[-3000:]
