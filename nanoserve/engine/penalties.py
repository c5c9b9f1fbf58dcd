"""Penalty state per KV slot, shared by every backend's sampler: which tokens a sequence's
context holds (repetition penalty) and how often it generated each (frequency and presence)."""

from __future__ import annotations

import torch

from nanoserve.engine.request import Request
from nanoserve.engine.work import uses_penalties


class PenaltyState:
    def __init__(self, slots: int, vocab: int, device: torch.device) -> None:
        # Kept on the device so a step never rebuilds them from lists.
        self.seen = torch.zeros(slots, vocab, dtype=torch.bool, device=device)
        self.counts = torch.zeros(slots, vocab, dtype=torch.int32, device=device)
        self.device = device

    def reset_slot(self, req: Request) -> None:
        """`req` was admitted to its slot: what its context holds, and what it generated before a
        preemption, count."""
        if not uses_penalties(req):
            return
        self.seen[req.slot].zero_()
        self.counts[req.slot].zero_()
        self.seen[req.slot, torch.tensor(req.prompt_ids, device=self.device)] = True
        if req.generated:  # a preempted request admitted again: what it generated so far counts
            generated = torch.tensor(req.generated, device=self.device)
            self.seen[req.slot, generated] = True
            self.counts[req.slot].index_put_(
                (generated,), torch.ones_like(generated, dtype=torch.int32), accumulate=True
            )

    def record(self, reqs: list[Request], tokens: torch.Tensor) -> None:
        """The tokens just drawn for `reqs` (row-aligned) join their slots' state."""
        rows = [j for j, r in enumerate(reqs) if uses_penalties(r)]
        if not rows:
            return
        sel = torch.tensor(rows, device=self.device)
        slots = torch.tensor([reqs[j].slot for j in rows], device=self.device)
        toks = tokens[sel]
        self.seen[slots, toks] = True
        self.counts.index_put_((slots, toks), torch.ones_like(toks, dtype=torch.int32), accumulate=True)
