"""Logits processing and sampling for a batch of rows, each with its own parameters.

Every function is pure and vectorised: one call handles all rows of a decode step, whatever mix
of parameters they carry. Per-row parameters are (N, 1) tensors; a row that does not use a
processor gets its neutral value (temperature 1, top_k = V, top_p = 1, ...) and is left exactly
unchanged. Semantics follow Hugging Face's logits warpers so results compare across servers.

Randomness is not drawn from a shared generator: each row brings its own uniform number, derived
from its request's seed and the index of the token being generated (`seeded_uniform`). A request
therefore samples the same tokens whether it runs alone or next to any other rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_MASK64 = (1 << 64) - 1


def seeded_uniform(seed: int, index: int) -> float:
    """A uniform number in [0, 1) that depends only on (seed, index): splitmix64 of both.

    Counter-based, so nothing has to be carried between steps and rows never share a stream.
    """
    z = (seed + (index + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    z ^= z >> 31
    return (z >> 11) * (1.0 / (1 << 53))  # the top 53 bits: every double in [0, 1) reachable


def apply_repetition_penalty(
    logits: torch.Tensor, seen: torch.Tensor, penalty: torch.Tensor
) -> torch.Tensor:
    """CTRL/HF repetition penalty on tokens already in the context.

    logits (N, V); seen (N, V) bool; penalty (N, 1), 1.0 = off. A seen token's positive logit is
    divided by the penalty, a negative one multiplied, so > 1 always makes it less likely.
    """
    penalised = torch.where(logits < 0, logits * penalty, logits / penalty)
    return torch.where(seen, penalised, logits)


def apply_additive_penalties(
    logits: torch.Tensor, counts: torch.Tensor, frequency: torch.Tensor, presence: torch.Tensor
) -> torch.Tensor:
    """OpenAI frequency/presence penalties: subtract freq * count + presence * (count > 0).

    counts (N, V): how often each token was generated so far; frequency, presence (N, 1).
    """
    counts = counts.to(logits.dtype)
    return logits - counts * frequency - (counts > 0).to(logits.dtype) * presence


def top_k_mask(logits: torch.Tensor, k: torch.Tensor, k_max: int) -> torch.Tensor:
    """Keep each row's k[i] largest logits (ties with the k-th kept, like HF); -inf elsewhere.

    k (N, 1) long in [1, V]; k_max = max(k), known on the host so no device sync is needed.
    A partial top-k of width k_max replaces a full sort of the vocabulary.
    """
    values = torch.topk(logits, k_max, dim=-1).values  # (N, k_max), descending
    kth = values.gather(-1, (k - 1).clamp(max=k_max - 1))  # (N, 1)
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p_mask(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Nucleus filtering (HF TopPLogitsWarper): drop the least likely tokens whose total
    probability is at most 1 - top_p, always keeping the most likely one. top_p (N, 1)."""
    sorted_logits, sorted_idx = torch.sort(logits, dim=-1, descending=False)
    cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)  # ascending order
    remove = cum <= (1 - top_p)
    remove[:, -1] = False  # the most likely token always stays
    remove = remove.scatter(-1, sorted_idx, remove)
    # Rows with top_p == 1 stay untouched (cumsum rounding could otherwise drop ~0-prob tokens).
    return torch.where(remove & (top_p < 1), float("-inf"), logits)


