"""The encoder's thread (nanoserve/server/streaming/encoding.py): one thread, jobs one at a time."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from nanoserve.server.http.errors import APIError
from nanoserve.server.streaming.encoding import EncodeQueue


async def test_jobs_run_one_at_a_time_on_one_thread() -> None:
    queue = EncodeQueue(max_pending_chars=10_000)
    running = 0
    most = 0

    def job() -> tuple[str, int]:
        nonlocal running, most
        running += 1
        most = max(most, running)
        time.sleep(0.02)  # long enough for the others to start, were there other threads
        running -= 1
        return threading.current_thread().name, torch.get_num_threads()

    results = await asyncio.gather(*(queue.run(job, 100) for _ in range(4)))
    assert most == 1
    assert len({name for name, _ in results}) == 1 and results[0][0].startswith("nanoserve-encoder")
    assert {threads for _, threads in results} == {1}  # no OpenMP pool beside the engine's
    assert queue.pending_chars == 0


async def test_characters_past_the_cap_are_refused_at_once() -> None:
    queue = EncodeQueue(max_pending_chars=150)
    release = threading.Event()
    first = asyncio.ensure_future(queue.run(release.wait, 100))
    await asyncio.sleep(0.01)
    with pytest.raises(APIError) as refused:
        await queue.run(lambda: None, 100)
    assert refused.value.status_code == 429 and refused.value.code == "tokenizer_busy"
    release.set()
    assert await first is True
