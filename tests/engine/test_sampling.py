"""nanoserve/model/sampling.py's vectorised processors equal a straightforward per-row implementation,
and seeded sampling gives a request the same tokens alone or batched."""

from __future__ import annotations

import asyncio
import math

import pytest
import torch

from nanoserve.engine.inbox import Inbox
from nanoserve.engine.request import Request
from nanoserve.engine.types import SamplingParams
from nanoserve.engine.validation import GREEDY_BELOW, effective_params
from nanoserve.model.checkpoint import Checkpoint
from nanoserve.model.nucleus import mass_cut, sorted_with_order
from nanoserve.model.sampling import (
    CANDIDATES,
    NUMPY_ARGMAX_FROM,
    SamplingBatch,
    _Head,
    apply_additive_penalties,
    apply_filters,
    apply_repetition_penalty,
    candidate_width,
    min_p_mask,
    process_logits,
    row_max,
    sample_from_logits,
    sample_tokens,
    seeded_uniform,
    top_k_mask,
    top_p_mask,
    typical_mask,
)
from tests.engine.conftest import EngineFactory, col, collect, token_ids

NEG = float("-inf")


def rows(n: int = 6, v: int = 50, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, v, generator=g) * 3
    logits[0, :5] = logits[0].max() + 1  # a five-way tie at the top
    logits[1, 10:] = NEG  # an already-masked row
    return logits


def ref_top_k(row: list[float], k: int) -> list[float]:
    kth = sorted(row, reverse=True)[k - 1]
    return [x if x >= kth else NEG for x in row]


def softmax(row: list[float]) -> list[float]:
    m = max(row)
    e = [math.exp(x - m) if x != NEG else 0.0 for x in row]
    s = sum(e)
    return [x / s for x in e]


def ref_top_p(row: list[float], p: float) -> list[float]:
    # Keep the most likely tokens until their mass reaches p (the token crossing p included).
    if p >= 1:
        return list(row)
    probs = softmax(row)
    order = sorted(range(len(row)), key=lambda i: -probs[i])
    keep, mass = set(), 0.0
    for i in order:
        keep.add(i)
        mass += probs[i]
        if mass >= p - 1e-6:
            break
    return [x if i in keep else NEG for i, x in enumerate(row)]


def ref_min_p(row: list[float], min_p: float) -> list[float]:
    probs = softmax(row)
    top = max(probs)
    return [x if probs[i] >= min_p * top else NEG for i, x in enumerate(row)]


def ref_typical(row: list[float], mass: float) -> list[float]:
    probs = softmax(row)
    ent = -sum(p * math.log(p) for p in probs if p > 0)
    dist = [abs(-math.log(p) - ent) if p > 0 else math.inf for p in probs]
    order = sorted(range(len(row)), key=lambda i: dist[i])
    keep, acc = set(), 0.0
    for i in order:
        keep.add(i)
        acc += probs[i]
        if acc >= mass:
            break
    return [x if i in keep else NEG for i, x in enumerate(row)]


def check(vectorised: torch.Tensor, per_row: list[list[float]]) -> None:
    expected = torch.tensor(per_row)
    assert torch.equal(torch.isinf(vectorised), torch.isinf(expected))
    finite = torch.isfinite(expected)
    assert torch.allclose(vectorised[finite], expected[finite])


def test_top_k_matches_per_row() -> None:
    x = rows()
    ks = [3, 1, 50, 7, 2, 20]
    out = top_k_mask(x, torch.tensor(ks).view(-1, 1), max(ks))
    check(out, [ref_top_k(r, k) for r, k in zip(x.tolist(), ks, strict=True)])
    assert (torch.isfinite(out[0]).sum()) == 5  # ties with the k-th are kept


def test_top_p_min_p_typical_match_per_row() -> None:
    x = rows(seed=1)
    ps = [0.9, 0.5, 1.0, 0.1, 0.75, 0.99]
    check(
        top_p_mask(x, torch.tensor(ps).view(-1, 1)),
        [ref_top_p(r, p) for r, p in zip(x.tolist(), ps, strict=True)],
    )
    mins = [0.05, 0.5, 0.0, 0.9, 0.2, 1.0]
    check(
        min_p_mask(x, torch.tensor(mins).view(-1, 1)),
        [ref_min_p(r, m) for r, m in zip(x.tolist(), mins, strict=True)],
    )
    masses = [0.9, 0.5, 0.2, 0.95, 0.6, 0.3]
    check(
        typical_mask(x, torch.tensor(masses).view(-1, 1)),
        [ref_typical(r, m) for r, m in zip(x.tolist(), masses, strict=True)],
    )


