"""native/sampler.inc draws what nanoserve/model/sampling.py's whole-vocabulary path draws (penalties,
temperature, top_k, top_p, min_p, typical_p, inverse-CDF sampling), and the runner hands it
exactly the rows it can take."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from nanoserve.engine.backends.native_backend import NativeBackend
from nanoserve.engine.backends.torch_backend import torch_draw
from nanoserve.engine.kv_slots import SpanKVCache
from nanoserve.engine.native_step import NativeStep, SamplePenalties
from nanoserve.engine.types import SamplingParams
from nanoserve.engine.work import needs_draw
from nanoserve.model.config import GPTConfig
from nanoserve.model.gpt import GPT
from nanoserve.model.sampling import SamplingBatch, sample_tokens
from tests.engine.conftest import EngineFactory, col, collect, token_ids

pytestmark = [pytest.mark.usefixtures("native_library"), pytest.mark.backends("native")]


@pytest.fixture(scope="module", params=["best", "c"])
def native(request: pytest.FixtureRequest, native_library: None) -> NativeStep:
    """The sampler at the best level this CPU has (AVX2's exp), and in plain C (expf)."""
    cfg = GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=32)
    model = GPT(cfg).eval()
    cache = SpanKVCache(cfg.n_layer, 2, cfg.n_head, cfg.block_size, cfg.head_dim, torch.float32, "cpu")
    step = NativeStep(model, cache, max_threads=2)
    if request.param == "c":
        assert step.use_isa("c") == "c"
    return step


def torch_draws(
    logits: torch.Tensor, temps: list[float], top_k: list[int], top_p: list[float], min_p: list[float],
    uniform: list[float], seen: torch.Tensor | None = None, counts: torch.Tensor | None = None,
    **more: torch.Tensor,
) -> torch.Tensor:
    """sample_tokens' draws for the native sampler's arguments; `more`: further SamplingBatch
    columns (penalties, typical_p), with the rows' `seen` and `counts` for the penalties."""
    v = logits.shape[-1]
    ks = [k if 0 < k < v else v for k in top_k]
    temps = [max(t, 0.0) for t in temps]  # (rows the native sampler skips: greedy here, unused)
    batch = SamplingBatch(
        temperature=col(temps), greedy=torch.tensor([t == 0 for t in temps]),
        uniform=torch.tensor(uniform, dtype=torch.float64), top_k=torch.tensor(ks).view(-1, 1),
        top_k_max=max(ks), top_p=col(top_p), min_p=col(min_p), any_greedy=0 in temps, **more,
    )
    return sample_tokens(logits, batch, seen=seen, counts=counts)


def cases() -> list[torch.Tensor]:
    """Rows from flat to peaked at widths on both sides of the narrow-row sort (1,024) and of
    the vector width, with tied scores (both zeros among them) and masked tokens."""
    g = torch.Generator().manual_seed(11)
    scale = torch.tensor([[0.05], [0.5], [1.0], [2.0], [3.0], [5.0], [8.0], [20.0]])
    out = []
    for width in (7, 65, 97, 1024, 1025, 4096, 50257):
        x = torch.randn(8, width, generator=g) * scale
        tied = x.round()  # ties, and 0.0 beside -0.0
        masked = x.clone()
        masked[:, ::3] = float("-inf")  # what a padded vocabulary leaves
        out += [x, tied, masked]
    # Wide rows whose cut falls among zeros of both signs: equal scores, different bits.
    zeros = torch.zeros(8, 4096)
    zeros[:, ::2] = -0.0
    zeros[4:, :100] = 1.0
    # Flat rows in order, largest first and last: the worst orders for a selection of the k
    # largest (flat, so that every top_k matters).
    x = torch.randn(8, 4096, generator=g) * 0.3
    ordered = [x.sort(dim=-1, descending=True).values, x.sort(dim=-1).values]
    return [*out, zeros, *ordered]


