"""Model hyperparameters: the one dataclass every other model file reads."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any

# Upper bounds on the sizes: far above any model this GPT can serve (GPT-3 175B has 96 layers and a
# width of 12,288), low enough that a typo such as `"n_embd": 2**40` is refused by name instead of
# becoming an overflow or an attempt to allocate terabytes.
SIZE_LIMITS = {
    "vocab_size": 2**22,
    "block_size": 2**20,
    "n_layer": 1024,
    "n_head": 1024,
    "n_embd": 2**16,
}


def _is_finite_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


NORMS = ("layernorm", "rmsnorm")
FAMILY_FIELDS = ("norm", "mlp", "mlp_hidden", "positions", "rope_theta", "n_kv_head", "tie_embeddings")
MLPS = ("gelu", "swiglu")
POSITIONS = ("learned", "rope")


@dataclass(frozen=True)
class GPTConfig:
    """Decoder hyperparameters: GPT-2's architecture by default, the Llama family's by choice.

    They travel inside every checkpoint's ``config.json``, so a checkpoint describes the module
    that can hold its weights without any code-side table of sizes. A checkpoint written before
    the family fields existed has none of them and is GPT-2 (the defaults).

    GPT-2: LayerNorm, a GELU MLP of 4 x n_embd, learned positions, every head its own keys and
    values, the output layer tied to the embedding, biases. Llama (SmolLM2, TinyLlama, Qwen-style):
    RMSNorm, SwiGLU (silu(x W1) * (x W3), then W2), rotary positions, fewer key/value heads than
    query heads (grouped-query attention; 1 is multi-query), often no biases and an untied output.
    """

    vocab_size: int
    block_size: int = 256  # the context window (the learned position table's size, if learned)
    n_layer: int = 6
    n_head: int = 6
    n_embd: int = 384
    dropout: float = 0.0
    bias: bool = True  # GPT-2 uses biases in Linear and LayerNorm; off is slightly faster
    layer_norm_epsilon: float = 1e-5  # the norm's epsilon (LayerNorm or RMSNorm)
    norm: str = "layernorm"  # layernorm | rmsnorm
    mlp: str = "gelu"  # gelu (tanh form, GPT-2's) | swiglu
    mlp_hidden: int | None = None  # the MLP's width (default: 4 x n_embd for gelu, 8/3 x for swiglu)
    positions: str = "learned"  # learned | rope
    rope_theta: float = 10000.0
    n_kv_head: int | None = None  # key/value heads (default: n_head; fewer is grouped-query)
    tie_embeddings: bool = True  # the output layer shares the token embedding's weights

    def __post_init__(self) -> None:
        # Strict types: a config.json value like `"bias": "yes"` or `"n_layer": 2.5` is refused
        # here rather than coerced or left to fail later (a bool is not an int, nor a number).
        for name, limit in SIZE_LIMITS.items():
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"GPTConfig.{name} must be a positive integer, got {value!r}")
            if value > limit:
                raise ValueError(f"GPTConfig.{name} is {value}, more than the limit of {limit}")
        if self.n_embd % self.n_head != 0:
            raise ValueError(
                f"GPTConfig.n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})"
            )
        for name in ("bias", "tie_embeddings"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"GPTConfig.{name} must be true or false, got {getattr(self, name)!r}")
        for name, choices in (("norm", NORMS), ("mlp", MLPS), ("positions", POSITIONS)):
            if getattr(self, name) not in choices:
                raise ValueError(
                    f"GPTConfig.{name} must be one of {', '.join(choices)}, got {getattr(self, name)!r}"
                )
        for name in ("mlp_hidden", "n_kv_head"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                      or not 0 < value <= SIZE_LIMITS["n_embd"] * 8):
                raise ValueError(f"GPTConfig.{name} must be a positive integer or null, got {value!r}")
        if self.n_head % self.kv_heads:
            raise ValueError(
                f"GPTConfig.n_head ({self.n_head}) must be a multiple of n_kv_head ({self.kv_heads})"
            )
        if self.positions == "rope":
            if self.head_dim % 2:
                raise ValueError(f"rotary positions need an even head size, got {self.head_dim}")
            if not _is_finite_number(self.rope_theta) or self.rope_theta <= 1:
                raise ValueError(
                    f"GPTConfig.rope_theta must be a finite number above 1, got {self.rope_theta!r}"
                )
        if not _is_finite_number(self.dropout) or not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout must be a number in [0, 1), got {self.dropout!r}")
        # LayerNorm divides by sqrt(var + eps): eps <= 0 or NaN gives NaN activations at the
        # first forward, long after loading succeeded.
        if not _is_finite_number(self.layer_norm_epsilon) or self.layer_norm_epsilon <= 0:
            raise ValueError(
                "GPTConfig.layer_norm_epsilon must be a finite number above 0, "
                f"got {self.layer_norm_epsilon!r}"
            )

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def kv_heads(self) -> int:
        return self.n_kv_head if self.n_kv_head is not None else self.n_head

    @property
    def hidden(self) -> int:
        """The MLP's width: mlp_hidden, else GPT-2's 4 x n_embd, or for SwiGLU 8/3 x n_embd rounded
        up to a multiple of 64 (three matrices instead of two at about the same parameters)."""
        if self.mlp_hidden is not None:
            return self.mlp_hidden
        if self.mlp == "gelu":
            return 4 * self.n_embd
        return -(-8 * self.n_embd // 3 // 64) * 64

    @property
    def family(self) -> str:
        """gpt2 when every choice is GPT-2's, else llama (some or all of the Llama family's)."""
        gpt2 = (self.norm, self.mlp, self.positions, self.kv_heads, self.tie_embeddings, self.hidden) == (
            "layernorm", "gelu", "learned", self.n_head, True, 4 * self.n_embd)
        return "gpt2" if gpt2 else "llama"

    def to_dict(self) -> dict[str, Any]:
        # The family fields only where they differ from GPT-2's: a GPT-2 checkpoint's config.json
        # stays what it always was.
        out = asdict(self)
        for f in fields(self):
            if f.name in FAMILY_FIELDS and out[f.name] == f.default:
                del out[f.name]
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GPTConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown GPTConfig fields: {', '.join(unknown)}")
        if "vocab_size" not in data:
            raise ValueError("missing GPTConfig field: vocab_size")
        return cls(**data)


# Named sizes for `nanoserve train --preset`. "baby" is nanoGPT's CPU config, "small-char" is
# nanoGPT's shakespeare_char GPU config, "gpt2" is GPT-2 small's shape.
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 32},
    "baby": {"n_layer": 4, "n_head": 4, "n_embd": 128, "block_size": 64},
    "char-medium": {"n_layer": 4, "n_head": 4, "n_embd": 256, "block_size": 128},
    "small-char": {"n_layer": 6, "n_head": 6, "n_embd": 384, "block_size": 256},
    "gpt2": {"n_layer": 12, "n_head": 12, "n_embd": 768, "block_size": 1024},
}
