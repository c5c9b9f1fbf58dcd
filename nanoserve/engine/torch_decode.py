"""The one-token forward (a decode step) as straight-line tensor calls.

`GPT.forward` serves training, prefill and decode alike; at batch 1 on a small model most of a
decode step is not arithmetic but Python: module calls, per-layer views and transposes, index
tensors for the cache write. This path computes exactly the same thing for rows that each feed
one token (same kernels in the same order, so the same logits; the parity tests run through it),
with the weights bound once and about half the calls per layer. The cache is the engine's own
(`SpanLayerCache.update` writes the new keys and returns the span to attend over).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from nanoserve.engine.kv_slots import SpanKVCache, SpanLayerCache
from nanoserve.model.gpt import GPT, Block, additive_mask, cached_attention


@dataclass
class _Layer:
    ln_1: nn.LayerNorm
    c_attn: nn.Module
    c_proj: nn.Module
    ln_2: nn.LayerNorm
    c_fc: nn.Module
    act: Callable[[torch.Tensor], torch.Tensor]  # the MLP's GELU module (forward, no hooks)
    mlp_proj: nn.Module
    cache: SpanLayerCache


class TorchDecodeStep:
    def __init__(self, model: GPT, cache: SpanKVCache) -> None:
        if model.training:
            raise ValueError("the decode step is for inference: put the model in eval() mode")
        if model.config.family != "gpt2" or model.wpe is None:
            raise ValueError("the straight-line decode step is GPT-2's (LayerNorm, GELU, learned positions)")
        self.wpe: nn.Embedding = model.wpe
        self.model = model
        self.cache = cache
        cfg = model.config
        self.n_head, self.head_dim, self.n_embd = cfg.n_head, cfg.head_dim, cfg.n_embd
        blocks: list[Block] = list(model.h)  # type: ignore[arg-type]
        caches: list[SpanLayerCache] = list(cache.layers)  # type: ignore[arg-type]
        self.layers = [
            _Layer(
                ln_1=cast(nn.LayerNorm, block.ln_1), c_attn=block.attn.c_attn, c_proj=block.attn.c_proj,
                ln_2=cast(nn.LayerNorm, block.ln_2),
                c_fc=block.mlp.c_fc, act=block.mlp.gelu.forward,
                mlp_proj=block.mlp.c_proj, cache=layer_cache,
            )
            for block, layer_cache in zip(blocks, caches, strict=True)
        ]

    def __call__(self, idx: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """idx, pos, slots: (B,) token, position and cache slot per row (the cache's span is
        already prepared). Returns the next-token logits (B, V)."""
        m = self.model
        b, nh, hs, c = idx.shape[0], self.n_head, self.head_dim, self.n_embd
        x = m.wte(idx) + self.wpe(pos)  # (B, C)
        positions = pos.view(-1, 1)  # (B, T=1)
        mask = additive_mask(positions, self.cache.span.length, x.dtype)  # (B, 1, 1, S)
        for layer in self.layers:
            h = F.layer_norm(x, (c,), layer.ln_1.weight, layer.ln_1.bias, layer.ln_1.eps)
            q, k, v = layer.c_attn(h).view(b, 3, nh, 1, hs).unbind(1)  # each (B, nh, 1, hs)
            keys, values = layer.cache.update(slots, positions, k, v)  # the span, (B, nh, S, hs)
            y = cached_attention(q, keys.to(q.dtype), values.to(q.dtype), mask)
            x = x + layer.c_proj(y.reshape(b, c))
            h = F.layer_norm(x, (c,), layer.ln_2.weight, layer.ln_2.bias, layer.ln_2.eps)
            x = x + layer.mlp_proj(layer.act(layer.c_fc(h)))
        ln_f = cast(nn.LayerNorm, m.ln_f)
        x = F.layer_norm(x, (c,), ln_f.weight, ln_f.bias, ln_f.eps)
        return m.lm_head(x)  # type: ignore[no-any-return]
