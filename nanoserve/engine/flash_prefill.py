"""Prompt chunks attended by torch's causal attention kernels (flash attention on a GPU).

The general forward attends a chunk over the cache's span under an additive mask (B, 1, T, span)
built in the activations' dtype: on a GPU that rules out the flash kernel (which takes no mask) and
reads the mask besides the keys. Two kinds of chunk need no mask at all:

- rows that all start at position 0 (a prompt's first chunk, each row its own prompt): each
  attends only to its own chunk, plain causal attention (`is_causal`);
- one row starting later (a long prompt's next chunk): it attends to its slot's cached
  positions and its own, causal with the diagonal at the bottom right (`causal_lower_right`),
  which the flash and memory-efficient kernels take as a flag, not a tensor.

Other groups (several rows at different starts, rows that score their prompt) keep the model's
forward. Keys and values are written to the slot cache as the model writes them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from nanoserve.engine.kv_slots import SpanKVCache, SpanLayerCache
from nanoserve.engine.work import WorkItem
from nanoserve.model.gpt import GPT, Block, apply_rope, repeat_kv


def flash_applies(items: Sequence[WorkItem]) -> bool:
    """Whether a group of prompt chunks (no scoring) needs no attention mask: every row starts at
    position 0, or there is one row."""
    return len(items) == 1 or all(item.start == 0 for item in items)


class FlashPrefill:
    def __init__(self, model: GPT, cache: SpanKVCache) -> None:
        if model.training:
            raise ValueError("the prefill step is for inference: put the model in eval() mode")
        self.model = model
        self.blocks: list[Block] = list(model.h)  # type: ignore[arg-type]
        self.layers: list[SpanLayerCache] = list(cache.layers)  # type: ignore[arg-type]
        cfg = model.config
        self.n_head, self.kv_heads = cfg.n_head, cfg.kv_heads
        self.head_dim, self.n_embd = cfg.head_dim, cfg.n_embd

    @torch.no_grad()
    def __call__(self, idx: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor, first_slot: int,
                 start: int) -> torch.Tensor:
        """idx, pos (G, T): the chunks' tokens and positions; slots (G,), the first of them
        `first_slot`; `start` the rows' first position (0 for every row, or the one row's).
        Returns the last position's logits (G, V)."""
        m, (g, t) = self.model, idx.shape
        nh, nkv, hs, c = self.n_head, self.kv_heads, self.head_dim, self.n_embd
        x = m.wte(idx)  # (G, T, C)
        rope = None
        if m.wpe is not None:
            x = x + m.wpe(pos)
        else:
            rope = m.rope_at(pos)  # each (G, 1, T, hs)
        # Later chunk: attend the start cached positions and the chunk's own, diagonal bottom right.
        mask = None if start == 0 else causal_lower_right(t, start + t)
        for block, layer in zip(self.blocks, self.layers, strict=True):
            q, k, v = block.attn.c_attn(block.ln_1(x)).split([c, nkv * hs, nkv * hs], dim=2)
            q = q.view(g, t, nh, hs).transpose(1, 2)  # (G, nh, T, hs)
            k = k.view(g, t, nkv, hs).transpose(1, 2)  # (G, nkv, T, hs)
            v = v.view(g, t, nkv, hs).transpose(1, 2)
            if rope is not None:
                q, k = apply_rope(q, *rope), apply_rope(k, *rope)
            layer.write(slots, pos, k, v)
            if mask is None:  # the chunk is the whole context; as cached (its dtype's rounding)
                keys, values = k.to(layer.k.dtype), v.to(layer.v.dtype)
            else:  # one row: its slot's positions up to the chunk's end, a view
                at = slice(first_slot, first_slot + 1)
                keys, values = layer.k[at, :, : start + t], layer.v[at, :, : start + t]
            keys, values = repeat_kv(keys.to(q.dtype), nh // nkv), repeat_kv(values.to(q.dtype), nh // nkv)
            if mask is None:
                y = F.scaled_dot_product_attention(q, keys, values, is_causal=True)
            else:
                y = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
            x = x + block.attn.c_proj(y.transpose(1, 2).reshape(g, t, c))
            x = x + block.mlp(block.ln_2(x))
        return m.lm_head(m.ln_f(x[:, -1]))  # type: ignore[no-any-return]