def min_p_mask(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens less likely than min_p times the most likely one (HF MinPLogitsWarper)."""
    probs = logits.softmax(dim=-1)
    threshold = min_p * probs.max(dim=-1, keepdim=True).values
    return logits.masked_fill(probs < threshold, float("-inf"))


def typical_mask(logits: torch.Tensor, mass: torch.Tensor) -> torch.Tensor:
    """Locally typical sampling (HF TypicalLogitsWarper): keep the tokens whose surprisal is
    closest to the distribution's entropy until their probability reaches `mass` (N, 1)."""
    logp = logits.log_softmax(dim=-1)
    p = logp.exp()
    entropy = -(logp * p).nansum(dim=-1, keepdim=True)  # 0 * -inf = nan for masked tokens
    shifted = (-logp - entropy).abs()
    sorted_scores, sorted_idx = torch.sort(shifted, dim=-1, descending=False)
    cum = logits.gather(-1, sorted_idx).softmax(dim=-1).cumsum(dim=-1)
    last = (cum < mass).sum(dim=-1, keepdim=True).clamp(max=logits.shape[-1] - 1)
    remove = sorted_scores > sorted_scores.gather(-1, last)
    remove[:, 0] = False
    remove = remove.scatter(-1, sorted_idx, remove)
    return torch.where(remove & (mass < 1), float("-inf"), logits)


def sample_from_logits(logits: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: row i takes the token where its cumulative probability passes
    uniform[i] (N,) in [0, 1). Zero-probability (masked) tokens are never chosen."""
    probs = logits.softmax(dim=-1).double()  # float64 cumsum: no drift over a 50k vocabulary
    cdf = probs.cumsum(dim=-1)  # (N, V)
    total = cdf[:, -1:]
    x = (uniform.to(cdf).view(-1, 1) * total).minimum(torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, x, right=True).view(-1).clamp(max=logits.shape[-1] - 1)


@dataclass
class SamplingBatch:
    """Per-row parameters of one step, as (N, 1) tensors, plus host-side flags saying which
    processors any row uses (so an all-greedy batch skips every one of them)."""

    temperature: torch.Tensor  # (N, 1); 0 = greedy
    greedy: torch.Tensor  # (N,) bool
    uniform: torch.Tensor  # (N,) float64 in [0, 1)
    top_k: torch.Tensor | None = None  # (N, 1) long; greedy rows may say 1 (their k is unused)
    top_k_max: int = 0
    top_p: torch.Tensor | None = None
    min_p: torch.Tensor | None = None
    typical_p: torch.Tensor | None = None
    repetition_penalty: torch.Tensor | None = None
    frequency_penalty: torch.Tensor | None = None
    presence_penalty: torch.Tensor | None = None
    all_greedy: bool = False


def apply_penalties(
    logits: torch.Tensor,
    batch: SamplingBatch,
    seen: torch.Tensor | None = None,
    counts: torch.Tensor | None = None,
) -> torch.Tensor:
    """Repetition, then frequency/presence penalties (rows with neutral values unchanged)."""
    logits = logits.float()
    if batch.repetition_penalty is not None and seen is not None:
        logits = apply_repetition_penalty(logits, seen, batch.repetition_penalty)
    if batch.frequency_penalty is not None and batch.presence_penalty is not None and counts is not None:
        logits = apply_additive_penalties(logits, counts, batch.frequency_penalty, batch.presence_penalty)
    return logits


def apply_filters(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Temperature, then top-k, top-p, min-p, typical-p (HF's order) on (N, V') logits."""
    logits = logits / torch.where(batch.temperature > 0, batch.temperature, 1.0)
    if batch.top_k is not None:
        logits = top_k_mask(logits, batch.top_k, min(batch.top_k_max, logits.shape[-1]))
    if batch.top_p is not None:
        logits = top_p_mask(logits, batch.top_p)
    if batch.min_p is not None:
        logits = min_p_mask(logits, batch.min_p)
    if batch.typical_p is not None:
        logits = typical_mask(logits, batch.typical_p)
    return logits


def process_logits(
    logits: torch.Tensor,
    batch: SamplingBatch,
    seen: torch.Tensor | None = None,
    counts: torch.Tensor | None = None,
) -> torch.Tensor:
    """Penalties then every filter over the full vocabulary: the straightforward path."""
    logits = apply_penalties(logits, batch, seen, counts)
    return logits if batch.all_greedy else apply_filters(logits, batch)


def sample_tokens(
    logits: torch.Tensor,
    batch: SamplingBatch,
    seen: torch.Tensor | None = None,
    counts: torch.Tensor | None = None,
) -> torch.Tensor:
    """One token per row (N,): greedy rows take the argmax, the others sample.

    When every sampling row has a small top_k, the filters run on the top_k_max candidates only
    (no softmax or sort over the full vocabulary). The candidates are put back in vocabulary
    order, so inverse-CDF sampling picks exactly the token the full-vocabulary path would (masked
    tokens add nothing to the CDF): a row's result does not depend on which path its batch took.
    """
    logits = apply_penalties(logits, batch, seen, counts)
    greedy = logits.argmax(dim=-1)
    if batch.all_greedy:
        return greedy
    vocab = logits.shape[-1]
    if batch.top_k is not None and batch.top_k_max * 4 <= vocab:
        values, ids = torch.topk(logits, batch.top_k_max, dim=-1)  # (N, K)
        ids, order = ids.sort(dim=-1)
        filtered = apply_filters(values.gather(-1, order), batch)
        sampled = ids.gather(-1, sample_from_logits(filtered, batch.uniform).view(-1, 1)).view(-1)
    else:
        sampled = sample_from_logits(apply_filters(logits, batch), batch.uniform)
    return torch.where(batch.greedy, greedy, sampled)


def token_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, top_n: int
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Log-probabilities under the model's own distribution (before any processing).

    Returns the chosen tokens' logprobs (N,), and when top_n > 0 the top_n alternatives'
    logprobs and ids (N, top_n).
    """
    logp = logits.float().log_softmax(dim=-1)
    chosen = logp.gather(-1, tokens.view(-1, 1)).view(-1)
    if top_n <= 0:
        return chosen, None, None
    top = torch.topk(logp, min(top_n, logp.shape[-1]), dim=-1)
    return chosen, top.values, top.indices
