"""`nanoserve train --serve`: a server on the run's output that serves each improved checkpoint.

The server is the ordinary `nanoserve serve --watch` in a process of its own (the trainer imports
nothing of the server): it starts after the first save, when there is a checkpoint to serve, and
reloads each later save, which the trainer swaps in whole (atomic_dir.py). When training ends it
keeps serving the final checkpoint until Ctrl-C.
"""

from __future__ import annotations

import ctypes
import signal
import subprocess
import sys
from pathlib import Path

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _end_with_the_trainer() -> None:
    """In the server's process before it runs: Linux sends it SIGTERM (a drain) when the trainer dies,
    however it dies (a SIGKILL included), so no server outlives its run."""
    if sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)


class ServeAlongside:
    def __init__(self, port: int, host: str = "127.0.0.1") -> None:
        self.port = port
        self.host = host
        self.process: subprocess.Popen[bytes] | None = None

    def on_save(self, out: Path) -> None:
        """Called after each save: the first one starts the server."""
        if self.process is not None:
            return
        command = [sys.executable, "-m", "nanoserve.cli", "serve", "--checkpoint", str(out), "--watch",
                   "--host", self.host, "--port", str(self.port), "--log-level", "warning"]
        self.process = subprocess.Popen(command, stdin=subprocess.DEVNULL, preexec_fn=_end_with_the_trainer)
        print(f"\nserving {out} on http://{self.host}:{self.port}/ (the chat page); each improved "
              "checkpoint is reloaded as it is saved", file=sys.stderr, flush=True)

    def serve_on(self) -> int:
        """After training: keep serving until Ctrl-C (or the server ends); the server's exit status."""
        if self.process is None:
            return 0
        if self.process.poll() is not None:  # it said why on this terminal
            print(f"training finished; the server had exited (status {self.process.returncode})",
                  file=sys.stderr, flush=True)
            return self.process.returncode or 1
        print(f"training finished; still serving on http://{self.host}:{self.port}/ (Ctrl-C stops it)",
              file=sys.stderr, flush=True)
        try:
            return self.process.wait()
        except KeyboardInterrupt:
            return self.stop()

    def stop(self) -> int:
        """Drain and stop the server (SIGTERM; the server's drain timeout bounds it)."""
        if self.process is None:
            return 0
        if self.process.poll() is None:
            self.process.terminate()
        try:
            return self.process.wait(60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait()
