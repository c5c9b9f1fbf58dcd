"""Where a row's probability mass, taken token by token in the order of a score, reaches a target.

top_p and typical_p both keep a row's tokens in some order until their probability reaches a
mass: top_p by logit, largest first; typical_p by distance from the entropy, smallest first. Both
rules come down to one value per row, the score of the token at which the running mass first
reaches the target (`mass_cut`); every token scoring at least as well as it stays, so tied tokens
stay or go together whatever order a sort gives them.

A sort finds that token in O(V log V). At GPT-2's 50,257 tokens that sort was most of a step's
sampling (32 rows: 50 ms with torch's sort, 33 with numpy's on CPUs where numpy's vectorised
sort is not used), and a flat distribution (a random or early model's) needs the whole
vocabulary. Wide rows therefore take a radix select instead: each token goes into one of 8,192
buckets by the top bits of its score's IEEE bits (buckets in score order), the buckets' masses
are summed, and only the bucket where the running mass crosses the target is sorted, usually a few
hundred tokens. The masses are float64 sums, as the sort's are; only their order differs (bucket
by bucket, not token by token), so the two agree unless a row's mass comes within ~1e-15 of its
target at the cut.
"""

from __future__ import annotations

import numpy as np
import torch

RADIX_FROM = 4096  # tokens per row from which mass_cut selects by buckets instead of sorting
BUCKET_BITS = 13  # 8,192 buckets: a flat row over 50k tokens puts a few hundred in the busiest


def mass_cut(
    scores: torch.Tensor, probs: torch.Tensor, target: torch.Tensor, largest_first: bool
) -> torch.Tensor:
    """(N, 1): for each row, the score of the first token, taking tokens by score (largest first
    or smallest first), at which the running probability reaches `target`; the last token's
    score if it never does (rounding can leave the whole row a hair short).

    scores (N, V) float; probs (N, V) float64, each token's probability; target (N, 1), > 0.
    Tokens scoring at least as well as the cut are the kept ones, ties included."""
    target = target.to(probs)
    if scores.shape[-1] >= RADIX_FROM:
        return _cut_by_buckets(scores, probs, target, largest_first)
    ordered, order = sorted_with_order(scores, largest_first)
    mass = probs.gather(-1, order).cumsum_(dim=-1)
    # Tokens before the cut are those whose running mass is still below the target; the mass
    # never decreases, so a binary search counts them.
    before = torch.searchsorted(mass, target).clamp_(max=scores.shape[-1] - 1)
    return ordered.gather(-1, before)


def sorted_with_order(values: torch.Tensor, largest_first: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's values sorted, and where each came from. On the CPU numpy's argsort for float32
    and float64 (torch's CPU sort was 3-15x slower at 50k values, depending on the CPU). Ties are
    not kept in their first order; callers treat tied values alike."""
    if values.device.type == "cpu" and values.dtype in (torch.float32, torch.float64):
        keys = values.detach().numpy()
        order_np = np.argsort(-keys if largest_first else keys, axis=-1)
        order = torch.from_numpy(order_np)
        return values.gather(-1, order), order
    out = torch.sort(values, dim=-1, descending=largest_first)
    return out.values, out.indices


def _bucket_of(scores: torch.Tensor, largest_first: bool) -> torch.Tensor:
    """(N, V) long in [0, 2**BUCKET_BITS): a bucket per score, buckets in the order tokens are
    taken. A float's IEEE bits read as a signed integer order positive floats; flipping the
    magnitude bits of negative ones orders those too, so the top bits make monotone buckets
    (equal scores share one; -0.0 and 0.0 may not, which cannot move the cut's value)."""
    if scores.dtype == torch.float64:
        bits, width = scores.contiguous().view(torch.int64), 64
    else:
        bits, width = scores.float().contiguous().view(torch.int32), 32
    key = bits >> (width - 1)  # all ones for negative scores, else zero
    key &= (1 << (width - 1)) - 1
    key ^= bits  # now ordered as the scores are
    if largest_first:
        key.bitwise_not_()  # ~k = -k - 1 reverses the order
    key >>= width - BUCKET_BITS
    return key.long().add_(1 << (BUCKET_BITS - 1))


def _cut_by_buckets(
    scores: torch.Tensor, probs: torch.Tensor, target: torch.Tensor, largest_first: bool
) -> torch.Tensor:
    n, buckets = len(scores), 1 << BUCKET_BITS
    bucket = _bucket_of(scores, largest_first)
    mass = torch.zeros(n, buckets, dtype=torch.float64, device=scores.device).scatter_add_(-1, bucket, probs)
    running = mass.cumsum_(dim=-1)
    # The bucket holding the cut: the first whose running mass reaches the target (a bucket
    # with nothing in it adds nothing, so it cannot be the first: target > 0).
    first = (running < target).sum(dim=-1, keepdim=True)
    never = first >= buckets
    first.clamp_(max=buckets - 1)
    above = torch.where(first > 0, running.gather(-1, (first - 1).clamp(min=0)), 0.0)
    # That bucket's tokens, each row's packed to the left of an (N, widest) block; the rest
    # of the block is filler that sorts last and weighs nothing.
    rows, cols = (bucket == first).nonzero(as_tuple=True)
    counts = torch.bincount(rows, minlength=n)
    slot = torch.arange(len(rows), device=rows.device) - (counts.cumsum(0) - counts)[rows]
    widest = int(counts.max()) if len(rows) else 1
    filler = float("-inf") if largest_first else float("inf")
    block = torch.full((n, widest), filler, dtype=scores.dtype, device=scores.device)
    block[rows, slot] = scores[rows, cols]
    weights = torch.zeros(n, widest, dtype=torch.float64, device=scores.device)
    weights[rows, slot] = probs[rows, cols]
    ordered, order = sorted_with_order(block, largest_first)
    inside = above + weights.gather(-1, order).cumsum_(dim=-1)
    before = torch.searchsorted(inside, target).clamp_(max=(counts.view(-1, 1) - 1).clamp(min=0))
    cut = ordered.gather(-1, before)
    if bool(never.any()):  # the whole row short of the target: every token stays
        last = scores.amin(dim=-1, keepdim=True) if largest_first else scores.amax(dim=-1, keepdim=True)
        cut = torch.where(never, last, cut)
    return cut
