"""The engine core: one step as schedule -> execute -> update.

The scheduler decides (`Scheduler.schedule` returns a `StepPlan`, plain data), the core executes
the plan on the runner (the KV-slot bookkeeping, the forwards, the draws) and hands the output
back (`Scheduler.update_from_output` turns it into token events). Only `execute` touches tensors.
"""

from __future__ import annotations

import logging
import time

import torch

from nanoserve.engine.grammar_limits import MASK_WAIT_S
from nanoserve.engine.request import Request
from nanoserve.engine.runner import ModelRunner
from nanoserve.engine.scheduler import Scheduler, StepResult
from nanoserve.engine.step_plan import CopyPrefix, RowError, StepOutput, StepPlan, samples_tokens
from nanoserve.engine.work import SampleResult

log = logging.getLogger(__name__)


class EngineCore:
    """Owned by the engine thread, like the scheduler and the runner it drives."""

    def __init__(self, scheduler: Scheduler, runner: ModelRunner) -> None:
        self.scheduler = scheduler
        self.runner = runner

    def step(self) -> StepResult:
        plan = self.scheduler.schedule(time.perf_counter())
        return self.scheduler.update_from_output(plan, self.execute(plan))

    def execute(self, plan: StepPlan) -> StepOutput:
        """Apply the plan's slot operations, run its items and draw a token for every row that
        completed its context and samples."""
        for op in plan.slot_ops:
            if isinstance(op, CopyPrefix):
                self.runner.cache.copy_prefix(op.source, op.dest, op.length)
            elif op.req.slot == op.slot:
                self.runner.reset_slot(op.req)
        if not plan.items:
            return StepOutput()
        # Grammar masks of the rows this step samples, computed beside the forward.
        self.runner.grammar_mask.start([item.req.constraint for item in plan.items if item.completes
                                        and item.req.constraint is not None and samples_tokens(item.req)])
        began = time.perf_counter()
        forward = self.runner.forward(plan.items)
        out = StepOutput(forward_done=time.perf_counter(), errors=forward.errors, rows=forward.rows)
        if forward.logits is None:
            return out
        reqs = [plan.items[i].req for i in forward.rows]
        logits = forward.logits
        # A mask may take the forward's end plus half the forward's time (at most MASK_WAIT_S): on a
        # model whose step is a millisecond, a fixed wait of MASK_WAIT_S would let one costly grammar
        # triple everyone's step.
        wait = min(MASK_WAIT_S, 0.5 * (out.forward_done - began))
        deferred = self._late_masks(plan, forward.rows, out.forward_done + wait)
        out.deferred = {forward.rows[j] for j in deferred}
        keep = [j for j, req in enumerate(reqs) if samples_tokens(req) and j not in deferred]
        if len(keep) < len(reqs):  # requests that only score their prompt (or wait for a mask) draw nothing
            if not keep:
                return out
            reqs, logits = [reqs[j] for j in keep], logits[keep]
        self._sample_isolated(reqs, logits, out.samples)
        return out

    def _late_masks(self, plan: StepPlan, rows: list[int], deadline: float) -> set[int]:
        """Positions in `rows` of decode rows whose grammar mask, begun with the forward, is still
        being computed at `deadline`: they wait for the next step (Scheduler.update_from_output
        feeds their token again) rather than delay the batch."""
        found = [(j, c) for j, i in enumerate(rows)
                 if (c := plan.items[i].req.constraint) is not None and samples_tokens(plan.items[i].req)]
        if not found:
            return set()
        late = self.runner.grammar_mask.late([c for _, c in found], deadline)
        return {j for (j, _), slow in zip(found, late, strict=True)
                if slow and len(plan.items[rows[j]].tokens) == 1}

    def _sample_isolated(self, reqs: list[Request], logits: torch.Tensor,
                         samples: list[SampleResult | RowError]) -> None:
        """Sample; if sampling raises, bisect so that only the rows whose own parameters make it
        fail get an error, and their batch-mates their tokens (a draw depends only on the row's own
        seed and step, so drawing a row again gives the same token)."""
        try:
            samples.append(self.runner.next_tokens(reqs, logits))
        except Exception as e:
            if len(reqs) == 1:
                log.warning("request %s failed in sampling: %s", reqs[0].request_id, e)
                samples.append(RowError(reqs[0], f"sampling failed: {type(e).__name__}: {e}"))
                return
            half = len(reqs) // 2
            self._sample_isolated(reqs[:half], logits[:half], samples)
            self._sample_isolated(reqs[half:], logits[half:], samples)
