"""The engine's inference swaps (packed linears, SigmoidGELU) compute what the plain modules do."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from nanoserve.engine.packed_linear import SigmoidGELU, pack_linears, packed_linear_supported
from nanoserve.model.checkpoint import Checkpoint


@pytest.mark.parametrize("size", [1000, 40_000, 600_000])  # F.gelu, the sigmoid form, F.gelu
def test_sigmoid_gelu_is_the_tanh_gelu(size: int) -> None:
    edges = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 50.0, -50.0, 1e20, -1e20, 3e38, -3e38])
    x = torch.cat([edges, torch.linspace(-12, 12, size - len(edges))])
    assert (x.numel() in SigmoidGELU.SIGMOID_FORM) == (size == 40_000)
    before = x.clone()
    torch.testing.assert_close(SigmoidGELU()(x), F.gelu(x, approximate="tanh"), rtol=1e-6, atol=1e-6)
    assert torch.equal(x, before)


def test_sigmoid_gelu_treats_non_finite_values_as_f_gelu_does() -> None:
    x = torch.tensor([1.5, float("inf"), float("-inf"), float("nan")]).repeat(10_000)
    assert x.numel() in SigmoidGELU.SIGMOID_FORM
    y = SigmoidGELU()(x)
    torch.testing.assert_close(y, F.gelu(x, approximate="tanh"), equal_nan=True)  # inf, nan, nan
    assert y[1].item() == float("inf")


@torch.no_grad()
def test_packed_model_matches_the_plain_model(lively: Checkpoint) -> None:
    if not packed_linear_supported(torch.device("cpu"), torch.float32):
        pytest.skip("oneDNN packed linears are not available in this torch build")
    plain, packed = lively.build_model("cpu"), lively.build_model("cpu")
    replaced = pack_linears(packed, batch_hint=4)
    cfg = plain.config
    assert replaced == 4 * cfg.n_layer + 1  # qkv, attention out, MLP in and out per block; lm_head
    assert all(isinstance(block.mlp.gelu, SigmoidGELU) for block in packed.h)  # type: ignore[union-attr]
    idx = torch.randint(0, cfg.vocab_size, (3, 11), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(packed(idx), plain(idx), rtol=0, atol=1e-4)