def test_sorted_with_order_gives_what_torch_sort_gives() -> None:
    # On the CPU numpy's argsort orders float32 and float64 rows; other dtypes take torch's.
    # Values only (ties may come in another order): ties, -inf and signed zeros included.
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 50304, generator=g) * 4
    x[0, ::7] = x[0, 3]
    x[1, :1000] = NEG
    x[2] = x[2].round() * torch.where(torch.rand(50304, generator=g) < 0.5, -1.0, 1.0)  # 0.0 and -0.0
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        y = x.to(dtype)
        for largest_first in (True, False):
            values, order = sorted_with_order(y, largest_first)
            assert values.dtype == dtype
            assert torch.equal(values, torch.sort(y, dim=-1, descending=largest_first).values)
            assert torch.equal(y.gather(-1, order), values)


def nucleus_cases() -> list[torch.Tensor]:
    """Rows wide enough for the bucket select, of every kind it has to get right."""
    g = torch.Generator().manual_seed(4)
    scale = torch.tensor([[0.05], [0.5], [1.0], [3.0], [8.0], [20.0]])
    flat_to_peaked = torch.randn(6, 50304, generator=g) * scale
    ties = (torch.randn(6, 4096, generator=g) * scale).round()  # thousands of tied scores
    masked = torch.randn(6, 5000, generator=g) * scale
    masked[:, ::3] = NEG  # what top_k leaves
    one_bucket = 1 + torch.rand(3, 8192, generator=g) * 1e-4  # every score in one bucket
    zeros = torch.randn(2, 4096, generator=g).round() * 0.0  # 0.0 and -0.0 only
    return [flat_to_peaked, ties, masked, one_bucket, zeros, flat_to_peaked[:3].double()]


def test_the_bucket_select_cuts_where_a_sort_does(monkeypatch: pytest.MonkeyPatch) -> None:
    # Rows of RADIX_FROM tokens or more find their cut by buckets, smaller ones by a sort; the
    # same rows forced through the sort must give the same cut, both ways round and at targets
    # from a sliver to the whole mass, and top_p and typical_p the same masks.
    import nanoserve.model.nucleus as nucleus

    g = torch.Generator().manual_seed(6)
    for x in nucleus_cases():
        n = len(x)
        probs = x.double().softmax(dim=-1)
        targets = [torch.rand(n, 1, generator=g, dtype=torch.float64) for _ in range(3)]
        targets += [torch.full((n, 1), t, dtype=torch.float64) for t in (1e-9, 0.999)]
        top_p = torch.rand(n, 1, generator=g).clamp(min=0.05)
        top_p[0] = 1.0
        with monkeypatch.context() as m:
            buckets = [mass_cut(x, probs, t, lf) for t in targets for lf in (True, False)]
            masks = top_p_mask(x, top_p), typical_mask(x, top_p.to(x.dtype))
            m.setattr(nucleus, "RADIX_FROM", 1 << 30)
            sorts = [mass_cut(x, probs, t, lf) for t in targets for lf in (True, False)]
            for by_buckets, by_sort in zip(buckets, sorts, strict=True):
                assert torch.equal(by_buckets, by_sort)
            assert torch.equal(masks[0], top_p_mask(x, top_p))
            assert torch.equal(masks[1], typical_mask(x, top_p.to(x.dtype)))
    kept = torch.isfinite(top_p_mask(nucleus_cases()[0], torch.tensor([[0.95]] * 6))).sum(dim=-1)
    assert 40000 < kept[0] < 50304 and kept[-1] < 100  # a flat row keeps most, a peaked one few


def test_a_mass_reaching_its_target_exactly_cuts_at_that_token() -> None:
    # Eight tokens of probability 1/8 each (sums exact in any order), the rest 0: a target of
    # k/8 is reached exactly at the k-th of them, which is the cut (not the next one).
    x = torch.randn(2, 8192, generator=torch.Generator().manual_seed(9)) * 4
    probs = torch.zeros(2, 8192, dtype=torch.float64)
    picked = x.topk(8, dim=-1).indices
    probs.scatter_(-1, picked, 0.125)
    descending = x.gather(-1, picked)
    for k in range(1, 9):
        target = torch.full((2, 1), k / 8, dtype=torch.float64)
        assert torch.equal(mass_cut(x, probs, target, largest_first=True), descending[:, k - 1 : k])


