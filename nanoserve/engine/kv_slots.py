"""The engine's KV cache: the model's fixed-shape slot cache, read only as far as needed.

The model's `LayerKVCache.update` returns every slot's full window, gathered with
`index_select` (a copy of B x window keys and values per layer per step), and attention then
runs over the whole window. For a decode step that is most of the time: at batch 32 on the
10.7M model the gather alone took 57% of the step. This cache keeps the same buffers and the
same write path but returns a view that (a) stops at the longest context in the batch, rounded
up to a multiple of `ROUND` so few distinct shapes occur, and (b) is a plain slice, not a copy,
when the batch's slots are consecutive (the scheduler orders rows by slot). Positions beyond a
row's own are masked by the model, so the shorter span gives the same attention.
"""

from __future__ import annotations

import torch
from torch import nn

from nanoserve.model.kv_cache import KVCache, LayerKVCache

ROUND = 16


class ActiveSpan:
    """What the next forward reads: `length` positions, and the first slot when the batch's
    slots are consecutive (None: gather them)."""

    def __init__(self, length: int) -> None:
        self.length = length
        self.first_slot: int | None = None


class SpanLayerCache(LayerKVCache):
    def __init__(self, span: ActiveSpan, *args: object) -> None:
        super().__init__(*args)  # type: ignore[arg-type]
        self.span = span

    def update(
        self, slot_idx: torch.Tensor, input_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.write(slot_idx, input_pos, k, v)
        b, n, first = k.shape[0], self.span.length, self.span.first_slot
        if first is not None:
            return self.k[first : first + b, :, :n], self.v[first : first + b, :, :n]
        return self.k[:, :, :n].index_select(0, slot_idx), self.v[:, :, :n].index_select(0, slot_idx)


class SpanKVCache(KVCache):
    def __init__(
        self, n_layer: int, slots: int, n_head: int, window: int, head_dim: int,
        dtype: torch.dtype, device: torch.device | str,
    ) -> None:
        nn.Module.__init__(self)
        self.slots = slots
        self.capacity = window
        self.span = ActiveSpan(window)
        self.layers = nn.ModuleList(
            SpanLayerCache(self.span, slots, n_head, window, head_dim, dtype, device) for _ in range(n_layer)
        )

    @property
    def window(self) -> int:  # type: ignore[override]
        """The model builds its attention mask over this many positions."""
        return self.span.length

    def prepare(self, slots: list[int], ends: list[int]) -> None:
        """Set the span for a forward whose rows sit in `slots` and end at positions `ends`."""
        longest = max(ends)
        self.span.length = min(self.capacity, -(-longest // ROUND) * ROUND)
        first = slots[0]
        consecutive = all(s == first + i for i, s in enumerate(slots))
        self.span.first_slot = first if consecutive else None

    def copy_prefix(self, src: int, dst: int, length: int) -> None:
        """Copy positions [0, length) of slot `src` into slot `dst` in every layer (a prompt
        prefilled once, shared by its other choices). Both backends read these same tensors."""
        for layer in self.layers:
            assert isinstance(layer, SpanLayerCache)
            layer.k[dst, :, :length].copy_(layer.k[src, :, :length])
            layer.v[dst, :, :length].copy_(layer.v[src, :, :length])
