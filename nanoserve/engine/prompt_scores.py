"""Prompt logprobs (OpenAI's `echo` with `logprobs`, TGI's `decoder_input_details`).

Prompt token i + 1 is scored by the logits at position i, which the prefill computes anyway: for a
chunk of a request that asks, the backend returns every position's logits instead of the last one
only (work.logit_rows), and `reduce_rows` turns them at once, on the engine thread, into each
token's logprob and its N most likely alternatives. A request so holds O(prompt x N) numbers,
never O(prompt x vocabulary), and no second forward runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

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
