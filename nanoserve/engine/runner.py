"""The tensor side of a step: batched forwards over the KV cache slots, then sampling.

The scheduler decides *what* runs (which rows, which tokens, which positions); the runner turns
that into as few forward passes as the backend takes (backends/), isolates failures to the rows
that caused them, and turns logits into tokens, logprobs and finiteness flags.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ParamSpec, TypeVar

import torch

from nanoserve.engine.backends.base import Backend
from nanoserve.engine.grammar import GrammarMask
from nanoserve.engine.penalties import PenaltyState
from nanoserve.engine.prompt_scores import PromptScores, reduce_rows
from nanoserve.engine.request import Request
from nanoserve.engine.threads import ThreadTuner
from nanoserve.engine.work import SampleResult, WorkItem, needs_draw
from nanoserve.model.sampling import row_max, token_logprobs

log = logging.getLogger(__name__)
P = ParamSpec("P")
R = TypeVar("R")


@dataclass
class Forward:
    """A step's logits: row k belongs to item rows[k]; failed items are in errors instead."""

    rows: list[int] = field(default_factory=list)
    logits: torch.Tensor | None = None  # (len(rows), V)
    errors: dict[int, str] = field(default_factory=dict)
    pieces: list[torch.Tensor] = field(default_factory=list)  # one per group, joined into logits

    def joined(self) -> Forward:
        # One group (every decode step without prompt chunks) is handed on as it came: no copy.
        if self.pieces:
            self.logits = self.pieces[0] if len(self.pieces) == 1 else torch.cat(self.pieces)
        self.pieces = []
        return self


def _inference(fn: Callable[P, R]) -> Callable[P, R]:
    """torch.inference_mode for callers outside it; free for the engine thread, which runs its
    whole loop inside one (entering and leaving the mode per call was ~4% of a batch-1 step at
    10.7M, measured with py-spy)."""

    @functools.wraps(fn)
    def run(*args: P.args, **kwargs: P.kwargs) -> R:
        if torch.is_inference_mode_enabled():
            return fn(*args, **kwargs)
        with torch.inference_mode():
            return fn(*args, **kwargs)

    return run


