"""The device sampler (nanoserve/model/device_sampling.py, nanoserve/engine/device_draw.py)
against the reference sampler (sampling.sample_tokens through torch_backend.torch_draw), on CPU."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import random
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensorMode,
)

from nanoserve.engine.backends.torch_backend import sampling_batch, torch_draw
from nanoserve.engine.device_draw import DeviceDraw, TokenReadback, pack_params, record_penalties
from nanoserve.engine.grammar import _disallowed
from nanoserve.engine.inbox import Inbox
from nanoserve.engine.penalties import PenaltyState
from nanoserve.engine.request import Request
from nanoserve.engine.types import SamplingParams
from nanoserve.engine.work import needs_draw
from nanoserve.model.device_sampling import (
    DeviceParams,
    allowed_from_words,
    apply_bias_and_mask,
    device_sample,
    device_uniform,
)
from nanoserve.model.sampling import row_max, sample_tokens, seeded_uniform
from nanoserve.model.tokenizer import CharTokenizer
from tests.engine.conftest import EngineFactory, collect, token_ids

TOKENIZER = CharTokenizer.train("abcdefghijklmnopqrstuvwxyz ")
GPT2_VOCAB = 50257
# Per-row choices; each row draws every one independently, so batches mix greedy and sampled
# rows, every filter and penalty, set and unset.
CHOICES: dict[str, list[object]] = {
    "temperature": [0.0, 0.0, 0.7, 1.0, 1.3],
    "top_k": [None, None, 0, 1, 5, 40],
    "top_p": [None, None, 0.5, 0.9, 0.95, 1.0],
    "min_p": [None, None, 0.0, 0.05, 0.2],
    "typical_p": [None, None, None, 0.8, 0.95],
    "repetition_penalty": [None, None, 1.0, 1.2, 0.8],
    "frequency_penalty": [0.0, 0.0, 0.5, -0.3],
    "presence_penalty": [0.0, 0.0, 0.4],
}


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def requests(loop: asyncio.AbstractEventLoop, rng: random.Random, n: int, vocab: int) -> list[Request]:
    reqs = []
    for slot in range(n):
        params = SamplingParams(**{name: rng.choice(options) for name, options in CHOICES.items()})  # type: ignore[arg-type]
        prompt = [rng.randrange(vocab) for _ in range(rng.randrange(1, 40))]
        req = Request("r", prompt, params, rng.randrange(2**63), 0, TOKENIZER, loop, Inbox(loop))
        req.slot = slot
        req.generated = [rng.randrange(vocab) for _ in range(rng.randrange(5))]
        reqs.append(req)
    return reqs


def model_like_logits(gen: torch.Generator, n: int, vocab: int) -> torch.Tensor:
    """Rows from flat (a random model's) to peaked (a trained one's)."""
    scale = torch.tensor([0.05, 1.0, 3.0, 6.0])[torch.randint(4, (n, 1), generator=gen)]
    return torch.randn(n, vocab, generator=gen) * scale


def penalty_state(reqs: list[Request], vocab: int) -> PenaltyState:
    state = PenaltyState(len(reqs), vocab, torch.device("cpu"))
    for r in reqs:
        state.reset_slot(r)
    return state


def whole_vocabulary_draw(reqs: list[Request], logits: torch.Tensor, greedy: torch.Tensor,
                          penalties: PenaltyState, vocab: int) -> torch.Tensor:
    """torch_draw with sample_tokens' candidates head off: the reference's whole-vocabulary path."""
    batch = sampling_batch(reqs, vocab, logits.device)
    batch.candidates = 0
    slots = torch.tensor([r.slot for r in reqs])
    drawn = sample_tokens(logits, batch, penalties.seen[slots], penalties.counts[slots])
    return torch.where(torch.tensor([needs_draw(r) for r in reqs]), drawn, greedy)


def test_the_device_uniform_is_seeded_uniform_bit_for_bit() -> None:
    rng = random.Random(0)
    seeds = [0, 1, 2**63 - 1, 2**62, *(rng.randrange(2**63) for _ in range(200))]
    index = [rng.randrange(100_000) for _ in seeds[4:]]
    pairs = [(s, i) for s in seeds[:4] for i in (0, 1, 2**31)] + list(zip(seeds[4:], index, strict=True))
    got = device_uniform(torch.tensor([s for s, _ in pairs]), torch.tensor([i for _, i in pairs]))
    assert got.dtype == torch.float64
    assert got.tolist() == [seeded_uniform(s, i) for s, i in pairs]  # float equality: every bit


@pytest.mark.parametrize("vocab", [65, GPT2_VOCAB])
def test_the_device_sampler_draws_the_reference_tokens(loop: asyncio.AbstractEventLoop, vocab: int) -> None:
    """Mixed batches over several steps: every token the reference's whole-vocabulary path draws,
    and the penalty state it leaves. Against the engine's reference (its candidates head on), the
    tokens can differ only where that reference disagrees with its own whole-vocabulary path: the
    head computes the nucleus's mass and the softmax over 64 tokens instead of 50k, a float32
    rounding (~1e-7) apart, so a draw moves only when its uniform or a top_p target falls that
    close to a boundary: at most 1 in 1,000 here. Measured with this test's requests in batches of
    32: 0 differences from either path in 9,600 draws (5,733 sampled) at 50,257 tokens and 9,600
    (5,775) at 65. (The whole-vocabulary path sums a 50k row's nucleus bucket by bucket,
    nucleus.py, this one token by token: ~1e-15 apart.)"""
    rng, gen = random.Random(vocab), torch.Generator().manual_seed(vocab)
    draws = head_differs = 0
    for _ in range(12 if vocab > 1000 else 40):
        reqs = requests(loop, rng, rng.choice([1, 5, 16]), vocab)
        ref_state = penalty_state(reqs, vocab)
        dev_state, sampler = copy.deepcopy(ref_state), DeviceDraw()
        for _step in range(3):
            logits = model_like_logits(gen, len(reqs), vocab)
            greedy = row_max(logits)[1]
            engine = torch_draw(reqs, logits.clone(), greedy, copy.deepcopy(ref_state), vocab)
            whole = whole_vocabulary_draw(reqs, logits, greedy, ref_state, vocab)
            ref_state.record(reqs, whole)  # the reference's bookkeeping, as torch_draw does it
            got = sampler(reqs, logits.clone(), greedy, dev_state, vocab)
            assert got.tolist() == whole.tolist()
            head_differs += int((engine != whole).sum())
            assert torch.equal(ref_state.seen, dev_state.seen)
            assert torch.equal(ref_state.counts, dev_state.counts)
            draws += len(reqs)
            for r, token in zip(reqs, got.tolist(), strict=True):
                r.generated.append(token)
    assert head_differs <= draws // 1000, (head_differs, draws)


@pytest.mark.backends("torch", "torch-cuda")
async def test_an_engine_drawing_on_the_device_streams_the_reference_tokens(
    make_engine: EngineFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The torch backend's draw through its DeviceDraw (as the factory sets it on a GPU): concurrent
    seeded streams with every kind of parameter, logit bias included, are the reference's."""
    reference, device = make_engine(max_seqs=8), make_engine(max_seqs=8)
    assert reference.runner.backend.describe()["sampler"] == "reference"  # a CPU draws on the host
    monkeypatch.setattr(device.runner.backend, "device_draw", DeviceDraw())
    assert device.runner.backend.describe()["sampler"] == "device"
    settings: list[dict[str, object]] = [
        dict(temperature=1.2, top_k=30, top_p=0.95, seed=1),
        dict(temperature=0.8, min_p=0.1, repetition_penalty=1.3, seed=2),
        dict(temperature=0.0, frequency_penalty=0.5, presence_penalty=0.3),
        dict(temperature=1.0, typical_p=0.9, seed=4),
        dict(temperature=0.9, logit_bias=((5, 3.0), (7, -100.0)), seed=5),
        dict(temperature=0.0),
    ]
    streams = []
    for engine in (reference, device):
        runs = (collect(engine, f"{i} Hello", max_new_tokens=40, stop_on_eos=False, **kw)
                for i, kw in enumerate(settings))
        streams.append([token_ids(events) for events in await asyncio.gather(*runs)])
    assert streams[0] == streams[1]
    assert len(set(streams[1][0])) > 5  # really sampled


