"""Faults while serving: mass disconnects, slow readers, engine failures, SIGTERM under load.

The engine failures are injected through the backend seam (tests/faults.py): requests whose
prompt contains the marker get NaN logits ("nan:") or make the forward pass raise ("raise:").
The servers come from the `fleet` fixture (tests/reliability/conftest.py).
"""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import time

import httpx
import pytest

from bench.load import LoadConfig, LoadReport, RequestResult, run_load
from tests.reliability.conftest import API_KEYS, MATE_TOKENS, SHARED_MAX_SEQS
from tests.reliability.conftest import FAULT_MARKER as MARKER
from tests.reliability.observe import scrape, total, wait_until
from tests.server.server import ServerProcess


def load(url: str, n: int, **kw: object) -> LoadReport:
    defaults: dict[str, object] = {"concurrency": n, "requests": n, "prompt": "Hello there",
                                   "max_new_tokens": 24, "seed": 7, "timeout_s": 60}
    return asyncio.run(run_load(LoadConfig(url=url, **{**defaults, **kw})))  # type: ignore[arg-type]


def assert_complete(results: list[RequestResult], tokens: int) -> None:
    for r in results:
        assert r.kind == "ok" and not r.malformed, r
        assert r.tokens == r.details_tokens == tokens and r.final_text == r.text, r


def engine_idle(url: str) -> bool:
    s = scrape(url)
    return total(s, "nanoserve_running_sequences") == 0 and total(s, "nanoserve_kv_slots_in_use") == 0


# ---- disconnects and slow readers (the shared server: 8 slots) --------------------------------

def test_mass_disconnect_frees_slots_and_spares_the_others(shared_server: ServerProcess) -> None:
    url = shared_server.base_url
    before = scrape(url)
    victims, survivors, long = 6, 2, 2000

    async def both() -> tuple[LoadReport, LoadReport]:
        gone = run_load(LoadConfig(url=url, concurrency=victims, requests=victims, prompt="Hello there",
                                   max_new_tokens=long, seed=100, disconnect_after=3, timeout_s=60))
        kept = run_load(LoadConfig(url=url, concurrency=survivors, requests=survivors,
                                   prompt="Hello there", max_new_tokens=24, seed=200, timeout_s=60))
        return await asyncio.gather(gone, kept)

    gone, kept = asyncio.run(both())
    assert [r.kind for r in gone.results] == ["disconnected"] * victims
    assert_complete(kept.results, 24)
    freed_in = wait_until(lambda: engine_idle(url), timeout_s=10)
    after = scrape(url)
    def delta(name: str) -> float:
        return total(after, name) - total(before, name)

    assert delta("nanoserve_requests_cancelled_total") == victims
    # Rows the engine ran: had the victims kept their slots they would have cost victims * long.
    rows = delta("nanoserve_engine_batch_size_sum")
    assert rows < victims * long / 10, f"{rows} rows run: the disconnected requests kept generating"
    print(f"disconnect: {victims} slots freed {freed_in:.3f}s after the survivors finished; "
          f"{rows:.0f} rows run")


def test_clients_leaving_the_queue_are_dropped_from_it(shared_server: ServerProcess) -> None:
    """Requests still waiting for a slot (200 sent, only keep-alives so far) are removed when their
    clients disconnect, while the running ones carry on."""
    url, slots, queued = shared_server.base_url, SHARED_MAX_SEQS, 6

    def gauge(name: str) -> float:
        return total(scrape(url), name)

    async def scenario() -> None:
        body = {"inputs": "Hello", "parameters": {"max_new_tokens": 3000}}
        async with httpx.AsyncClient(base_url=url, timeout=60) as c:
            holders = [c.stream("POST", "/generate_stream", json=body) for _ in range(slots)]
            for h in holders:
                await h.__aenter__()
            await asyncio.to_thread(wait_until, lambda: gauge("nanoserve_running_sequences") == slots, 30)
            waiters = [c.stream("POST", "/generate_stream", json=body) for _ in range(queued)]
            for w in waiters:
                assert (await w.__aenter__()).status_code == 200
            await asyncio.to_thread(wait_until, lambda: gauge("nanoserve_waiting_requests") == queued, 30)
            for w in waiters:
                await w.__aexit__(None, None, None)
            await asyncio.to_thread(wait_until, lambda: gauge("nanoserve_waiting_requests") == 0, 10)
            assert gauge("nanoserve_running_sequences") == slots  # the holders were not touched
            for h in holders:
                await h.__aexit__(None, None, None)

    asyncio.run(scenario())
    wait_until(lambda: engine_idle(url), timeout_s=10)


