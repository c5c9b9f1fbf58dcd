"""The examples in docs/api.md, run: each request is read from the doc itself and sent, and what
the doc shows (fields, values, error texts) must be what comes back."""

from __future__ import annotations

import contextlib
import io
import json
import re
from pathlib import Path

import pytest

from tests.server.asgi import asgi_client
from tests.server.conftest import OPENAI_API_KEY
from tests.server.doc_text import blocks, curl_request
from tests.server.server import ServerProcess

ROOT = Path(__file__).resolve().parents[2]
CKPT = ROOT / "checkpoints" / "shakespeare-char"
API = (ROOT / "docs" / "api.md").read_text(encoding="utf-8")
# The TGI part, then the OpenAI part.
HTTP, OPENAI = API.split("\n## OpenAI-compatible API\n", 1)


def keys(shown: str, after: str) -> list[str]:
    """The field names the doc shows in the JSON object that follows `after`."""
    obj = shown.split(after, 1)[1] if after else shown
    depth, names = 0, []
    for m in re.finditer(r'[{}\[\]]|"(\w+)":', obj):
        if m.group(0) in "{[":
            depth += 1
        elif m.group(0) in "}]":
            depth -= 1
            if depth == 0:
                break
        elif depth == 1:
            names.append(m.group(1))
    return names


async def test_the_native_examples_answer_as_the_doc_shows() -> None:
    generate, stream = [b for b in blocks(HTTP, "bash") if "curl" in b]
    shown_json = blocks(HTTP, "json")[0]
    shown_stream = next(b for b in blocks(HTTP, "") if b.startswith("data: "))
    async with asgi_client(CKPT) as client:
        route, body = curl_request(generate)
        r = await client.post(route, json=body)
        assert r.status_code == 200, r.text
        out = r.json()
        assert list(out) == keys(shown_json, "") == ["generated_text", "details"]
        assert list(out["details"]) == keys(shown_json, '"details": ')
        for field in ("finish_reason", "generated_tokens", "prompt_tokens", "cropped_tokens", "seed"):
            shown = re.search(rf'"{field}": ("?\w+"?)', shown_json)
            assert shown and out["details"][field] == json.loads(shown.group(1)), field
        assert list(out["details"]["tokens"][0]) == keys(shown_json, '"tokens": [')

        route, body = curl_request(stream)
        r = await client.post(route, json=body)
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
        first, last = shown_stream.split("\n")[0], shown_stream.strip().split("\n")[-1]
        assert list(events[0]) == keys(first, "data: ") and events[0]["index"] == 0
        assert list(events[0]["token"]) == keys(first, '"token":')
        assert list(events[-1]["details"]) == keys(last, '"details":')
        assert events[-1]["generated_text"] == "".join(e["token"]["text"] for e in events)

        # The errors shown under "Errors": a string where temperature's number belongs, in TGI's
        # shape on a TGI route and in OpenAI's on /v1.
        tgi_error, openai_error = (json.loads(b) for b in blocks(HTTP, "json")[1:3])
        r = await client.post("/generate", json={"inputs": "ROMEO:", "parameters": {"temperature": "hot"}})
        assert r.status_code == 422 and r.json() == tgi_error
        r = await client.post("/v1/completions", json={"prompt": "ROMEO:", "temperature": "hot"})
        assert r.status_code == 400 and r.json() == openai_error


async def test_the_openai_refusal_shown_is_the_one_given() -> None:
    shown = json.loads(blocks(OPENAI, "json")[0])
    async with asgi_client(CKPT) as client:
        body = {"model": "shakespeare-char", "prompt": "ROMEO:", "suffix": "x"}
        r = await client.post("/v1/completions", json=body)
        assert r.status_code == 400 and r.json() == shown


@pytest.mark.timeout(120)
def test_the_openai_sdk_example_runs(openai_server: ServerProcess) -> None:
    code = blocks(OPENAI, "python")[0]
    code = code.replace("http://127.0.0.1:8000/v1", openai_server.base_url + "/v1")
    code = code.replace("unused-unless-the-server-sets-keys", OPENAI_API_KEY)
    assert openai_server.base_url in code and OPENAI_API_KEY in code  # the doc still reads as expected
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(code, "docs/api.md", "exec"), {})  # our own doc's example
    assert printed.getvalue().strip()  # a reply, then a streamed completion
