"""Reading the examples a document shows: its fenced blocks and the requests of its curl lines."""

from __future__ import annotations

import json
import re
from typing import Any


def fenced(doc: str) -> list[tuple[str, str]]:
    """(language, text) of each fenced block, in order."""
    out: list[tuple[str, str]] = []
    lang: str | None = None
    lines: list[str] = []
    for line in doc.split("\n"):
        if line.startswith("```"):
            if lang is None:
                lang, lines = line[3:].strip(), []
            else:
                out.append((lang, "\n".join(lines) + "\n"))
                lang = None
        elif lang is not None:
            lines.append(line)
    return out


def blocks(doc: str, lang: str) -> list[str]:
    return [text for kind, text in fenced(doc) if kind == lang]


def curl_request(command: str) -> tuple[str, dict[str, Any]]:
    """The route and JSON body of a `curl 127.0.0.1:8000/... -d '{...}'` command."""
    route = re.search(r"127\.0\.0\.1:8000(/\S+)", command)
    body = re.search(r"-d '(\{.*?\})'", command, re.S)
    assert route and body, f"a documented example this test cannot read: {command[:80]!r}"
    return route.group(1), json.loads(body.group(1))
