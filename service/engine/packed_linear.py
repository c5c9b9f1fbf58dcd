"""oneDNN linear layers with weights reordered once, for CPU inference.

On these CPUs the default `F.linear` (MKL sgemm; and a slow reference path for bfloat16) is the
main cost of a decode step. oneDNN with the weight pre-packed into its blocked layout is 2-5x
faster at decode shapes (fp32) and much more in bfloat16. The swap happens on the engine's own
model instance, never in model/: training and the reference keep plain nn.Linear.
"""

from __future__ import annotations

import torch
from torch import nn

from model.gpt import MLP


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

    def __init__(self, linear: nn.Linear, batch_hint: int, gelu_tanh: bool = False) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        # oneDNN applies GELU (tanh form) to the output while it is still in registers: one pass
        # over the MLP's widest activation instead of two.
        self.post_op, self.post_algo = ("gelu", "tanh") if gelu_tanh else ("none", "")
        weight = linear.weight.detach()
        self.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(weight, batch_hint))
        bias = linear.bias.detach() if linear.bias is not None else None
        self.register_buffer("bias", bias)
        self.packed: torch.Tensor
        self.bias: torch.Tensor | None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, self.in_features), self.packed, self.bias,
                                               self.post_op, [], self.post_algo)
        return y.view(*lead, self.out_features)


def pack_linears(model: nn.Module, batch_hint: int) -> int:
    """Replace every nn.Linear in `model` by a PackedLinear (an MLP's first one with its GELU
    fused) and drop the inference no-ops (dropout); returns how many linears were replaced."""
    count = 0
    for module in list(model.modules()):
        if isinstance(module, MLP) and module.gelu.approximate == "tanh":
            module.c_fc = PackedLinear(module.c_fc, batch_hint, gelu_tanh=True)  # type: ignore[assignment]
            module.gelu = nn.Identity()  # type: ignore[assignment]
            count += 1
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, name, PackedLinear(child, batch_hint))
                count += 1
            elif isinstance(child, nn.Dropout):
                # A Python call per layer per step that returns its input at inference.
                setattr(module, name, nn.Identity())
    return count