def test_the_native_sampler_draws_what_sample_tokens_draws(native: NativeStep) -> None:
    # Every row of every case, at temperatures around 1, with top_k (1, a few, 40, off; ties at
    # the k-th come with the rounded cases), top_p from a sliver to off and min_p, alone and
    # together, and uniform numbers including 0 and the largest below 1; greedy rows get the
    # argmax, rows of temperature -1 are left as they were. The native exp is float32 (the torch
    # path's top_p mass float64): a draw could differ only where a row's mass, ratio or uniform
    # number lands within ~1e-6 of a boundary; none of these do.
    g = torch.Generator().manual_seed(12)
    top_ks = [0, 1, 5, 40, 0, 0, 3, 0, 0, 1000]
    top_ps = [0.3, 0.9, 0.5, 0.95, 1e-6, 0.99, 1.0, 0.7, 1.0]
    min_ps = [0.0, 0.0, 0.05, 0.0, 0.2, 0.0, 1.0, 0.5]  # 1: only the likeliest and its ties
    drawn = 0
    for i, x in enumerate(cases()):
        n = len(x)
        temps = [(0.0, -1.0)[i % 2] if (r + i) % 5 == 0 else 0.4 + (r % 4) * 0.5 for r in range(n)]
        top_k = [top_ks[(r + 3 * i) % len(top_ks)] for r in range(n)]
        top_p = [top_ps[(r + i) % len(top_ps)] for r in range(n)]
        min_p = [min_ps[(r + 2 * i) % len(min_ps)] for r in range(n)]
        uniform = torch.rand(n, generator=g, dtype=torch.float64).tolist()
        uniform[i % n], uniform[(i + 1) % n] = 0.0, 1.0 - 2.0**-53
        out = torch.full((n,), -1, dtype=torch.int64)
        native.sample(x.contiguous(), temps, top_k, top_p, min_p, uniform, out)
        expected = torch_draws(x, temps, top_k, top_p, min_p, uniform)
        drawn_here = torch.tensor([t >= 0 for t in temps])
        assert torch.equal(out[drawn_here], expected[drawn_here]), f"case {i}, width {x.shape[-1]}"
        assert (out[~drawn_here] == -1).all()
        drawn += int(drawn_here.sum())
    assert drawn > 160  # 24 cases x 8 rows, a tenth of them skipped


def test_the_native_sampler_applies_the_penalties_as_sample_tokens_does(native: NativeStep) -> None:
    # Repetition (dividing positive logits, multiplying negative ones), frequency and presence
    # penalties from per-slot seen flags and counts, rows sharing slots, beside the filters.
    g = torch.Generator().manual_seed(14)
    for width in (97, 4096, 50257):
        slots, n = 5, 8
        seen = torch.rand(slots, width, generator=g) < 0.3
        counts = torch.randint(0, 4, (slots, width), generator=g, dtype=torch.int32) * seen
        scale = torch.tensor([[0.5], [1.0], [2.0], [3.0], [1.0], [4.0], [0.3], [2.0]])
        x = torch.randn(n, width, generator=g) * scale
        slot = [0, 1, 2, 3, 4, 0, 2, 4]
        rep = [1.3, 1.0, 0.8, 1.5, 1.0, 1.2, 2.0, 1.0]
        freq = [0.0, 0.5, 0.0, 0.3, 0.0, 1.0, 0.2, 0.0]
        pres = [0.0, 0.7, 0.0, 0.0, 0.4, 0.5, 0.0, 0.0]
        temps = [1.0, 0.8, 1.2, 0.0, 1.0, 0.7, 1.5, -1.0]  # 0: greedy, penalised; -1: skipped
        top_k = [0, 0, 40, 0, 5, 0, 0, 0]
        top_p = [1.0, 0.9, 1.0, 0.95, 1.0, 0.8, 1.0, 1.0]
        min_p = [0.0, 0.0, 0.0, 0.0, 0.0, 0.05, 0.0, 0.0]
        uniform = torch.rand(n, generator=g, dtype=torch.float64).tolist()
        out = torch.full((n,), -1, dtype=torch.int64)
        native.sample(x, temps, top_k, top_p, min_p, uniform, out,
                      SamplePenalties(seen, counts, slot, rep, freq, pres))

        index = torch.tensor(slot)
        expected = torch_draws(x, temps, top_k, top_p, min_p, uniform, seen[index], counts[index],
                               repetition_penalty=col(rep), frequency_penalty=col(freq),
                               presence_penalty=col(pres))
        drawn = torch.tensor([t >= 0 for t in temps])
        assert torch.equal(out[drawn], expected[drawn]), f"width {width}"
        assert (out[~drawn] == -1).all()


def test_a_uniform_number_on_a_boundary_takes_the_next_token(native: NativeStep) -> None:
    # Four tied tokens (probability 1/4 each, sums exact): u = k/4 lands exactly on the k-th
    # boundary of the CDF, and inverse-CDF sampling takes the first token whose CDF passes it.
    x = torch.full((4, 64), float("-inf"))
    x[:, [3, 10, 20, 50]] = 2.0
    uniform = [0.0, 0.25, 0.5, 0.75]
    out = torch.zeros(4, dtype=torch.int64)
    native.sample(x, [1.0] * 4, [0] * 4, [1.0] * 4, [0.0] * 4, uniform, out)
    assert out.tolist() == [3, 10, 20, 50]
    assert torch.equal(out, torch_draws(x, [1.0] * 4, [0] * 4, [1.0] * 4, [0.0] * 4, uniform))


