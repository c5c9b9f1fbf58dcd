"""Which models are served, under which names, and which engine answers each.

The registry maps a name to a `ServedModel` (its checkpoint directory, engine and version). A
request resolves its model once, at the start, and keeps that engine object to its end; a reload
swaps the registry's entry, so the next request gets the new engine while those in flight finish on
the old (nanoserve/server/models/reload.py). Everything here runs on the event loop: a swap and a
resolution never interleave.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nanoserve.engine.engine import Engine
from nanoserve.model.checkpoint import CONFIG_FILE, TOKENIZER_FILE, WEIGHTS_FILE

# The files load_checkpoint reads: a change to any of them is a new version.
CHECKPOINT_FILES = (CONFIG_FILE, TOKENIZER_FILE, WEIGHTS_FILE)


@dataclass(frozen=True)
class ModelSpec:
    """One `--checkpoint` value: PATH, or NAME=PATH (else the checkpoint's own name is used)."""

    path: Path
    name: str | None = None

    @classmethod
    def parse(cls, value: str) -> ModelSpec:
        name, sep, path = value.partition("=")
        if sep and name and "/" not in name and not Path(value).exists():
            return cls(Path(path).expanduser().resolve(), name.strip())
        return cls(Path(value).expanduser().resolve())


def model_specs(checkpoint: Path, models: list[str]) -> list[ModelSpec]:
    """What to serve: `models` when given (the first is the default), else `checkpoint` alone."""
    return [ModelSpec.parse(m) for m in models] if models else [ModelSpec(checkpoint)]


def fingerprint(path: Path) -> tuple[Any, ...]:
    """Cheap change detection: the directory's and each checkpoint file's identity, size and mtime
    (a renamed-in directory, a replaced or rewritten file all change it)."""
    parts: list[Any] = []
    for p in (path, *(path / f for f in CHECKPOINT_FILES)):
        try:
            st = p.stat()
            parts.append((p.name, st.st_ino, st.st_size, st.st_mtime_ns))
        except OSError:
            parts.append((p.name, None))
    return tuple(parts)


def content_digest(path: Path) -> str:
    """sha256 over the checkpoint's files (names and contents, in a fixed order)."""
    h = hashlib.sha256()
    for name in CHECKPOINT_FILES:
        h.update(name.encode() + b"\0")
        with open(path / name, "rb") as f:
            h.update(hashlib.file_digest(f, "sha256").digest())
    return h.hexdigest()


@dataclass(frozen=True)
class ModelVersion:
    """A checkpoint's version: its content hash and the training step it was saved at."""

    digest: str
    step: int | None

    def label(self) -> str:
        """`sha256:<12 hex>` and `@step N` when the provenance records a step."""
        short = f"sha256:{self.digest[:12]}"
        return short if self.step is None else f"{short}@step{self.step}"


@dataclass
class ServedModel:
    name: str
    path: Path
    engine: Engine
    version: ModelVersion
    fingerprint: tuple[Any, ...]
    reloads: int = 0
    last_error: str | None = None
    loaded_at: float = field(default=0.0)

    def describe(self) -> dict[str, Any]:
        """The model's entry in /info and the reload answer."""
        return {
            "name": self.name, "version": self.version.label(), "sha256": self.version.digest,
            "step": self.version.step, "window": self.engine.window, "reloads": self.reloads,
            "last_reload_error": self.last_error,
        }


class UnknownModel(LookupError):
    def __init__(self, asked: str, served: list[str]) -> None:
        self.asked = asked
        self.served = served
        names = ", ".join(repr(n) for n in served)
        super().__init__(f"model {asked!r} is not served; this server serves {names}")


class ModelRegistry:
    """Name -> served model, in `--checkpoint` order (the first is the default)."""

    def __init__(self) -> None:
        self._models: dict[str, ServedModel] = {}
        self.retiring: set[Engine] = set()  # swapped out, finishing their requests

    def add(self, served: ServedModel) -> None:
        if served.name in self._models:
            raise ValueError(f"two models are named {served.name!r}: name one of them with NAME=PATH")
        self._models[served.name] = served

    def swap(self, served: ServedModel) -> ServedModel:
        """Put `served` in its name's place; returns the entry it replaced."""
        old = self._models[served.name]
        self._models[served.name] = served
        return old

    def names(self) -> list[str]:
        return list(self._models)

    def __iter__(self) -> Iterator[ServedModel]:
        return iter(list(self._models.values()))

    def __len__(self) -> int:
        return len(self._models)

    @property
    def default(self) -> ServedModel | None:
        return next(iter(self._models.values()), None)

    def resolve(self, name: str | None) -> ServedModel | None:
        """The model a request names. None or "" is the default; so is any name while one model is
        served (clients send placeholders such as "tgi" or "gpt-4"; today's behaviour). None when
        nothing is loaded yet. Raises UnknownModel when several are served and none has this name."""
        default = self.default
        if default is None:
            return None
        if not name:
            return default
        found = self._models.get(name)
        if found is not None:
            return found
        if len(self._models) == 1:
            return default
        raise UnknownModel(name, self.names())

    def engines(self) -> list[Engine]:
        """Every engine running: the served ones and those still finishing after a swap."""
        return [m.engine for m in self._models.values()] + list(self.retiring)
