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

import numpy as np
import torch

from nanoserve.model.nucleus import mass_cut

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
    # Only the seen tokens change: computed at their (row, token) pairs, not over all of the
    # (N, V) logits (32 x 50k: 0.8 ms instead of 4.3, the same values).
    rows, tokens = seen.nonzero(as_tuple=True)
    values, factor = logits[rows, tokens], penalty.view(-1)[rows]
    out = logits.clone()
    out[rows, tokens] = torch.where(values < 0, values * factor, values / factor)
    return out


def apply_additive_penalties(
    logits: torch.Tensor, counts: torch.Tensor, frequency: torch.Tensor, presence: torch.Tensor
) -> torch.Tensor:
    """OpenAI frequency/presence penalties: subtract freq * count + presence * (count > 0).

    counts (N, V): how often each token was generated so far; frequency, presence (N, 1).
    """
    # A token never generated is left as it is (x - 0 * f - 0 * p is x): only the generated ones
    # are computed (32 x 50k: 1.1 ms instead of 2.4, the same values).
    rows, tokens = counts.nonzero(as_tuple=True)
    count = counts[rows, tokens].to(logits.dtype)
    out = logits.clone()
    out[rows, tokens] = logits[rows, tokens] - count * frequency.view(-1)[rows] - presence.view(-1)[rows]
    return out


def top_k_mask(logits: torch.Tensor, k: torch.Tensor, k_max: int) -> torch.Tensor:
    """Keep each row's k[i] largest logits (ties with the k-th kept, like HF); -inf elsewhere.

    k (N, 1) long in [1, V]; k_max = max(k), known on the host so no device sync is needed.
    A partial top-k of width k_max replaces a full sort of the vocabulary.
    """
    values = torch.topk(logits, k_max, dim=-1).values  # (N, k_max), descending
    kth = values.gather(-1, (k - 1).clamp(max=k_max - 1))  # (N, 1)
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p_mask(logits: torch.Tensor, top_p: torch.Tensor, tail: torch.Tensor | None = None) -> torch.Tensor:
    """Nucleus filtering, HF TopPLogitsWarper's rule: a token stays while the probability of the
    tokens more likely than it is below top_p (the most likely token always stays, and the one
    that crosses top_p with it). top_p (N, 1).

    `logits` may be a row's most likely tokens only (sample_tokens' candidates): `tail` (N, 1) is
    then the log of the probability mass of the tokens not among them (-inf: none).

    The mass is summed in float64 from the most likely token down (on rows of 4,096 tokens or
    more bucket by bucket first, nanoserve/model/nucleus.py: the same sum to ~1e-15), so a row's head and
    its whole vocabulary cut at the same token. Tied tokens stay or go together (the mass above a
    tie is the mass above the first of them, however a sort orders them), so what stays is every
    token at least as likely as the last one the rule keeps. (HF sums in float32 from the least
    likely token up: the same rule, with up to ~1e-6 of rounding at 50k tokens.)"""
    lse = logits.logsumexp(dim=-1, keepdim=True)
    if tail is not None:
        lse = torch.logaddexp(lse, tail)
    probs = logits.to(torch.float64, copy=True).sub_(lse.double()).exp_()
    # The first token always stays; the next ones while the mass above them is below top_p.
    last = mass_cut(logits, probs, top_p, largest_first=True)
    # Rows with top_p == 1 stay untouched (rounding could otherwise drop ~0-probability tokens).
    last = torch.where(top_p < 1, last, float("-inf"))
    return logits.masked_fill(logits < last, float("-inf"))


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
    # The tokens closest to the entropy first, until their mass reaches `mass`; tied scores
    # stay or go together.
    cut = mass_cut(shifted, logits.softmax(dim=-1).double(), mass, largest_first=False)
    return torch.where((shifted > cut) & (mass < 1), float("-inf"), logits)


NUMPY_ARGMAX_FROM = 4096  # logits per row from which row_max takes numpy's argmax


