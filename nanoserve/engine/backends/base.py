"""The seam between the engine and the code that computes: what a backend does for a step.

The engine schedules (which requests run, which of their tokens, where in the KV cache); a
backend computes: it holds the KV cache, runs a forward over a group of work items that each feed
the same number of tokens, and draws the next token of the rows that sample. Two implement it:
`NativeBackend` (the C step and sampler, CPU) and `TorchBackend` (torch's kernels, any device).
`choose_backend` (factory.py) picks one at start-up and says why.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, ClassVar

import torch

from nanoserve.engine.kv_slots import SpanKVCache
from nanoserve.engine.penalties import PenaltyState
from nanoserve.engine.request import Request
from nanoserve.engine.work import WorkItem


class Backend(ABC):
    name: ClassVar[str]
    cache: SpanKVCache
    device: torch.device
    # The most tokens one forward may hold (0: any number); the runner cuts groups to fit.
    max_rows: int = 0
    # Whether a row's logits are the same whatever rows share its forward: deterministic mode
    # may then batch rows instead of running each alone.
    batch_invariant: bool = False

    @abstractmethod
    def forward(self, items: Sequence[WorkItem]) -> torch.Tensor:
        """Feed every item's tokens into its slot (each item the same number of tokens, each its
        own slot, its cache holding positions < item.start); returns the logits at the rows
        `work.logit_rows(items)` names, in that order: each item's last token, or every token of
        an item that scores its prompt (item.scores)."""

    @abstractmethod
    def draw(self, reqs: list[Request], logits: torch.Tensor, greedy: torch.Tensor,
             penalties: PenaltyState) -> torch.Tensor:
        """The next token of each row of `logits` (N, V): rows that draw (work.needs_draw) by their
        parameters, seed and step; the others keep `greedy` (their argmax). Records the drawn
        tokens of rows with penalties in `penalties`."""

    @abstractmethod
    def kernels(self) -> str:
        """Which kernels run, for /info and the start-up log (e.g. "avx512", "torch cpu")."""

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "kernels": self.kernels()}