def test_a_row_whose_mass_never_reaches_the_target_keeps_every_token() -> None:
    # Rounding can leave a row's total a hair below top_p: the cut is then the last token.
    x = torch.randn(2, 8192, generator=torch.Generator().manual_seed(8))
    probs = x.double().softmax(dim=-1) * 0.5
    target = torch.full((2, 1), 0.9, dtype=torch.float64)
    assert torch.equal(mass_cut(x, probs, target, largest_first=True), x.amin(dim=-1, keepdim=True))
    assert torch.equal(mass_cut(x, probs, target, largest_first=False), x.amax(dim=-1, keepdim=True))


def test_penalties_match_per_row() -> None:
    x = rows(n=3, seed=2)
    seen = torch.zeros(3, 50, dtype=torch.bool)
    seen[0, [1, 2, 3]] = True
    seen[2, 40] = True
    rep = [1.5, 2.0, 0.5]
    out = apply_repetition_penalty(x, seen, torch.tensor(rep).view(-1, 1))
    for i, row in enumerate(x.tolist()):
        for t, v in enumerate(row):
            want = (v * rep[i] if v < 0 else v / rep[i]) if seen[i, t] else v
            assert out[i, t].item() == pytest.approx(want)
    counts = torch.zeros(3, 50, dtype=torch.int32)
    counts[0, 4] = 3
    counts[1, 5] = 1
    freq, pres = [0.5, -1.0, 2.0], [0.25, 1.0, 0.0]
    out = apply_additive_penalties(x, counts, torch.tensor(freq).view(-1, 1), torch.tensor(pres).view(-1, 1))
    for i, row in enumerate(x.tolist()):
        for t, v in enumerate(row):
            c = int(counts[i, t])
            assert out[i, t].item() == pytest.approx(v - c * freq[i] - (c > 0) * pres[i])


def test_inverse_cdf_sampling_follows_the_distribution_and_skips_masked() -> None:
    logits = torch.tensor([[0.0, math.log(3.0), NEG, 0.0]]).repeat(4000, 1)
    u = torch.tensor([seeded_uniform(7, i) for i in range(4000)], dtype=torch.float64)
    got = sample_from_logits(logits, u)
    freq = torch.bincount(got, minlength=4).double() / 4000
    assert freq[2] == 0
    assert torch.allclose(freq, torch.tensor([0.2, 0.6, 0.0, 0.2], dtype=torch.float64), atol=0.03)
    assert len({seeded_uniform(1, i) for i in range(1000)}) == 1000
    assert seeded_uniform(1, 5) == seeded_uniform(1, 5) != seeded_uniform(2, 5)


def test_top_k_candidates_path_picks_what_the_full_vocabulary_path_picks() -> None:
    n, v = 64, 400
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(n, v, generator=g) * 4
    ks = [int(k) for k in torch.randint(1, 60, (n,), generator=g)]
    tps, mps = [0.5 + (i % 4) / 8 for i in range(n)], [(i % 3) / 20 for i in range(n)]
    batch = SamplingBatch(
        temperature=col([0.5 + (i % 5) / 4 for i in range(n)]),
        greedy=torch.zeros(n, dtype=torch.bool),
        uniform=torch.tensor([seeded_uniform(11, i) for i in range(n)], dtype=torch.float64),
        top_k=torch.tensor(ks).view(-1, 1),
        top_k_max=max(ks),
        top_p=col(tps),
        min_p=col(mps),
        candidates=candidate_width(v, ks, tps, mps, typical=False),
    )
    assert batch.candidates == max(ks)  # every row has a top_k: that many candidates
    fast = sample_tokens(logits, batch)
    full = sample_from_logits(process_logits(logits, batch), batch.uniform)
    assert torch.equal(fast, full)
    assert len(set(fast.tolist())) > 20