def row_max(logits: torch.Tensor) -> tuple[list[float], torch.Tensor]:
    """Each row's largest logit and the index of its first occurrence (N,), as torch's
    `max(dim=-1)` gives them: a row holding a NaN gives NaN, at its first NaN; -inf rows give
    -inf. Wide CPU float32 rows go to numpy's argmax (vectorised, no copy): 32 rows of GPT-2's
    50,257 logits 110 us against torch's max 668 us, one row 9 against 87. Narrow ones stay on
    torch's: at 65 logits both take ~6 us, and the 10.7M engine's batch-1 step was slower with
    numpy's. Every step's greedy pick and finiteness check come from here."""
    wide = logits.dim() == 2 and logits.shape[-1] >= NUMPY_ARGMAX_FROM
    if wide and logits.device.type == "cpu" and logits.dtype == torch.float32:
        rows = logits.detach().numpy()
        best = rows.argmax(axis=-1)
        return rows[np.arange(len(rows)), best].tolist(), torch.from_numpy(best)
    top, best = logits.max(dim=-1)
    return top.tolist(), best


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
    candidates: int = 0  # see candidate_width; 0: the filters see the whole vocabulary
    top_p: torch.Tensor | None = None
    min_p: torch.Tensor | None = None
    typical_p: torch.Tensor | None = None
    repetition_penalty: torch.Tensor | None = None
    frequency_penalty: torch.Tensor | None = None
    presence_penalty: torch.Tensor | None = None
    all_greedy: bool = False
    any_greedy: bool | None = None  # None: not known (a subset from rows())

    def rows(self, index: torch.Tensor) -> SamplingBatch:
        """These rows' parameters (for the filters and sampling; penalties are applied by then)."""

        def pick(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t[index]

        return SamplingBatch(
            temperature=self.temperature[index], greedy=self.greedy[index], uniform=self.uniform[index],
            top_k=pick(self.top_k), top_k_max=self.top_k_max, top_p=pick(self.top_p),
            min_p=pick(self.min_p), typical_p=pick(self.typical_p), all_greedy=self.all_greedy,
        )


CANDIDATES = 64  # the head of the vocabulary a nucleus (top_p, min_p) is first looked for in


def candidate_width(
    vocab: int, top_k: list[int], top_p: list[float], min_p: list[float], typical: bool
) -> int:
    """How many of each row's most likely tokens its filters can run on instead of the whole
    vocabulary (0: the whole vocabulary), from the sampling rows' parameters: top_k (vocab when
    unset), top_p (1 unset) and min_p (0 unset); typical_p (any row) needs every token.

    A row's support after filtering lies in its top K tokens when its top_k <= K; with top_p or
    min_p it does when the K hold enough of the distribution, which sample_tokens checks on the
    logits (rows that miss take the whole-vocabulary path). A row with none of them samples from
    everything, and so does the batch."""
    if typical or not top_k:
        return 0
    bounded = [k for k in top_k if k < vocab]
    if len(bounded) == len(top_k):  # every row's top_k bounds it: exactly as many as needed
        width = max(bounded)
    elif all(k < vocab or p < 1 or m > 0 for k, p, m in zip(top_k, top_p, min_p, strict=True)):
        width = max([CANDIDATES, *bounded])
    else:
        return 0
    return width if width * 4 <= vocab else 0


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


def apply_filters(
    logits: torch.Tensor, batch: SamplingBatch, tail: torch.Tensor | None = None
) -> torch.Tensor:
    """Temperature, then top-k, top-p, min-p, typical-p (HF's order) on (N, V') logits; `tail` as
    in top_p_mask, after temperature."""
    logits = logits / _temperature(batch)
    if batch.top_k is not None:
        logits = top_k_mask(logits, batch.top_k, min(batch.top_k_max, logits.shape[-1]))
    if batch.top_p is not None:
        logits = top_p_mask(logits, batch.top_p, tail)
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


def _temperature(batch: SamplingBatch) -> torch.Tensor:
    return torch.where(batch.temperature > 0, batch.temperature, 1.0)


def sample_tokens(
    logits: torch.Tensor,
    batch: SamplingBatch,
    seen: torch.Tensor | None = None,
    counts: torch.Tensor | None = None,
) -> torch.Tensor:
    """One token per row (N,): greedy rows take the argmax, the others sample.

    With `batch.candidates` (candidate_width), the filters run on each row's K most likely tokens,
    not the whole vocabulary (32 rows of GPT-2's 50k tokens under top_p 0.95, peaked as a trained
    model's: 4-7 ms instead of 11-12). A row whose filtered support may reach past them (a flat
    distribution under top_p or min_p) goes straight to the whole vocabulary: since the cut needs
    no sort there (nanoserve/model/nucleus.py), a second, wider head would cost more than it saves. The
    candidates are put back
    in vocabulary order, so inverse-CDF sampling picks the token the whole-vocabulary path would
    (masked tokens add nothing to the CDF; up to float rounding at a boundary): a row's result
    does not depend on the path its batch took.
    """
    logits = apply_penalties(logits, batch, seen, counts)
    if batch.all_greedy:
        return row_max(logits)[1]
    width = batch.candidates
    use_head = 0 < width * 4 <= logits.shape[-1]  # a head is only cheaper well below the vocabulary
    if batch.any_greedy is False and not use_head:
        # Every row samples from the whole vocabulary: what the general path below does for
        # such a batch, without its index bookkeeping (a handful of small ops, ~10% of the
        # sampling time of 32 rows over a 65-token vocabulary).
        return sample_from_logits(apply_filters(logits, batch), batch.uniform)
    sampled = torch.zeros(len(logits), dtype=torch.long, device=logits.device)
    rest = (~batch.greedy).nonzero().view(-1)
    if len(rest) and use_head:
        head = _Head(*_rows(logits, batch, rest), width)
        if head.fits.any():
            sampled[rest[head.fits]] = head.sample(head.fits)
        rest = rest[~head.fits]
    if len(rest):
        rest_logits, rows = _rows(logits, batch, rest)
        sampled[rest] = sample_from_logits(apply_filters(rest_logits, rows), rows.uniform)
    greedy = batch.greedy.nonzero().view(-1)
    if len(greedy):  # the argmax only for the rows that take it (a 50k-wide pass per row)
        sampled[greedy] = row_max(logits[greedy])[1]
    return sampled


def _rows(
    logits: torch.Tensor, batch: SamplingBatch, index: torch.Tensor
) -> tuple[torch.Tensor, SamplingBatch]:
    """Rows `index` (increasing) of the logits and of the batch; all of them without a copy."""
    if len(index) == len(logits):
        return logits, batch
    return logits[index], batch.rows(index)


class _Head:
    """Each row's `width` most likely tokens, and whether its filtered support lies among them
    (`fits`, (N,) bool). Every row's top_k is at most batch.candidates (<= width) or unset:
    candidate_width makes it so."""

    def __init__(self, logits: torch.Tensor, batch: SamplingBatch, width: int) -> None:
        self.batch = batch
        self.values, self.ids = torch.topk(logits, width, dim=-1)  # (N, K), descending
        self.tail: torch.Tensor | None = None
        fits = torch.zeros(len(logits), dtype=torch.bool, device=logits.device)
        temperature = _temperature(batch)
        if batch.top_k is not None:
            fits |= (batch.top_k <= width).view(-1)  # top_k masks everything past them
        if batch.top_p is not None and not bool(fits.all()):
            # The mass of the tokens past the candidates, after temperature; none for top_k rows.
            tail = (logits / temperature).scatter(-1, self.ids, float("-inf")).logsumexp(dim=-1, keepdim=True)
            self.tail = torch.where(fits.view(-1, 1), float("-inf"), tail)
            scaled = self.values / temperature
            lse = torch.logaddexp(scaled.logsumexp(dim=-1, keepdim=True), self.tail)
            probs = (scaled.double() - lse.double()).exp()
            # A token past the candidates is no likelier than the last one, so the mass above it
            # is at least that of the candidates likelier than the last: at least top_p, it goes.
            above_last = (probs * (self.values > self.values[:, -1:])).sum(dim=-1, keepdim=True)
            fits |= ((batch.top_p < 1) & (above_last >= batch.top_p)).view(-1)
        if batch.min_p is not None:
            # min_p keeps tokens at least min_p times as likely as the most likely: if the last
            # candidate is not, no token past it is.
            ratio = ((self.values[:, -1:] - self.values[:, :1]) / temperature).exp()
            fits |= ((batch.min_p > 0) & (ratio < batch.min_p)).view(-1)
        self.fits = fits

    def sample(self, which: torch.Tensor) -> torch.Tensor:
        """Tokens for rows `which` (a bool mask), each from its candidates."""
        every = bool(which.all())
        batch = self.batch if every else self.batch.rows(which)
        ids, values, tail = self.ids, self.values, self.tail
        if not every:
            ids, values, tail = ids[which], values[which], None if tail is None else tail[which]
        # Vocabulary order: the CDF walks the tokens as the whole-vocabulary path does.
        ids, order = ids.sort(dim=-1)
        filtered = apply_filters(values.gather(-1, order), batch, tail)
        return ids.gather(-1, sample_from_logits(filtered, batch.uniform).view(-1, 1)).view(-1)


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
