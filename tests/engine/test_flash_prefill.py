"""Prompt chunks through torch's causal kernels (flash_prefill.py) give the general forward's
logits and cache, for both families: fresh prompts together, and a long prompt's later chunk."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from nanoserve.engine.backends.torch_backend import TorchBackend
from nanoserve.engine.flash_prefill import FlashPrefill, flash_applies
from nanoserve.engine.work import WorkItem
from tests.engine.test_graph_step import FAMILIES, RTOL, new_cache, tiny

# Float32: the kernels sum in another order than the masked forward; the tolerance is the graph
# step's (test_graph_step.py says how it is derived).


def _reference(model, cache, idx, pos, slots):  # type: ignore[no-untyped-def]
    cache.prepare(slots.tolist(), (pos[:, -1] + 1).tolist())
    return model(idx, input_pos=pos, cache=cache, slots=slots, last_only=True)[:, -1]


@pytest.mark.parametrize("family", sorted(FAMILIES))
@torch.no_grad()
def test_fresh_prompts_and_a_later_chunk_give_the_forwards_logits_and_cache(family: str) -> None:
    model = tiny(family)
    ref_cache, cache = new_cache(model), new_cache(model)
    prefill = FlashPrefill(model, cache)
    gen = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    # Three prompts' first chunks of 20 tokens together, in slots 4, 0, 2.
    slots = torch.tensor([4, 0, 2])
    idx, pos = torch.randint(0, vocab, (3, 20), generator=gen), torch.arange(20).repeat(3, 1)
    want = _reference(model, ref_cache, idx, pos, slots)
    got = prefill(idx, pos, slots, 4, 0)
    torch.testing.assert_close(got, want, rtol=0, atol=RTOL * want.abs().max().item())
    # Slot 0's next two chunks (positions 20..44, 45..69): they attend to what is cached before them.
    for start, t in ((20, 25), (45, 25)):
        idx, pos = torch.randint(0, vocab, (1, t), generator=gen), torch.arange(start, start + t).view(1, -1)
        want = _reference(model, ref_cache, idx, pos, torch.tensor([0]))
        got = prefill(idx, pos, torch.tensor([0]), 0, start)
        torch.testing.assert_close(got, want, rtol=0, atol=RTOL * want.abs().max().item())
    for ref_layer, layer in zip(ref_cache.layers, cache.layers, strict=True):
        torch.testing.assert_close(layer.k, ref_layer.k, rtol=0, atol=1e-5)
        torch.testing.assert_close(layer.v, ref_layer.v, rtol=0, atol=1e-5)


def test_only_groups_without_a_mask_take_it() -> None:
    def item(start: int) -> WorkItem:
        return WorkItem(SimpleNamespace(slot=0), [1, 2], start, True)  # type: ignore[arg-type]

    assert flash_applies([item(0), item(0)]) and flash_applies([item(30)])
    assert not flash_applies([item(0), item(30)])


@torch.no_grad()
def test_the_backend_sends_prompt_chunks_through_it(monkeypatch: pytest.MonkeyPatch) -> None:
    model = tiny("llama gqa")
    backend = TorchBackend(model, new_cache(model), flash_prefill=True)
    assert backend.prefill is not None and backend.describe()["flash_prefill"]
    calls: list[int] = []
    run = backend.prefill.__call__
    monkeypatch.setattr(FlashPrefill, "__call__", lambda self, *a: calls.append(a[4]) or run(*a))
    reqs = [SimpleNamespace(slot=s) for s in (1, 2)]
    backend.forward([WorkItem(r, [3, 4, 5], 0, True) for r in reqs])  # type: ignore[arg-type]
    backend.forward([WorkItem(reqs[0], [6, 7], 3, True)])  # type: ignore[arg-type]
    backend.forward([WorkItem(r, [6, 7], 3, True) for r in reqs])  # type: ignore[arg-type]  # a mask
    assert calls == [0, 3]
