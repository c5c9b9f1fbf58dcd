"""llama.cpp's `llama-server` as a process: started on 127.0.0.1 on a GGUF, ready once /health
answers 200 (503 while the model loads), ended by its PID. The settings mirror a nanoserve server's
under the same load: continuous batching, one slot per concurrent stream of `slot_context` tokens,
the same CPU threads for prompts and decoding."""

from __future__ import annotations

import contextlib
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx


@dataclass
class LlamaServerConfig:
    slots: int = 32  # --parallel: sequences decoded together
    slot_context: int = 256  # tokens per slot: the context is slots x slot_context
    threads: int = 2

    def args(self, server: Path, gguf: Path, port: int, help_text: str) -> list[str]:
        cmd = [str(server), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
               "--parallel", str(self.slots), "-c", str(self.slots * self.slot_context),
               "--cont-batching", "-t", str(self.threads), "-tb", str(self.threads)]
        if "--no-webui" in help_text:  # older builds have no web UI switch
            cmd.append("--no-webui")
        return cmd


@dataclass
class LlamaServer:
    base_url: str
    process: subprocess.Popen[bytes]
    log_path: Path

    def logs(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM to this PID, SIGKILL if it has not exited within `timeout`."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def server_help(server: Path) -> str:
    done = subprocess.run([str(server), "--help"], capture_output=True, text=True, timeout=60, check=False)
    return done.stdout + done.stderr


@contextlib.contextmanager
def running_llama_server(server: Path, gguf: Path, config: LlamaServerConfig, port: int,
                         ready_timeout: float = 180.0) -> Iterator[LlamaServer]:
    """A ready llama-server for the block; always stopped (and its log removed) after."""
    log = tempfile.NamedTemporaryFile(prefix="llama-server-", suffix=".log", delete=False)  # noqa: SIM115
    cmd = config.args(server, gguf, port, server_help(server))
    process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    log.close()
    srv = LlamaServer(f"http://127.0.0.1:{port}", process, Path(log.name))
    try:
        _wait_ready(srv, ready_timeout)
        yield srv
    finally:
        srv.stop()
        srv.log_path.unlink(missing_ok=True)


def _wait_ready(srv: LlamaServer, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if srv.process.poll() is not None:
            raise RuntimeError(f"llama-server exited ({srv.process.returncode}):\n{srv.logs()[-3000:]}")
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(f"{srv.base_url}/health", timeout=5).status_code == 200:
                return
        time.sleep(0.5)
    raise RuntimeError(f"llama-server not ready after {timeout:.0f} s:\n{srv.logs()[-3000:]}")
