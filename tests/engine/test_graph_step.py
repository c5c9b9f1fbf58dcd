"""The static-shape decode step (graph_step.py): the general forward's logits at every bucket,
padding that never touches a real slot, no data-dependent shape or host read, and on CUDA the
captured graphs replaying the eager step."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensorMode,
)

from nanoserve.engine.backends.factory import choose_backend
from nanoserve.engine.backends.torch_backend import TorchBackend
from nanoserve.engine.config import EngineConfig
from nanoserve.engine.graph_step import GraphDecodeStep, batch_buckets, bucket_for, span_buckets
from nanoserve.engine.kv_slots import SpanKVCache
from nanoserve.engine.work import WorkItem
from nanoserve.model.config import GPTConfig
from nanoserve.model.gpt import GPT

MAX_ROWS = 6  # batch buckets 1, 2, 4, 6: 3 and 5 rows are padded
WINDOW = 128  # span buckets 64, 128: rows cross from one to the other as they decode
FAMILIES = {
    "gpt2": dict(),
    # Grouped-query attention: 4 query heads over 2 key/value heads.
    "llama gqa": dict(norm="rmsnorm", mlp="swiglu", positions="rope", n_kv_head=2, bias=False,
                      tie_embeddings=False),
}
# Float32 throughout. The step and the forward compute the same sums in different orders (two
# matmuls vs the fused kernel or baddbmm; a reshape of the queries vs repeat_kv), so each logit
# differs by rounding: float32's relative epsilon 1.2e-7 times the few terms of these 32-wide
# dot products over 2 layers, on logits whose scaled weights make them up to ~10^2. 1e-4
# relative to the largest logit bounds that with room, and is far below what a wrong position,
# slot or mask changes (the logits' spread across positions is of order 1).
RTOL = 1e-4


def tiny(family: str) -> GPT:
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=48, block_size=WINDOW, n_layer=2, n_head=4, n_embd=32, **FAMILIES[family])
    model = GPT(cfg).eval()
    with torch.no_grad():  # sharper logits than the small init's, so a wrong one shows
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(4.0)
    return model


def new_cache(model: GPT) -> SpanKVCache:
    cfg = model.config
    return SpanKVCache(cfg.n_layer, MAX_ROWS + 1, cfg.kv_heads, WINDOW, cfg.head_dim, torch.float32, "cpu")


@torch.no_grad()
def prefill(model: GPT, caches: list[SpanKVCache], lengths: list[int], gen: torch.Generator) -> None:
    """Random prompts of `lengths` into slots 0.. of every cache (on the model's device)."""
    dev = model.wte.weight.device
    for slot, n in enumerate(lengths):
        prompt = torch.randint(0, model.config.vocab_size, (1, n), generator=gen).to(dev)
        for cache in caches:
            cache.prepare([slot], [n])
            model(prompt, input_pos=torch.arange(n, device=dev).view(1, -1), cache=cache,
                  slots=torch.tensor([slot], device=dev))


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("rows", range(1, MAX_ROWS + 1))
@torch.no_grad()
def test_the_step_gives_the_forwards_logits_at_every_bucket(family: str, rows: int) -> None:
    model = tiny(family)
    ref_cache, cache = new_cache(model), new_cache(model)
    step = GraphDecodeStep(model, cache, MAX_ROWS)
    gen = torch.Generator().manual_seed(rows)
    lengths = [60 - 7 * i for i in range(MAX_ROWS)]  # every row at its own position, some near 64
    prefill(model, [ref_cache, cache], lengths, gen)
    slots = list(range(MAX_ROWS))[::-1][:rows]  # not in slot order: the step gathers
    pos = [lengths[s] for s in slots]
    for _ in range(8):  # the longest row crosses span bucket 64 -> 128
        idx = torch.randint(0, model.config.vocab_size, (rows,), generator=gen)
        ref_cache.prepare(slots, [p + 1 for p in pos])
        want = model(idx.view(-1, 1), input_pos=torch.tensor(pos).view(-1, 1), cache=ref_cache,
                     slots=torch.tensor(slots), last_only=True)[:, -1]
        got = step(idx.tolist(), pos, slots)
        torch.testing.assert_close(got, want, rtol=0, atol=RTOL * want.abs().max().item())
        pos = [p + 1 for p in pos]
    for ref_layer, layer in zip(ref_cache.layers, cache.layers, strict=True):  # the same keys written
        torch.testing.assert_close(layer.k[:MAX_ROWS], ref_layer.k[:MAX_ROWS], rtol=0, atol=1e-4)


@pytest.mark.parametrize("family", sorted(FAMILIES))
@torch.no_grad()
def test_padding_rows_write_only_the_scratch_slot(family: str) -> None:
    model = tiny(family)
    cache = new_cache(model)
    for layer in cache.layers:  # every slot full of values a stray write would change
        layer.k.normal_()
        layer.v.normal_()
    before = [(layer.k.clone(), layer.v.clone()) for layer in cache.layers]
    step = GraphDecodeStep(model, cache, MAX_ROWS)
    slots, pos = [4, 1, 2], [9, 3, 30]
    step([5, 6, 7], pos, slots)  # 3 rows run as bucket 4: one padding row
    scratch = step.scratch
    for layer, (k0, v0) in zip(cache.layers, before, strict=True):
        for name, now, old in (("k", layer.k, k0), ("v", layer.v, v0)):
            changed = (now != old).any(dim=1).any(dim=-1).nonzero().tolist()  # (slot, position) pairs
            assert changed == sorted([[scratch, 0], *map(list, zip(slots, pos, strict=True))]), name


def run_faked(fn: Callable[[], object]) -> None:
    """Run `fn` on fake tensors: any data-dependent shape (nonzero, masked_select) or read of a
    value by the host (.item(), .tolist(), a tensor in an `if`) raises."""
    with FakeTensorMode(allow_non_fake_inputs=True):
        fn()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_step_has_no_data_dependent_shape_or_host_read(family: str) -> None:
    model = tiny(family)
    step = GraphDecodeStep(model, new_cache(model), MAX_ROWS)
    for b in step.batches:
        for s in step.spans:
            run_faked(lambda b=b, s=s: step.compute(b, s))  # type: ignore[misc]


@pytest.mark.parametrize("sync", [lambda t: t.sum().item(), lambda t: t.nonzero(), lambda t: bool(t[0] > 0)])
def test_the_fake_run_catches_host_reads_and_data_dependent_shapes(
    sync: Callable[[torch.Tensor], object],
) -> None:
    """The check above is not blind: each of these, added to the step, would fail it."""
    x = torch.arange(4.0)
    with pytest.raises((DataDependentOutputException, DynamicOutputShapeException)):
        run_faked(lambda: sync(x * 2))


def test_buckets() -> None:
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 32, 64]
    assert batch_buckets(100) == [1, 2, 4, 8, 16, 32, 64, 96, 100]
    assert batch_buckets(1) == [1]
    assert span_buckets(1024) == [64, 128, 256, 512, 1024]
    assert span_buckets(100) == [64, 100]
    assert span_buckets(32) == [32]
    assert bucket_for(33, batch_buckets(100)) == 64
    with pytest.raises(ValueError, match="more than the largest bucket"):
        bucket_for(101, batch_buckets(100))


