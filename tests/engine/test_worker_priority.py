"""Background threads lower their own scheduling priority, and only their own."""

from __future__ import annotations

import os
import sys
import threading

import pytest

from nanoserve.engine.worker_priority import BACKGROUND_NICE, lower_thread_priority

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice is Linux's")


def test_the_calling_thread_gets_a_higher_nice_value_and_the_process_keeps_its_own() -> None:
    process_nice = os.getpriority(os.PRIO_PROCESS, 0)
    seen: list[int] = []

    def background() -> None:
        lower_thread_priority()
        seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))

    worker = threading.Thread(target=background)
    worker.start()
    worker.join()
    assert seen == [min(19, process_nice + BACKGROUND_NICE)]
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == process_nice
    assert os.getpriority(os.PRIO_PROCESS, 0) == process_nice
