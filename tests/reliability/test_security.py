"""Security over real sockets: API keys, logs, CORS, size limits, no HTML echo, the chat page's
rendering, no unpickling, and the container's user.

The `secure` server of the fleet (tests/reliability/conftest.py) has API keys, one allowed CORS
origin and debug logging; the `shared` server has neither keys nor CORS.
"""

from __future__ import annotations

import json
import re
import socket
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.error_shapes import error_kind, error_message
from tests.reliability.conftest import ALLOWED_ORIGIN, API_KEYS
from tests.server.server import REPO_ROOT, ServerProcess

WRONG_KEY = "wrong-key-but-long-enough-42"
OPEN_ROUTES = {("GET", "/health"), ("GET", "/ready")}
# Public by design (documented in nanoserve/server/http/auth.py): the static chat page holds no data, and
# /metrics is open unless `metrics_require_auth` is set. FastAPI's docs pages sit outside the app's
# dependencies; they describe the API and hold no data either.
PUBLIC_BY_DESIGN = {("GET", "/"), ("GET", "/metrics")}
BODIES = {
    "/generate": {"inputs": "Hi", "parameters": {"max_new_tokens": 2}},
    "/generate_stream": {"inputs": "Hi", "parameters": {"max_new_tokens": 2}},
    "/": {"inputs": "Hi", "parameters": {"max_new_tokens": 2}},
    "/tokenize": {"inputs": "Hi"},
    "/v1/completions": {"prompt": "Hi", "max_tokens": 2},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
    "/v1/embeddings": {"input": "Hi"},
    "/v1/responses": {"input": "Hi", "max_output_tokens": 2},
}


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def served_routes(client: httpx.Client) -> list[tuple[str, str]]:
    spec = client.get("/openapi.json", headers=bearer(API_KEYS[0])).json()
    return sorted((m.upper(), p) for p, ops in spec["paths"].items() for m in ops if "{" not in p)


def test_every_protected_route_needs_a_key_and_probes_stay_open(sclient: httpx.Client) -> None:
    routes = served_routes(sclient)
    protected = [r for r in routes if r not in OPEN_ROUTES | PUBLIC_BY_DESIGN]
    assert {("POST", "/generate"), ("POST", "/generate_stream"), ("POST", "/v1/chat/completions"),
            ("GET", "/v1/models"), ("GET", "/info"), ("POST", "/")} <= set(protected), protected
    for method, path in protected:
        body = BODIES.get(path) if method == "POST" else None
        for headers in ({}, bearer(WRONG_KEY), bearer(API_KEYS[0] + "x"), {"Authorization": API_KEYS[0]}):
            r = sclient.request(method, path, json=body, headers=headers)
            assert r.status_code == 401, (method, path, headers, r.status_code, r.text[:200])
            assert error_kind(r) in ("missing_api_key", "invalid_api_key")  # either dialect
            assert WRONG_KEY not in r.text and API_KEYS[0] not in r.text
        ok = sclient.request(method, path, json=body, headers=bearer(API_KEYS[1]))
        assert ok.status_code == 200, (method, path, ok.text[:200])
    for method, path in OPEN_ROUTES:
        assert sclient.request(method, path).status_code == 200, path
    # Routes with a path parameter: a stored response is the key's own; without one, 401 first.
    for method in ("GET", "DELETE"):
        r = sclient.request(method, "/v1/responses/resp_unknown")
        assert r.status_code == 401 and error_kind(r) == "missing_api_key", (method, r.text[:200])


def test_keys_never_reach_the_logs(secure_server: ServerProcess, sclient: httpx.Client) -> None:
    sclient.post("/generate", json=BODIES["/generate"], headers=bearer(API_KEYS[0]))
    with sclient.stream("POST", "/generate_stream", json=BODIES["/generate_stream"],
                        headers=bearer(API_KEYS[1])) as r:
        r.read()
    sclient.post("/generate", json=BODIES["/generate"], headers=bearer(WRONG_KEY))
    sclient.post("/generate", json={"inputs": 5}, headers=bearer(API_KEYS[0]))  # a 422, logged
    logs = secure_server.logs()
    assert "nanoserve.access" in logs or "route=" in logs, "no access log lines to check"
    for secret in (*API_KEYS, WRONG_KEY):
        assert secret not in logs, f"a key appears in the server's output: {secret[:6]}..."


