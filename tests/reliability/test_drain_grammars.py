"""SIGTERM while requests compile their grammars (or wait for the grammar pool's one worker): they
were not admitted yet, so they get the drain's 503 `draining` at once, each in its API's dialect
(TGI's `error_type`, OpenAI's `error.code`), never a plain-text 500 with a traceback when the
server stops; those admitted before the signal finish, and the process exits 0."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from tests.error_shapes import error_kind
from tests.reliability.conftest import ONE_THREAD
from tests.server.conftest import metric_value
from tests.server.server import running_server

# About 0.1 s to compile for the tiny vocabulary, within the grammar limits: the pool compiles one
# at a time, so 32 of them keep it busy for seconds.
SLOW_REGEX = "(x{1000}){30}"
EACH = 16
REQUESTS: dict[str, tuple[str, dict[str, Any]]] = {
    "tgi": ("/generate", {"inputs": "Hello", "parameters": {
        "max_new_tokens": 4, "grammar": {"type": "regex", "value": SLOW_REGEX}}}),
    "openai": ("/v1/completions", {"prompt": "Hello", "max_tokens": 4,
                                   "response_format": {"type": "regex", "value": SLOW_REGEX}}),
}


def _wait_until_all_arrived(http: httpx.Client, count: int, answered: Callable[[], int]) -> None:
    """Until the server holds (or has answered) `count` of the requests."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        scrape = http.get("/metrics").text
        held = sum(metric_value(scrape, f'nanoserve_http_requests_in_flight{{route="{path}"}}')
                   for path, _ in REQUESTS.values())
        if held + answered() >= count:
            return
        time.sleep(0.02)
    raise AssertionError(f"fewer than {count} requests arrived in 30 s")


def test_requests_compiling_grammars_at_sigterm_get_the_drain_503(tiny_checkpoint: Path) -> None:
    env = {**ONE_THREAD, "NANOSERVE_DRAIN_TIMEOUT": "20", "NANOSERVE_MAX_QUEUE": "128"}
    answers: list[tuple[str, httpx.Response]] = []
    failures: list[str] = []

    def send(http: httpx.Client, name: str) -> None:
        path, body = REQUESTS[name]
        try:
            answers.append((name, http.post(path, json=body)))
        except httpx.HTTPError as e:  # a connection closed without an answer
            failures.append(f"{name}: {e!r}")

    with running_server(tiny_checkpoint, env=env, ready_timeout=240) as server, httpx.Client(
        base_url=server.base_url, timeout=60, limits=httpx.Limits(max_connections=4 * EACH),
    ) as http:
        threads = [threading.Thread(target=send, args=(http, name)) for _ in range(EACH) for name in REQUESTS]
        for t in threads:
            t.start()
        # The first compiles may be done (and admitted), the rest wait for the pool.
        _wait_until_all_arrived(http, 2 * EACH, lambda: len(answers))
        server.process.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        for t in threads:
            t.join(60)
        waited = time.monotonic() - signalled
        assert server.wait(30) == 0
        logs = server.logs()
    assert not failures, failures
    refused = {name: 0 for name in REQUESTS}
    for name, r in answers:
        assert r.status_code in (200, 503), (name, r.status_code, r.text)
        if r.status_code == 503:
            assert error_kind(r) == "draining" and r.headers["retry-after"] == "1", (name, r.text)
            assert ("error_type" in r.json()) == (name == "tgi"), r.text  # the route's dialect
            refused[name] += 1
    print(f"drain: {refused} of {EACH} each refused, all answered {waited:.2f} s after SIGTERM")
    assert len(answers) == 2 * EACH and all(refused.values()), refused
    assert waited < 4, waited  # at once, not after the compiles or the server's flush timeout
    for bad in ("Traceback", "CancelledError", "Exception in ASGI"):
        assert bad not in logs, logs[-3000:]