class ModelRunner:
    """Runs a step's work items on the backend as few forwards as they fit in, isolates a failure
    to the rows that cause it, and samples. Owns the penalty state and the thread tuner."""

    def __init__(self, backend: Backend, vocab: int, usable_vocab: int, deterministic: bool = False,
                 cpu_threads: int = 1) -> None:
        self.backend = backend
        self.cache = backend.cache
        self.device = backend.device
        self.vocab = vocab
        # nanoGPT pads the vocabulary (50257 -> 50304) for speed: ids the tokenizer cannot
        # decode must never be sampled.
        self.usable_vocab = usable_vocab
        self.deterministic = deterministic
        self.grammar_mask = GrammarMask()
        self.penalties = PenaltyState(backend.cache.slots, vocab, self.device)
        # CPU threads per forward: measured per forward size, see threads.py. Deterministic
        # mode keeps one fixed count (a different count may change the kernels' rounding).
        self.cpu_threads = cpu_threads
        self.threads = ThreadTuner(cpu_threads, enabled=self.device.type == "cpu" and not deterministic)

    # ---- forward -------------------------------------------------------------------------
    def forward(self, items: list[WorkItem]) -> Forward:
        """Run every item; returns the last-position logits of the items that complete their
        context (one row each, in `Forward.rows` order) and an error text per failed item index."""
        groups: dict[int, list[int]] = {}
        max_rows = self.backend.max_rows
        for i, item in enumerate(items):
            # Deterministic mode runs rows alone, unless the backend computes each row the same
            # way whatever the batch (then they may share a forward).
            invariant = self.backend.batch_invariant and len(item.tokens) <= max_rows
            key = i if self.deterministic and not invariant else -len(item.tokens)
            groups.setdefault(key, []).append(i)
        out = Forward()
        for idx in groups.values():
            # Rows in slot order: consecutive slots let the cache hand out a view, not a copy.
            idx.sort(key=lambda i: items[i].req.slot)
            t = len(items[idx[0]].tokens)
            # A backend with a row limit gets pieces of at most max_rows tokens.
            per = max_rows // t if max_rows else len(idx)
            per = per if per > 0 else len(idx)
            for k in range(0, len(idx), per):
                self._run_isolated(items, idx[k : k + per], out)
        return out.joined()

    def _run_isolated(self, items: list[WorkItem], idx: list[int], out: Forward) -> None:
        """Forward a group; if it raises, bisect so only the culprit rows fail."""
        try:
            rows = self._run_group([items[i] for i in idx])
        except Exception as e:  # any failure is isolated to its rows
            if len(idx) == 1:
                log.warning("request %s failed in forward: %s", items[idx[0]].req.request_id, e)
                out.errors[idx[0]] = f"forward pass failed: {type(e).__name__}: {e}"
                return
            half = len(idx) // 2
            self._run_isolated(items, idx[:half], out)
            self._run_isolated(items, idx[half:], out)
            return
        keep = [j for j, i in enumerate(idx) if items[i].completes]
        if not keep:
            return
        if len(keep) < len(idx):  # prompt chunks that do not end their prompt sample nothing
            rows = rows[keep]
        out.rows += [idx[j] for j in keep]
        out.pieces.append(rows)

    @_inference
    def _run_group(self, items: list[WorkItem]) -> torch.Tensor:
        t = len(items[0].tokens)
        if self.backend.max_rows and len(items) * t > self.backend.max_rows:
            raise RuntimeError(f"a forward of {len(items) * t} tokens is more than the backend's "
                               f"{self.backend.max_rows} rows")  # forward() never sends one
        self.threads.begin(len(items) * t)
        logits = self.backend.forward(items)
        self.threads.end()
        if any(item.scores for item in items):
            logits = self._score_prompts(items, logits)
        return logits  # (G, V)

    def _score_prompts(self, items: list[WorkItem], logits: torch.Tensor) -> torch.Tensor:
        """Reduce the rows of items that score their prompt (every position's, work.logit_rows) to
        each next prompt token's logprob and top N, recorded on the request; returns each item's
        last row, (G, V). Records nothing unless every item's reduction succeeds (a failure is
        retried in smaller groups by _run_isolated)."""
        t = len(items[0].tokens)
        last: list[int] = []
        done: list[tuple[Request, PromptScores]] = []
        at = 0
        for item in items:
            width = t if item.scores else 1
            if item.scores:
                req = item.req
                following = req.prompt_ids[item.start + 1 : item.start + 1 + item.scores]
                top_n = req.params.prompt_logprobs or 0
                done.append((req, reduce_rows(logits[at : at + item.scores], following, top_n,
                                              self.usable_vocab)))
            at += width
            last.append(at - 1)
        for req, scores in done:
            req.prompt_scores.extend(scores)
        return logits[last]

    def reset_slot(self, req: Request) -> None:
        self.penalties.reset_slot(req)

    # ---- sampling ------------------------------------------------------------------------
    @_inference
    def next_tokens(self, reqs: list[Request], logits: torch.Tensor) -> SampleResult:
        """Sample one token for each row of logits (N, V); rows without a usable distribution
        (a NaN, a +inf, or nothing above -inf) are flagged."""
        if self.usable_vocab < self.vocab:
            logits[:, self.usable_vocab :] = float("-inf")
        self._add_logit_bias(reqs, logits)
        # Structured output: a constrained row's disallowed tokens become -inf here, before the
        # greedy pick and either backend's draw (rows without a grammar are not touched).
        constrained = [(j, r.constraint) for j, r in enumerate(reqs) if r.constraint is not None]
        if constrained:
            self.grammar_mask.apply(constrained, logits)
        # One pass gives both the check and the greedy pick: max propagates NaN, a +inf max breaks
        # the softmax, an all -inf row has nothing to pick; -inf entries elsewhere are ordinary
        # (probability zero). isfinite().all() + where + argmax took 3.6x as long at 50k logits.
        top, greedy = row_max(logits)  # ties: the first index, as argmax
        finite = [math.isfinite(v) for v in top]  # a few rows: cheaper than a torch op
        if not any(needs_draw(r) for r in reqs):
            tokens = greedy  # what a draw returns for such a batch, without running one
        else:
            if not all(finite):  # rows without a distribution sample from zeros (then flagged)
                logits = torch.where(torch.tensor(finite, device=logits.device).view(-1, 1), logits, 0.0)
            tokens = self.backend.draw(reqs, logits, greedy, self.penalties)
        top_n = max(r.params.top_n_tokens for r in reqs)
        want_lp = top_n > 0 or any(r.params.logprobs for r in reqs)
        lp = top_v = top_i = None
        if want_lp:
            lp, top_v, top_i = token_logprobs(logits, tokens, top_n)
        return SampleResult(
            reqs=reqs,
            tokens=tokens.tolist(),
            finite=finite,
            logprobs=lp.tolist() if lp is not None else None,
            top_logprobs=top_v.tolist() if top_v is not None else None,
            top_ids=top_i.tolist() if top_i is not None else None,
        )

    def _add_logit_bias(self, reqs: list[Request], logits: torch.Tensor) -> None:
        """OpenAI's logit_bias, added in place to the raw logits of the rows that carry one: every
        later step (the greedy pick, penalties, filters, either backend's draw, logprobs) sees it,
        so the native and the torch sampler apply it alike."""
        for j, req in enumerate(reqs):
            if req.params.logit_bias:
                ids, values = zip(*req.params.logit_bias, strict=True)
                logits[j, list(ids)] += torch.tensor(values, dtype=logits.dtype, device=logits.device)