def test_nucleus_candidates_pick_what_the_whole_vocabulary_picks() -> None:
    """top_p and min_p without top_k: a row whose nucleus fits in the first 64 candidates is
    sampled there, one that needs more over everything; every row picks what the
    whole-vocabulary path picks, greedy rows and top_k rows beside them included."""
    n, v = 120, 4096
    g = torch.Generator().manual_seed(5)
    scale = torch.tensor([[0.2, 1.5, 3.0, 8.0][i % 4] for i in range(n)]).view(-1, 1)  # flat .. peaked
    logits = torch.randn(n, v, generator=g) * scale
    kinds = [i % 5 for i in range(n)]  # 0 top_p, 1 min_p, 2 top_p + min_p, 3 top_k + top_p, 4 greedy
    temps = [0.0 if kind == 4 else 0.7 + (i % 3) / 4 for i, kind in enumerate(kinds)]
    ks = [20 if kind == 3 else v for kind in kinds]
    tps = [0.5 + (i % 5) / 10 if kind in (0, 2, 3) else 1.0 for i, kind in enumerate(kinds)]
    mps = [0.02 + (i % 3) / 10 if kind in (1, 2) else 0.0 for i, kind in enumerate(kinds)]
    sampling = [i for i, kind in enumerate(kinds) if kind != 4]
    width = candidate_width(v, *([xs[i] for i in sampling] for xs in (ks, tps, mps)), typical=False)
    assert width == CANDIDATES
    batch = SamplingBatch(
        temperature=col(temps),
        greedy=torch.tensor([kind == 4 for kind in kinds]),
        uniform=torch.tensor([seeded_uniform(7, i) for i in range(n)], dtype=torch.float64),
        top_k=torch.tensor(ks).view(-1, 1), top_k_max=v, top_p=col(tps), min_p=col(mps), candidates=width,
    )
    fast = sample_tokens(logits, batch)
    full = sample_tokens(logits, SamplingBatch(**{**vars(batch), "candidates": 0}))
    assert torch.equal(fast, full)
    # Each way was taken: rows fitting in 64 candidates and rows that do not.
    fits, sampled = _Head(logits, batch, CANDIDATES).fits, ~batch.greedy
    assert (fits & sampled).sum() > 10
    assert (~fits & sampled).sum() > 10


def test_top_p_keeps_tied_tokens_together_across_the_candidates_edge() -> None:
    # One likely token (~24% of the mass), then 100 tied ones (~44%), then the rest: at top_p 0.3
    # the mass above every tied token is the first one's, so all 100 stay, though 64 candidates
    # cut their run: that row must not be sampled from 64 candidates.
    v, n = 4096, 400
    row = torch.full((v,), -3.0)
    row[0], row[1:101] = 5.0, 1.0
    perm = torch.randperm(v, generator=torch.Generator().manual_seed(1))
    kept = top_p_mask(row[perm].view(1, -1), col([0.3]))
    assert torch.isfinite(kept).sum() == 101 and torch.isfinite(kept[0, perm.argsort()[:101]]).all()
    logits = row.expand(n, v).clone()
    batch = SamplingBatch(
        temperature=col([1.0] * n), greedy=torch.zeros(n, dtype=torch.bool),
        uniform=torch.tensor([seeded_uniform(3, i) for i in range(n)], dtype=torch.float64),
        top_p=col([0.3] * n), candidates=candidate_width(v, [v] * n, [0.3] * n, [0.0] * n, typical=False),
    )
    assert not _Head(logits, batch, CANDIDATES).fits.any()
    fast = sample_tokens(logits, batch)
    assert torch.equal(fast, sample_tokens(logits, SamplingBatch(**{**vars(batch), "candidates": 0})))
    assert set(fast.tolist()) <= set(range(101)) and max(fast.tolist()) > CANDIDATES


def test_candidate_width() -> None:
    v = 50257
    assert candidate_width(v, [v, 40], [0.9, 1.0], [0.0, 0.0], typical=False) == CANDIDATES
    assert candidate_width(v, [v, 500], [0.9, 1.0], [0.0, 0.0], typical=False) == 500
    assert candidate_width(v, [v], [1.0], [0.0], typical=False) == 0  # plain temperature: everything
    assert candidate_width(v, [40], [1.0], [0.0], typical=True) == 0
    assert candidate_width(v, [40, 7], [0.9, 1.0], [0.0, 0.0], typical=False) == 40  # all top_k
    assert candidate_width(200, [200], [0.9], [0.0], typical=False) == 0  # 64 * 4 > V
    assert candidate_width(v, [], [], [], typical=False) == 0


