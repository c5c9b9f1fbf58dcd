"""Prompt logprobs (OpenAI's `echo` with `logprobs`, TGI's `decoder_input_details`).

Prompt token i + 1 is scored by the logits at position i, which the prefill computes anyway: for a
chunk of a request that asks, the backend returns every position's logits instead of the last one
only (work.logit_rows), and `reduce_rows` turns them at once, on the engine thread, into each
token's logprob and its N most likely alternatives. A request so holds O(prompt x N) numbers,
never O(prompt x vocabulary), and no second forward runs.

A scored row costs more than a plain prompt row: the output layer over the whole vocabulary, which
a plain row skips. `ScoringCost` says how much more, so the scheduler charges a scored chunk its
real share of a step's prefill budget, and bounds the rows of logits a step's scored chunks hold.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn

from nanoserve.engine.types import Prompt, PromptToken, TopToken
from nanoserve.model.tokenizer import Tokenizer


@dataclass
class PromptScores:
    """Scores of prompt tokens 1, 2, ... in order (token 0 has none): what is done so far."""

    logprobs: list[float] = field(default_factory=list)
    top_ids: list[list[int]] = field(default_factory=list)
    top_logprobs: list[list[float]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.logprobs)

    def extend(self, other: PromptScores) -> None:
        self.logprobs += other.logprobs
        self.top_ids += other.top_ids
        self.top_logprobs += other.top_logprobs

    def clear(self) -> None:
        self.logprobs, self.top_ids, self.top_logprobs = [], [], []


# Scored rows' logits (rows x vocabulary floats) one step may hold: 16 MiB in float32, and as much
# again for their log-softmax (reduce_rows). 83 rows at GPT-2's vocabulary, thousands at a char one.
SCORED_LOGITS = 1 << 22


@dataclass(frozen=True)
class ScoringCost:
    """What a prompt row that is scored costs next to a plain one, from the model's shapes."""

    weight: float = 1.0  # prefill budget one scored row takes (a plain row takes 1)
    max_rows: int = SCORED_LOGITS  # scored rows one step may hold the logits of

    @classmethod
    def of(cls, blocks: nn.Module, n_embd: int, vocab: int) -> ScoringCost:
        """A plain prompt row multiplies each weight of the transformer `blocks` once (their
        matrices' elements are its multiply-adds; attention over the context adds some, left out:
        the weight errs high); a scored row adds the output layer's vocab x n_embd and the
        log-softmax and top-k over its vocab logits, a few operations each (left out too)."""
        per_row = sum(p.numel() for p in blocks.parameters() if p.dim() == 2)
        return cls(weight=1.0 + vocab * n_embd / max(1, per_row), max_rows=max(1, SCORED_LOGITS // vocab))

    def rows(self, budget: int) -> int:
        """Scored rows one chunk takes: what `budget` plain rows cost, within max_rows."""
        return max(1, min(int(budget / self.weight), self.max_rows))

    def cost(self, rows: int) -> int:
        return math.ceil(rows * self.weight)


def reduce_rows(logits: torch.Tensor, next_ids: list[int], top_n: int, usable_vocab: int) -> PromptScores:
    """Rows of raw logits (R, V) and the token that followed each row's position -> that token's
    logprob and the top `top_n` (ids, logprobs) of each row; FloatingPointError if a logprob is
    not finite. Ids the tokenizer cannot decode
    (nanoGPT's vocabulary padding) take no probability; logit_bias and grammars do not apply
    (prompt logprobs are the model's own, as vLLM reports them)."""
    lp = torch.log_softmax(logits[:, :usable_vocab].float(), dim=-1)  # (R, usable)
    ids = torch.tensor(next_ids, dtype=torch.long, device=lp.device).view(-1, 1)
    out = PromptScores(logprobs=lp.gather(1, ids).view(-1).tolist())
    # Finite logits give finite log-softmax values: anything else is a model fault, which fails
    # the request as a non-finite generated row does (and JSON has no NaN to send).
    bad = next((i for i, v in enumerate(out.logprobs) if not math.isfinite(v)), None)
    if bad is not None:
        raise FloatingPointError(f"the model produced non-finite logits (NaN/inf) scoring prompt row {bad}")
    if top_n > 0:
        values, top = lp.topk(min(top_n, lp.shape[1]), dim=-1)
        out.top_ids, out.top_logprobs = top.tolist(), values.tolist()
    else:
        out.top_ids, out.top_logprobs = [[] for _ in next_ids], [[] for _ in next_ids]
    return out


def prompt_of(tokenizer: Tokenizer, ids: list[int], scores: PromptScores | None) -> Prompt:
    """The prompt as events carry it: its text, and each token with its score (if scored)."""
    tokens = []
    for i, token in enumerate(ids):
        logprob: float | None = None
        tops: tuple[TopToken, ...] = ()
        if scores is not None and 0 < i <= len(scores):
            logprob = scores.logprobs[i - 1]
            tops = tuple(TopToken(t, tokenizer.id_to_piece(t), v)
                         for t, v in zip(scores.top_ids[i - 1], scores.top_logprobs[i - 1], strict=True))
        tokens.append(PromptToken(token, tokenizer.id_to_piece(token), logprob, tops))
    return Prompt(text=tokenizer.decode(ids), tokens=tuple(tokens))
