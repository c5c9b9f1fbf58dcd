"""A GPT-2-architecture decoder with one forward path for training and cached inference."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from nanoserve.model.config import GPTConfig
from nanoserve.model.kv_cache import KVCache, LayerKVCache


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.n_kv_head = config.kv_heads
        self.head_dim = config.head_dim
        self.rope = config.positions == "rope"
        # Fused projection: queries, then keys and values (one matmul instead of three; GPT-2's own
        # `c_attn` layout when every head has its keys and values, nh + 2 x n_kv heads wide).
        kv = self.n_kv_head * self.head_dim
        self.c_attn = nn.Linear(config.n_embd, config.n_embd + 2 * kv, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = config.dropout
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(
        self,
        x: torch.Tensor,
        input_pos: torch.Tensor,
        cache: LayerKVCache | None,
        slots: torch.Tensor | None,
        mask: torch.Tensor | None,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        b, t, c = x.shape  # (B, T, C)
        nh, nkv, hs = self.n_head, self.n_kv_head, self.head_dim
        q, k, v = self.c_attn(x).split([c, nkv * hs, nkv * hs], dim=2)
        q = q.view(b, t, nh, hs).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(b, t, nkv, hs).transpose(1, 2)  # (B, nkv, T, hs)
        v = v.view(b, t, nkv, hs).transpose(1, 2)  # (B, nkv, T, hs)
        if rope is not None:  # rotary positions: queries and keys turned by their position
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        if cache is None:
            # Training / uncached inference: the whole sequence is here, plain causal attention.
            k, v = repeat_kv(k, nh // nkv), repeat_kv(v, nh // nkv)
            y = F.scaled_dot_product_attention(
                q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
            )
        else:
            assert slots is not None and mask is not None
            k, v = cache.update(slots, input_pos, k, v)  # (B, nkv, W, hs): the cache holds nkv heads
            k, v = repeat_kv(k, nh // nkv), repeat_kv(v, nh // nkv)
            y = cached_attention(q, k.to(q.dtype), v.to(q.dtype), mask)
        y = y.transpose(1, 2).contiguous().view(b, t, c)  # (B, T, C)
        return self.resid_dropout(self.c_proj(y))


def repeat_kv(x: torch.Tensor, n: int) -> torch.Tensor:
    """(B, nkv, S, hs) -> (B, nkv * n, S, hs): each key/value head serves n query heads in turn
    (grouped-query attention; HF's repeat_kv). The cache stays nkv heads: that is GQA's saving."""
    return x if n == 1 else x.repeat_interleave(n, dim=1)


def rope_tables(config: GPTConfig, device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of every position's angles, (block_size, hs): frequency i turns dimensions i
    and i + hs/2 (the "rotate half" layout of HF's Llama, so its weights work unchanged)."""
    hs = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, hs, 2, dtype=torch.float64, device=device) / hs))
    angles = torch.outer(torch.arange(config.block_size, dtype=torch.float64, device=device), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)  # (block_size, hs)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, h, T, hs) turned by its positions' cos/sin (B, 1, T, hs); computed in float32."""
    half = x.shape[-1] // 2
    xf = x.float()
    rotated = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
    return (xf * cos + rotated * sin).to(x.dtype)


# From this many rows, one-token attention runs as two batched matmuls (see decode_attention);
# below it the fused kernel is cheaper (fewer ops: ~0.1 ms per layer less at batch 1).
DECODE_MATMUL_ROWS = 8


def additive_mask(input_pos: torch.Tensor, span: int, dtype: torch.dtype) -> torch.Tensor:
    """(B, 1, T, span): 0 where the query at input_pos (B, T) may attend a cached position (every
    position up to its own), -inf elsewhere. Additive and in the activations' dtype, built once
    per forward (a boolean mask is converted again by every layer's attention)."""
    b, t = input_pos.shape
    allowed = torch.arange(span, device=input_pos.device).view(1, 1, 1, -1) <= input_pos.view(b, 1, t, 1)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=input_pos.device)
    return mask.masked_fill_(~allowed, float("-inf"))