async def test_seeded_sampling_same_alone_and_batched(make_engine: EngineFactory, lively: Checkpoint) -> None:
    params = dict(max_new_tokens=50, temperature=1.2, top_k=30, top_p=0.95, seed=1234, stop_on_eos=False)
    engine = make_engine(max_seqs=8)
    alone = token_ids(await collect(engine, "Hello there", **params))
    again = token_ids(await collect(engine, "Hello there", **params))
    assert alone == again
    mates = [("abc", 30, 0.7, 1), ("x" * 40, 60, 1.5, 2), ("Z", 10, 0.0, 3), ("q r s", 45, 1.0, 4)]
    others = [
        collect(engine, p, max_new_tokens=n, temperature=t, seed=s, stop_on_eos=False) for p, n, t, s in mates
    ]
    results = await asyncio.gather(collect(engine, "Hello there", **params), *others)
    assert token_ids(results[0]) == alone
    assert len(set(alone)) > 5  # really sampled, not a constant
    other = token_ids(await collect(engine, "Hello there", **{**params, "seed": 99}))
    assert other != alone


async def test_a_temperature_too_low_to_sample_decodes_greedily(make_engine: EngineFactory) -> None:
    # Below GREEDY_BELOW the engine decodes greedily: at 1e-45 logits / temperature overflowed
    # float32 and each sampler drew nonsense (the native one random tokens, torch's one repeated
    # token), where 1e-30 still gave the greedy tokens.
    engine = make_engine()
    params = dict(max_new_tokens=12, stop_on_eos=False)
    greedy = token_ids(await collect(engine, "Hello there", temperature=0.0, **params))
    for t in (1e-45, 1e-30, GREEDY_BELOW / 2):
        assert token_ids(await collect(engine, "Hello there", temperature=t, seed=1, **params)) == greedy, t
    assert effective_params(SamplingParams(temperature=GREEDY_BELOW), 100).temperature == GREEDY_BELOW
    assert len(set(greedy)) > 3


@pytest.mark.parametrize("deterministic", [False, True])
async def test_logprobs_alone_vs_batched(make_engine: EngineFactory, deterministic: bool) -> None:
    """Deterministic mode computes every row alone: bit-identical logprobs whatever the batch.
    The default batched mode gives the same tokens (asserted above) with logprobs equal to
    float rounding."""
    engine = make_engine(max_seqs=6, deterministic=deterministic)
    params = dict(max_new_tokens=30, temperature=1.0, seed=5, logprobs=True, stop_on_eos=False)
    alone = await collect(engine, "Hello there", **params)
    mates = [collect(engine, p, max_new_tokens=40, temperature=0.8, seed=1, stop_on_eos=False)
             for p in ("abc", "x" * 40, "q r s", "Z")]
    batched, *_ = await asyncio.gather(collect(engine, "Hello there", **params), *mates)
    assert token_ids(batched) == token_ids(alone)
    a = [e.logprob for e in alone if e.logprob is not None]
    b = [e.logprob for e in batched if e.logprob is not None]
    if deterministic:
        assert a == b
    else:
        assert a == pytest.approx(b, abs=1e-4)



@pytest.mark.parametrize("temperature", [0.0, 0.8])
async def test_the_runner_flags_rows_with_no_usable_distribution(
    make_engine: EngineFactory, lively: Checkpoint, temperature: float
) -> None:
    """NaN anywhere, a +inf, or nothing above -inf: flagged; masked (-inf) entries beside finite
    ones are ordinary, and a greedy row takes the first of tied maxima (argmax's rule)."""
    runner = make_engine(max_seqs=6).runner
    vocab = runner.usable_vocab
    logits = torch.zeros(6, runner.vocab)
    logits[:, 3] = logits[:, 9] = 2.0  # a tie: the first index wins
    logits[1, :3] = logits[1, 10:] = NEG  # only tokens 3..9 possible
    logits[2, 5] = float("nan")
    logits[3, 7] = float("inf")
    logits[4, :vocab] = NEG
    logits[5, 0] = NEG
    reqs = []
    for slot in range(6):
        params = SamplingParams(temperature=temperature)
        loop = asyncio.get_running_loop()
        req = Request("r", [1], params, slot, 0, lively.tokenizer, loop, Inbox(loop))
        req.slot = slot
        reqs.append(req)
    result = runner.next_tokens(reqs, logits)
    assert result.finite == [True, True, False, False, False, True]
    if temperature == 0.0:
        assert [result.tokens[i] for i in (0, 1, 5)] == [3, 3, 3]
    else:
        assert 3 <= result.tokens[1] < 10 and result.tokens[5] != 0


