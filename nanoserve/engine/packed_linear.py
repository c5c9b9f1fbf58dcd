"""oneDNN linear layers with weights reordered once, for CPU inference.

On these CPUs the default `F.linear` (MKL sgemm; and a slow reference path for bfloat16) is the
main cost of a decode step. oneDNN with the weight pre-packed into its blocked layout is 2-5x
faster at decode shapes (fp32) and much more in bfloat16. The swap happens on the engine's own
model instance, never in nanoserve/model/: training and the reference keep plain nn.Linear.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from nanoserve.model.gpt import MLP

# GELU's tanh form, 0.5 x (1 + tanh(z)), is x * sigmoid(2 z): the same function (float32 results
# within 5e-7 of F.gelu's), and torch's sigmoid is vectorised far better than its tanh here.
_TWO_SQRT_2_OVER_PI = 2 * math.sqrt(2 / math.pi)


def packed_linear_supported(device: torch.device, dtype: torch.dtype) -> bool:
    # oneDNN packs bf16 weights only on CPUs with bf16 conversion instructions (AVX-512 BW/VL/DQ or
    # AVX-NE-CONVERT); elsewhere the reorder raises, so bf16 falls back to plain F.linear there.
    return (
        device.type == "cpu"
        and dtype in (torch.float32, torch.bfloat16)
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and (dtype != torch.bfloat16 or bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()))
    )


class PackedLinear(nn.Module):
    """Same maths as nn.Linear; the weight lives in oneDNN's layout (a separate copy, so a
    tied output projection does not disturb the embedding table it shares weights with)."""

    def __init__(self, linear: nn.Linear, batch_hint: int) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        weight = linear.weight.detach()
        self.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(weight, batch_hint))
        bias = linear.bias.detach() if linear.bias is not None else None
        self.register_buffer("bias", bias)
        self.packed: torch.Tensor
        self.bias: torch.Tensor | None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, self.in_features), self.packed, self.bias,
                                               "none", [], "")
        return y.view(*lead, self.out_features)


class SigmoidGELU(nn.Module):
    """GELU, tanh form, computed as x * sigmoid(2 sqrt(2/pi) (x + 0.044715 x^3)) on mid-sized
    activations, where that is faster than F.gelu; F.gelu elsewhere.

    On an AVX2-only CPU, 2 threads (`python -m bench.gelu`, bench/results/gelu-avx2.md):
    torch's tanh is slow there, so from 32k to 400k values (the MLP of a decode step at 16-128
    rows) the sigmoid form's five passes take 0.53-0.98x F.gelu's time. Below that one kernel's
    call overhead wins; above it (a prefill) the temporaries fall out of cache and fresh large
    allocations fault their pages in: 2.4-2.9x F.gelu at 1024 rows. oneDNN's GELU post-op fused
    into the linear is slower than F.gelu at every size there (1.4-5x). The input is
    never modified.
    """

    SIGMOID_FORM = range(32768, 524289)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() not in self.SIGMOID_FORM:
            return F.gelu(x, approximate="tanh")
        return sigmoid_gelu(x)


def sigmoid_gelu(x: torch.Tensor) -> torch.Tensor:
    """The tanh-form GELU as x * sigmoid(2 sqrt(2/pi) (x + 0.044715 x^3)), at any size."""
    y = torch.addcmul(x, x * x, x, value=0.044715)
    return y.mul_(_TWO_SQRT_2_OVER_PI).sigmoid_().mul_(x)


def _swappable_gelu(mlp: MLP) -> bool:
    return mlp.gelu.approximate == "tanh" and mlp.c_fc.weight.dtype == torch.float32


def pack_linears(model: nn.Module, batch_hint: int) -> int:
    """Replace every nn.Linear in `model` by a PackedLinear, an MLP's tanh GELU by SigmoidGELU,
    and drop the inference no-ops (dropout); returns how many linears were replaced."""
    count = 0
    for module in list(model.modules()):
        # float32 only: in bfloat16 each of the sigmoid form's passes would round (F.gelu rounds once).
        if isinstance(module, MLP) and _swappable_gelu(module):
            module.gelu = SigmoidGELU()  # type: ignore[assignment]
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, name, PackedLinear(child, batch_hint))
                count += 1
            elif isinstance(child, nn.Dropout):
                # A Python call per layer per step that returns its input at inference.
                setattr(module, name, nn.Identity())
    return count