def cached_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Attention of q (B, nh, T, hs) over cached k/v (B, nh, S, hs) under an additive_mask."""
    if q.shape[2] == 1 and q.shape[0] >= DECODE_MATMUL_ROWS:
        return decode_attention(q, k, v, mask)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Attention for one new token per row: q (B, nh, 1, hs), k/v (B, nh, S, hs), additive mask
    (B, 1, 1, S).

    Two batched matmuls instead of `scaled_dot_product_attention`: with a per-row mask and a
    single query, the CPU flash kernel is slow at large batches, most of all in bfloat16:
    on 2 CPU cores a whole decode step at batch 64 takes 14 ms this way vs 24 ms with
    the fused kernel (10.7M model, bf16), 53 vs 58 ms at 124M bf16 batch 32, and about the same
    in float32. Scores are softmaxed in float32 whatever the model dtype, as the fused kernel does.
    """
    b, nh, _, hs = q.shape
    s = k.shape[2]
    if q.dtype != torch.float32:
        # Reduced-precision batched matmuls copy a strided operand element by element (a cache
        # span is strided: it stops short of the window); one plain copy first is ~3x cheaper.
        k, v = k.contiguous(), v.contiguous()
    scores = torch.baddbmm(
        mask.expand(b, nh, 1, s).reshape(b * nh, 1, s).to(q.dtype),
        q.reshape(b * nh, 1, hs), k.reshape(b * nh, s, hs).transpose(1, 2),
        alpha=1.0 / math.sqrt(hs),
    )
    probs = scores.float().softmax(dim=-1).to(q.dtype)
    return torch.bmm(probs, v.reshape(b * nh, s, hs)).view(b, nh, 1, hs)


