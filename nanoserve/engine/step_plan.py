"""What passes between the scheduler and the engine core in one step, as plain data.

A step is schedule -> execute -> update (vLLM's `EngineCore.step`): the scheduler's `schedule()`
returns a `StepPlan` (which requests run, which tokens each, the KV-slot bookkeeping to apply
first); the engine core executes it on the runner and returns a `StepOutput` (logits rows,
sampled tokens, failures); the scheduler's `update_from_output` turns that into token events.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from nanoserve.engine.request import Request
from nanoserve.engine.types import TokenEvent
from nanoserve.engine.work import SampleResult, WorkItem


@dataclass(frozen=True)
class CopyPrefix:
    """Copy the first `length` cached positions of slot `source` into slot `dest`."""

    source: int
    dest: int
    length: int


@dataclass(frozen=True)
class ResetSlot:
    """`req` was seated in `slot`: its per-slot sampling state starts from its context. Skipped
    when `req` no longer holds `slot` by the time it runs (its later seat has its own reset)."""

    req: Request
    slot: int


SlotOp = CopyPrefix | ResetSlot


@dataclass(frozen=True)
class StepPlan:
    """One step as the scheduler decided it. `slot_ops` run in order before the forward (they
    are what admission and prompt sharing did to the KV slots since the last step); `ended` are
    requests the scheduler ended before planning (cancelled, past their deadline)."""

    step: int  # this step's number; 0 when nothing runs
    items: list[WorkItem] = field(default_factory=list)
    slot_ops: list[SlotOp] = field(default_factory=list)
    ended: list[tuple[Request, TokenEvent]] = field(default_factory=list)

    @property
    def tokens(self) -> int:
        return sum(len(item.tokens) for item in self.items)


@dataclass(frozen=True)
class RowError:
    """A row whose sampling raised (its own parameters made it fail): it ends with `message`."""

    req: Request
    message: str


@dataclass
class StepOutput:
    """What the backend made of a plan. Item indices refer to `StepPlan.items`."""

    forward_done: float = 0.0  # perf_counter() when the forward ended
    errors: dict[int, str] = field(default_factory=dict)  # item index -> why its forward failed
    rows: list[int] = field(default_factory=list)  # items that completed their context, in order
    # The sampled rows (rows whose request samples), in order; a row that failed alone is a RowError.
    samples: list[SampleResult | RowError] = field(default_factory=list)
    # Decode items not sampled because their grammar mask was not ready (engine/grammar.py): their
    # token is fed again next step.
    deferred: set[int] = field(default_factory=set)


def samples_tokens(req: Request) -> bool:
    """Whether a completed row draws a token (a request with max_new_tokens 0 only scores its prompt)."""
    return req.params.max_new_tokens > 0