def test_the_native_sampler_follows_the_distribution(native: NativeStep) -> None:
    # 20,000 draws of one row: each token's share is its probability under temperature and top_p
    # (the two likeliest tokens hold 0.75 of the mass at temperature 0.5; top_p 0.7 keeps them only).
    logits = torch.tensor([[2.0, 1.5, 0.0, -1.0, 0.5, float("-inf")]]).repeat(20000, 1)
    uniform = torch.rand(20000, generator=torch.Generator().manual_seed(13), dtype=torch.float64).tolist()
    out = torch.zeros(20000, dtype=torch.int64)
    native.sample(logits, [0.5] * 20000, [0] * 20000, [0.7] * 20000, [0.0] * 20000, uniform, out)
    counts = torch.bincount(out, minlength=6).double() / 20000
    p = torch.softmax(torch.tensor([2.0, 1.5]) / 0.5, dim=-1).double()
    assert counts[2:].sum() == 0
    assert torch.allclose(counts[:2], p, atol=0.01)


def typical_reference(x: torch.Tensor, t: float, mass: float) -> tuple[np.ndarray, np.ndarray, float]:
    """typical_p in float64 (what native/sampler.inc computes, up to its float32 exp): each token's
    probability and distance |log p + H| at temperature t, and the distance at the cut."""
    z = x.double().numpy() / t
    logp = z - z.max() - np.log(np.exp(z - z.max()).sum())
    p = np.exp(logp)
    d = np.abs(logp + -(p * logp).sum())
    order = np.argsort(d, kind="stable")
    reach = np.cumsum(p[order])
    at = min(int(np.searchsorted(reach, mass * reach[-1])), len(order) - 1)
    return p, d, float(d[order[at]])


def test_typical_p_draws_what_sample_tokens_draws_where_distances_are_apart(native: NativeStep) -> None:
    # The native entropy and distances are float64, torch's float32: on rows whose distances
    # around the cut are well apart (checked against a float64 reference; close rows are
    # skipped, and most rows are not), every draw is the torch path's, with typical_p alone and
    # after top_k, top_p and min_p.
    g = torch.Generator().manual_seed(15)
    checked = skipped = 0
    for width in (7, 65, 97, 1024, 1025, 4096):
        x = torch.randn(16, width, generator=g) * torch.tensor([1.0, 2.0, 3.0, 5.0]).repeat(4).view(-1, 1)
        temps = [0.7, 1.0, 1.3, 1.0] * 4
        typical = [0.2, 0.5, 0.9, 0.95] * 4
        top_k = [0] * 8 + [40, 0, 0, 5] * 2
        top_p = [1.0] * 8 + [1.0, 0.9, 1.0, 1.0] * 2
        min_p = [0.0] * 8 + [0.0, 0.0, 0.05, 0.0] * 2
        uniform = torch.rand(16, generator=g, dtype=torch.float64).tolist()
        out = torch.full((16,), -1, dtype=torch.int64)
        native.sample(x, temps, top_k, top_p, min_p, uniform, out, typical_p=typical)
        expected = torch_draws(x, temps, top_k, top_p, min_p, uniform, typical_p=col(typical))
        for r in range(8):  # typical_p alone: the reference applies to these rows as they are
            _, d, cut = typical_reference(x[r], temps[r], typical[r])
            near = np.abs(d - cut)
            if ((near > 0) & (near < 1e-4)).any():  # another distance within float32 noise of the cut
                skipped += 1
                continue
            assert out[r] == expected[r], f"width {width}, row {r}"
            checked += 1
        assert torch.equal(out[8:], expected[8:]), f"width {width}, with other filters"
    assert checked >= 40 and skipped <= 8, (checked, skipped)