class SlowReader:
    """A raw-socket client with a tiny receive buffer that reads a few bytes now and then."""

    def __init__(self, port: int, body: bytes) -> None:
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        self.sock.connect(("127.0.0.1", port))
        self.sock.sendall(
            b"POST /generate_stream HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode() + body
        )
        self.received = b""

    def nibble(self, n: int = 256) -> None:
        self.sock.settimeout(5)
        self.received += self.sock.recv(n)

    @property
    def finished(self) -> bool:
        # A TGI stream ends with its last token's details, or with TGI's error event (a data line
        # with "error" and "error_type").
        return b'"generated_text":"' in self.received or b'"error_type":' in self.received

    def close(self) -> None:
        self.sock.close()


def test_slow_reader_does_not_stall_the_others(shared_server: ServerProcess) -> None:
    url = shared_server.base_url
    body = b'{"inputs": "Hello", "parameters": {"max_new_tokens": 3000, "top_n_tokens": 5, "details": true}}'
    slow = SlowReader(shared_server.port, body)
    try:
        slow.nibble()
        assert slow.received.startswith(b"HTTP/1.1 200"), slow.received[:200]
        started = time.monotonic()
        report = load(url, 4, requests=8)  # while the slow reader has read almost nothing
        others_s = time.monotonic() - started
        assert_complete(report.results, 24)
        slow.nibble()
        assert not slow.finished, "the slow reader got to the end: the test did not make it lag"
        print(f"slow reader: 8 other requests finished in {others_s:.2f}s while it had read "
              f"{len(slow.received)} bytes")
    finally:
        slow.close()
    # Its disconnect frees the slot even though its writer was blocked on a full socket.
    wait_until(lambda: engine_idle(url), timeout_s=15)


# ---- engine faults -----------------------------------------------------------------------------

@pytest.mark.parametrize("server", ["secure", "raise"])  # "secure" has nan:, "raise" has raise:
def test_engine_fault_ends_one_request_with_an_error_event(
    server: str, fleet: dict[str, ServerProcess]
) -> None:
    url = fleet[server].base_url
    headers = {"Authorization": f"Bearer {API_KEYS[0]}"} if server == "secure" else {}
    mates_n, seeds = 3, [50, 51, 52]

    def steps() -> float:
        return total(scrape(url), "nanoserve_engine_step_duration_seconds_count")

    # The mates ask for more tokens than the engine can make within the test's timeouts, so they
    # are certainly still running when the poisoned request fails: each ends only when this test
    # closes it. (Racing bounded mates against the poisoned request's round trip was flaky on a
    # busy machine.) Every step that makes a token is counted before its events are handed out, so
    # once the error has arrived, a mate's token number `after_fault` comes from a later step.
    need: list[int] = []

    async def mate(client: httpx.AsyncClient, seed: int, started: asyncio.Event) -> str:
        body = {"inputs": "Hi", "parameters": {"max_new_tokens": MATE_TOKENS, "do_sample": True,
                                               "temperature": 1.0, "seed": seed}}
        texts: list[str] = []
        async with client.stream("POST", "/generate_stream", json=body, headers=headers) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                event = json.loads(line.removeprefix("data: "))
                assert "error" not in event, line
                assert event["generated_text"] is None, "a mate ended by itself: the test lost its hold"
                texts.append(event["token"]["text"])
                started.set()
                if need and len(texts) >= need[0]:
                    return "".join(texts)  # leaving the block disconnects
        raise AssertionError("a mate's stream ended early")

    async def batch() -> tuple[str, list[str], int]:
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            before = await asyncio.to_thread(steps)
            started = [asyncio.Event() for _ in range(mates_n)]
            mates = [asyncio.ensure_future(mate(client, s, e)) for s, e in zip(seeds, started, strict=True)]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)
            poisoned = await client.post("/generate_stream", headers=headers, json={
                "inputs": f"Hi {MARKER}!", "parameters": {"max_new_tokens": 20, "seed": 1}})
            after_fault = int(await asyncio.to_thread(steps) - before) + 1
            need.append(after_fault)
            return poisoned.text, await asyncio.wait_for(asyncio.gather(*mates), 60), after_fault

    poisoned, mates, after_fault = asyncio.run(batch())
    # TGI's error event: one data line {"error", "error_type": "generation"} ends the stream.
    last = json.loads(poisoned.strip().splitlines()[-1].removeprefix("data: "))
    assert last["error_type"] == "generation" and '"generated_text"' not in poisoned, poisoned
    # The mates' tokens, up to one made after the fault, are exactly what each makes alone.
    with httpx.Client(base_url=url, timeout=60, headers=headers) as client:
        for seed, text in zip(seeds, mates, strict=True):
            assert len(text) >= after_fault
            alone = client.post("/generate", json={"inputs": "Hi", "parameters": {
                "max_new_tokens": len(text), "do_sample": True, "temperature": 1.0, "seed": seed}})
            assert alone.status_code == 200 and alone.json()["generated_text"] == text, seed
    assert httpx.get(f"{url}/ready", timeout=10).status_code == 200
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200
    errors = total(scrape(url), "nanoserve_requests_finished_total", finish_reason="error")
    assert errors == 1
    wait_until(lambda: engine_idle(url), timeout_s=10)
    print(f"fault {server}: poisoned request ended with an error event; its {mates_n} mates were "
          f"running then and matched solo runs over {after_fault}+ tokens")


