"""Symmetric int8 weights for the native step's linear layers (native/matmul_int8.inc).

Each output feature's weights get one float32 scale, their largest magnitude over 127, and are
rounded to int8 in [-127, 127]; the step quantizes each row of a layer's inputs the same way (one
scale per row) as the product starts, sums int8 x int8 products exactly in int32 and scales the
sum once: y = ((float)sum_k xq wq * xs) * ws + b. `quantize_rows` and `linear_reference` are that
function in torch, the tests' and bench/int8_quality.py's reference.
"""

from __future__ import annotations

import torch


def quantize_int8(weight: torch.Tensor, chunk: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, in) weight -> (int8 weights (out, in), float32 scales (out,)): W ~ q * scale[:, None].
    `chunk` rows at a time, so the float temporaries stay small (a 124M output layer whole: ~150 MB
    each)."""
    q = torch.empty(weight.shape, dtype=torch.int8)
    scale = torch.empty(weight.shape[0], dtype=torch.float32)
    for start in range(0, weight.shape[0], chunk):
        w = weight[start : start + chunk].detach().float()
        s = w.abs().amax(dim=1) / 127
        safe = torch.where(s > 0, s, torch.ones_like(s))  # an all-zero row stays zero
        q[start : start + chunk] = torch.round(w / safe[:, None]).clamp_(-127, 127)
        scale[start : start + chunk] = s
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The float32 weights an int8 layer stands for."""
    return q.float() * scale[:, None]


def pack_int8_panels(q: torch.Tensor, panel: int, group: int) -> torch.Tensor:
    """int8 (out, in) weights as decode.c reads them (NS_I8): panels of `panel` output features by
    groups of `group` inputs, [p][g][j][i] = q[p * panel + j][g * group + i], zero-padded to whole
    panels and groups: one 64-byte load is a panel's weights for a group of inputs."""
    out, inp = q.shape
    padded = q.new_zeros(-(-out // panel) * panel, -(-inp // group) * group)
    padded[:out, :inp] = q
    p, g = padded.shape[0] // panel, padded.shape[1] // group
    return padded.view(p, panel, g, group).permute(0, 2, 1, 3).contiguous()


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of x (..., in) float32 -> (integer-valued float32 in [-127, 127], per-row scales (..., 1)),
    as the step quantizes a linear layer's inputs: round(x * (127 / max|x|)) to nearest even."""
    amax = x.abs().amax(dim=-1, keepdim=True)
    inv = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
    return torch.round(x * inv), amax / 127


def linear_reference(
    x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """The step's int8 linear layer on float32 rows x (..., in): the same roundings in the same order,
    the integer sums exact (float64 holds them)."""
    xq, xs = quantize_rows(x.float())
    sums = (xq.double() @ q.double().T).float()  # exact integers, rounded to float32 as C's (float)int32
    y = sums * xs * scale
    return y + bias.float() if bias is not None else y
