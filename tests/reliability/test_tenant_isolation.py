"""The prefix-cache probe attack, replayed against real servers: key A's prompt holds an 8-digit PIN;
key B probes `known prefix + digit + junk` and reads /metrics' reused-tokens counter, then times
whole guesses. With prefix reuse isolated by tenant (the default) B recovers nothing, by counts or
by timing; the same attack on a server that shares prefixes across tenants (prefix_cache_shared)
recovers the PIN, which shows the harness measures a real channel.

A char vocabulary: a token is a character, so reused tokens count characters.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.conftest import make_tiny_checkpoint
from tests.reliability.conftest import ONE_THREAD, READY_TIMEOUT_S
from tests.server.conftest import metric_value
from tests.server.server import ServerProcess, start_server, wait_ready

pytestmark = pytest.mark.slow

KEY_A, KEY_B = "tenant-a-key-0123456789", "tenant-b-key-abcdefghij"
PIN = "48213975"
KNOWN = "Account note. PIN "  # what B knows of A's prompt: everything before the PIN
JUNK = "; zz"
REUSED = "nanoserve_engine_prefix_cache_reused_tokens_total"
# The timing guesses' shared tail: long enough that reusing it is far faster than prefilling it.
DOC = "The customer asked about the balance and the statement of the account. " * 11
TRIALS = 5


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, ServerProcess]]:
    """Two servers with keys A and B: "isolated" (the default) and "shared" (prefix_cache_shared)."""
    # Wide enough that prefilling DOC costs a measurable time (a hit saves it).
    ckpt = make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-wide", block_size=1024,
                                n_layer=4, n_embd=256)
    env = {**ONE_THREAD, "NANOSERVE_API_KEYS": f"{KEY_A},{KEY_B}", "NANOSERVE_MAX_SEQS": "4"}
    started = {"isolated": start_server(ckpt, env=env),
               "shared": start_server(ckpt, env={**env, "NANOSERVE_PREFIX_CACHE_SHARED": "1"})}
    try:
        for server in started.values():
            wait_ready(server, timeout=READY_TIMEOUT_S)
        yield started
    finally:
        for server in started.values():
            server.stop()
            server.log_path.unlink(missing_ok=True)


def _send(http: httpx.Client, key: str, prompt: str) -> float:
    """One token of `prompt` as `key`; the seconds it took."""
    start = time.perf_counter()
    r = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1, "temperature": 0},
                  headers={"Authorization": f"Bearer {key}"})
    assert r.status_code == 200, r.text
    return time.perf_counter() - start


def _reused(http: httpx.Client) -> float:
    return metric_value(http.get("/metrics").text, REUSED)


def _own_bound(prompt: str, history: list[str]) -> int:
    """The most tokens `prompt` can reuse from B's own earlier prompts (the last one is always fed)."""
    def common(a: str, b: str) -> int:
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        return n
    return min(len(prompt) - 1, max((common(prompt, h) for h in history), default=0))


def _probe_by_counts(http: httpx.Client) -> tuple[str, list[tuple[int, int]]]:
    """B's attack on the counter: per position, the digit whose probe reused the most tokens
    (alone). Returns the digits recovered, and each probe's (reused, bound by B's own prompts)."""
    secret = f"{KNOWN}{PIN}. Do not share it."
    known, history, seen = KNOWN, list[str](), list[tuple[int, int]]()
    for _ in PIN:
        reused = {}
        for digit in "0123456789":
            probe = known + digit + JUNK
            _send(http, KEY_A, secret)  # the victim's conversation goes on: its prompt stays cached
            before = _reused(http)
            _send(http, KEY_B, probe)
            reused[digit] = int(_reused(http) - before)
            seen.append((reused[digit], _own_bound(probe, history)))
            history.append(probe)
        best = max(reused.values())
        winners = [d for d, n in reused.items() if n == best]
        if len(winners) != 1:
            break
        known += winners[0]
    return known.removeprefix(KNOWN), seen


def _probe_by_timing(http: httpx.Client) -> tuple[list[float], list[float]]:
    """B times a right and a wrong guess of A's whole prompt, each trial with a tail B never sent
    before (so B's own cache holds none of it). Returns the right guesses' and wrong ones' times."""
    right, wrong = [], []
    for trial in range(TRIALS):
        tail = f" Case {trial}. " + DOC[trial:] + DOC[:trial]
        secret, guess = f"{KNOWN}{PIN}.{tail}", f"{KNOWN}00000000.{tail}"
        _send(http, KEY_A, secret)
        wrong.append(_send(http, KEY_B, guess))
        _send(http, KEY_A, secret)
        right.append(_send(http, KEY_B, secret))
    return right, wrong


def test_isolated_reuse_leaks_nothing_by_counts_or_timing(servers: dict[str, ServerProcess]) -> None:
    with httpx.Client(base_url=servers["isolated"].base_url, timeout=120) as http:
        recovered, seen = _probe_by_counts(http)
        right, wrong = _probe_by_timing(http)
    print(f"isolated: recovered {recovered!r}; right guesses {statistics.median(right) * 1e3:.0f} ms, "
          f"wrong {statistics.median(wrong) * 1e3:.0f} ms (medians)")
    # Every probe reused at most what B's own earlier probes explain: nothing of A's prompt.
    assert all(reused <= bound for reused, bound in seen), seen
    assert recovered == "", recovered
    # A right guess of A's prompt is prefilled like a wrong one (no hit on A's cache).
    assert statistics.median(right) > 0.6 * statistics.median(wrong), (right, wrong)


def test_the_same_attack_recovers_the_pin_where_prefixes_are_shared(
    servers: dict[str, ServerProcess],
) -> None:
    with httpx.Client(base_url=servers["shared"].base_url, timeout=120) as http:
        recovered, _ = _probe_by_counts(http)
        right, wrong = _probe_by_timing(http)
    print(f"shared: recovered {recovered!r}; right guesses {statistics.median(right) * 1e3:.0f} ms, "
          f"wrong {statistics.median(wrong) * 1e3:.0f} ms (medians)")
    assert recovered == PIN
    assert statistics.median(right) < 0.5 * statistics.median(wrong), (right, wrong)


def test_a_shared_cache_salt_reuses_across_keys_on_both_apis(servers: dict[str, ServerProcess]) -> None:
    prompt = f"Team note {time.monotonic_ns()}: the release is on Friday."  # in no cache yet
    with httpx.Client(base_url=servers["isolated"].base_url, timeout=60) as http:
        def reused_by(key: str, path: str, body: dict[str, object]) -> int:
            before = _reused(http)
            r = http.post(path, json=body, headers={"Authorization": f"Bearer {key}"})
            assert r.status_code == 200, r.text
            return int(_reused(http) - before)

        def openai(salt: str | None) -> dict[str, object]:
            return {"prompt": prompt, "max_tokens": 1, "temperature": 0, "cache_salt": salt}

        tgi: dict[str, object] = {"inputs": prompt, "parameters": {"max_new_tokens": 1, "cache_salt": "team"}}
        assert reused_by(KEY_A, "/v1/completions", openai("team")) == 0
        assert reused_by(KEY_B, "/v1/completions", openai(None)) == 0  # B's own tenant: nothing
        assert reused_by(KEY_B, "/v1/completions", openai("other")) == 0
        assert reused_by(KEY_B, "/generate", tgi) == len(prompt) - 1  # the salt A used
        bad = http.post("/v1/completions", json=openai(""), headers={"Authorization": f"Bearer {KEY_B}"})
        assert bad.status_code == 400 and "cache_salt" in bad.text, bad.text
