"""The README's "Using it" examples, run against the shipped checkpoint: what it shows is what a
user gets (same request bodies, read from the README itself; the outputs it prints must match)."""

from __future__ import annotations

import json
from pathlib import Path

from tests.server.asgi import asgi_client
from tests.server.doc_text import curl_request

ROOT = Path(__file__).resolve().parents[2]
CKPT = ROOT / "checkpoints" / "shakespeare-char"


def _examples() -> list[tuple[str, dict, list[str]]]:
    """(route, JSON body, the output lines shown under it) for each curl in the console block."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme.split("## Using it", 1)[1]
    block = section.split("```console\n", 1)[1].split("```", 1)[0]
    out: list[tuple[str, dict, list[str]]] = []
    for command in block.split("$ ")[1:]:
        route, body = curl_request(command)
        shown = [line for line in command.split("\n")[2:] if line.strip()]
        out.append((route, body, shown))
    return out


async def test_the_readme_examples_give_what_the_readme_shows() -> None:
    examples = _examples()
    assert [route for route, _, _ in examples] == ["/generate", "/generate_stream"]
    async with asgi_client(CKPT) as client:
        (_, body, shown), (_, stream_body, stream_shown) = examples
        r = await client.post("/generate", json=body)
        assert r.status_code == 200 and r.json() == json.loads(shown[0])

        r = await client.post("/generate_stream", json=stream_body)
        assert r.status_code == 200
        events = [json.loads(line.removeprefix("data: ")) for line in r.text.splitlines()
                  if line.startswith("data: ")]
        # The README abbreviates the stream ("..." lines, "{...}" inside events): compare what it spells out.
        first = json.loads(stream_shown[0].removeprefix("data: "))
        assert (events[0]["token"]["id"], events[0]["token"]["text"]) == (first["token"]["id"],
                                                                           first["token"]["text"])
        assert round(events[0]["token"]["logprob"], 2) == first["token"]["logprob"]
        last = stream_shown[-1]
        assert f'"index":{events[-1]["index"]}' in last and f'"id":{events[-1]["token"]["id"]}' in last
        assert f'"generated_text":{json.dumps(events[-1]["generated_text"])}' in last
        assert f'"finish_reason":"{events[-1]["details"]["finish_reason"]}"' in last
        assert f'"generated_tokens":{events[-1]["details"]["generated_tokens"]}' in last