def test_a_cache_without_a_scratch_slot_is_refused() -> None:
    model = tiny("gpt2")
    with pytest.raises(ValueError, match="one for padding"):
        GraphDecodeStep(model, new_cache(model), MAX_ROWS + 1)


def test_the_factory_turns_the_step_on_for_cuda_only(monkeypatch: pytest.MonkeyPatch) -> None:
    model = tiny("llama gqa")
    config = EngineConfig(device="cpu", backend="torch", max_seqs=5, packed_linear=False)
    backend, _ = choose_backend(model, config, WINDOW, 1)
    assert backend.cache.slots == 5 and backend.describe()["cuda_graphs"] == "ignored: not a CUDA device"
    off, _ = choose_backend(model, replace(config, cuda_graphs=False), WINDOW, 1)
    assert off.describe()["cuda_graphs"] == "off (cuda_graphs false)"
    # As on a GPU (the model stays on the CPU, so nothing is captured and the step runs eagerly):
    # the cache gains the padding slot and decode rows take the static step.
    monkeypatch.setattr(EngineConfig, "resolved_device", lambda self: "cuda")
    backend, _ = choose_backend(model, config, WINDOW, 1)
    assert isinstance(backend, TorchBackend) and backend.graph_step is not None
    assert backend.cache.slots == 6 and backend.graph_step.batches == [1, 2, 4, 5]