class MLP(nn.Module):
    """GPT-2's GELU MLP, or the Llama family's SwiGLU: c_fc computes W1 x and W3 x in one matmul
    (gate, then up), and c_proj (W2) takes silu(W1 x) * (W3 x)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.swiglu = config.mlp == "swiglu"
        hidden = config.hidden
        self.c_fc = nn.Linear(config.n_embd, 2 * hidden if self.swiglu else hidden, bias=config.bias)
        self.gelu = nn.GELU(approximate="tanh")  # GPT-2's "gelu_new", so HF weights match exactly
        self.c_proj = nn.Linear(hidden, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.swiglu:
            gate, up = self.c_fc(x).chunk(2, dim=-1)
            return self.dropout(self.c_proj(F.silu(gate) * up))  # type: ignore[no-any-return]
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))  # type: ignore[no-any-return]


def make_norm(config: GPTConfig) -> nn.Module:
    if config.norm == "rmsnorm":
        return nn.RMSNorm(config.n_embd, eps=config.layer_norm_epsilon)
    return nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon, bias=config.bias)


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = make_norm(config)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = make_norm(config)
        self.mlp = MLP(config)

    def forward(
        self,
        x: torch.Tensor,
        input_pos: torch.Tensor,
        cache: LayerKVCache | None,
        slots: torch.Tensor | None,
        mask: torch.Tensor | None,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), input_pos, cache, slots, mask, rope)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig, init_weights: bool = True) -> None:
        """init_weights=False leaves the weights uninitialised, for a model whose weights are
        loaded next (built on the meta device): meta's `normal_` is a Python decomposition whose
        first call imports ~800 modules (sympy, torch._refs), 74 MiB resident in every server."""
        super().__init__()
        self.config = config
        # An embedding given its weight skips its own normal_ init.
        def table(n: int) -> torch.Tensor | None:
            return None if init_weights else torch.empty(n, config.n_embd)

        self.wte = nn.Embedding(config.vocab_size, config.n_embd, _weight=table(config.vocab_size))
        # Learned positions: a table of block_size rows. Rotary ones have no weights: their
        # cos/sin tables are made per device on first use (_rope), outside the state dict.
        self.wpe = (nn.Embedding(config.block_size, config.n_embd, _weight=table(config.block_size))
                    if config.positions == "learned" else None)
        self._rope: tuple[torch.Tensor, torch.Tensor] | None = None
        self.drop = nn.Dropout(config.dropout)
        self.h = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = make_norm(config)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_embeddings:
            # Weight tying: the output projection reuses the token embedding (GPT-2; fewer
            # parameters, and it regularises small models).
            self.lm_head.weight = self.wte.weight
        if not init_weights:
            return
        self.apply(self._init_weights)
        # GPT-2 scales the init of each residual projection by 1/sqrt(2 * n_layer) so the residual
        # stream's variance does not grow with depth.
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_params(self, non_embedding: bool = True) -> int:
        n = sum(p.numel() for p in self.parameters())
        return n - self.wpe.weight.numel() if non_embedding and self.wpe is not None else n

    def new_cache(
        self, slots: int, window: int | None = None, dtype: torch.dtype | None = None
    ) -> KVCache:
        """A KV cache for `slots` concurrent sequences, on this model's device and dtype."""
        ref = self.wte.weight
        return KVCache(
            self.config.n_layer, slots, self.config.kv_heads, window or self.config.block_size,
            self.config.head_dim, dtype or ref.dtype, ref.device,
        )

    def forward(
        self,
        idx: torch.Tensor,
        input_pos: torch.Tensor | None = None,
        cache: KVCache | None = None,
        slots: torch.Tensor | None = None,
        last_only: bool = False,
    ) -> torch.Tensor:
        """Logits for token ids `idx` of shape (B, T).

        Without a cache this is the training path: positions are 0..T-1, attention is causal.
        With a cache, `input_pos` (B, T) gives each new token's position (rows may differ),
        `slots` (B,) each row's cache slot, and attention covers all cached positions <= its own.
        `last_only` returns only the last position's logits (B, 1, V): all that sampling needs.
        """
        x = self._blocks(idx, input_pos, cache, slots)  # (B, T, C)
        if last_only:
            x = x[:, -1:, :]
        return self.lm_head(self.ln_f(x))  # (B, T, V)

    def hidden_states(self, idx: torch.Tensor) -> torch.Tensor:
        """The final norm's output (B, T, C) for token ids (B, T), positions 0..T-1, no cache: what
        the output layer reads, and what embeddings pool."""
        return self.ln_f(self._blocks(idx, None, None, None))  # type: ignore[no-any-return]

    def _blocks(
        self, idx: torch.Tensor, input_pos: torch.Tensor | None, cache: KVCache | None,
        slots: torch.Tensor | None,
    ) -> torch.Tensor:
        """The residual stream (B, T, C) after the last block."""
        b, t = idx.shape
        if input_pos is None:
            if t > self.config.block_size:
                raise ValueError(f"sequence of {t} tokens exceeds block_size {self.config.block_size}")
            input_pos = torch.arange(t, device=idx.device).unsqueeze(0).expand(b, t)
        x = self.wte(idx)  # (B, T, C)
        rope = None
        if self.wpe is not None:
            x = x + self.wpe(input_pos)
        else:
            rope = self.rope_at(input_pos)
        x = self.drop(x)
        mask = None
        if cache is not None:
            if slots is None:
                slots = torch.arange(b, device=idx.device)
            mask = additive_mask(input_pos, cache.window, x.dtype)  # (B, 1, T, W)
        for i, block in enumerate(self.h):
            layer_cache = cache.layers[i] if cache is not None else None
            x = block(x, input_pos, layer_cache, slots, mask, rope)
        return x

    def rope_at(self, input_pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin at positions input_pos (B, T), shaped (B, 1, T, hs) to turn every head."""
        if self._rope is None or self._rope[0].device != input_pos.device:
            self._rope = rope_tables(self.config, input_pos.device)
        cos, sin = self._rope
        return cos[input_pos].unsqueeze(1), sin[input_pos].unsqueeze(1)
