"""Grammar attacks against a real server, a victim client streaming beside each (issue 47's first class).

A grammar is the client's program, compiled and run by the server: a 15-character regex that asks
for a million-state lexer, a JSON schema whose string pattern costs a mask of tens of milliseconds
a token, a schema that passes a bound only a few characters into its text. Each is sent by several
clients at once, with `n` / `best_of` where the route takes them, while the victim (test_attacks.py's
harness, its own client id) streams 48 tokens again and again. Every attack request must get a 4xx
naming the bound or a 200 whose text follows its grammar, never a 5xx or a timeout; the victim's
median stream stays within 2x of its time alone plus JITTER_S (beside costly masks, plus SHARED_BATCH_SLACK_S;
its slowest within test_attacks.py's bound, which allows for two cores shared with the attacker's
own client); the server's memory stays bounded.
"""

from __future__ import annotations

import re
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from tests.error_shapes import error_kind, error_message
from tests.reliability.observe import rss_bytes
from tests.reliability.test_attacks import (
    MAX_SEQS,
    Victim,
    assert_unharmed,
    baseline,
    make_bpe_checkpoint,
    post,
)
from tests.reliability.test_attacks import serve as serve_attacked
from tests.server.server import ServerProcess

pytestmark = pytest.mark.slow

BOMB = "(a{1000}){1000}"  # 15 characters; llguidance's default limits took ~2 s and ~110 MB each
LONG_PATTERN = {"type": "string", "pattern": "^a{100000}$"}
SLOW_MASK = {"type": "string", "pattern": "^a{3000}$"}  # compiles, then a costly mask every token
LATE = {"type": "object", "properties": {"a": {"type": "boolean"},
                                         "b": {"type": "string", "pattern": "^(a{1000}){1000}$"}},
        "required": ["a", "b"], "additionalProperties": False}
LIMITS = "initial_lexer_fuel|max_lexer_states|max_grammar_size|max_items_in_row|max_mask_ms|mask_budget"
MEDIAN_SLOWDOWN = 2.0  # issue 47: victims within 2x of their time alone (medians 0.9-1.8x measured)
# Plus this much: the victim's stream alone takes 0.04-0.14 s on this tiny model, so a few
# milliseconds of scheduling jitter on 2 shared cores move its ratio by tenths (a clean CI run once
# measured 0.051 s alone and a 0.11 s median beside JSON pattern bombs whose compiles had all been
# refused).
JITTER_S = 0.05
# Costly masks share the victim's batch, and the mask thread takes a share of the 2 cores: the
# victim's median measured 1.3-2.7x there (3.2-4.3x when a step waited a fixed 2 ms for late masks,
# longer than this model's whole step of ~1 ms; the wait is now half the forward's time).
SHARED_BATCH_SLACK_S = 0.25
RSS_GROWTH = 300 << 20


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    yield from serve_attacked(make_bpe_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-bpe"))


def attack(send: Callable[[str, int], httpx.Response], clients: int, each: int) -> list[httpx.Response]:
    """`clients` attacker clients (their own ids), each sending `each` requests one after another."""
    out: list[httpx.Response] = []

    def run(k: int) -> None:
        for i in range(each):
            out.append(send(f"attacker-{k}", i))

    workers = [threading.Thread(target=run, args=(k,)) for k in range(clients)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=120)
    assert not any(w.is_alive() for w in workers), "an attack request got no answer in 120 s"
    return out


def assert_refused_or_valid(responses: list[httpx.Response], valid: Callable[[dict[str, Any]], bool]) -> None:
    """Each answer a 4xx naming a grammar bound (or a full queue), or a 200 that `valid` accepts."""
    for r in responses:
        assert r.status_code < 500, r.text
        if r.status_code == 200:
            assert valid(r.json()), r.text
        elif r.status_code != 429:
            assert r.status_code in (400, 422), r.text
            assert re.search(LIMITS, error_message(r)), r.text


def assert_victim_within_2x(victim: Victim, alone_s: float, what: str, slack_s: float = JITTER_S) -> None:
    assert_unharmed(victim, alone_s, what)  # every stream complete; the slowest within the harness's bound
    median = statistics.median(victim.durations)
    assert median <= MEDIAN_SLOWDOWN * alone_s + slack_s, (what, alone_s, victim.durations)


def test_regex_bombs_with_best_of_and_n(server: ServerProcess) -> None:
    base = server.base_url
    alone = baseline(base)
    rss_before = rss_bytes(server.process.pid)
    regex = {"type": "regex", "value": BOMB}

    def send(client: str, i: int) -> httpx.Response:
        if i % 2:
            return post(base, "/v1/completions", {"prompt": "It was", "n": MAX_SEQS, "max_tokens": 8,
                                                  "response_format": regex}, client=client)
        return post(base, "/generate", {"inputs": "It was", "parameters": {
            "best_of": MAX_SEQS, "do_sample": True, "max_new_tokens": 8, "grammar": regex}}, client=client)

    t0 = time.perf_counter()
    with Victim(base) as victim:
        answers = attack(send, clients=8, each=4)
    took = time.perf_counter() - t0
    assert_victim_within_2x(victim, alone, f"{len(answers)} regex bombs ({took:.1f} s)")
    assert_refused_or_valid(answers, lambda _: False)  # none compiles
    assert sum(r.status_code in (400, 422) for r in answers) >= len(answers) // 2
    grown = rss_bytes(server.process.pid) - rss_before
    print(f"regex bombs: RSS grew {grown / 2**20:.0f} MiB")
    assert grown < RSS_GROWTH


def test_json_pattern_bombs_on_chat(server: ServerProcess) -> None:
    base = server.base_url
    alone = baseline(base)
    fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": LONG_PATTERN}}

    def send(client: str, i: int) -> httpx.Response:
        return post(base, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                   "max_tokens": 16, "response_format": fmt}, client=client)

    with Victim(base) as victim:
        answers = attack(send, clients=4, each=6)
    assert_victim_within_2x(victim, alone, f"{len(answers)} JSON pattern bombs on chat")
    assert_refused_or_valid(answers, lambda _: False)


