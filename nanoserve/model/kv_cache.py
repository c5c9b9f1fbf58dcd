"""A preallocated key/value cache with fixed-shape buffers.

Fixed shapes (slots x heads x window x head_dim per layer) mean nothing is allocated while
generating, every sequence can sit at its own position in the same batch, and the decode step
keeps the static shapes that `torch.compile` and CUDA graphs need. Each layer owns its own
buffers: one tensor shared by all layers made compiled code copy the whole cache every step.
"""

from __future__ import annotations

import torch
from torch import nn


class LayerKVCache(nn.Module):
    """The keys and values of one attention layer for every slot."""

    def __init__(
        self, slots: int, n_head: int, window: int, head_dim: int, dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        super().__init__()
        shape = (slots, n_head, window, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.k: torch.Tensor
        self.v: torch.Tensor

    def update(
        self, slot_idx: torch.Tensor, input_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write new keys/values and return the full cache rows of the batch's slots.

        slot_idx: (B,) slot of each batch row; input_pos: (B, T) position of each new token;
        k, v: (B, nh, T, hs). Returns k, v of shape (B, nh, window, hs).
        """
        self.write(slot_idx, input_pos, k, v)
        return self.k.index_select(0, slot_idx), self.v.index_select(0, slot_idx)

    def write(
        self, slot_idx: torch.Tensor, input_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """Store new keys/values (B, nh, T, hs) at each row's slot and positions."""
        # Scatter each row's T new entries at its own positions: (slot, pos) pairs broadcast to
        # (B, T), all heads at once; the indexed result is laid out (B, T, nh, hs).
        rows = slot_idx.view(-1, 1)
        self.k[rows, :, input_pos] = k.transpose(1, 2).to(self.k.dtype)
        self.v[rows, :, input_pos] = v.transpose(1, 2).to(self.v.dtype)


class KVCache(nn.Module):
    """Per-layer caches for `slots` concurrent sequences of up to `window` tokens."""

    def __init__(
        self, n_layer: int, slots: int, n_head: int, window: int, head_dim: int,
        dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
    ) -> None:
        super().__init__()
        self.slots = slots
        self.window = window
        self.layers = nn.ModuleList(
            LayerKVCache(slots, n_head, window, head_dim, dtype, device) for _ in range(n_layer)
        )

    @property
    def nbytes(self) -> int:
        layers: list[LayerKVCache] = list(self.layers)  # type: ignore[arg-type]
        return sum(layer.k.nbytes + layer.v.nbytes for layer in layers)