# ---- SIGTERM under load ------------------------------------------------------------------------

def test_sigterm_under_load_drains_then_exits_zero(fleet: dict[str, ServerProcess]) -> None:
    server = fleet["drain"]
    url, in_flight, tokens, drain_timeout = server.base_url, 6, 200, 60.0
    progress: dict[int, int] = {}  # in-flight request -> tokens received so far

    async def scenario() -> tuple[LoadReport, list[int], float, dict[int, int]]:
        streaming = asyncio.Event()

        def on_token(r: RequestResult) -> None:
            progress[r.index] = r.tokens
            if len(progress) == in_flight:
                streaming.set()

        async with httpx.AsyncClient(base_url=url, timeout=30) as c:
            # A long stream the test closes itself keeps the drain open until the probes are done,
            # however fast the machine finishes the other six.
            holder = c.stream("POST", "/generate_stream",
                              json={"inputs": "Hi", "parameters": {"max_new_tokens": 3000}})
            await holder.__aenter__()
            task = asyncio.ensure_future(run_load(LoadConfig(
                url=url, concurrency=in_flight, requests=in_flight, prompt="Hello there",
                max_new_tokens=tokens, seed=9, timeout_s=120, on_token=on_token)))
            await asyncio.wait_for(streaming.wait(), 60)
            server.process.send_signal(signal.SIGTERM)
            signalled, at_signal = time.monotonic(), dict(progress)
            await asyncio.to_thread(wait_until, lambda: httpx.get(f"{url}/ready").status_code == 503, 10)
            refused = [(await c.post("/generate", json={"inputs": "Hi"})).status_code for _ in range(3)]
            refused.append((await c.post("/generate_stream", json={"inputs": "Hi"})).status_code)
            await holder.__aexit__(None, None, None)
        return await task, refused, signalled, at_signal

    report, refused, signalled, at_signal = asyncio.run(scenario())
    assert not task_running_after_exit(server, signalled, drain_timeout)
    assert refused == [503] * 4
    assert any(n < tokens for n in at_signal.values()), f"nothing was in flight at SIGTERM: {at_signal}"
    assert_complete(report.results, tokens)  # every in-flight stream ran to its end
    assert server.process.returncode == 0, server.logs()


def task_running_after_exit(server: ServerProcess, signalled: float, drain_timeout: float) -> bool:
    """Wait for the exit; True when the process outlived the drain timeout (+5 s to flush)."""
    try:
        server.wait(max(0.0, signalled + drain_timeout + 5 - time.monotonic()))
    except Exception:
        return True
    print(f"SIGTERM: exited {time.monotonic() - signalled:.2f}s after the signal")
    return False
