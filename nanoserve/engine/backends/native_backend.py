"""The native CPU backend: every forward is one call of the C step (native_step.py), and every
row that draws is drawn by its C sampler (native/sampler.inc)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from nanoserve.engine.backends.base import Backend
from nanoserve.engine.kv_slots import SpanKVCache
from nanoserve.engine.native_step import NativeStep, SamplePenalties, release_weights
from nanoserve.engine.penalties import PenaltyState
from nanoserve.engine.request import Request
from nanoserve.engine.work import WorkItem, logit_rows, needs_draw, uses_penalties
from nanoserve.model.gpt import GPT
from nanoserve.model.sampling import seeded_uniform


class NativeBackend(Backend):
    name = "native"
    # Rows are computed independently (no reduction runs across rows; threads split output
    # features), so a row's logits do not depend on its batch or the thread count.
    batch_invariant = True

    def __init__(
        self, model: GPT, cache: SpanKVCache, max_rows: int, cpu_threads: int, isa: str,
        quantize: str = "none", screen_usable: int = 0,
    ) -> None:
        """`screen_usable`: the tokenizer's vocabulary, to screen a float32 model's output layer
        (native/head_screen.inc) over it where this CPU can; 0: never screen."""
        self.cache = cache
        self.quantize = quantize
        self.device = torch.device("cpu")
        self.step = NativeStep(model, cache, max_threads=cpu_threads, max_rows=max_rows, hold_once=True,
                               max_isa=isa, quantize=quantize, screen_usable=screen_usable)
        self.usable = screen_usable
        self.max_rows = self.step.max_rows
        # The step holds its own copies of the weights; the model's would only hold them twice.
        # Nothing may run the model's forward after this (its weights become meta tensors).
        self.released_bytes = release_weights(model)

    def kernels(self) -> str:
        return self.step.isa

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "quantize": self.quantize, "screened_head": self.step.screening}

    def forward(self, items: Sequence[WorkItem]) -> torch.Tensor:
        t = len(items[0].tokens)
        # Every token is a row; a prompt chunk's rows see each other's keys (native_step.py).
        tokens = [tok for it in items for tok in it.tokens]
        positions = [p for it in items for p in range(it.start, it.start + t)]
        rows = [it.req.slot for it in items for _ in range(t)]
        out = logit_rows(items)
        screen: list[int] | None = None
        if self.step.screening:  # a k per logit row (an item scoring its prompt has t, never screened)
            screen = []
            for it in items:
                screen += [0] * t if it.scores else [screen_width(it, self.usable)]
        return self.step(tokens, positions, rows, out, screen)

    def draw(self, reqs: list[Request], logits: torch.Tensor, greedy: torch.Tensor,
             penalties: PenaltyState) -> torch.Tensor:
        logits = logits.to(torch.float32).contiguous()  # as the step returns them: no copy
        tokens = greedy.clone()
        drawing = [needs_draw(r) for r in reqs]
        ps = [r.params for r in reqs]
        penal = [j for j, r in enumerate(reqs) if drawing[j] and uses_penalties(r)]
        self.step.sample(
            logits,
            [p.temperature if d else -1.0 for p, d in zip(ps, drawing, strict=True)],  # -1: keep greedy
            [p.top_k or 0 for p in ps],
            [p.top_p if p.top_p is not None else 1.0 for p in ps],
            [p.min_p or 0.0 for p in ps],
            [seeded_uniform(r.seed, len(r.generated)) for r in reqs],
            tokens,
            SamplePenalties(
                penalties.seen, penalties.counts, [r.slot for r in reqs],
                [p.repetition_penalty or 1.0 for p in ps], [p.frequency_penalty for p in ps],
                [p.presence_penalty for p in ps],
            ) if penal else None,
            typical_p=[p.typical_p if p.typical_p is not None else 1.0 for p in ps],
        )
        if penal:
            penalties.record([reqs[j] for j in penal], tokens[penal])
        return tokens


def screen_width(item: WorkItem, usable: int) -> int:
    """The k of the only logits the item's next token is read from (native/head_screen.inc): 1 for
    a greedy pick, top_k for a top-k draw; 0 when the whole row is read: logprobs, logit_bias, a
    grammar, penalties, a draw without top_k, or a chunk that samples nothing (any k: its logits
    are dropped, so 1)."""
    if not item.completes:
        return 1
    req = item.req
    p = req.params
    if p.logprobs or p.top_n_tokens or p.logit_bias or req.constraint is not None or uses_penalties(req):
        return 0
    if p.temperature == 0:
        return 1
    return p.top_k if p.top_k and p.top_k < usable else 0