def test_rows_sent_to_the_whole_vocabulary_keep_their_own_draws() -> None:
    # No greedy row; peaked rows are sampled from their 64 candidates, flat and "shelf" rows (64
    # likely tokens, then a long plateau) miss them and take the whole vocabulary as a subset of
    # the batch: each row must still get the token its own logits and uniform number give.
    v, n = 4096, 9
    flat, shelf, peaked = torch.zeros(v), torch.full((v,), math.log(0.037)), torch.full((v,), -20.0)
    shelf[:64] = 0.0
    peaked[100:110] = 0.0
    logits = torch.stack([(shelf, flat, peaked)[i % 3] for i in range(n)])
    batch = SamplingBatch(
        temperature=col([1.0] * n), greedy=torch.zeros(n, dtype=torch.bool),
        uniform=torch.tensor([seeded_uniform(9, i) for i in range(n)], dtype=torch.float64),
        top_p=col([0.9] * n), candidates=candidate_width(v, [v] * n, [0.9] * n, [0.0] * n, typical=False),
    )
    assert _Head(logits, batch, CANDIDATES).fits.tolist() == [i % 3 == 2 for i in range(n)]
    fast = sample_tokens(logits, batch)
    assert torch.equal(fast, sample_tokens(logits, SamplingBatch(**{**vars(batch), "candidates": 0})))
    alone = [sample_tokens(logits[i : i + 1], batch.rows(torch.tensor([i]))).item() for i in range(n)]
    assert fast.tolist() == alone
    assert len(set(fast.tolist())) > 5


def test_a_batch_with_no_greedy_row_takes_the_short_path_to_the_same_tokens() -> None:
    # The runner marks batches without a greedy row (any_greedy False); with no candidates to try
    # (a small vocabulary, or typical_p) they skip the index bookkeeping. Each row must still
    # get what the general path gives it, filters and its own uniform number included.
    for v, typical in ((65, False), (65, True), (4096, True)):
        n = 7
        logits = rows(n, v, seed=v) / 2
        kw = dict(
            temperature=col([0.7, 1.0, 1.3, 1.0, 0.5, 2.0, 1.0]), greedy=torch.zeros(n, dtype=torch.bool),
            uniform=torch.tensor([seeded_uniform(3, i) for i in range(n)], dtype=torch.float64),
            top_k=torch.tensor([[5], [v], [v], [v], [3], [v], [v]]), top_k_max=v,
            top_p=col([1.0, 0.9, 1.0, 0.5, 1.0, 1.0, 1.0]), min_p=col([0.0, 0.0, 0.1, 0.0, 0.0, 0.0, 0.0]),
            typical_p=col([1.0] * 6 + [0.8]) if typical else None,
            candidates=0 if typical else candidate_width(
                v, [5, v, v, v, 3, v, v], [1.0, 0.9, 1, 0.5, 1, 1, 1], [0, 0, 0.1, 0, 0, 0, 0],
                typical=False),
        )
        short = sample_tokens(logits.clone(), SamplingBatch(**kw, any_greedy=False))  # type: ignore[arg-type]
        general = sample_tokens(logits.clone(), SamplingBatch(**kw))  # type: ignore[arg-type]
        assert torch.equal(short, general), (v, typical)
        for i in range(n):  # and what the row alone would draw
            alone = SamplingBatch(**kw).rows(torch.tensor([i]))  # type: ignore[arg-type]
            assert short[i] == sample_from_logits(apply_filters(logits[i : i + 1], alone), alone.uniform)


def test_row_max_on_wide_rows_is_what_torch_max_gives() -> None:
    # Rows of GPT-2's width go to numpy's argmax (row_max; narrower ones and other dtypes take
    # torch's max itself): the same values and first indices, with ties, NaN (the first NaN's
    # place), -inf and +inf rows, and over a strided view of the rows.
    vocab = 50257
    assert vocab >= NUMPY_ARGMAX_FROM
    g = torch.Generator().manual_seed(6)
    x = torch.randn(7, vocab, generator=g)
    x[1, 3] = x[1, 9] = x[1].max() + 1  # a tie for the largest: the first index
    x[2, 5], x[2, 7] = float("nan"), float("nan")
    x[3] = NEG
    x[4, 11] = float("inf")
    x[5, vocab - 1] = 100.0  # the last index
    with torch.inference_mode():  # as the engine's thread runs it
        held = x.clone()
    for logits in (x, x[::2], held):
        top, idx = row_max(logits)
        ref_top, ref_idx = logits.max(dim=-1)
        assert idx.dtype == torch.long and torch.equal(idx, ref_idx)
        got = torch.tensor(top)
        assert torch.equal(got.isnan(), ref_top.isnan())
        assert torch.equal(got.nan_to_num(0.0), ref_top.nan_to_num(0.0))
