"""Bad input, table-driven: every case gets a 4xx whose message names the problem; nothing breaks.

One real server answers the whole table (the several-MB body goes through uvicorn as users send it),
then must still be healthy, still generate, and have answered no request with a 5xx.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from tests.reliability.observe import scrape, total
from tests.server.server import ServerProcess

JSON = {"content-type": "application/json"}


@dataclass(frozen=True)
class Case:
    name: str
    route: str
    body: Any  # a JSON-able value, or bytes sent as they are
    status: int
    problem: str  # regex (case-insensitive) the error message must match: the field or the problem
    headers: tuple[tuple[str, str], ...] = (("content-type", "application/json"),)


def gen(**params: Any) -> dict[str, Any]:
    return {"inputs": "Hello", "parameters": {"max_new_tokens": 4, **params}}


def comp(**fields: Any) -> dict[str, Any]:
    return {"prompt": "Hello", "max_tokens": 4, **fields}


def chat(**fields: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4, **fields}


def resp(**fields: Any) -> dict[str, Any]:
    return {"input": "Hello", "max_output_tokens": 4, **fields}


MB3 = "a" * (3 << 20)

CASES = [
    # Shape of the body itself.
    Case("malformed json", "/generate", b'{"inputs": "Hello",', 422, r"json"),
    Case("wrong content type", "/generate", json.dumps(gen()).encode(), 415, r"application/json",
         (("content-type", "text/plain"),)),
    Case("body is a list", "/generate", [1, 2], 422, r"body|object|dict"),
    Case("missing inputs", "/generate", {"parameters": {}}, 422, r"inputs"),
    Case("invalid utf-8", "/generate", b'{"inputs": "\xff\xfe"}', 400, r"utf-?8"),
    Case("several MB prompt", "/generate", {"inputs": MB3}, 413, r"bytes|too large"),
    # Wrong types, including booleans where numbers belong.
    Case("inputs is a number", "/generate", {"inputs": 5}, 422, r"inputs"),
    Case("max_new_tokens is a string", "/generate", gen(max_new_tokens="8"), 422, r"max_new_tokens"),
    Case("max_new_tokens is a bool", "/generate", gen(max_new_tokens=True), 422, r"max_new_tokens"),
    Case("temperature is a bool", "/generate", gen(temperature=True), 422, r"temperature"),
    Case("seed is a float", "/generate", gen(seed=1.5), 422, r"seed"),
    Case("stop holds a number", "/generate", gen(stop=[3]), 422, r"stop"),
    # NaN / Infinity (Python's json module emits and accepts them; strict JSON does not).
    Case("temperature NaN", "/generate", b'{"inputs": "a", "parameters": {"temperature": NaN}}', 422,
         r"temperature"),
    Case("top_p Infinity", "/generate", b'{"inputs": "a", "parameters": {"top_p": Infinity}}', 422,
         r"top_p"),
    # Negative or absurd values.
    Case("negative max_new_tokens", "/generate", gen(max_new_tokens=-1), 422, r"max_new_tokens"),
    Case("zero max_new_tokens", "/generate", gen(max_new_tokens=0), 422, r"max_new_tokens"),
    Case("huge max_new_tokens", "/generate", gen(max_new_tokens=10**9), 422, r"max_new_tokens"),
    Case("negative temperature", "/generate", gen(temperature=-0.5), 422, r"temperature"),
    Case("top_p above 1", "/generate", gen(top_p=1.5), 422, r"top_p"),
    Case("negative top_k", "/generate", gen(top_k=-3), 422, r"top_k"),
    Case("zero repetition_penalty", "/generate", gen(repetition_penalty=0), 422, r"repetition_penalty"),
    Case("negative seed", "/generate", gen(seed=-1), 422, r"seed"),
    Case("seed beyond 64 bits", "/generate", gen(seed=2**70), 422, r"seed"),
    Case("negative truncate", "/generate", gen(truncate=-1), 422, r"truncate"),
    Case("absurd top_n_tokens", "/generate", gen(top_n_tokens=1000), 422, r"top_n_tokens"),
    # Text the server cannot take.
    Case("empty prompt", "/generate", {"inputs": ""}, 422, r"inputs"),
    Case("lone surrogate", "/generate", b'{"inputs": "ab\\ud800cd"}', 422,
         r"surrogate|unicode|u\+d800|\\ud800"),
    Case("character outside the vocabulary", "/generate", {"inputs": "caf\u00e9"}, 422,
         r"\u00e9|u\+00e9"),
    Case("too many stop strings", "/generate", gen(stop=[f"s{i}" for i in range(50)]), 422, r"stop"),
    Case("empty stop string", "/generate", gen(stop=[""]), 422, r"stop"),
    Case("stream route: bad value", "/generate_stream", gen(temperature=-1), 422, r"temperature"),
    # OpenAI routes: strict, and unsupported features are named, not ignored; 400 as OpenAI answers.
    Case("completions: unknown field", "/v1/completions", comp(frobnicate=1), 400, r"frobnicate"),
    Case("completions: n above 16", "/v1/completions", comp(n=17), 400, r"\bn\b"),
    Case("completions: empty prompt", "/v1/completions", comp(prompt=""), 400, r"prompt"),
    Case("completions: huge max_tokens", "/v1/completions", comp(max_tokens=10**9), 400, r"max_tokens"),
    Case("completions: bool max_tokens", "/v1/completions", comp(max_tokens=True), 400, r"max_tokens"),
    Case("completions: NaN presence_penalty", "/v1/completions",
         b'{"prompt": "a", "presence_penalty": NaN}', 400, r"presence_penalty"),
    Case("chat: unknown field", "/v1/chat/completions", chat(frobnicate=1), 400, r"frobnicate"),
    Case("chat: n above 16", "/v1/chat/completions", chat(n=17), 400, r"\bn\b"),
    Case("chat: a tool without a function", "/v1/chat/completions",
         chat(tools=[{"type": "function"}]), 400, r"tools\[0\]\.function"),
    Case("chat: tool_choice names a function not in tools", "/v1/chat/completions",
         chat(tools=[{"type": "function", "function": {"name": "f"}}],
              tool_choice={"type": "function", "function": {"name": "g"}}), 400, r"tool_choice.*'g'"),
    Case("chat: a forced call's schema that does not compile", "/v1/chat/completions",
         chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {
             "type": "object", "properties": {"a": {"type": "nonsense"}}}}}], tool_choice="required"),
         400, r"tools"),
    Case("chat: missing messages", "/v1/chat/completions", {"max_tokens": 4}, 400, r"messages"),
    Case("chat: empty messages", "/v1/chat/completions", chat(messages=[]), 400, r"messages"),
    Case("chat: unknown role", "/v1/chat/completions",
         chat(messages=[{"role": "wizard", "content": "hi"}]), 400, r"role"),
    Case("chat: content is a number", "/v1/chat/completions",
         chat(messages=[{"role": "user", "content": 7}]), 400, r"content"),
    Case("chat: temperature above 2", "/v1/chat/completions", chat(temperature=3.0), 400, r"temperature"),
    Case("chat: stream is a string", "/v1/chat/completions", chat(stream="yes"), 400, r"stream"),
    Case("chat: too many stop strings", "/v1/chat/completions", chat(stop=["x"] * 50), 400, r"stop"),
    Case("chat: character outside the vocabulary", "/v1/chat/completions",
         chat(messages=[{"role": "user", "content": "\u65e5\u672c"}]), 400, r"\u65e5|u\+65e5"),
    Case("responses: unknown field", "/v1/responses", resp(frobnicate=1), 400, r"frobnicate"),
    Case("responses: input is a number", "/v1/responses", resp(input=5), 400, r"input"),
    Case("responses: a web search tool", "/v1/responses", resp(tools=[{"type": "web_search"}]), 400,
         r"tools.*only function tools"),
    Case("responses: a function call output without output", "/v1/responses",
         resp(input=[{"type": "function_call_output", "call_id": "c"}]), 400, r"input\[0\]\.output"),
    Case("responses: image part", "/v1/responses",
         resp(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]), 400,
         r"input_image"),
    Case("responses: unknown previous_response_id", "/v1/responses", resp(previous_response_id="resp_x"),
         400, r"previous response"),
    Case("responses: json_schema without a schema", "/v1/responses",
         resp(text={"format": {"type": "json_schema", "name": "s"}}), 400, r"schema"),
    Case("responses: max_output_tokens is a bool", "/v1/responses", resp(max_output_tokens=True), 400,
         r"max_output_tokens"),
    Case("embeddings: unknown field", "/v1/embeddings", {"input": "x", "frobnicate": 1}, 400, r"frobnicate"),
    Case("embeddings: input is a number", "/v1/embeddings", {"input": 5}, 400, r"input"),
    Case("embeddings: empty input list", "/v1/embeddings", {"input": []}, 400, r"input.*empty"),
    Case("embeddings: token id outside the vocabulary", "/v1/embeddings", {"input": [10**9]}, 400,
         r"token id"),
    Case("embeddings: dimensions", "/v1/embeddings", {"input": "x", "dimensions": 3}, 400, r"dimensions"),
    Case("embeddings: character outside the vocabulary", "/v1/embeddings", {"input": ["ok", "\u65e5"]}, 400,
         r"\u65e5|u\+65e5"),
]


def send(client: httpx.Client, case: Case) -> httpx.Response:
    content = case.body if isinstance(case.body, bytes) else json.dumps(case.body).encode()
    return client.post(case.route, content=content, headers=dict(case.headers))


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_input_is_a_clear_4xx(client: httpx.Client, case: Case) -> None:
    resp = send(client, case)
    assert resp.status_code == case.status, f"{case.name}: {resp.status_code} {resp.text[:300]}"
    body = resp.json()
    if case.route.startswith("/v1/"):  # OpenAI's error shape
        assert set(body["error"]) >= {"message", "type", "code", "param"}
        message = body["error"]["message"]
    else:  # TGI's, on TGI's routes
        assert set(body) == {"error", "error_type"} and body["error_type"] == "validation"
        message = body["error"]
    assert re.search(case.problem, message, re.IGNORECASE), (
        f"{case.name}: message does not name the problem ({case.problem!r}): {message!r}"
    )
    assert "Traceback" not in resp.text


def test_server_is_healthy_after_the_table(client: httpx.Client, shared_server: ServerProcess) -> None:
    for case in CASES:  # again, so this test stands alone under -k / random order
        send(client, case)
    assert client.get("/health").status_code == 200
    assert client.get("/ready").status_code == 200
    ok = client.post("/generate", json=gen(max_new_tokens=5, seed=1, details=True))
    assert ok.status_code == 200, ok.text
    assert ok.json()["details"]["generated_tokens"] == 5
    samples = scrape(shared_server.base_url)
    errors_5xx = sum(v for n, lab, v in samples
                     if n == "nanoserve_http_requests_total" and lab.get("code", "").startswith("5"))
    assert errors_5xx == 0
    refused = sum(total(samples, "nanoserve_http_requests_total", code=c) for c in ("400", "422"))
    assert refused >= len(CASES) - 2
