"""`nanoserve train --serve`'s server never outlives its trainer, however the trainer ends."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

# A stand-in trainer: starts a long-lived child the way ServeAlongside starts its server, prints the
# child's pid, then waits to be killed.
TRAINER = """
import subprocess, sys, time
from nanoserve.model.training.serve_alongside import _end_with_the_trainer
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"],
                         preexec_fn=_end_with_the_trainer)
print(child.pid, flush=True)
time.sleep(120)
"""


@pytest.mark.skipif(sys.platform != "linux", reason="the parent-death signal is Linux's")
def test_the_server_ends_when_its_trainer_is_killed() -> None:
    trainer = subprocess.Popen([sys.executable, "-c", TRAINER], stdout=subprocess.PIPE, text=True)
    try:
        assert trainer.stdout is not None
        child = int(trainer.stdout.readline())
        os.kill(child, 0)  # running
        trainer.send_signal(signal.SIGKILL)
        trainer.wait(30)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                os.kill(child, 0)
            except ProcessLookupError:
                return  # gone (reaped by init once it ended on SIGTERM)
            time.sleep(0.05)
        os.kill(child, signal.SIGKILL)
        pytest.fail("the child outlived its killed parent")
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait(30)
