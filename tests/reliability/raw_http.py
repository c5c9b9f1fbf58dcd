"""Raw-socket helpers for the attacks below HTTP: open sockets, read whole responses, watch a
server process's descriptors and memory, and run one ordinary stream beside an attack."""

from __future__ import annotations

import json
import os
import select
import socket
import threading
import time
from dataclasses import dataclass, field

import httpx

from tests.reliability.observe import rss_bytes

STREAM_TOKENS = 40


def connect(port: int, timeout: float = 10.0) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=timeout)


def fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def read_until_close(sock: socket.socket, timeout: float = 10.0, limit: int = 1 << 20) -> bytes:
    """Everything the server sends until it closes (or `timeout`, or `limit` bytes)."""
    data = b""
    deadline = time.monotonic() + timeout
    while len(data) < limit and time.monotonic() < deadline:
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            break
        except ConnectionResetError:
            break
        if not chunk:
            break
        data += chunk
    return data


def closed_by_server(sock: socket.socket, timeout: float) -> tuple[bool, bytes]:
    """(whether the server closed `sock` within `timeout`, what it sent before)."""
    data = b""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([sock], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            break
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            return True, data
        if not chunk:
            return True, data
        data += chunk
    return False, data


def split_responses(data: bytes) -> list[tuple[int, dict[str, str], bytes]]:
    """The HTTP/1.1 responses in `data`, in order: (status, headers, body); bodies by
    Content-Length or chunked. A truncated last response is left out."""
    out = []
    while data:
        head, sep, rest = data.partition(b"\r\n\r\n")
        if not sep:
            break
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
        if "content-length" in headers:
            n = int(headers["content-length"])
            if len(rest) < n:
                break
            body, data = rest[:n], rest[n:]
        elif headers.get("transfer-encoding") == "chunked":
            body, data, complete = _dechunk(rest)
            if not complete:
                break
        else:
            body, data = rest, b""
        out.append((status, headers, body))
    return out


def _dechunk(data: bytes) -> tuple[bytes, bytes, bool]:
    body = b""
    while True:
        size_line, sep, rest = data.partition(b"\r\n")
        if not sep:
            return body, b"", False
        size = int(size_line.split(b";")[0], 16)
        if len(rest) < size + 2:
            return body, b"", False
        body, data = body + rest[:size], rest[size + 2:]
        if size == 0:
            return body, data, True


def error_code(body: bytes) -> str:
    """The error's code: the shared shape's `error.code`, or TGI's `error_type` on its routes."""
    data = json.loads(body)
    return str(data["error"]["code"] if isinstance(data["error"], dict) else data["error_type"])


@dataclass
class Baseline:
    """A server process's descriptors and resident memory at one moment."""

    pid: int
    fds: int = 0
    rss: int = 0
    notes: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.fds, self.rss = fd_count(self.pid), rss_bytes(self.pid)

    def back_within(self, fds: int, rss_mb: float, timeout_s: float = 10.0) -> tuple[int, float]:
        """Wait (bounded) until fds <= baseline + `fds`; assert RSS <= baseline + `rss_mb` MB.
        Returns (extra fds, extra MB) at that moment."""
        deadline = time.monotonic() + timeout_s
        extra = fd_count(self.pid) - self.fds
        while extra > fds and time.monotonic() < deadline:
            time.sleep(0.1)
            extra = fd_count(self.pid) - self.fds
        grown = (rss_bytes(self.pid) - self.rss) / 2**20
        assert extra <= fds, f"{extra} descriptors more than before the attack"
        assert grown <= rss_mb, f"RSS grew {grown:.0f} MB"
        return extra, grown


class BystanderStream:
    """One ordinary /generate_stream request run in a thread beside an attack."""

    def __init__(self, base_url: str, tokens: int = STREAM_TOKENS) -> None:
        self.base_url = base_url
        self.body = {"inputs": "Hello there", "parameters": {"max_new_tokens": tokens, "seed": 3}}
        self.done_before_flood = False  # for a test to note
        self.events: list[str] = []
        self.error: BaseException | None = None
        self.started = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            with httpx.stream("POST", self.base_url + "/generate_stream", json=self.body,
                              timeout=60) as r:
                r.raise_for_status()
                for line in r.iter_lines():
                    if line.startswith("data:"):
                        self.events.append(line)
                        self.started.set()
        except BaseException as e:  # reported by result()
            self.error = e
        finally:
            self.started.set()

    def done(self) -> bool:
        return not self._thread.is_alive()

    def result(self, timeout: float = 60.0) -> list[str]:
        """The stream's events once it ended; raises if it failed or did not end in time."""
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "the bystander stream did not finish"
        if self.error is not None:
            raise self.error
        return self.events
