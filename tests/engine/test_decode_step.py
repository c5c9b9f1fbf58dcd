"""The engine's straight-line decode step gives the general forward's logits."""

from __future__ import annotations

import pytest
import torch

import nanoserve.model.gpt as gpt_module
from nanoserve.engine.kv_slots import SpanKVCache
from nanoserve.engine.packed_linear import pack_linears, packed_linear_supported
from nanoserve.engine.torch_decode import TorchDecodeStep
from nanoserve.model.checkpoint import Checkpoint


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("slot_order", ["consecutive", "scattered"])
@pytest.mark.parametrize("matmul_rows", [8, 1])  # 1: the batched-matmul attention even for 3 rows
@torch.no_grad()
def test_decode_step_matches_the_model_forward(
    lively: Checkpoint, packed: bool, slot_order: str, matmul_rows: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(gpt_module, "DECODE_MATMUL_ROWS", matmul_rows)
    model = lively.build_model("cpu")
    if packed:
        if not packed_linear_supported(torch.device("cpu"), torch.float32):
            pytest.skip("oneDNN packed linears are not available in this torch build")
        pack_linears(model, batch_hint=4)  # also swaps the MLP's GELU for SigmoidGELU
    cfg = model.config
    cache = SpanKVCache(cfg.n_layer, 6, cfg.n_head, cfg.block_size, cfg.head_dim, torch.float32, "cpu")
    step = TorchDecodeStep(model, cache)
    gen = torch.Generator().manual_seed(0)
    slots = [0, 1, 2] if slot_order == "consecutive" else [4, 1, 3]
    lengths = [5, 17, 9]  # every row at its own position
    for slot, n in zip(slots, lengths, strict=True):
        prompt = torch.randint(0, cfg.vocab_size, (1, n), generator=gen)
        cache.prepare([slot], [n])
        model(prompt, input_pos=torch.arange(n).view(1, -1), cache=cache, slots=torch.tensor([slot]))
    slot_t, pos = torch.tensor(slots), torch.tensor(lengths)
    for _ in range(4):
        idx = torch.randint(0, cfg.vocab_size, (3,), generator=gen)
        cache.prepare(slots, [p + 1 for p in pos.tolist()])
        out = model(idx.view(-1, 1), input_pos=pos.view(-1, 1), cache=cache, slots=slot_t, last_only=True)
        want = out[:, -1]
        got = step(idx, pos, slot_t)  # writes the same keys and values again
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
        pos = pos + 1