def test_typical_p_on_flat_wide_rows_keeps_the_float64_cut(native: NativeStep) -> None:
    # GPT-2-wide flat rows, where thousands of distances lie within float32 rounding of each
    # other: every draw comes from the float64 reference's kept tokens or from those within 1e-5
    # of its cut, and nearly every draw is the reference's own inverse-CDF draw (a cut in the
    # wrong place, or too few or too many tokens kept, would move most of them).
    g = torch.Generator().manual_seed(16)
    for scale, mass in ((0.05, 0.9), (0.5, 0.5), (1.0, 0.95), (3.0, 0.2)):
        row = torch.randn(50257, generator=g) * scale
        n = 48
        x = row.repeat(n, 1)
        uniform = torch.rand(n, generator=g, dtype=torch.float64).tolist()
        out = torch.zeros(n, dtype=torch.int64)
        native.sample(x, [1.0] * n, [0] * n, [1.0] * n, [0.0] * n, uniform, out, typical_p=[mass] * n)
        p, d, cut = typical_reference(row, 1.0, mass)
        kept = d <= cut
        band = np.abs(d - cut) <= 1e-5
        assert all(kept[i] or band[i] for i in out.tolist()), scale
        cdf = np.cumsum(np.where(kept, p, 0.0))
        reference = np.searchsorted(cdf, np.array(uniform) * cdf[-1], side="right")
        assert (out.numpy() == reference).sum() >= n - 2, (scale, (out.numpy() != reference).sum())
        assert len(set(out.tolist())) > n // 2  # really sampled


def test_the_rows_that_draw_are_the_sampled_and_the_penalised_ones() -> None:
    # The native backend draws every such row with its sampler; the others keep the argmax.
    def takes(**params: float) -> bool:
        return needs_draw(SimpleNamespace(params=SamplingParams(**params)))  # type: ignore[arg-type]

    assert takes(temperature=0.7) and takes(temperature=1.0, top_p=0.9, top_k=5, min_p=0.1)
    assert takes(temperature=1.0, repetition_penalty=1.2, frequency_penalty=0.5, presence_penalty=0.5)
    assert not takes(temperature=0.0)  # greedy rows keep the max pass's argmax
    assert takes(temperature=0.0, repetition_penalty=1.2)  # unless a penalty moves it
    assert takes(temperature=1.0, typical_p=0.9)


async def test_a_request_draws_the_same_tokens_alone_and_beside_others(
    make_engine: EngineFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Its rows are drawn natively whatever its batch mates need (typical_p, a penalty, greedy):
    # the sampler is handed its temperature and a -1 (skip) for each mate it does not draw.
    handed: list[list[float]] = []
    sample = NativeStep.sample

    def recorded(self: NativeStep, logits: torch.Tensor, temperature: list[float], *rest: object,
                 **named: object) -> None:
        handed.append(temperature)
        sample(self, logits, temperature, *rest, **named)  # type: ignore[arg-type]

    monkeypatch.setattr(NativeStep, "sample", recorded)
    params = dict(max_new_tokens=40, temperature=1.3, top_p=0.9, seed=7, stop_on_eos=False)
    engine = make_engine(max_seqs=8)
    alone = token_ids(await collect(engine, "Hello there", **params))
    mates = [dict(typical_p=0.8, temperature=0.9), dict(frequency_penalty=0.5, temperature=1.1),
             dict(temperature=0.0), dict(repetition_penalty=1.3, temperature=0.0)]
    others = [
        collect(engine, "abc", max_new_tokens=40, seed=i, stop_on_eos=False, **m) for i, m in enumerate(mates)
    ]
    results = await asyncio.gather(collect(engine, "Hello there", **params), *others)
    assert token_ids(results[0]) == alone
    assert len(set(alone)) > 5
    # 0.9: the typical_p mate; 1.1 and 0.0: the penalised ones, sampled and greedy; -1: plain greedy.
    assert {t for temps in handed for t in temps} == {-1.0, 0.0, 0.9, 1.1, 1.3}
    assert max(len(temps) for temps in handed) == 5  # batched with its four mates


async def test_an_engine_generates_the_same_tokens_with_either_sampler(
    make_engine: EngineFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    params = dict(max_new_tokens=40, temperature=1.3, top_k=12, top_p=0.9, min_p=0.02, stop_on_eos=False)
    penalised = dict(params, repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.2)
    greedy = dict(penalised, temperature=0.0)
    prompts = ["Hello there", "abc", "q r s", "Z", "xyz"]
    engine = make_engine(max_seqs=4)

    async def run() -> list[list[int]]:
        # Penalised requests too, sampled and greedy: their seen tokens and counts must follow
        # either way.
        return [token_ids(await collect(engine, p, seed=i, **[params, penalised, greedy][i % 3]))
                for i, p in enumerate(prompts)]

    native = await run()
    # The same native forwards, every row drawn by the torch backend's sampler instead.
    monkeypatch.setattr(NativeBackend, "draw", lambda self, *args: torch_draw(*args, self.step.vocab))
    assert await run() == native
    assert len({t for tokens in native for t in tokens}) > 10  # really sampled
