"""What a step asks a backend to compute: work items in, sampled tokens out."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from nanoserve.engine.request import Request


@dataclass
class WorkItem:
    """Feed `tokens` of `req` at positions start.. into its slot; sample if `completes`.
    Positions start..start+scores-1 score the prompt token after each (prompt_scores.py)."""

    req: Request
    tokens: list[int]
    start: int
    completes: bool
    scores: int = 0


def logit_rows(items: Sequence[WorkItem]) -> list[int]:
    """Which rows of a forward's tokens (item j's token k is row j * t + k, t tokens an item) a
    backend returns logits for: every row of an item that scores its prompt, else the last."""
    t = len(items[0].tokens)
    rows: list[int] = []
    for j, item in enumerate(items):
        rows += range(j * t, (j + 1) * t) if item.scores else [j * t + t - 1]
    return rows


@dataclass
class SampleResult:
    """Host-side results of one step's sampling, row-aligned with the rows that sampled."""

    reqs: list[Request]
    tokens: list[int]
    finite: list[bool]
    logprobs: list[float] | None
    top_logprobs: list[list[float]] | None
    top_ids: list[list[int]] | None


def needs_draw(req: Request) -> bool:
    """Whether a row needs more than the argmax of its raw logits: it samples, or a penalty
    moves its greedy pick."""
    return req.params.temperature > 0 or uses_penalties(req)


def uses_penalties(req: Request) -> bool:
    p = req.params
    return p.repetition_penalty not in (None, 1.0) or bool(p.frequency_penalty or p.presence_penalty)
