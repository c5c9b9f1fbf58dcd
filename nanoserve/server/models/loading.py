"""Loading a model to serve, validated completely before anything serves it, and retiring one.

Validation is everything a start-up does: the checkpoint's files are read and checked
(load_checkpoint: keys, shapes, dtypes, values, tokenizer), the engine is built (its memory check
counts what is loaded already, the old version of this model included), and the engine's warm-up
runs a greedy and a sampled generation. A checkpoint whose files change while it loads is refused,
so a writer still writing is never served half-read.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace
from pathlib import Path

from nanoserve.engine.config import EngineConfig
from nanoserve.engine.engine import Engine
from nanoserve.engine.types import EngineObserver
from nanoserve.model.checkpoint import Checkpoint, load_checkpoint, with_chat_template_file
from nanoserve.server.models.registry import ModelSpec, ModelVersion, ServedModel, content_digest, fingerprint
from nanoserve.server.runtime.heap import return_free_memory

log = logging.getLogger("nanoserve.models")

# A swapped-out engine shuts down once it has had no request for this long: a request that resolved
# it just before the swap still gets to submit (resolution and submission are a few awaits apart).
RETIRE_IDLE_S = 1.0


class ModelLoadError(Exception):
    """A checkpoint that cannot be served; the message says why."""


class CheckpointChanged(ModelLoadError):
    """The checkpoint's files changed while it loaded: reading it again may succeed."""


# A server starting beside a trainer that saves every few seconds may see a save land during its
# first load: it reads the checkpoint again, and the last time serves what it read.
START_ATTEMPTS = 3


def _load(path: Path, chat_template: Path | None) -> Checkpoint:
    checkpoint = load_checkpoint(path)
    if chat_template is not None:
        checkpoint = with_chat_template_file(checkpoint, chat_template)
    return checkpoint


async def load_served(
    spec: ModelSpec, config: EngineConfig, observer: EngineObserver, *,
    chat_template: Path | None = None, checkpoint: Checkpoint | None = None, accept_change: bool = False,
) -> ServedModel:
    """Load, build and warm up `spec`'s model (raises ModelLoadError, or what loading raised).
    `checkpoint`: already loaded from `spec.path` (the first start's, validated by `nanoserve serve`).
    `accept_change`: serve it even if the files changed while it loaded (a complete checkpoint all the
    same: loading checks every tensor), keeping the fingerprint from before so a watcher reloads."""
    path = spec.path
    before = fingerprint(path)
    try:
        digest = await asyncio.to_thread(content_digest, path)
    except OSError as e:
        raise ModelLoadError(f"cannot read {path}: {e.strerror or e}") from None
    if checkpoint is None:
        checkpoint = await asyncio.to_thread(_load, path, chat_template)
    name = spec.name or checkpoint.name
    if name != checkpoint.name:  # responses, /info and model cards name what the request named
        checkpoint = replace(checkpoint, name=name)
    steps = checkpoint.provenance.get("steps")
    version = ModelVersion(digest, steps if isinstance(steps, int) else None)
    engine = await asyncio.to_thread(Engine, checkpoint, config, observer)
    del checkpoint
    return_free_memory()  # the weights the engine released (nanoserve/server/runtime/heap.py)
    engine.start()
    try:
        await engine.warmup()
        if fingerprint(path) != before:
            if not accept_change:
                raise CheckpointChanged(f"{path} changed while it was loading (a writer still writing?); "
                                        "the next reload reads it again")
            log.warning("%s changed while it was loading; serving what was loaded (%s), which a reload "
                        "replaces", path, version.label())
    except BaseException:
        await engine.shutdown(0.0)
        raise
    return ServedModel(name, path, engine, version, before, loaded_at=time.time())


async def retire(engine: Engine, retiring: set[Engine], drain_timeout: float) -> None:
    """Shut a swapped-out engine down once its requests have finished (however long they take), then
    return its memory."""
    retiring.add(engine)
    try:
        idle_since: float | None = None
        while engine.health():
            stats = engine.stats()
            busy = stats.running or stats.waiting or engine.embeddings.unfinished
            now = time.monotonic()
            idle_since = None if busy else (idle_since or now)
            if idle_since is not None and now - idle_since >= RETIRE_IDLE_S:
                break
            await asyncio.sleep(0.05)
        cut = await engine.shutdown(drain_timeout)
        log.info("retired %s's previous engine%s", engine.checkpoint.name,
                 f" ({cut} requests cut)" if cut else "")
    except Exception:
        log.exception("retiring an engine failed")
    finally:
        retiring.discard(engine)
        return_free_memory()
