"""Limits on connections, below HTTP: how many may be open, how long a request head may take and how
large it may grow, how long a kept-alive connection may sit idle.

`ConnectionLimits` holds the numbers (from settings, with the open-file limit applied by
`connection_capacity`); `ConnectionGuard` is what the protocol (nanoserve/server/http/protocol.py) tells when
a limit is hit: it counts `nanoserve_connection_limit_hits_total{limit}` and logs, at most one line
per limit every `LOG_INTERVAL_S` plus a count of the events folded into it, so that an attack
cannot turn the log into a second attack.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import time
from dataclasses import dataclass

from nanoserve.server.metrics.instruments import Instruments

log = logging.getLogger("nanoserve.connections")

# Room for the request line on top of max_header_bytes, when the head is counted as it arrives.
REQUEST_LINE_BYTES = 8 << 10
# File descriptors kept for everything but client sockets (checkpoint files, logs, the listener).
FD_RESERVE = 128
# Refused or answered-and-closing connections that may linger (so their answer is not lost to a
# reset) at once, and for how long; past that many, they are closed at once.
LINGER_MAX = 64
LINGER_S = 1.0
# What a lingering connection may still send, dropped unparsed, before it is closed at once (a
# reset). Most clients send a whole body before they read the answer, so a refused body's rest
# up to this is read and dropped and they get their 413; past it, a client that goes on sending
# (an announced gigabyte) costs the loop no more than this.
LINGER_MAX_BYTES = 16 << 20
LOG_INTERVAL_S = 10.0
# Pipelined requests parsed ahead of their turn on one connection (each holds its scope and body);
# while some wait, heads are parsed PIPELINED_PIECE bytes at a time so the count overshoots little,
# and the input behind them waits unparsed, closing the connection past MAX_UNPARSED_BYTES.
MAX_PIPELINED = 16
PIPELINED_PIECE = 1024
MAX_UNPARSED_BYTES = 1 << 20

# Every `limit` label value, so each series exists (at 0) from the first scrape.
LIMITS = ("max_connections", "max_connections_per_client", "header_bytes", "header_timeout",
          "idle_timeout", "parse_error", "pipelining")
_LEVELS = {"idle_timeout": logging.DEBUG, "header_timeout": logging.INFO, "parse_error": logging.INFO}


@dataclass(frozen=True)
class ConnectionLimits:
    """The protocol's limits; the defaults are the settings' defaults."""

    max_connections: int = 1024
    max_connections_per_client: int = 0  # 0: no limit per client address
    header_timeout: float = 10.0
    idle_timeout: float = 5.0
    max_head_bytes: int = (32 << 10) + REQUEST_LINE_BYTES


def raise_open_file_limit() -> int:
    """Raise the soft RLIMIT_NOFILE to the hard limit where allowed; the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 16)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as e:
            log.warning("could not raise the open-file limit from %d to %d: %s", soft, target, e)
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


def connection_capacity(requested: int, open_file_limit: int) -> int:
    """`requested`, lowered so that every open connection, the lingering ones and the server's own
    files fit under the open-file limit (past it, accept() fails and clients are reset unanswered)."""
    room = open_file_limit - FD_RESERVE - LINGER_MAX
    return max(1, min(requested, room if room > 0 else open_file_limit // 2))


class ConnectionGuard:
    """Shared by every connection of one server: open-connection count, limit hits, their log."""

    def __init__(self, limits: ConnectionLimits, instruments: Instruments | None = None) -> None:
        self.limits = limits
        self.open = 0  # admitted connections now open
        self._by_client: dict[str, int] = {}  # admitted connections open, per client address
        self.lingering = 0
        self._instruments = instruments
        self._quiet_until: dict[str, float] = {}
        self._held: dict[str, int] = {}
        if instruments is not None:
            for limit in LIMITS:
                instruments.connection_limit_hits.labels(limit=limit)
            instruments.connections_capacity.set(limits.max_connections)

    def admit(self, host: str | None) -> str | None:
        """Count a new connection from `host` in; or, when a limit is full, the limit's name."""
        if self.open >= self.limits.max_connections:
            return "max_connections"
        per_client = self.limits.max_connections_per_client
        if per_client and host is not None:
            held = self._by_client.get(host, 0)
            if held >= per_client:
                return "max_connections_per_client"
            self._by_client[host] = held + 1
        self.open += 1
        self._set_open()
        return None

    def closed(self, host: str | None) -> None:
        """A connection `admit` counted in closed."""
        self.open -= 1
        self._set_open()
        held = self._by_client.pop(host, 0) if host is not None else 0
        if host is not None and held > 1:
            self._by_client[host] = held - 1

    def _set_open(self) -> None:
        if self._instruments is not None:
            self._instruments.connections_open.set(self.open)

    def hit(self, limit: str, message: str) -> None:
        """A connection hit `limit` (one of LIMITS); `message` says what happened to it."""
        if self._instruments is not None:
            self._instruments.connection_limit_hits.labels(limit=limit).inc()
        level = _LEVELS.get(limit, logging.WARNING)
        if level == logging.DEBUG:  # routine (idle keep-alive closes): no rate limit needed
            log.debug("%s", message)
            return
        now = time.monotonic()
        if now >= self._quiet_until.get(limit, 0.0):
            self._quiet_until[limit] = now + LOG_INTERVAL_S
            log.log(level, "%s", message)
            return
        self._held[limit] = self._held.get(limit, 0) + 1
        if self._held[limit] == 1:  # the first event held back: say how many, when the interval ends
            asyncio.get_running_loop().call_later(self._quiet_until[limit] - now, self._flush, limit, level)

    def _flush(self, limit: str, level: int) -> None:
        held = self._held.pop(limit, 0)
        if held:
            self._quiet_until[limit] = time.monotonic() + LOG_INTERVAL_S
            log.log(level, "%d more connections hit the %s limit in the last %gs (not logged one by one)",
                    held, limit, LOG_INTERVAL_S)