cuda = pytest.mark.skipif(not torch.cuda.is_available(),
                          reason="CUDA graphs need a CUDA device (the GPU check runs these)")


@cuda
@pytest.mark.backends("torch-cuda")  # the GPU check's filter selects it by that parameter
@pytest.mark.parametrize("family", sorted(FAMILIES))
@torch.no_grad()
def test_captured_graphs_replay_the_eager_step_without_a_sync(family: str, backend: str) -> None:
    model = tiny(family).cuda()
    cfg = model.config
    caches = [SpanKVCache(cfg.n_layer, MAX_ROWS + 1, cfg.kv_heads, WINDOW, cfg.head_dim,
                          torch.float32, "cuda") for _ in range(2)]
    eager, graphed = GraphDecodeStep(model, caches[0], MAX_ROWS), GraphDecodeStep(model, caches[1], MAX_ROWS)
    assert graphed.capture() == len(graphed.batches) * len(graphed.spans)
    for layer in caches[1].layers:  # capturing wrote the scratch slot alone
        assert layer.k[:MAX_ROWS].abs().sum().item() == 0 and layer.k[MAX_ROWS].abs().sum().item() > 0
    gen = torch.Generator().manual_seed(0)
    lengths = [50, 40, 62, 3, 20, 61]
    prefill(model, caches, lengths, gen)
    for rows in (1, 3, 6):
        slots = list(range(rows))
        pos = [lengths[s] for s in slots]
        for _ in range(4):
            idx = torch.randint(0, cfg.vocab_size, (rows,), generator=gen).tolist()
            want = eager(idx, pos, slots)
            torch.cuda.set_sync_debug_mode("error")  # a synchronizing call raises
            try:
                got = graphed(idx, pos, slots)
            finally:
                torch.cuda.set_sync_debug_mode("default")
            torch.testing.assert_close(got, want, rtol=0, atol=RTOL * want.abs().max().item())
            pos = [p + 1 for p in pos]


@pytest.mark.parametrize("family", sorted(FAMILIES))
@torch.no_grad()
def test_the_torch_backend_decodes_through_the_step(family: str) -> None:
    """The backend's decode forward runs the static step when given graph rows (eager off a GPU),
    and returns the plain backend's logits; prompt chunks still take the model's forward."""
    model = tiny(family)
    plain = TorchBackend(model, new_cache(model))
    graphed = TorchBackend(model, new_cache(model), graph_rows=MAX_ROWS)
    assert graphed.graph_step is not None and plain.graph_step is None
    assert graphed.describe()["cuda_graphs"].startswith("eager, batch buckets [1, 2, 4, 6]")
    gen = torch.Generator().manual_seed(0)
    reqs = [SimpleNamespace(slot=s) for s in (3, 0, 5)]
    prompts = [torch.randint(0, 48, (n,), generator=gen).tolist() for n in (7, 30, 12)]
    for backend in (plain, graphed):
        for req, prompt in zip(reqs, prompts, strict=True):
            backend.forward([WorkItem(req, prompt, 0, True)])  # type: ignore[arg-type]
    pos = [len(p) for p in prompts]
    for _ in range(3):
        items = [WorkItem(r, [int(t)], p, True)  # type: ignore[arg-type]
                 for r, t, p in zip(reqs, torch.randint(0, 48, (3,), generator=gen), pos, strict=True)]
        want = plain.forward(items)
        got = graphed.forward(items)
        torch.testing.assert_close(got, want, rtol=0, atol=RTOL * want.abs().max().item())
        pos = [p + 1 for p in pos]
    # The step ran: 3 rows padded to 4, the padding row's keys in the scratch slot, position 0.
    assert graphed.cache.layers[0].k[MAX_ROWS, :, 0].abs().sum() > 0
    assert plain.cache.layers[0].k[MAX_ROWS].abs().sum() == 0