def test_cors_only_for_the_configured_origin(sclient: httpx.Client, client: httpx.Client) -> None:
    preflight = {"Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}
    allowed = sclient.options("/v1/chat/completions", headers={"Origin": ALLOWED_ORIGIN, **preflight})
    assert allowed.status_code == 200
    assert allowed.headers["access-control-allow-origin"] == ALLOWED_ORIGIN
    assert "access-control-allow-credentials" not in allowed.headers
    for c in (sclient, client):  # other origins on the configured server; any origin without CORS
        evil = c.options("/v1/chat/completions", headers={"Origin": "https://evil.example", **preflight})
        assert "access-control-allow-origin" not in evil.headers
        simple = c.get("/health", headers={"Origin": "https://evil.example"})
        assert "access-control-allow-origin" not in simple.headers
    wildcard = client.get("/health", headers={"Origin": ALLOWED_ORIGIN})
    assert "access-control-allow-origin" not in wildcard.headers  # CORS is off unless configured


def test_body_limit_holds_without_content_length(client: httpx.Client) -> None:
    def chunks() -> Iterator[bytes]:  # chunked transfer: the limit must trip while reading
        yield b'{"inputs": "'
        for _ in range(40):
            yield b"a" * 65536
        yield b'"}'

    r = client.post("/generate", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413 and "bytes" in error_message(r)
    assert client.get("/health").status_code == 200


def test_oversized_headers_are_refused(client: httpx.Client) -> None:
    r = client.get("/health", headers={"X-Filler": "a" * (1 << 20)})
    assert r.status_code == 431
    assert "more than the limit" in r.json()["error"]["message"]
    many = {f"X-H{i}": "1" for i in range(200)}
    r = client.get("/health", headers=many)
    assert r.status_code == 431
    assert "headers, more than the limit of 100" in r.json()["error"]["message"]
    assert client.get("/health").status_code == 200


def test_a_trickling_body_gets_408_and_its_connection_closed(fleet: dict[str, ServerProcess]) -> None:
    # The "raise" server's body timeout is 2 s. Twenty clients send their headers and one byte of
    # a 100-byte body, then nothing: each must be answered 408 and closed, none left in flight.
    server = fleet["raise"]
    head = (b"POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100\r\n\r\n{")
    socks = [socket.create_connection(("127.0.0.1", server.port), timeout=20) for _ in range(20)]
    start = time.monotonic()
    for s in socks:
        s.sendall(head)
    for s in socks:
        data = b""
        while chunk := s.recv(65536):  # to the server's close
            data += chunk
        s.close()
        status, _, body = data.partition(b"\r\n\r\n")
        assert status.startswith(b"HTTP/1.1 408"), data[:200]
        # TGI's error shape on /generate
        assert "was not complete within" in json.loads(body)["error"], body
    assert time.monotonic() - start < 15
    in_flight = re.search(r'nanoserve_http_requests_in_flight\{route="/generate"\} (\S+)',
                          httpx.get(server.base_url + "/metrics", timeout=10).text)
    assert in_flight is not None and float(in_flight.group(1)) == 0


def test_untrusted_input_is_never_echoed_as_html(client: httpx.Client) -> None:
    script = "<script>alert(1)</script>"
    responses = [
        client.get(f"/{script}"),
        client.post("/generate", json={"inputs": script + "\u00e9"}),  # a character outside the vocab
        client.post("/v1/chat/completions", json={"messages": [], script: 1}),
        client.post("/generate", content=script.encode(), headers={"content-type": "application/json"}),
    ]
    for r in responses:
        assert 400 <= r.status_code < 500, r.text
        assert r.headers["content-type"].startswith("application/json"), r.headers["content-type"]
    page = client.get("/")
    assert page.headers["content-type"].startswith("text/html")
    csp = page.headers.get("content-security-policy", "")
    assert "script-src 'self'" in csp and "unsafe-inline" not in csp, csp
    assert page.headers.get("x-content-type-options") == "nosniff"


STATIC = REPO_ROOT / "nanoserve" / "server" / "static"
HTML_SINKS = re.compile(r"\.(innerHTML|outerHTML)\b|insertAdjacentHTML|document\.write|\beval\s*\(|"
                        r"new\s+Function\s*\(|createContextualFragment|DOMParser")


def test_chat_page_script_renders_text_never_html() -> None:
    scripts = sorted(STATIC.glob("*.js"))
    assert scripts, f"no chat page scripts in {STATIC}"
    for path in scripts:
        code = "\n".join(line for line in path.read_text().splitlines() if not line.lstrip().startswith("//"))
        sinks = HTML_SINKS.findall(code)
        assert not sinks, f"{path.name} uses HTML sinks {sinks}: model/user text must go in as text"
    assert any("textContent" in p.read_text() for p in scripts)
    for html in STATIC.glob("*.html"):
        text = html.read_text()
        assert not re.search(r"<script(?![^>]*\bsrc=)[^>]*>", text), f"{html.name} has an inline script"
        assert "http://" not in text and "https://" not in text, f"{html.name} loads an external asset"


def test_checkpoints_are_never_unpickled() -> None:
    unpickling = re.compile(r"\btorch\.load\(|\bpickle\.loads?\(|weights_only\s*=\s*False|\bdill\.|"
                            r"\bjoblib\.load\(")
    found = [
        f"{path.relative_to(REPO_ROOT)}:{n}"
        for path in (REPO_ROOT / "nanoserve").rglob("*.py")
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if unpickling.search(line)
    ]
    assert not found, f"code that can unpickle: {found}"


def test_container_runs_as_non_root() -> None:
    dockerfile = REPO_ROOT / "Dockerfile"
    if not dockerfile.exists():
        pytest.skip("no Dockerfile in this tree")
    lines = [line.strip() for line in dockerfile.read_text().splitlines()]
    last_stage = max(i for i, line in enumerate(lines) if line.upper().startswith("FROM "))
    users = [line.split(None, 1)[1] for line in lines[last_stage:] if line.upper().startswith("USER ")]
    assert users, "the final stage sets no USER: the container would run as root"
    user = users[-1].split(":")[0]
    assert user not in {"root", "0"}, f"the final stage runs as {users[-1]}"