def test_costly_masks_and_late_failures_end_by_name(server: ServerProcess) -> None:
    base = server.base_url
    alone = baseline(base)

    def send(client: str, i: int) -> httpx.Response:
        schema = SLOW_MASK if i % 2 == 0 else LATE
        return post(base, "/generate", {"inputs": "It was", "parameters": {
            "max_new_tokens": 48, "details": True, "grammar": {"type": "json", "value": schema}}},
            client=client)

    def valid(body: dict[str, Any]) -> bool:
        text = body["generated_text"]
        done = body["details"]["finish_reason"] != "length"
        if text.startswith('"'):  # the pattern's string: complete, or cut by the length limit
            return bool(re.fullmatch('"a{3000}"' if done else '"a*', text))
        return not done and any(t.startswith(text) for t in ('{"a": true, "b": "', '{"a": false, "b": "'))

    with Victim(base) as victim:
        answers = attack(send, clients=4, each=4)
    assert_victim_within_2x(victim, alone, f"{len(answers)} costly masks and late grammar failures",
                            slack_s=SHARED_BATCH_SLACK_S)
    assert_refused_or_valid(answers, valid)
    late = [r for r in answers if r.status_code == 422 and "b" in error_message(r)]
    assert all(error_kind(r) == "validation" for r in late)  # TGI's dialect for the client's error
    assert "Traceback" not in server.logs()


def test_a_clients_grammar_is_not_stuck_behind_anothers_compiles(server: ServerProcess) -> None:
    """The grammar pool serves clients in turn: a small grammar waits for a compile of each other
    client at most, not for every bomb queued before it."""
    base = server.base_url
    small = {"inputs": "It was", "parameters": {"max_new_tokens": 8,
                                                "grammar": {"type": "regex", "value": "[a-e]{3}"}}}
    post(base, "/generate", small, client="victim")  # the tokenizer's grammar view is built
    t0 = time.perf_counter()
    r = post(base, "/generate", small, client="victim")
    alone = time.perf_counter() - t0
    assert r.status_code == 200 and re.fullmatch("[a-e]{3}", r.json()["generated_text"]), r.text
    regex = {"type": "regex", "value": BOMB}
    done = threading.Event()

    def flood() -> None:
        attack(lambda client, _: post(base, "/generate", {"inputs": "x", "parameters": {
            "grammar": regex}}, client=client), clients=6, each=3)
        done.set()

    flooder = threading.Thread(target=flood)
    flooder.start()
    time.sleep(0.3)  # the bombs are queued on the pool
    t0 = time.perf_counter()
    r = post(base, "/generate", small, client="victim")
    waited = time.perf_counter() - t0
    flooder.join(120)
    print(f"a small grammar: {alone:.3f} s alone, {waited:.3f} s behind 18 bombs of 6 clients")
    assert r.status_code == 200 and re.fullmatch("[a-e]{3}", r.json()["generated_text"]), r.text
    assert done.is_set()
    assert waited < alone + 3.0  # a few compiles of ~0.1-0.3 s, not the whole flood


def test_a_client_that_left_frees_its_compiles(server: ServerProcess) -> None:
    """Compiles of a client that went away are dropped before they start: its share of the queue
    (4 here: max_waiting_per_client, half of max_queue) is free again at once, not after them."""
    base = server.base_url
    # ~0.5 s each of the grammar pool before max_items_in_row refuses it.
    wide = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(1500)}}
    bomb = {"inputs": "x", "parameters": {"grammar": {"type": "json", "value": wide}}}
    gone = 0
    for _ in range(4):  # the client's whole share, each request abandoned at once
        try:
            httpx.post(f"{base}/generate", json=bomb, timeout=0.05, headers={"X-Client": "leaver"})
        except httpx.TimeoutException:
            gone += 1
    assert gone == 4
    time.sleep(0.2)  # the server sees the disconnects
    small = {"inputs": "It was", "parameters": {"max_new_tokens": 8,
                                                "grammar": {"type": "regex", "value": "[a-e]{3}"}}}
    t0 = time.perf_counter()
    r = post(base, "/generate", small, client="leaver")
    waited = time.perf_counter() - t0
    print(f"after leaving 4 compiles: a small grammar answered in {waited:.3f} s")
    assert r.status_code == 200, r.text  # not 429: the abandoned compiles no longer count
    assert re.fullmatch("[a-e]{3}", r.json()["generated_text"]), r.text
    assert waited < 1.2  # behind one running compile at most, not four
