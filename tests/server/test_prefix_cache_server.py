"""Prompt prefix reuse seen from outside: a chat's second turn on a real `nanoserve serve` reuses the
first turn's KV cache, and /metrics counts it (the shared OpenAI test server, so deltas only)."""

from __future__ import annotations

from typing import Any

import httpx

from tests.server.conftest import OPENAI_API_KEY, metric_value
from tests.server.server import ServerProcess

COUNTERS = ("lookups", "hits", "reused_tokens")


def _counters(url: str) -> dict[str, float]:
    scrape = httpx.get(url + "/metrics", timeout=10).text
    return {name: metric_value(scrape, f"nanoserve_engine_prefix_cache_{name}_total") for name in COUNTERS}


def _chat(url: str, messages: list[dict[str, str]]) -> dict[str, Any]:
    body = {"model": "tiny-test", "messages": messages, "max_tokens": 8, "temperature": 0}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=60,
                   headers={"Authorization": f"Bearer {OPENAI_API_KEY}"})
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


def test_a_chat_follow_up_reuses_the_first_turn_and_metrics_count_it(openai_server: ServerProcess) -> None:
    url = openai_server.base_url
    # Short turns: the route drops a conversation's oldest turns where it leaves the reply no room
    # in the tiny model's 64-token window.
    turn = [{"role": "user", "content": "Hi"}]
    before = _counters(url)
    first = _chat(url, turn)
    middle = _counters(url)
    answer = first["choices"][0]["message"]["content"]
    second = _chat(url, [*turn, {"role": "assistant", "content": answer}, {"role": "user", "content": "Go"}])
    after = _counters(url)
    assert middle["lookups"] - before["lookups"] == 1
    assert after["lookups"] - middle["lookups"] == 1
    assert after["hits"] - middle["hits"] == 1
    # The second prompt starts with the whole first one (the template opens the assistant's turn with
    # what its message starts with); only the rest is prefilled.
    reused = after["reused_tokens"] - middle["reused_tokens"]
    assert first["usage"]["prompt_tokens"] <= reused < second["usage"]["prompt_tokens"]
