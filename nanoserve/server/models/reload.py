"""Reloading served models from disk without dropping a request: SIGHUP, POST /admin/reload, --watch.

For each model whose files changed (a cheap fingerprint first, then the content hash), the new
checkpoint is loaded beside the old one and validated completely (loading.py); only then is the
registry's entry swapped, so new requests go to the new engine while requests in flight finish on
the old one, which shuts down once it is idle. A checkpoint that fails validation leaves the old
version serving; the failure is logged, counted (nanoserve_model_reloads_total{result="failed"}),
kept in /info's `last_reload_error` and returned by the reload call.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client import Counter

from nanoserve.engine.config import EngineConfig
from nanoserve.engine.types import EngineObserver
from nanoserve.server.models.loading import load_served, retire
from nanoserve.server.models.registry import (
    ModelRegistry,
    ModelSpec,
    ServedModel,
    content_digest,
    fingerprint,
)

log = logging.getLogger("nanoserve.models")

WATCH_INTERVAL_S = 1.0


@dataclass
class ReloadResult:
    model: str
    result: str  # "reloaded", "unchanged" or "failed"
    version: str  # the version serving after the call
    previous: str | None = None  # the version replaced, when reloaded
    error: str | None = None  # why the files on disk are not served, when failed


class Reloader:
    """Reloads changed checkpoints one at a time (a lock: SIGHUP, the route and the watcher may
    overlap)."""

    def __init__(
        self, registry: ModelRegistry, config: EngineConfig, observer: EngineObserver, *,
        chat_template: Path | None, drain_timeout: float, counter: Counter,
        on_swap: Callable[[ServedModel], None],
    ) -> None:
        self.registry = registry
        self.config = config
        self.observer = observer
        self.chat_template = chat_template
        self.drain_timeout = drain_timeout
        self.counter = counter
        self.on_swap = on_swap
        self._lock = asyncio.Lock()
        self._failed: dict[str, tuple[object, ...]] = {}  # fingerprints that failed, by model
        self._tasks: set[asyncio.Future[object]] = set()

    async def reload(self, *, retry_failed: bool = True) -> list[ReloadResult]:
        """Reload every model whose files changed; one result per model."""
        async with self._lock:
            return [await self._reload_one(m, retry_failed) for m in self.registry]

    def changed(self) -> bool:
        """Whether any model's files look changed (and not already found bad as they are now)."""
        for m in self.registry:
            fp = fingerprint(m.path)
            if fp != m.fingerprint and fp != self._failed.get(m.name):
                return True
        return False

    async def watch(self, interval: float = WATCH_INTERVAL_S) -> None:
        """Poll the checkpoints' files; reload when one changes (runs until cancelled)."""
        while True:
            await asyncio.sleep(interval)
            try:
                if self.changed():
                    await self.reload(retry_failed=False)
            except Exception:
                log.exception("watching the checkpoints failed")

    def spawn(self, work: Coroutine[Any, Any, object]) -> None:
        """Run `work` in the background, referenced until it ends."""
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def stop(self) -> None:
        """Cancel the watcher and the retirements (the server's shutdown stops every engine)."""
        for task in list(self._tasks):
            task.cancel()

    async def _reload_one(self, served: ServedModel, retry_failed: bool) -> ReloadResult:
        name, current = served.name, served.version.label()
        fp = fingerprint(served.path)
        if fp == served.fingerprint:
            return ReloadResult(name, "unchanged", current)
        if fp == self._failed.get(name) and not retry_failed:
            return ReloadResult(name, "failed", current, error=served.last_error)
        try:
            digest = await asyncio.to_thread(content_digest, served.path)
        except OSError:
            digest = None  # missing or unreadable: loading says why
        if digest == served.version.digest:
            served.fingerprint = fp  # touched or rewritten with the same contents
            return ReloadResult(name, "unchanged", current)
        try:
            new = await load_served(ModelSpec(served.path, name), self.config, self.observer,
                                    chat_template=self.chat_template)
        except Exception as e:  # anything: the old version keeps serving
            reason = str(e) or type(e).__name__
            self._failed[name] = fp
            served.last_error = reason
            self.counter.labels(model=name, result="failed").inc()
            log.warning("reload of %s failed; %s keeps serving: %s", name, current, reason)
            return ReloadResult(name, "failed", current, error=reason)
        new.reloads = served.reloads + 1
        old = self.registry.swap(new)
        self._failed.pop(name, None)
        self.on_swap(new)
        self.counter.labels(model=name, result="reloaded").inc()
        log.info("reloaded %s: %s -> %s (requests in flight finish on %s)", name, current,
                 new.version.label(), current)
        self.spawn(retire(old.engine, self.registry.retiring, self.drain_timeout))
        return ReloadResult(name, "reloaded", new.version.label(), previous=current)