def test_a_request_draws_the_same_tokens_alone_or_batched(loop: asyncio.AbstractEventLoop) -> None:
    rng, gen = random.Random(7), torch.Generator().manual_seed(7)
    reqs = requests(loop, rng, 16, GPT2_VOCAB)
    logits = model_like_logits(gen, len(reqs), GPT2_VOCAB)
    greedy = row_max(logits)[1]
    state = penalty_state(reqs, GPT2_VOCAB)
    batched = DeviceDraw()(reqs, logits, greedy, copy.deepcopy(state), GPT2_VOCAB)
    alone = [DeviceDraw()([r], logits[j : j + 1], greedy[j : j + 1], copy.deepcopy(state), GPT2_VOCAB).item()
             for j, r in enumerate(reqs)]
    assert batched.tolist() == alone
    assert len(set(alone)) > 8  # the rows really sample


def test_rows_padding_a_batch_to_a_graph_bucket_change_nothing(loop: asyncio.AbstractEventLoop) -> None:
    """A batch of 5 padded to 8 rows (pack_params' rows) in a scratch slot: the 5 requests draw
    what they draw unpadded, and the penalty state is what the 5 alone leave."""
    vocab, n, bucket = 1000, 5, 8
    rng, gen = random.Random(4), torch.Generator().manual_seed(4)
    reqs = requests(loop, rng, n, vocab)
    for r in reqs:  # every row penalised, so each writes its slot's state
        r.params = dataclasses.replace(r.params, repetition_penalty=1.3, frequency_penalty=0.5)
    logits = model_like_logits(gen, bucket, vocab)
    alone, padded = PenaltyState(n + 1, vocab, torch.device("cpu")), None
    for r in reqs:
        alone.reset_slot(r)
    padded, before = copy.deepcopy(alone), int(alone.counts.sum())
    want = _device_step(torch.from_numpy(pack_params(reqs, vocab)), logits[:n], alone, logits[:n].argmax(-1),
                        *_no_bias_or_mask(n, vocab))
    got = _device_step(torch.from_numpy(pack_params(reqs, vocab, rows=bucket, pad_slot=n)), logits, padded,
                       logits.argmax(-1), *_no_bias_or_mask(bucket, vocab))
    assert got[:n].tolist() == want.tolist()
    assert torch.equal(padded.seen, alone.seen) and torch.equal(padded.counts, alone.counts)
    assert alone.counts.sum() == before + n  # the 5 wrote


