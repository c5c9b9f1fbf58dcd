"""Faults injected through the backend seam, for tests only (nothing in the server knows of them).

`FaultyBackend` wraps a real backend: a row whose request's prompt contains the marker gets NaN
logits (`nan:<marker>`), or makes the forward it is in raise (`raise:<marker>`). Tests use it three
ways:
- in process: `with injected_faults("nan:POISON"): Engine(...)` (or `create_app(...)`);
- on a real server process: `start_server(..., fault="raise:POISON")` (tests/server/server.py),
  which runs `python -m tests.faults serve ...`: this module installs the fault, then runs the
  real `nanoserve` command line.
"""

from __future__ import annotations

import os
import sys
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from nanoserve.engine.backends import factory
from nanoserve.engine.backends.base import Backend
from nanoserve.engine.penalties import PenaltyState
from nanoserve.engine.request import Request
from nanoserve.engine.work import WorkItem

FAULT_ENV = "NANOSERVE_TEST_FAULT"


class InjectedFault(RuntimeError):
    """What a `raise:` fault raises in the forward pass."""


class FaultyBackend(Backend):
    def __init__(self, inner: Backend, spec: str) -> None:
        kind, _, marker = spec.partition(":")
        if kind not in ("nan", "raise") or not marker:
            raise ValueError(f"a fault is 'nan:<marker>' or 'raise:<marker>', got {spec!r}")
        self.inner, self.kind, self.marker = inner, kind, marker
        self.name = inner.name  # type: ignore[misc]  # it reports as the backend it wraps
        self.cache, self.device = inner.cache, inner.device
        self.max_rows, self.batch_invariant = inner.max_rows, inner.batch_invariant
        self._targeted: weakref.WeakKeyDictionary[Request, bool] = weakref.WeakKeyDictionary()

    def _hit(self, req: Request) -> bool:
        if req not in self._targeted:
            self._targeted[req] = self.marker in req.tokenizer.decode(req.prompt_ids)
        return self._targeted[req]

    def forward(self, items: Sequence[WorkItem]) -> torch.Tensor:
        hit = [j for j, item in enumerate(items) if self._hit(item.req)]
        if hit and self.kind == "raise":
            raise InjectedFault("injected fault (raise)")
        logits = self.inner.forward(items)
        if hit:
            # Rows as work.logit_rows returns them: every position of an item scoring its prompt.
            widths = [len(item.tokens) if item.scores else 1 for item in items]
            owners = [j for j, width in enumerate(widths) for _ in range(width)]
            logits = logits.clone()
            logits[[r for r, j in enumerate(owners) if j in hit]] = float("nan")
        return logits

    def draw(self, reqs: list[Request], logits: torch.Tensor, greedy: torch.Tensor,
             penalties: PenaltyState) -> torch.Tensor:
        return self.inner.draw(reqs, logits, greedy, penalties)

    def kernels(self) -> str:
        return self.inner.kernels()


@contextmanager
def injected_faults(spec: str) -> Iterator[None]:
    """Engines built inside get their backend wrapped in a FaultyBackend."""
    real = factory.choose_backend

    def faulty(*args: Any, **kwargs: Any) -> tuple[Backend, str]:
        backend, why = real(*args, **kwargs)
        return FaultyBackend(backend, spec), why

    factory.choose_backend = faulty  # type: ignore[assignment]  # the engine calls it through the module
    try:
        yield
    finally:
        factory.choose_backend = real  # type: ignore[assignment]


def main(argv: Sequence[str]) -> int:
    """`nanoserve` with the fault of $NANOSERVE_TEST_FAULT installed."""
    from nanoserve.cli import main as nanoserve

    with injected_faults(os.environ[FAULT_ENV]):
        return nanoserve(list(argv))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
