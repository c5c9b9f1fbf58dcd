"""Sampling where the logits are: every row, every processor, fixed shapes, no host synchronisation.

nanoserve/model/sampling.py is the reference: it skips work the host can see is unneeded (rows
without a filter, tokens never seen, a candidates head instead of the whole vocabulary), which
takes data-dependent shapes (`nonzero`, boolean indexing) and host reads (`.all()`, `.tolist()`).
A CUDA graph can hold neither, and on a GPU each host read is a synchronisation. Here every row
runs every processor over the whole vocabulary, with neutral parameters leaving a row exactly
unchanged (temperature 1, top_k = V, top_p = 1, min_p = 0, typical_p = 1, penalties 1/0/0), so
the shapes depend on (rows, vocabulary) only and the result on each row's own parameters only.

The maths is the reference's, op for op where it can be (penalties, temperature, min-p, the
final inverse-CDF draw), so a row draws the token `sample_tokens` draws. Where the reference cuts
a nucleus by radix buckets or on a candidates head, this takes one sort of the whole row: the same
cut unless float rounding puts a row's mass within ~1e-7 of its target (tests/engine/
test_device_sampler.py measures how rarely).

Randomness is `seeded_uniform` computed on int64 tensors: bit for bit the host's number for the
same (seed, index), so a request draws the same tokens on either path, alone or batched.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nanoserve.model.sampling import min_p_mask, sample_from_logits

# Columns of the packed (N, PACKED_WIDTH) int64 parameter tensor: one host-to-device copy a step.
# Float columns hold float64 bits (numpy's .view), so one integer tensor carries both kinds.
FLOAT_COLUMNS = ("temperature", "top_p", "min_p", "typical_p", "repetition", "frequency", "presence")
INT_COLUMNS = ("top_k", "seed", "index", "slot", "draws", "penalised")
PACKED_WIDTH = len(FLOAT_COLUMNS) + len(INT_COLUMNS)


def _signed(value: int) -> int:
    """A 64-bit constant as the int64 torch holds it (two's complement)."""
    return value - (1 << 64) if value >= 1 << 63 else value


# splitmix64's constants, as in sampling.seeded_uniform.
_GOLDEN = _signed(0x9E3779B97F4A7C15)
_MIX1 = _signed(0xBF58476D1CE4E5B9)
_MIX2 = _signed(0x94D049BB133111EB)


def _shr(z: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical shift right of int64 bits: torch's >> is arithmetic (copies the sign bit), so the
    top `bits` bits it fills are cleared."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def device_uniform(seed: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """seeded_uniform(seed[i], index[i]) for every row, (N,) float64, bit for bit: int64
    multiplication and addition wrap modulo 2**64 as the host's masked arithmetic does."""
    z = seed + (index + 1) * _GOLDEN
    z = (z ^ _shr(z, 30)) * _MIX1
    z = (z ^ _shr(z, 27)) * _MIX2
    z = z ^ _shr(z, 31)
    # The top 53 bits, exactly representable in float64; the scale is a power of two (exact).
    return _shr(z, 11).to(torch.float64) * (1.0 / (1 << 53))


@dataclass(frozen=True)
class DeviceParams:
    """Per-row parameters as the processors take them: floats (N, 1) float32 (as the reference's
    SamplingBatch holds them), top_k (N, 1) long, the rest (N,)."""

    temperature: torch.Tensor  # 0: greedy (the row takes its argmax)
    top_k: torch.Tensor  # in [1, V]; V = off
    top_p: torch.Tensor
    min_p: torch.Tensor
    typical_p: torch.Tensor
    repetition: torch.Tensor
    frequency: torch.Tensor
    presence: torch.Tensor
    seed: torch.Tensor  # int64
    index: torch.Tensor  # int64: which generated token this draw is (the uniform's counter)
    slot: torch.Tensor  # int64: the row's KV slot (its penalty state's row)
    draws: torch.Tensor  # bool: the row needs more than its raw argmax (work.needs_draw)
    penalised: torch.Tensor  # bool: the row carries a penalty (work.uses_penalties)

    @classmethod
    def unpack(cls, packed: torch.Tensor) -> DeviceParams:
        """Views of a packed (N, PACKED_WIDTH) int64 tensor (FLOAT_COLUMNS then INT_COLUMNS)."""
        nf = len(FLOAT_COLUMNS)
        floats = packed[:, :nf].view(torch.float64).float()  # the reference's float32 columns
        ints = packed[:, nf:]
        cols = {name: floats[:, i : i + 1] for i, name in enumerate(FLOAT_COLUMNS)}
        top_k, seed, index, slot, draws, penalised = ints.unbind(dim=-1)
        return cls(**cols, top_k=top_k.view(-1, 1), seed=seed, index=index, slot=slot,
                   draws=draws != 0, penalised=penalised != 0)


def apply_bias_and_mask(
    logits: torch.Tensor,
    bias_ids: torch.Tensor | None = None,
    bias_values: torch.Tensor | None = None,
    allowed: torch.Tensor | None = None,
) -> torch.Tensor:
    """OpenAI's logit_bias as padded (N, B) token ids and values (a row's unused entries: id 0,
    value 0, which adds nothing), then a grammar's (N, V) bool mask of allowed tokens, in the
    logits' own dtype as the runner applies them. Ids in a row must be distinct (a dict's keys)."""
    if bias_ids is not None and bias_values is not None:
        logits = logits.scatter_add(-1, bias_ids, bias_values.to(logits.dtype))
    if allowed is not None:
        logits = logits.masked_fill(~allowed, float("-inf"))
    return logits


def device_penalties(
    logits: torch.Tensor, p: DeviceParams, seen: torch.Tensor | None, counts: torch.Tensor | None
) -> torch.Tensor:
    """The reference's apply_penalties over every (row, token): seen (N, V) bool, counts (N, V)
    int; the same float32 operations, so the same values where the reference computes them and the
    logits unchanged where it does not (a token not seen, a penalty of 1, counts of 0)."""
    logits = logits.float()
    if seen is not None:
        f = p.repetition
        logits = torch.where(seen, torch.where(logits < 0, logits * f, logits / f), logits)
    if counts is not None:
        penalised = logits - counts.to(logits.dtype) * p.frequency - p.presence
        logits = torch.where(counts > 0, penalised, logits)
    return logits


def sorted_cut(ordered: torch.Tensor, probs: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """(N, 1): the score at which a row's running mass, its tokens taken in `ordered`'s order
    (scores already sorted, `probs` (N, V) float64 in the same order), first reaches `target`
    (N, 1); the last score if it never does. nucleus.mass_cut's rule without its data-dependent
    radix select: tokens scoring at least as well as the cut stay, ties together."""
    mass = probs.cumsum(dim=-1)
    before = torch.searchsorted(mass, target.to(mass)).clamp_(max=ordered.shape[-1] - 1)
    return ordered.gather(-1, before)


def device_filters(logits: torch.Tensor, p: DeviceParams, typical: bool = True) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p and (when `typical`: a host-known choice that fixes which
    ops run, so a graph is captured per choice) typical-p, HF's order, on every row."""
    logits = logits / torch.where(p.temperature > 0, p.temperature, 1.0)
    # One descending sort gives the k-th largest value and the top-p order. Top-p needs no
    # top-k mask on it: the kept tokens lead, their probabilities (from the masked lse) sum to 1,
    # so the cut falls among them, or past them (rounding) where it keeps all of them anyway.
    ordered = logits.sort(dim=-1, descending=True).values  # (N, V)
    kth = ordered.gather(-1, (p.top_k - 1).clamp(0, logits.shape[-1] - 1))
    logits = logits.masked_fill(logits < kth, float("-inf"))
    # top-p as top_p_mask: the lse over the vocabulary-order logits (the reference's rounding),
    # each token's float64 probability, the running mass from the likeliest down.
    lse = logits.logsumexp(dim=-1, keepdim=True).double()
    cut = sorted_cut(ordered, (ordered.double() - lse).exp(), p.top_p)
    logits = logits.masked_fill(logits < torch.where(p.top_p < 1, cut, float("-inf")), float("-inf"))
    logits = min_p_mask(logits, p.min_p)
    return _typical(logits, p.typical_p) if typical else logits


def _typical(logits: torch.Tensor, mass: torch.Tensor) -> torch.Tensor:
    """sampling.typical_mask, its cut by one ascending sort of the scores."""
    logp = logits.log_softmax(dim=-1)
    entropy = -(logp * logp.exp()).nansum(dim=-1, keepdim=True)  # 0 * -inf = nan for masked tokens
    shifted = (-logp - entropy).abs()
    ordered, order = shifted.sort(dim=-1)
    cut = sorted_cut(ordered, logits.softmax(dim=-1).double().gather(-1, order), mass)
    return torch.where((shifted > cut) & (mass < 1), float("-inf"), logits)


def device_sample(
    logits: torch.Tensor,
    p: DeviceParams,
    seen: torch.Tensor | None = None,
    counts: torch.Tensor | None = None,
    typical: bool = True,
    sample: bool = True,
) -> torch.Tensor:
    """One token per row (N,) long, still on the logits' device: greedy rows (temperature 0) the
    first argmax of their penalised logits, the others inverse-CDF sampling of their filtered
    logits at their seeded uniform, vocabulary order, as sample_from_logits. Bias and grammar
    masks come first (apply_bias_and_mask), as the runner applies them before any draw.
    `sample` False (host-known: no row samples, a batch of greedy rows with penalties) skips the
    filters and the draw."""
    logits = device_penalties(logits, p, seen, counts)
    picked = logits.argmax(dim=-1)  # first index of the maximum, as row_max
    if not sample:
        return picked
    drawn = sample_from_logits(device_filters(logits, p, typical), device_uniform(p.seed, p.index))
    return torch.where(p.temperature.view(-1) > 0, drawn, picked)


def allowed_from_words(words: torch.Tensor, vocab: int) -> torch.Tensor:
    """A grammar's (N, W) int32 bitmask words (bit t of word t // 32 set: token t allowed, as
    llguidance writes them) -> (N, vocab) bool, unpacked on the device: the host copies 32 times
    fewer bytes than a bool mask. vocab <= 32 * W."""
    bits = torch.arange(32, dtype=words.dtype, device=words.device)
    allowed = (words.unsqueeze(-1) >> bits) & 1  # (N, W, 32); & 1 drops the sign bits >> copies
    return allowed.flatten(1)[:, :vocab] != 0