def _no_bias_or_mask(n: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    words = torch.full((n, (vocab + 31) // 32), -1, dtype=torch.int32)  # every token allowed
    return torch.zeros(n, 1, dtype=torch.long), torch.zeros(n, 1), words


def test_logit_bias_and_the_grammar_mask_as_the_runner_applies_them(loop: asyncio.AbstractEventLoop) -> None:
    """Padded (row, token, value) biases and bitmask words unpacked on the device: the same
    logits as the runner's in-place bias (ModelRunner._add_logit_bias) and grammar mask
    (grammar._disallowed), so the same tokens."""
    vocab, n = 1000, 6
    rng, gen = random.Random(3), torch.Generator().manual_seed(3)
    logits = model_like_logits(gen, n, vocab)
    biases = [dict((rng.randrange(vocab), rng.choice([-100.0, -2.5, 3.0, 100.0])) for _ in range(k))
              for k in (0, 1, 3, 8, 2, 0)]
    width = max(len(b) for b in biases)
    ids = torch.tensor([list(b) + [0] * (width - len(b)) for b in biases])
    values = torch.tensor([list(b.values()) + [0.0] * (width - len(b)) for b in biases])
    words = np.random.default_rng(3).integers(-(2**31), 2**31, size=(n, (vocab + 31) // 32), dtype=np.int64)
    words = words.astype(np.int32)
    expected = logits.clone()
    for j, b in enumerate(biases):  # the runner's arithmetic
        if b:
            expected[j, list(b)] += torch.tensor(list(b.values()))
    expected[torch.from_numpy(_disallowed(words, vocab))] = float("-inf")
    allowed = allowed_from_words(torch.from_numpy(words), vocab)
    got = apply_bias_and_mask(logits, ids, values, allowed)
    assert torch.equal(got, expected)
    reqs = requests(loop, rng, n, vocab)
    p = DeviceParams.unpack(torch.from_numpy(pack_params(reqs, vocab)))
    assert torch.equal(device_sample(got, p), device_sample(expected, p))


def _device_step(packed: torch.Tensor, logits: torch.Tensor, state: PenaltyState, greedy: torch.Tensor,
                 ids: torch.Tensor, values: torch.Tensor, words: torch.Tensor) -> torch.Tensor:
    """Everything DeviceDraw and a captured step run after the parameters' copy, every option on."""
    p = DeviceParams.unpack(packed)
    biased = apply_bias_and_mask(logits, ids, values, allowed_from_words(words, logits.shape[-1]))
    seen, counts = state.seen.index_select(0, p.slot), state.counts.index_select(0, p.slot)
    tokens = torch.where(p.draws, device_sample(biased, p, seen, counts, typical=True), greedy)
    record_penalties(state, p, tokens)
    return tokens


def test_the_device_step_has_no_data_dependent_shapes_or_host_reads(loop: asyncio.AbstractEventLoop) -> None:
    """Under FakeTensorMode tensors have shapes but no values: an op whose output shape depends on
    values (nonzero, boolean indexing) or that reads a value on the host (.item(), .tolist(),
    bool(t)) raises. The reference sampler, which uses them, raises there (the check can fail)."""
    vocab, n = 4096, 8
    reqs = requests(loop, random.Random(5), n, vocab)
    for r in reqs:  # every processor on in some row
        r.params = dataclasses.replace(r.params, typical_p=0.9, repetition_penalty=1.2, temperature=0.8)
    real_logits = torch.randn(n, vocab)
    packed = torch.from_numpy(pack_params(reqs, vocab))
    state = penalty_state(reqs, vocab)
    with FakeTensorMode(allow_non_fake_inputs=False) as mode:
        fake = [mode.from_tensor(t) for t in (packed, real_logits, state.seen, state.counts)]
        fake_state = copy.copy(state)
        fake_state.seen, fake_state.counts = fake[2], fake[3]
        greedy = fake[1].argmax(dim=-1)
        ids, values = torch.zeros(n, 4, dtype=torch.long), torch.zeros(n, 4)
        words = torch.zeros(n, vocab // 32, dtype=torch.int32)
        tokens = _device_step(fake[0], fake[1], fake_state, greedy, ids, values, words)
        assert tokens.shape == (n,) and tokens.dtype == torch.long
        batch = sampling_batch(reqs, vocab, torch.device("cpu"))
        with pytest.raises((DynamicOutputShapeException, DataDependentOutputException)):
            sample_tokens(fake[1], batch, fake[2], fake[3])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_the_device_step_replays_as_a_cuda_graph_without_a_sync(loop: asyncio.AbstractEventLoop) -> None:
    """Run eagerly under sync debug mode "error" (a synchronising op raises), captured once (a
    sync during capture fails it), replayed on new logits and parameters copied into its static
    inputs: the tokens and penalty state of the same step run eagerly."""
    vocab, n, dev = GPT2_VOCAB, 16, torch.device("cuda")
    rng, gen = random.Random(9), torch.Generator().manual_seed(9)
    words = torch.full((n, (vocab + 31) // 32), -1, dtype=torch.int32, device=dev)  # all allowed
    ids, values = torch.zeros(n, 2, dtype=torch.long, device=dev), torch.zeros(n, 2, device=dev)

    def inputs() -> tuple[torch.Tensor, torch.Tensor, PenaltyState]:
        reqs = requests(loop, rng, n, vocab)
        state = copy.deepcopy(penalty_state(reqs, vocab))
        state.seen, state.counts = state.seen.to(dev), state.counts.to(dev)
        packed = torch.from_numpy(pack_params(reqs, vocab)).to(dev)
        return packed, model_like_logits(gen, n, vocab).to(dev), state

    packed, logits, state = inputs()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture, as torch.cuda.graph asks
        torch.cuda.set_sync_debug_mode("error")
        try:
            _device_step(packed, logits, copy.deepcopy(state), logits.argmax(-1), ids, values, words)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _device_step(packed, logits, state, logits.argmax(-1), ids, values, words)
    for _ in range(3):
        new_packed, new_logits, new_state = inputs()
        eager_state = copy.deepcopy(new_state)
        eager = _device_step(new_packed, new_logits, eager_state, new_logits.argmax(-1), ids, values, words)
        packed.copy_(new_packed)
        logits.copy_(new_logits)
        state.seen.copy_(new_state.seen)
        state.counts.copy_(new_state.counts)
        graph.replay()
        assert torch.equal(out, eager)
        assert torch.equal(state.seen, eager_state.seen) and torch.equal(state.counts, eager_state.counts)


@pytest.mark.parametrize("device", ["cpu", *(["cuda"] if torch.cuda.is_available() else [])])
def test_tokens_come_back_in_one_copy(device: str) -> None:
    readback = TokenReadback()
    readback.start(torch.tensor([5, 1, 7], device=device))
    assert readback.tokens() == [5, 1, 7]
    readback.start(torch.tensor([2], device=device))  # the buffer reused for a smaller step
    assert readback.tokens() == [2]
